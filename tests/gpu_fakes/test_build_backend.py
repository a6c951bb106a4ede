"""`specrt build --backend`: the GPU builds on a CPU machine. ort-cuda is a cross-build
(fp16 gqa graphs with a constant total length, checked against fp32 on ONNX Runtime CPU, the
manifest saying CUDA was not verified); tensorrt is refused before any export without
TensorRT and a GPU, and with a fake `tensorrt` and a pretend probe writes its engine fields
into manifest.json; auto picks the CPU here and says why; the int8 self-draft and quantized
targets are refused for GPU backends. Nothing here has run on a GPU."""
from __future__ import annotations

import json
import logging
import sys

import numpy as np
import onnx
import pytest
from test_tensorrt_builder import H200, fake_tensorrt

from specrt import manifest as mf
from specrt.builder.config import GPU_DEFAULT_DRAFT, BuildConfig
from specrt.builder import backend as build_backend
from specrt.builder import gpu as gpu_build
from specrt.engines import tensorrt as trt_engines
from specrt.engines import trt_build as trt_fields
from specrt.engines.errors import BackendUnavailableError
from specrt.errors import ConfigError, ManifestError

CPU = build_backend.Probe()
TRT_GPU = build_backend.Probe(tensorrt="11.1.0.106", gpu="NVIDIA H200")
ORT_GPU = build_backend.Probe(gpu="NVIDIA H200", ort_providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
SMALL = dict(max_context=96, prefill_chunk=16, k=3)


def _build(out, target, **kw):
    from specrt.builder.pipeline import build
    return build(BuildConfig(target=str(target), out=str(out), **{**SMALL, **kw}), progress=False)


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory, tiny_pair, monkeypatch_module):
    """--backend ort-cuda with a truncated draft, on this CPU machine (a pretend CPU probe, so
    the result does not depend on what the machine has)."""
    monkeypatch_module.setattr(build_backend, "probe", lambda: CPU)
    target, _ = tiny_pair
    with _capture_warnings() as seen:
        out = _build(tmp_path_factory.mktemp("cuda") / "eng", target, draft="truncate:2", backend="ort-cuda")
    return out, seen


@pytest.fixture(scope="module")
def trt_build(tmp_path_factory, tiny_pair, monkeypatch_module):
    """--backend tensorrt with a fake `tensorrt`, a pretend TensorRT + GPU probe and GPU identity."""
    calls = []
    tmp = tmp_path_factory.mktemp("trt")
    monkeypatch_module.setattr(build_backend, "probe", lambda: TRT_GPU)
    monkeypatch_module.setitem(sys.modules, "tensorrt", fake_tensorrt(calls))
    monkeypatch_module.setattr(trt_engines, "gpu_identity", lambda device=0: dict(H200))
    monkeypatch_module.setenv("SPECRT_CACHE", str(tmp / "cache"))
    target, _ = tiny_pair
    return _build(tmp / "eng", target, backend="tensorrt"), calls, tmp / "cache"


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


class _capture_warnings:
    def __enter__(self):
        self.records, self.handler = [], logging.Handler(logging.WARNING)
        self.handler.emit = self.records.append
        logging.getLogger("specrt").addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        logging.getLogger("specrt").removeHandler(self.handler)


def _onnx_types(path):
    proto = onnx.load(str(path), load_external_data=False)
    return proto, {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]}


# --- ort-cuda: a cross-build on the CPU ---------------------------------------------------------

