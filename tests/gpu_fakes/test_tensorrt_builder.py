"""The TensorRT builder with a fake `tensorrt` module (TensorRT is not installable here):
the engine plan and its static shapes, the calls made (strongly typed network, parse from
file, workspace, optimization and hardware-compatibility levels), timing-cache reuse
across engines and builds, the engine fields written into manifest.json, and the refusal of engines built
for another TensorRT version or GPU architecture. Nothing here has run TensorRT."""
from __future__ import annotations

import enum
import sys
import types
from pathlib import Path

import onnx
import pytest

from specrt import manifest as mf
from specrt.engines import tensorrt as trt_engines
from specrt.engines import trt_build
from specrt.engines.errors import EngineBuildError, EngineCompatError, TensorRTMissingError

H200 = {"gpu_name": "NVIDIA H200", "compute_capability": "9.0"}


# --- a fake tensorrt: records what the builder asks of it ------------------------------------

def fake_tensorrt(calls: list, *, parse_ok: bool = True, build_ok: bool = True, version: str = "11.1.0.106"):
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version

    class ILogger:
        def __init__(self):
            pass

    class IProgressMonitor:
        def __init__(self):
            pass

    trt.ILogger, trt.IProgressMonitor = ILogger, IProgressMonitor
    trt.NetworkDefinitionCreationFlag = enum.IntEnum("NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 0})
    trt.MemoryPoolType = enum.Enum("MemoryPoolType", "WORKSPACE")
    trt.HardwareCompatibilityLevel = enum.Enum("HardwareCompatibilityLevel", "NONE AMPERE_PLUS SAME_COMPUTE_CAPABILITY")

    class Tensor:
        def __init__(self, name, shape):
            self.name, self.shape = name, tuple(shape)

    class Network:
        def __init__(self, flags):
            self.flags, self.inputs = flags, []

        @property
        def num_inputs(self):
            return len(self.inputs)

        def get_input(self, i):
            return self.inputs[i]

    class OnnxParser:
        def __init__(self, network, logger):
            assert isinstance(logger, ILogger)
            self.network, self.num_errors = network, 0

        def parse_from_file(self, path):
            calls.append(("parse_from_file", path))
            if not parse_ok:
                self.num_errors = 1
                return False
            proto = onnx.load(path, load_external_data=False)
            for v in proto.graph.input:
                self.network.inputs.append(Tensor(v.name, [d.dim_value for d in v.type.tensor_type.shape.dim]))
            return True

        def get_error(self, i):
            return "In node 3 (Attention): past_key is not supported"

    class TimingCache:
        def __init__(self, blob):
            self.blob = blob

        def serialize(self):
            return self.blob + b"+tactics"

    class Config:
        def set_memory_pool_limit(self, pool, size):
            calls.append(("set_memory_pool_limit", pool.name, size))

        def create_timing_cache(self, blob):
            calls.append(("create_timing_cache", bytes(blob)))
            return TimingCache(bytes(blob))

        def set_timing_cache(self, cache, ignore_mismatch):
            calls.append(("set_timing_cache", cache.blob, ignore_mismatch))
            self.cache = cache

        def get_timing_cache(self):
            return self.cache

        def __setattr__(self, name, value):
            if name != "cache":
                calls.append(("config." + name, getattr(value, "name", value)))
            object.__setattr__(self, name, value)

    class Builder:
        def __init__(self, logger):
            assert isinstance(logger, ILogger)

        def create_network(self, flags):
            calls.append(("create_network", flags))
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def build_serialized_network(self, network, config):
            calls.append(("build_serialized_network", [t.name for t in network.inputs]))
            if config.__dict__.get("progress_monitor") is not None:
                pm = config.progress_monitor
                pm.phase_start("Building", None, 2)
                assert pm.step_complete("Building", 0) is True
                pm.phase_finish("Building")
            return b"PLAN" + str(len(network.inputs)).encode() if build_ok else None

    trt.Builder, trt.OnnxParser = Builder, OnnxParser
    return trt


# --- fixtures --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def standard_build(tmp_path_factory, tiny_pair) -> Path:
    """A real ONNX build of the tiny pair, standard-op graphs (target: 3 graphs, draft: 2)."""
    from conftest import build_tiny
    target, draft = tiny_pair
    return build_tiny(tmp_path_factory.mktemp("trt") / "onnx", target, str(draft), attention="standard")


def _builder(tmp_path, calls, **kw):
    fake = fake_tensorrt(calls, **{k: kw.pop(k) for k in ("parse_ok", "build_ok", "version") if k in kw})
    return trt_engines.TensorRTBuilder(trt_engines.BuilderSettings(**kw), tmp_path / "timing.cache", trt=fake)


# --- the plan --------------------------------------------------------------------------------

def test_plan_has_prefill_decode_verify_of_the_target_and_the_drafts_graphs(standard_build):
    man = mf.load(standard_build)
    specs = trt_engines.plan_engines(man)
    assert [(s.role, s.graph, s.tokens) for s in specs] == [
        ("target", "prefill", 16), ("target", "decode", 1), ("target", "verify", 4),
        ("draft", "prefill", 16), ("draft", "decode", 1)]
    cap = man.shapes.kv_capacity
    verify = specs[2]
    assert verify.inputs["input_ids"] == [1, 4] and verify.inputs["past_len"] == [1]
    assert verify.inputs["past_k_2"] == [1, 2, cap, 16] and len(verify.inputs) == 2 + 2 * 3
    assert verify.plan_file == "target/verify.plan"
    assert verify.onnx_sha256 == man.target.graphs["verify"].sha256
    assert verify.weights_sha256 == man.target.weights["sha256"]


def test_plan_refuses_graphs_the_tensorrt_parser_cannot_read(tiny_engines):
    """The default build uses ORT's GroupQueryAttention contrib op."""
    with pytest.raises(EngineBuildError, match="--attention standard"):
        trt_engines.plan_engines(mf.load(tiny_engines))


def test_plan_refuses_onnx_runtime_integer_drafts(standard_build):
    from dataclasses import replace
    man = mf.load(standard_build)
    man = replace(man, models={**man.models, "draft": replace(man.draft, precision="int8-blockwise")})
    with pytest.raises(EngineBuildError, match="MatMulNBits"):
        trt_engines.plan_engines(man)


# --- the calls the builder makes -------------------------------------------------------------

def test_builder_makes_a_strongly_typed_network_parsed_from_the_file_with_the_settings(standard_build, tmp_path):
    calls = []
    b = _builder(tmp_path, calls, workspace_bytes=1 << 28, optimization_level=4, hardware_compatibility="ampere_plus")
    spec = trt_engines.plan_engines(mf.load(standard_build))[2]
    b.build(spec, standard_build / spec.onnx, tmp_path / "verify.plan")
    names = [c[0] for c in calls]
    assert ("create_network", 1 << 0) in calls                      # 1 << STRONGLY_TYPED
    assert ("parse_from_file", str(standard_build / spec.onnx)) in calls
    assert ("set_memory_pool_limit", "WORKSPACE", 1 << 28) in calls
    assert ("config.builder_optimization_level", 4) in calls
    assert ("config.hardware_compatibility_level", "AMPERE_PLUS") in calls
    assert ("set_timing_cache", b"", False) in calls                  # fresh cache, mismatches refused
    assert names.index("parse_from_file") < names.index("build_serialized_network")
    assert not any("flag" in n.lower() and n != "create_network" for n in names), "no FP16/INT8 builder flags"
    assert (tmp_path / "verify.plan").read_bytes() == b"PLAN" + str(2 + 2 * 3).encode()


def test_timing_cache_persists_and_is_reused_by_the_next_engine_and_the_next_build(standard_build, tmp_path):
    calls = []
    b = _builder(tmp_path, calls)
    specs = trt_engines.plan_engines(mf.load(standard_build))
    b.build(specs[0], standard_build / specs[0].onnx, tmp_path / "a.plan")
    b.build(specs[1], standard_build / specs[1].onnx, tmp_path / "b.plan")
    loaded = [c[1] for c in calls if c[0] == "create_timing_cache"]
    assert loaded == [b"", b"+tactics"]                              # the 2nd engine starts from the 1st's cache
    assert (tmp_path / "timing.cache").read_bytes() == b"+tactics+tactics"
    calls2 = []
    b2 = _builder(tmp_path, calls2)                                  # a later build on the same machine
    b2.build(specs[2], standard_build / specs[2].onnx, tmp_path / "c.plan")
    assert [c[1] for c in calls2 if c[0] == "create_timing_cache"] == [b"+tactics+tactics"]


def test_parse_errors_name_the_node_and_what_to_do(standard_build, tmp_path):
    b = _builder(tmp_path, [], parse_ok=False)
    spec = trt_engines.plan_engines(mf.load(standard_build))[1]
    with pytest.raises(EngineBuildError, match=r"past_key is not supported.*--attention standard"):
        b.build(spec, standard_build / spec.onnx, tmp_path / "x.plan")
    assert not (tmp_path / "x.plan").exists()


def test_a_failed_build_writes_no_plan(standard_build, tmp_path):
    b = _builder(tmp_path, [], build_ok=False)
    spec = trt_engines.plan_engines(mf.load(standard_build))[1]
    with pytest.raises(EngineBuildError, match="failed to build the target decode engine"):
        b.build(spec, standard_build / spec.onnx, tmp_path / "x.plan")
    assert not (tmp_path / "x.plan").exists()


def test_network_inputs_that_differ_from_the_manifest_are_refused(standard_build, tmp_path):
    b = _builder(tmp_path, [])
    specs = trt_engines.plan_engines(mf.load(standard_build))
    decode_spec, verify = specs[1], specs[2]
    with pytest.raises(EngineBuildError, match=r"input_ids.*\[1, 4\].*\[1, 1\]"):
        b.build(decode_spec, standard_build / verify.onnx, tmp_path / "x.plan")   # the verify graph, T=4


def test_progress_is_reported_through_the_monitor(standard_build, tmp_path):
    seen = []
    fake = fake_tensorrt([])
    b = trt_engines.TensorRTBuilder(trt_engines.BuilderSettings(), tmp_path / "tc", trt=fake, progress=seen.append)
    spec = trt_engines.plan_engines(mf.load(standard_build))[1]
    b.build(spec, standard_build / spec.onnx, tmp_path / "x.plan")
    assert seen == ["Building: 0/2", "Building: 1", "Building: done"]


def test_build_engines_writes_every_plan_and_the_engine_fields_into_the_manifest(standard_build, tmp_path):
    fake = fake_tensorrt([])
    settings = trt_engines.BuilderSettings(hardware_compatibility="same_compute_capability")
    b = trt_engines.TensorRTBuilder(settings, tmp_path / "timing.cache", trt=fake)
    out = tmp_path / "trt"
    result = trt_build.build_engines(standard_build, out, settings, builder=b, gpu=H200)
    assert not (out / "tensorrt.json").exists() and not (standard_build / "tensorrt.json").exists()
    man = mf.load(out)                       # the ONNX build copied, plus the engine fields
    onnx_man = mf.load(standard_build)
    assert onnx_man.engines is None          # the source build is left as it was
    assert set(result["engines"]) == {"target", "draft"} and set(result["engines"]["draft"]) == {"prefill", "decode"}
    assert man.device["backend"] == "tensorrt" and man.device["gpu_name"] == "NVIDIA H200"
    e = man.engines
    assert e["tensorrt_version"] == "11.1.0.106"
    assert (e["gpu_name"], e["compute_capability"]) == ("NVIDIA H200", "9.0")
    assert e["hardware_compatibility_level"] == "same_compute_capability"
    assert e["builder"] == {"workspace_bytes": 4 << 30, "optimization_level": 3,
                            "hardware_compatibility": "same_compute_capability", "strongly_typed": True}
    assert e["timing_cache"] == {"file": str(tmp_path / "timing.cache"), "reused": False}
    v = man.target.graphs["verify"]
    assert v.sha256 == onnx_man.target.graphs["verify"].sha256          # the engine's input, by hash
    assert v.engine == {"file": "target/verify.plan", "sha256": mf.sha256_file(out / "target" / "verify.plan"),
                        "bytes": (out / "target" / "verify.plan").stat().st_size}
    f = result["engines"]["target"]["verify"]
    assert f == trt_build.engine_view(man, "target", "verify") and f["tokens"] == 4
    assert trt_engines.check_engine_compat(f, {"tensorrt_version": "11.1.0.106", **H200}) == []
    mf.check_files(man, out, hashes=True)


# --- refusal -----------------------------------------------------------------------------------

def _fields(**kw):
    spec = trt_engines.EngineSpec("target", "decode", 1, "target/decode.onnx", "a" * 64, "target/weights.bin", "b" * 64)
    settings = trt_engines.BuilderSettings(hardware_compatibility=kw.pop("level", "none"))
    return trt_engines.engine_fields(spec, "c" * 64, settings, kw.pop("version", "11.1.0.106"), {**H200, **kw})


HERE = {"tensorrt_version": "11.1.0.106", **H200}


def test_an_engine_built_here_is_accepted():
    assert trt_engines.check_engine_compat(_fields(), HERE) == []


def test_another_tensorrt_version_is_refused_with_what_to_rebuild():
    with pytest.raises(EngineCompatError, match=r"TensorRT 11\.1\.0\.106; this machine has TensorRT 11\.2\.0.*"
                                                r"rebuild the TensorRT engines"):
        trt_engines.check_engine_compat(_fields(), {**HERE, "tensorrt_version": "11.2.0"})


def test_another_gpu_architecture_is_refused():
    here = {**HERE, "gpu_name": "NVIDIA A100", "compute_capability": "8.0"}
    refused = r"target/decode.plan engine was built for compute capability 9\.0 \(NVIDIA H200\).*has 8\.0"
    with pytest.raises(EngineCompatError, match=refused):
        trt_engines.check_engine_compat(_fields(), here)
    with pytest.raises(EngineCompatError):
        trt_engines.check_engine_compat(_fields(level="same_compute_capability"), here)


def test_ampere_plus_engines_run_on_any_gpu_from_ampere_on():
    assert trt_engines.check_engine_compat(_fields(level="ampere_plus"),
                                           {**HERE, "gpu_name": "NVIDIA A100", "compute_capability": "8.0"})
    with pytest.raises(EngineCompatError, match="Ampere or newer"):
        trt_engines.check_engine_compat(_fields(level="ampere_plus"),
                                        {**HERE, "gpu_name": "Tesla T4", "compute_capability": "7.5"})


def test_same_architecture_other_gpu_runs_with_a_warning():
    warnings = trt_engines.check_engine_compat(_fields(), {**HERE, "gpu_name": "NVIDIA H100 80GB HBM3"})
    assert len(warnings) == 1 and "tuned on NVIDIA H200" in warnings[0]


def test_no_tensorrt_here_is_refused():
    with pytest.raises(EngineCompatError, match="needs TensorRT 11.1.0.106, which is not installed"):
        trt_engines.check_engine_compat(_fields(), {**HERE, "tensorrt_version": None})


# --- without TensorRT ------------------------------------------------------------------------

def test_module_imports_without_tensorrt_and_says_what_is_missing_when_used(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)      # import tensorrt -> ImportError
    with pytest.raises(TensorRTMissingError, match="TensorRT is not installed.*tensorrt.*GPU"):
        trt_engines.TensorRTBuilder(trt_engines.BuilderSettings(), tmp_path / "tc")
    from specrt.errors import SpecrtError
    assert issubclass(TensorRTMissingError, SpecrtError)


def test_tensorrt_is_imported_lazily_from_sys_modules(monkeypatch, standard_build, tmp_path):
    """With a `tensorrt` module importable (here the fake, in sys.modules), the builder uses it."""
    calls = []
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt(calls, version="11.9.9"))
    b = trt_engines.TensorRTBuilder(trt_engines.BuilderSettings(), tmp_path / "tc")
    assert b.trt.__version__ == "11.9.9"
    spec = trt_engines.plan_engines(mf.load(standard_build))[1]
    b.build(spec, standard_build / spec.onnx, tmp_path / "x.plan")
    assert ("create_network", 1) in calls


