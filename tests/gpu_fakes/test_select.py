"""Backend selection over fake probes (no GPU here): auto prefers TensorRT, then ONNX
Runtime CUDA, then the CPU, and says why; explicit requests are refused with what is missing,
except ort-cuda, whose graphs a CPU machine can build (a cross-build, said in the reason)."""
from __future__ import annotations

import pytest

from specrt.engines.errors import BackendUnavailableError
from specrt.builder.backend import Probe, cuda_verifiable, probe, select_backend

CPU = Probe()
GPU_ONLY = Probe(gpu="NVIDIA H200")
ORT_CUDA = Probe(gpu="NVIDIA H200", ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
FULL = Probe(tensorrt="11.1.0", gpu="NVIDIA H200", ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
TRT_NO_GPU = Probe(tensorrt="11.1.0")


@pytest.mark.parametrize("p,want,reason", [
    (FULL, "tensorrt", "TensorRT 11.1.0 and GPU NVIDIA H200 found"),
    (Probe(tensorrt="11.1.0", gpu="NVIDIA H200"), "tensorrt", "TensorRT 11.1.0"),
    (ORT_CUDA, "ort-cuda", "onnxruntime-gpu found; TensorRT is not installed"),
    (GPU_ONLY, "ort-cpu", "neither TensorRT nor onnxruntime-gpu"),
    (TRT_NO_GPU, "ort-cpu", "no CUDA GPU"),
    (Probe(ort_providers=("CUDAExecutionProvider",)), "ort-cpu", "no CUDA GPU"),
    (CPU, "ort-cpu", "no CUDA GPU"),
])
def test_auto_picks_the_fastest_available_backend_and_says_why(p, want, reason):
    backend, why = select_backend("auto", p)
    assert backend == want and reason in why and why.startswith("auto:")


def test_explicit_requests_are_honoured_when_possible():
    assert select_backend("tensorrt", FULL)[0] == "tensorrt"
    assert select_backend("ort-cuda", FULL)[0] == "ort-cuda"
    assert select_backend("ort-cpu", FULL) == ("ort-cpu", "requested")


@pytest.mark.parametrize("requested,p,missing", [
    ("tensorrt", CPU, "lacks TensorRT and a CUDA GPU"),
    ("tensorrt", ORT_CUDA, "lacks TensorRT:"),
    ("tensorrt", TRT_NO_GPU, "lacks a CUDA GPU"),
])
def test_an_unavailable_explicit_backend_is_refused_never_silently_replaced(requested, p, missing):
    with pytest.raises(BackendUnavailableError) as e:
        select_backend(requested, p)
    assert missing in str(e.value)


def test_unknown_backend_is_refused():
    with pytest.raises(BackendUnavailableError, match="choose one of ort-cpu, ort-cuda, tensorrt, auto"):
        select_backend("cuda", FULL)


def test_the_real_probe_runs_here_and_auto_says_cpu_without_a_gpu():
    p = probe()
    assert "CPUExecutionProvider" in p.ort_providers
    if p.gpu is None:      # the CPU machines this project is developed on
        assert select_backend("auto", p) == ("ort-cpu", "auto: no CUDA GPU found")


@pytest.mark.parametrize("p,missing", [
    (CPU, "lacks onnxruntime-gpu (CUDAExecutionProvider) and a CUDA GPU"),
    (GPU_ONLY, "lacks onnxruntime-gpu (CUDAExecutionProvider),"),
    (Probe(ort_providers=("CUDAExecutionProvider",)), "lacks a CUDA GPU,"),
])
def test_ort_cuda_without_a_gpu_is_a_cross_build_that_says_cuda_was_not_verified(p, missing):
    backend, why = select_backend("ort-cuda", p)
    assert backend == "ort-cuda" and "cross-build" in why and missing in why and "not verified" in why
    assert not cuda_verifiable(p)


def test_ort_cuda_with_a_gpu_and_onnxruntime_gpu_is_verifiable():
    assert select_backend("ort-cuda", ORT_CUDA) == ("ort-cuda", "requested; onnxruntime CUDAExecutionProvider on "
                                                                "GPU NVIDIA H200")
    assert cuda_verifiable(ORT_CUDA) and cuda_verifiable(FULL)


@pytest.mark.parametrize("p", [CPU, GPU_ONLY, TRT_NO_GPU, Probe(ort_providers=("CUDAExecutionProvider",))])
def test_auto_never_cross_builds_for_ort_cuda(p):
    assert select_backend("auto", p)[0] == "ort-cpu"