def test_ort_cuda_cross_build_records_device_kv_dtypes_and_that_cuda_was_not_verified(cuda_build):
    out, warnings = cuda_build
    man = mf.load(out)
    assert man.device["backend"] == "onnxruntime" and man.device["kind"] == "cuda"
    assert man.device["cuda_execution_verified"] is False and man.device["cross_build"] is True
    assert man.device["verified_on"] == "CPUExecutionProvider"
    assert man.engines is None
    choice = man.build["backend"]
    assert choice["requested"] == "ort-cuda" and "cross-build" in choice["reason"]
    assert any("cross-build" in r.getMessage() and "not verified" in r.getMessage() for r in warnings)
    assert man.build["config"]["attention"] == "gqa" and man.build["config"]["backend"] == "ort-cuda"
    for m in man.models.values():
        assert m.precision == "fp16" and m.kv["dtype"] == "float16" and m.in_place
        assert m.io["dtypes"] == {"input_ids": "int64", "past_len": "int64", "logits": "float32", "kv": "float16"}
        assert m.kv["total_sequence_length"].startswith("static")
    mf.check_files(man, out, hashes=True)


def test_ort_cuda_build_checks_fp16_against_fp32_with_the_stated_tolerance(cuda_build):
    from specrt.builder.gates import precision
    man = mf.load(cuda_build[0])
    for role, graphs in (("target", {"prefill", "decode", "verify"}), ("draft", {"prefill", "decode"})):
        par = man.models[role].parity
        r = par["fp16_vs_fp32"]
        assert r["provider"] == "CPUExecutionProvider" and set(r["graphs"]) == graphs
        assert (r["atol"], r["rtol"]) == (precision.FP16_ATOL, precision.FP16_RTOL)
        assert all(0 < g["max_abs_logit_delta"] <= r["tolerance"] for g in r["graphs"].values())
        assert r["greedy"]["identical_prefix"] == r["greedy"]["tokens"] == 32
        assert all(g["max_abs_logit_delta"] < par["fp32_export"]["tolerance"]
                   for g in par["fp32_export"]["graphs"].values())     # the fp32 reference vs torch
        assert "fp16_cuda_vs_fp32_cpu" not in par                      # no CUDA here: nothing claimed
    assert man.draft.parity["agreement_with_target"]["positions"] > 0
    assert man.target.parity["identity"]["rows"] > 0


def test_ort_cuda_graphs_are_fp16_with_a_constant_total_length_and_run_on_ort_cpu(cuda_build):
    from specrt.driver import GraphSet, greedy
    out = cuda_build[0]
    man = mf.load(out)
    m = man.target
    T = onnx.TensorProto
    proto, types = _onnx_types(out / m.graphs["verify"].file)
    assert (types["input_ids"], types["past_k_0"], types["present_k_0"], types["logits"]) == \
        (T.INT64, T.FLOAT16, T.FLOAT16, T.FLOAT)
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in proto.graph.node
              if n.op_type == "Constant"}
    consts.update({i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer
                   if i.data_location != T.EXTERNAL})
    gqa = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(int(consts[n.input[6]]) == man.shapes.kv_capacity for n in gqa)
    graphs = {g: {"file": e.file.split("/", 1)[1], "tokens": e.tokens, "sha256": e.sha256} for g, e in m.graphs.items()}
    gs = GraphSet(out / "target", graphs, m.dims, man.shapes.kv_capacity)
    assert gs.cache[0].dtype == np.float16
    run = greedy(gs, [5, 6, 7, 8, 9], 8, keep_rows=True)
    assert len(run.tokens) == 8 and all(np.isfinite(r).all() for r in run.rows)


# --- tensorrt: refused here, before any export ---------------------------------------------------

@pytest.mark.parametrize("p,missing", [(CPU, "lacks TensorRT and a CUDA GPU"), (ORT_GPU, "lacks TensorRT:"),
                                       (build_backend.Probe(tensorrt="11.1.0.106"), "lacks a CUDA GPU")])
def test_tensorrt_without_tensorrt_or_a_gpu_is_refused_before_any_export(monkeypatch, tmp_path, p, missing):
    from specrt.export import onnx_export, sources

    def never(*a, **k):
        raise AssertionError("the build reached the export")

    monkeypatch.setattr(build_backend, "probe", lambda: p)
    monkeypatch.setattr(sources, "load_source", never)
    monkeypatch.setattr(onnx_export, "export_model", never)
    with pytest.raises(BackendUnavailableError) as e:
        _build(tmp_path / "eng", tmp_path / "no-model", backend="tensorrt")
    assert missing in str(e.value) and "TensorRT 11" in str(e.value) and "--backend ort-cuda" in str(e.value)
    assert list(tmp_path.iterdir()) == []        # not even the output folder


