"""Which backend a build targets: `resolve(cfg)` -> (the config for that backend, the choice),
before any work; `select_backend(requested, probe)` -> (backend, reason) is the decision.

    auto -> "tensorrt"  when TensorRT imports and a CUDA GPU is visible
         -> "ort-cuda"  when onnxruntime-gpu (CUDAExecutionProvider) and a GPU are there
         -> "ort-cpu"   otherwise (auto never cross-builds)
An explicit request is honoured or refused with what is missing; it never falls back
silently. `ort-cuda` is always honoured: its fp16 ONNX graphs are built and checked on
ONNX Runtime CPU, so a CPU machine can cross-build them; the reason then says that the
CUDA execution was not verified (`cuda_verifiable(probe)` is False). The decision is a pure function of a `Probe`, so it is tested on CPU with fake
probes; `probe()` looks at this machine (TensorRT and cuda-python are imported through the
runtime's loaders, the only ones). On an H100 `probe()` found the GPU and onnxruntime-gpu
and chose ort-cuda (2026-12-05); TensorRT has never run (docs/gpu.md).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from specrt.builder.config import BACKENDS, BuildConfig
from specrt.engines.errors import BackendUnavailableError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    tensorrt: str | None = None          # TensorRT version when `import tensorrt` works
    gpu: str | None = None               # name of CUDA device 0, when one is visible
    ort_providers: tuple[str, ...] = ("CPUExecutionProvider",)

    @property
    def ort_cuda(self) -> bool:
        return "CUDAExecutionProvider" in self.ort_providers


def select_backend(requested: str, probe: Probe) -> tuple[str, str]:
    if requested not in BACKENDS:
        raise BackendUnavailableError(f"backend={requested!r}; choose one of {', '.join(BACKENDS)}")
    gpu = f"GPU {probe.gpu}" if probe.gpu else "no CUDA GPU"
    if requested == "ort-cpu":
        return "ort-cpu", "requested"
    if requested == "tensorrt":
        if not probe.tensorrt or not probe.gpu:
            missing = " and ".join(x for x, ok in (("TensorRT", probe.tensorrt), ("a CUDA GPU", probe.gpu)) if not ok)
            raise BackendUnavailableError(
                f"--backend tensorrt needs TensorRT and a CUDA GPU; this machine lacks {missing}: run the build on "
                "a machine with an NVIDIA GPU, TensorRT 11 (`tensorrt` for CUDA 13) and cuda-python, or build "
                "here with --backend ort-cuda (fp16 ONNX graphs, cross-built) or ort-cpu")
        return "tensorrt", f"requested; TensorRT {probe.tensorrt} on {gpu}"
    if requested == "ort-cuda":
        if not cuda_verifiable(probe):
            missing = " and ".join(x for x, ok in (("onnxruntime-gpu (CUDAExecutionProvider)", probe.ort_cuda),
                                                   ("a CUDA GPU", probe.gpu)) if not ok)
            return "ort-cuda", (f"requested; cross-build: this machine lacks {missing}, so the fp16 graphs are "
                                "checked on ONNX Runtime CPU only and their CUDA execution is not verified "
                                "(`pip install specrt[cuda]` on a GPU machine to verify it there)")
        return "ort-cuda", f"requested; onnxruntime CUDAExecutionProvider on {gpu}"
    # auto
    if probe.gpu and probe.tensorrt:
        return "tensorrt", f"auto: TensorRT {probe.tensorrt} and {gpu} found"
    if probe.gpu and probe.ort_cuda:
        why = "TensorRT is not installed" if not probe.tensorrt else ""
        return "ort-cuda", f"auto: {gpu} and onnxruntime-gpu found; {why}".rstrip("; ")
    if probe.gpu:
        return "ort-cpu", (f"auto: {gpu} found but neither TensorRT nor onnxruntime-gpu is installed; "
                           "running on the CPU")
    return "ort-cpu", "auto: no CUDA GPU found"


def cuda_verifiable(probe: Probe) -> bool:
    """Whether this machine can run the ort-cuda graphs on CUDA at build time."""
    return bool(probe.gpu and probe.ort_cuda)


def probe() -> Probe:
    """This machine: TensorRT version, CUDA device 0's name, ONNX Runtime's providers."""
    from specrt.runtime.backends.trt_runtime import load_tensorrt
    try:
        trt_version = str(load_tensorrt().__version__)
    except Exception:   # absent, or a broken install (missing libnvinfer): counts as absent  # noqa: BLE001
        trt_version = None
    try:
        import onnxruntime
        providers = tuple(onnxruntime.get_available_providers())
    except ImportError:
        providers = ()
    return Probe(tensorrt=trt_version, gpu=_gpu_name(), ort_providers=providers)


def _gpu_name() -> str | None:
    from specrt.runtime.backends.cuda_device import gpu_identity, load_cudart
    try:
        gpu = gpu_identity(load_cudart(), 0)
    except Exception:   # no cuda-python, or no driver (cuda-python raises instead of returning an error)  # noqa: BLE001
        return None
    return (gpu["gpu_name"] or "CUDA device 0") if gpu else None


def resolve(cfg: BuildConfig, *, progress: bool = False) -> tuple[BuildConfig, dict]:
    """The config for a concrete backend and the choice {"requested", "backend", "reason",
    "cuda_verified"}. The CPU default probes nothing (the fast build stays as fast)."""
    if cfg.backend == "ort-cpu":
        return cfg.resolved(), {"requested": "ort-cpu", "backend": "ort-cpu", "reason": "requested",
                                "cuda_verified": False}
    p = probe()
    backend, why = select_backend(cfg.backend, p)   # refuses tensorrt without TensorRT and a GPU
    resolved = cfg.resolved(backend)
    choice = {"requested": cfg.backend, "backend": backend, "reason": why,
              "cuda_verified": backend == "ort-cuda" and cuda_verifiable(p), "gpu": p.gpu}
    if backend == "ort-cuda" and not choice["cuda_verified"]:
        log.warning("specrt build: backend ort-cuda (%s)", why)
    else:
        log.info("specrt build: backend %s (%s)", backend, why)
        if progress:
            print(f"specrt build: backend {backend} ({why})", file=sys.stderr)
    return resolved, choice