def test_gpu_identity_without_cuda_python_says_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(TensorRTMissingError, match="cuda-python"):
        trt_engines.gpu_identity()


def test_settings_are_validated():
    with pytest.raises(EngineBuildError, match="hardware_compatibility='ampere'"):
        trt_engines.BuilderSettings(hardware_compatibility="ampere")
    with pytest.raises(EngineBuildError, match="0..5"):
        trt_engines.BuilderSettings(optimization_level=7)


# --- INT8 Q/DQ graphs ---------------------------------------------------------------------------

def _qdq_graph(*, zero_point=0, act_scale=(0.05,), weight_axis_scale=True):
    """x [1, 8] -> Q/DQ (per tensor) -> MatMul with a Q/DQ int8 weight [8, 4] (per channel)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    w_scale = (np.abs(w).max(0) / 127).astype(np.float32) if weight_axis_scale else np.float32(np.abs(w).max() / 127)
    w_q = np.clip(np.round(w / w_scale), -127, 127).astype(np.int8)
    a_scale = np.array(act_scale, np.float32) if len(act_scale) > 1 else np.float32(act_scale[0])
    inits = [numpy_helper.from_array(w_q, "w_q"), numpy_helper.from_array(np.asarray(w_scale, np.float32), "w_scale"),
             numpy_helper.from_array(np.zeros(np.shape(w_scale), np.int8), "w_zp"),
             numpy_helper.from_array(np.asarray(a_scale), "a_scale"),
             numpy_helper.from_array(np.full(np.shape(a_scale), zero_point, np.int8), "a_zp")]
    axis = [helper.make_attribute("axis", 1)] if weight_axis_scale else []
    dq_w = helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w"], name="dq_w")
    dq_w.attribute.extend(axis)
    q_axis = [helper.make_attribute("axis", 1)] if len(act_scale) > 1 else []
    q_x = helper.make_node("QuantizeLinear", ["x", "a_scale", "a_zp"], ["x_q"], name="q_x")
    q_x.attribute.extend(q_axis)
    dq_x = helper.make_node("DequantizeLinear", ["x_q", "a_scale", "a_zp"], ["x_dq"], name="dq_x")
    dq_x.attribute.extend(q_axis)
    nodes = [q_x, dq_x, dq_w, helper.make_node("MatMul", ["x_dq", "w"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def test_a_symmetric_qdq_graph_is_accepted_runs_on_ort_and_builds_without_int8_flags(tmp_path):
    import numpy as np
    import onnxruntime as ort

    model = _qdq_graph()
    assert trt_engines.qdq_problems(model) == []
    onnx.save(model, str(tmp_path / "qdq.onnx"))
    from specrt.runtime.backends.ort_cpu import session_options
    sess = ort.InferenceSession(str(tmp_path / "qdq.onnx"), session_options(2), providers=["CPUExecutionProvider"])
    x = np.linspace(-1, 1, 8, dtype=np.float32)[None]
    assert sess.run(None, {"x": x})[0].shape == (1, 4)
    calls = []
    b = _builder(tmp_path, calls)
    spec = trt_engines.EngineSpec("target", "decode", 1, "qdq.onnx", "0" * 64, "w", "0" * 64, inputs={"x": [1, 8]})
    b.build(spec, tmp_path / "qdq.onnx", tmp_path / "qdq.plan")
    assert ("create_network", 1) in calls and (tmp_path / "qdq.plan").exists()


@pytest.mark.parametrize("kw,problem", [
    ({"zero_point": 3}, "zero point must be constant 0"),
    ({"act_scale": (0.05,) * 8}, "per-channel scale on an activation"),
    ({"act_scale": (-0.05,)}, "scale must be > 0"),
])
def test_qdq_graphs_tensorrt_cannot_build_are_named_with_the_reason(kw, problem):
    problems = trt_engines.qdq_problems(_qdq_graph(**kw))
    assert problems and all(problem in p for p in problems), problems