def test_the_cli_says_why_tensorrt_is_refused(monkeypatch, tmp_path, capsys):
    from specrt import cli
    monkeypatch.setattr(build_backend, "probe", lambda: CPU)
    rc = cli.main(["build", "--target", str(tmp_path / "m"), "--out", str(tmp_path / "o"), "--backend", "tensorrt"])
    err = capsys.readouterr().err
    assert rc == 2 and "BackendUnavailableError: --backend tensorrt needs TensorRT and a CUDA GPU" in err


# --- tensorrt with a fake TensorRT: engine fields in manifest.json --------------------------------

def test_tensorrt_build_writes_engine_fields_into_the_manifest_not_a_sidecar(trt_build):
    out, calls, cache = trt_build
    man = mf.load(out)                                    # validates the engine fields
    assert not (out / "tensorrt.json").exists()
    assert man.device["backend"] == "tensorrt" and man.device["kind"] == "cuda"
    assert man.device["gpu_name"] == "NVIDIA H200" and man.device["engine_outputs_verified"] is False
    e = man.engines
    assert (e["tensorrt_version"], e["gpu_name"], e["compute_capability"]) == ("11.1.0.106", "NVIDIA H200", "9.0")
    assert e["hardware_compatibility_level"] == "none" and e["builder"]["strongly_typed"] is True
    assert e["timing_cache"]["reused"] is False and e["timing_cache"]["file"].startswith(str(cache))
    assert man.tools["tensorrt"] == "11.1.0.106"
    assert man.draft is None and man.build["config"]["draft"] == GPU_DEFAULT_DRAFT == "none"
    for g, entry in man.target.graphs.items():
        assert entry.engine == {"file": f"target/{g}.plan", "sha256": mf.sha256_file(out / f"target/{g}.plan"),
                                "bytes": (out / f"target/{g}.plan").stat().st_size}
    parsed = [c[1].rsplit("/", 2)[-2:] for c in calls if c[0] == "parse_from_file"]
    assert parsed == [["target", "prefill.onnx"], ["target", "decode.onnx"], ["target", "verify.onnx"]]
    assert {rel for rel, _ in mf.artifact_files(man)} >= {f"target/{g}.plan" for g in man.target.graphs}
    mf.check_files(man, out, hashes=True)
    from specrt.builder import outdir
    assert outdir.foreign_entries(out) == []            # a rebuild into the same --out needs no --force


def test_tensorrt_build_exports_fp16_standard_graphs_checked_against_fp32(trt_build):
    out = trt_build[0]
    man = mf.load(out)
    assert man.build["config"]["attention"] == "standard"
    proto, types = _onnx_types(out / man.target.graphs["decode"].file)
    assert types["past_k_0"] == onnx.TensorProto.FLOAT16
    assert {"TensorScatter", "Attention"} <= {n.op_type for n in proto.graph.node}
    assert not any(n.domain == "com.microsoft" for n in proto.graph.node)
    r = man.target.parity["fp16_vs_fp32"]
    assert all(g["max_abs_logit_delta"] <= r["tolerance"] for g in r["graphs"].values())
    view = trt_fields.engine_view(man, "target", "verify")
    assert view["file"] == "target/verify.plan" and view["compute_capability"] == "9.0" and view["tokens"] == 4


def test_inspect_shows_backend_device_and_engines(trt_build, cuda_build):
    from specrt.tools.describe import describe
    text = describe(mf.load(trt_build[0]))
    assert "device     tensorrt on cuda" in text and "backend    tensorrt (requested; TensorRT 11.1.0.106" in text
    assert "engines    TensorRT 11.1.0.106 on NVIDIA H200 (compute capability 9.0)" in text
    assert "engine target/verify.plan" in text and "fp16     verify   vs fp32" in text
    text = describe(mf.load(cuda_build[0]))
    assert "onnxruntime on cuda" in text and "cuda_execution_verified False" in text and "cross-build" in text


@pytest.mark.parametrize("edit,match", [
    (lambda r: r.pop("engines"), "name engine files but the top-level engines object"),
    (lambda r: r["models"]["target"]["graphs"]["verify"].pop("engine"), "target.verify have no engine"),
    (lambda r: r["engines"].update(compute_capability="sm90"), "is not MAJOR.MINOR"),
    (lambda r: r["engines"].update(hardware_compatibility_level="ampere"), "hardware_compatibility_level"),
    (lambda r: r["models"]["target"]["graphs"]["decode"]["engine"].update(bytes="12"), "positive integer bytes"),
    (lambda r: r["engines"].pop("builder"), "engines.builder"),
])
def test_damaged_engine_fields_are_refused(trt_build, tmp_path, edit, match):
    raw = json.loads((trt_build[0] / mf.FILENAME).read_text())
    edit(raw)
    (tmp_path / mf.FILENAME).write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match=match):
        mf.load(tmp_path)


def test_manifests_without_engine_fields_still_load(tiny_engines, tmp_path):
    raw = json.loads((tiny_engines / mf.FILENAME).read_text())
    assert "engines" not in raw and not any("engine" in e for m in raw["models"].values()
                                           for e in m["graphs"].values())   # CPU builds write none
    assert raw["build"]["backend"]["backend"] == "ort-cpu" and raw["build"]["config"]["draft"] is not None
    for key in ("backend",):             # a manifest written before --backend existed
        raw["build"].pop(key)
        raw["build"]["config"].pop(key)
    (tmp_path / mf.FILENAME).write_text(json.dumps(raw))
    man = mf.load(tmp_path)
    assert man.engines is None and all(e.engine is None for m in man.models.values() for e in m.graphs.values())
    assert json.loads(man.to_json()).keys() == raw.keys()


# --- auto, refusals, the CLI ----------------------------------------------------------------------

def test_auto_without_a_gpu_picks_ort_cpu_says_why_and_keeps_the_cpu_defaults(monkeypatch, capsys):
    monkeypatch.setattr(build_backend, "probe", lambda: CPU)
    cfg, choice = build_backend.resolve(BuildConfig(target="t", out="o", backend="auto"), progress=True)
    assert (cfg.backend, cfg.draft, cfg.attention) == ("ort-cpu", "int8", "gqa")
    assert choice["reason"] == "auto: no CUDA GPU found" and choice["requested"] == "auto"
    assert "specrt build: backend ort-cpu (auto: no CUDA GPU found)" in capsys.readouterr().err


@pytest.mark.parametrize("p,backend,attention,verified", [(TRT_GPU, "tensorrt", "standard", False),
                                                          (ORT_GPU, "ort-cuda", "gqa", True)])
def test_auto_with_a_gpu_picks_its_backend_with_the_gpu_defaults(monkeypatch, p, backend, attention, verified):
    monkeypatch.setattr(build_backend, "probe", lambda: p)
    cfg, choice = build_backend.resolve(BuildConfig(target="t", out="o", backend="auto"))
    assert (cfg.backend, cfg.attention, cfg.draft) == (backend, attention, GPU_DEFAULT_DRAFT)
    assert choice["cuda_verified"] is verified and choice["reason"].startswith("auto:")
    device = gpu_build._device(backend, choice)
    assert device["cuda_execution_verified"] is verified and device["kind"] == "cuda"


def test_the_default_cpu_build_does_not_probe(monkeypatch):

    def no(*a):
        raise AssertionError("probed")

    monkeypatch.setattr(build_backend, "probe", no)
    cfg, choice = build_backend.resolve(BuildConfig(target="t", out="o"))
    assert (cfg.backend, cfg.draft, cfg.attention, choice["reason"]) == ("ort-cpu", "int8", "gqa", "requested")


@pytest.mark.parametrize("backend", ["ort-cuda", "tensorrt"])
@pytest.mark.parametrize("draft", ["int8", "int8-dynamic"])
def test_the_int8_self_draft_is_refused_for_gpu_backends_with_the_alternatives(backend, draft):
    with pytest.raises(ConfigError) as e:
        BuildConfig(target="t", out="o", backend=backend, draft=draft)
    msg = str(e.value)
    assert "CPU construction" in msg and "truncate:N" in msg and "--draft none" in msg and "draft model" in msg


def test_an_int8_draft_with_auto_is_refused_before_export_when_a_gpu_backend_is_chosen(monkeypatch):
    monkeypatch.setattr(build_backend, "probe", lambda: TRT_GPU)
    with pytest.raises(ConfigError, match="--draft int8 with --backend tensorrt"):
        build_backend.resolve(BuildConfig(target="t", out="o", backend="auto", draft="int8"))


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_targets_are_refused_for_gpu_backends_naming_specrt_qdq(precision):
    with pytest.raises(ConfigError, match=r"`specrt qdq`"):
        BuildConfig(target="t", out="o", backend="tensorrt", precision=precision)
    with pytest.raises(ConfigError, match="leave --precision at fp32"):
        BuildConfig(target="t", out="o", backend="ort-cuda", precision=precision)


@pytest.mark.parametrize("backend,attention", [("ort-cuda", "standard"), ("ort-cuda", "portable"),
                                               ("tensorrt", "gqa"), ("tensorrt", "portable")])
def test_an_attention_variant_the_backend_cannot_run_is_refused(backend, attention):
    with pytest.raises(ConfigError, match="leave --attention out"):
        BuildConfig(target="t", out="o", backend=backend, attention=attention)


@pytest.mark.parametrize("argv,want", [
    ([], {"backend": "ort-cpu", "draft": None, "attention": None, "out": "OUT"}),
    (["--backend", "ort-cuda"], {"backend": "ort-cuda", "draft": None, "out": "OUT"}),
    (["--backend", "tensorrt", "--draft", "truncate:2"], {"backend": "tensorrt", "draft": "truncate:2"}),
    (["--backend", "auto"], {"backend": "auto"}),
])
def test_cli_build_backend_flag(monkeypatch, tmp_path, argv, want):
    from specrt import cli
    from specrt.builder import pipeline
    seen = []
    monkeypatch.setattr(pipeline, "build", lambda cfg, **kw: seen.append(cfg) or cfg.out)
    assert cli.main(["build", "--target", "T", "--out", "OUT", *argv]) == 0
    assert {k: getattr(seen[0], k) for k in want} == want


def test_cli_preset_with_a_gpu_backend_writes_beside_the_cpu_engines(monkeypatch):
    from specrt import cli
    from specrt.builder import pipeline
    seen = []
    monkeypatch.setattr(pipeline, "build", lambda cfg, **kw: seen.append(cfg) or cfg.out)
    assert cli.main(["build", "--preset", "smollm2", "--target", "T", "--backend", "ort-cuda"]) == 0
    assert seen[0].out == "artifacts/smollm2-ort-cuda" and seen[0].draft is None   # -> GPU_DEFAULT_DRAFT
    assert cli.main(["build", "--preset", "smollm2", "--target", "T"]) == 0
    assert seen[1].out == "artifacts/smollm2" and seen[1].resolved().draft == "int8"   # make engines: unchanged


def test_cli_refuses_an_unknown_backend(capsys):
    from specrt import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["build", "--target", "T", "--out", "O", "--backend", "cuda"])
    assert e.value.code == 2 and "invalid choice: 'cuda'" in capsys.readouterr().err
