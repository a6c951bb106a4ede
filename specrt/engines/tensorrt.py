"""ONNX (standard-op graphs) -> serialized TensorRT engines, and the engine fields the
runtime checks before it loads one.

GPU-ONLY, NOT YET RUN ON A GPU. TensorRT cannot be installed on the machines this was
written on; the TensorRT calls below follow the TensorRT 11 Python API (strongly typed
networks, no precision flags) and are unit-tested against a fake `tensorrt` module
(tests/gpu_fakes/test_tensorrt_builder.py), never against TensorRT itself. What is tested for
real on CPU: the plan (which engines, their static shapes), the builder settings, the
manifest fields, the timing-cache reuse and the refusal logic.

    manifest.json (ONNX, attention="standard") ─ plan_engines ─ [EngineSpec per role x graph]
        EngineSpec ─ TensorRTBuilder.build ─ Builder ─ create_network(STRONGLY_TYPED)
                                           ─ OnnxParser.parse_from_file(graph.onnx)
                                           ─ BuilderConfig(workspace, opt level, HW compat,
                                                           timing cache loaded from disk)
                                           ─ build_serialized_network ─ <role>/<graph>.plan
                                           ─ timing cache written back (reused by the next build)
        -> trt_build.add_engines: manifest.json gets each graph's engine {file, sha256, bytes} and the
           top-level engines {TensorRT version, GPU, compute capability, HW compat level,
           builder settings, timing cache} ─ check_engine_compat at load time

Precision is the graph's: an fp16 graph (export precision="fp16") gives an fp16 engine;
an INT8 engine comes from a graph with symmetric Q/DQ nodes. TensorRT 11 has no FP16/INT8
builder flags. `import tensorrt` happens only inside `load_tensorrt()` (the runtime's loader);
`trt_build.py` builds every engine of a folder and writes their fields into its manifest.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specrt import manifest as mf
from specrt.engines.errors import EngineBuildError, EngineCompatError, TensorRTMissingError

GRAPHS = ("prefill", "decode", "verify")
HW_COMPAT = ("none", "ampere_plus", "same_compute_capability")   # trt.HardwareCompatibilityLevel members
# graph precisions TensorRT can build: float graphs, and INT8 as symmetric QuantizeLinear/DequantizeLinear
TRT_PRECISIONS = ("fp32", "fp16", "int8-qdq")


def load_tensorrt():
    """The `tensorrt` module (imported by the runtime's loader, the only one), or
    TensorRTMissingError saying what is missing."""
    from specrt.runtime.backends.trt_runtime import load_tensorrt as import_tensorrt
    try:
        return import_tensorrt()
    except ImportError as e:   # the runtime's TensorRTUnavailableError; its cause is the import's own error
        raise TensorRTMissingError(
            f"TensorRT is not installed ({e.__context__ or e}): TensorRT engines need the `tensorrt` Python package "
            "(TensorRT 11, CUDA 13) and an NVIDIA GPU; install it on the GPU machine, or use --backend ort-cpu / "
            "ort-cuda") from None


def gpu_identity(device: int = 0) -> dict:
    """{"gpu_name", "compute_capability"} of a CUDA device, through the runtime's cuda-python
    loader (GPU-only)."""
    from specrt.runtime.backends.cuda_device import gpu_identity as identify, load_cudart
    try:
        cudart = load_cudart()
    except ImportError as e:
        raise TensorRTMissingError(f"cuda-python is not installed ({e.__context__ or e}): `pip install cuda-python` "
                                   "on the GPU machine (TensorRT engines are built and run on the GPU)") from None
    gpu = identify(cudart, device)
    if gpu is None:
        raise TensorRTMissingError(f"no usable CUDA device {device}: TensorRT engines need an NVIDIA GPU")
    return gpu


# --- the plan (pure; tested on CPU) ------------------------------------------------------

@dataclass(frozen=True)
class EngineSpec:
    """One engine: a model's static-shape graph. inputs: tensor -> static shape."""
    role: str               # "target" | "draft"
    graph: str              # "prefill" | "decode" | "verify"
    tokens: int             # T
    onnx: str               # graph file, relative to the manifest
    onnx_sha256: str
    weights: str
    weights_sha256: str
    inputs: dict = field(default_factory=dict)

    @property
    def plan_file(self) -> str:
        return f"{self.role}/{self.graph}.plan"


def plan_engines(man: mf.Manifest) -> list[EngineSpec]:
    """Every engine to build from an ONNX manifest: prefill chunk, decode and verify(k+1) of
    the target, and the draft's graphs (prefill + decode, or decode only for a shared cache)."""
    attention = man.build.get("config", {}).get("attention")
    if attention != "standard":
        raise EngineBuildError(
            f"these graphs were exported with attention={attention!r}; TensorRT's ONNX parser reads only the "
            "standard-op graphs (TensorScatter + Attention): rebuild with `specrt build --attention standard`")
    specs = []
    cap = man.shapes.kv_capacity
    for role, m in man.models.items():
        if m.precision not in TRT_PRECISIONS:
            raise EngineBuildError(
                f"the {role} model is {m.precision}: its ONNX Runtime integer ops (MatMulNBits, MatMulInteger) have "
                f"no TensorRT equivalent; TensorRT takes {', '.join(TRT_PRECISIONS)} graphs: use an fp32 target and "
                "a separate or truncated draft (--draft truncate:N), or a symmetric Q/DQ graph")
        d = m.dims
        kv_shape = [man.shapes.batch, int(d["kv_heads"]), cap, int(d["head_dim"])]
        for g in GRAPHS:
            if g not in m.graphs:
                continue
            e = m.graphs[g]
            inputs = {m.io["input_ids"]: [man.shapes.batch, e.tokens], m.io["past_len"]: [man.shapes.batch]}
            for i in range(m.layers):
                inputs[m.io["past_key"] % i] = kv_shape
                inputs[m.io["past_value"] % i] = kv_shape
            specs.append(EngineSpec(role=role, graph=g, tokens=e.tokens, onnx=e.file, onnx_sha256=e.sha256,
                                    weights=m.weights["file"], weights_sha256=m.weights["sha256"], inputs=inputs))
    return specs


@dataclass(frozen=True)
class BuilderSettings:
    workspace_bytes: int = 4 << 30
    optimization_level: int = 3            # TensorRT's default (0..5)
    hardware_compatibility: str = "none"   # "ampere_plus": one plan for every SM >= 8.0, slower tactics
    strongly_typed: bool = True            # required on 10.x, always on (flag ignored) on 11.x

    def __post_init__(self):
        if self.hardware_compatibility not in HW_COMPAT:
            raise EngineBuildError(f"hardware_compatibility={self.hardware_compatibility!r}; choose one of {HW_COMPAT}")
        if not 0 <= self.optimization_level <= 5:
            raise EngineBuildError(f"optimization_level={self.optimization_level} is outside TensorRT's 0..5")


# --- the thin TensorRT layer (GPU-only; tested with a fake module) -------------------------

class TensorRTBuilder:
    """Builds engines one at a time with one persistent timing cache.

    The timing cache file is read before every build and written back after it, so the
    engines of one build, and later builds on the same GPU and TensorRT, reuse the
    measured tactics. `log` receives TensorRT's build log lines (severity, message)."""

    def __init__(self, settings: BuilderSettings, timing_cache: Path, *, trt=None, log=None, progress=None):
        self.trt = trt if trt is not None else load_tensorrt()
        self.settings, self.timing_cache = settings, Path(timing_cache)
        self.logger = _make_logger(self.trt, log or (lambda severity, msg: None))
        self.progress = progress

    def build(self, spec: EngineSpec, onnx_path: Path, plan_path: Path) -> None:
        trt, s = self.trt, self.settings
        builder = trt.Builder(self.logger)
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if s.strongly_typed else 0
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, self.logger)
        if not parser.parse_from_file(str(onnx_path)):   # from the file, so external weights resolve
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise EngineBuildError(f"TensorRT could not parse {onnx_path} ({spec.role} {spec.graph}): "
                                   + "; ".join(errors[:5]) + ": re-export with --attention standard")
        _check_static_inputs(network, spec, onnx_path)
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, s.workspace_bytes)
        config.builder_optimization_level = s.optimization_level
        config.hardware_compatibility_level = getattr(trt.HardwareCompatibilityLevel, s.hardware_compatibility.upper())
        blob = self.timing_cache.read_bytes() if self.timing_cache.is_file() else b""
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=False)   # a cache from another GPU/TRT is refused
        if self.progress is not None:
            self._monitor = _make_progress_monitor(trt, self.progress)   # alive as long as the build
            config.progress_monitor = self._monitor
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise EngineBuildError(f"TensorRT failed to build the {spec.role} {spec.graph} engine from {onnx_path}: "
                                   "see the build log above (workspace too small? unsupported layer?)")
        _write_atomic(plan_path, memoryview(plan).tobytes())
        _write_atomic(self.timing_cache, memoryview(config.get_timing_cache().serialize()).tobytes())


def _check_static_inputs(network, spec: EngineSpec, onnx_path: Path) -> None:
    got = {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        got[t.name] = [int(x) for x in t.shape]
    if got != spec.inputs:
        diff = {n: (got.get(n), want) for n, want in spec.inputs.items() if got.get(n) != want}
        extra = sorted(set(got) - set(spec.inputs))
        raise EngineBuildError(f"{onnx_path}: network inputs differ from the manifest's static shapes "
                               f"(name: (graph, manifest)) {diff} unexpected {extra}: rebuild the ONNX graphs")


def _make_logger(trt, sink):
    class _Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            sink(str(severity), msg)

    return _Logger()


def _make_progress_monitor(trt, report):
    class _Progress(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)

        def phase_start(self, phase_name, parent_phase, num_steps):
            report(f"{phase_name}: 0/{num_steps}")

        def step_complete(self, phase_name, step):
            report(f"{phase_name}: {step + 1}")
            return True   # False would cancel the build

        def phase_finish(self, phase_name):
            report(f"{phase_name}: done")

    return _Progress()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- INT8: TensorRT's rules for explicit Q/DQ graphs (pure; tested on CPU) -----------------

def qdq_problems(model) -> list[str]:
    """What keeps TensorRT from building an INT8 engine from this Q/DQ graph (empty when
    none): zero points must be constant zeros (symmetric), scales constant and > 0, and
    per-channel (1-D) scales only on weights, never on activations. `model`: onnx.ModelProto."""
    import numpy as np
    from onnx import numpy_helper

    consts = {i.name: i for i in model.graph.initializer}
    consts.update({n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant" and n.attribute
                   and n.attribute[0].name == "value"})

    def value(name):
        t = consts.get(name)
        return None if t is None else numpy_helper.to_array(t)

    problems = []
    for n in model.graph.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        where = f"{n.op_type} {n.name or n.output[0]!r}"
        scale = value(n.input[1])
        if scale is None:
            problems.append(f"{where}: scale is computed, TensorRT needs a constant")
        elif not (scale > 0).all():
            problems.append(f"{where}: scale must be > 0")
        if len(n.input) > 2 and n.input[2]:
            zp = value(n.input[2])
            if zp is None or np.any(zp != 0):
                problems.append(f"{where}: zero point must be constant 0 (symmetric); TensorRT has no asymmetric INT8")
        per_channel = scale is not None and scale.ndim == 1 and scale.size > 1
        # a weight's quantizer reads an initializer (Q) or its DQ reads a constant int8 tensor
        if per_channel and n.input[0] not in consts:
            problems.append(f"{where}: per-channel scale on an activation; TensorRT quantizes activations per tensor")
    return problems


# --- engine fields and the refusal (pure; tested on CPU) ------------------------------------

def engine_fields(spec: EngineSpec, plan_sha256: str, settings: BuilderSettings, tensorrt_version: str,
                  gpu: dict) -> dict:
    """What the manifest records about one engine: enough to refuse it on the wrong machine
    and to know whether its inputs changed."""
    return {"file": spec.plan_file, "sha256": plan_sha256, "tokens": spec.tokens,
            "tensorrt_version": tensorrt_version, "gpu_name": gpu["gpu_name"],
            "compute_capability": gpu["compute_capability"],
            "hardware_compatibility_level": settings.hardware_compatibility,
            "builder": asdict(settings), "inputs": {"onnx": spec.onnx, "onnx_sha256": spec.onnx_sha256,
                                                    "weights": spec.weights, "weights_sha256": spec.weights_sha256},
            "shapes": spec.inputs}


def check_engine_compat(fields: dict, here: dict) -> list[str]:
    """Refuse an engine this machine cannot run; returns warnings for what it can run but
    was not tuned for. here: {"tensorrt_version", "gpu_name", "compute_capability"} (the
    TensorRT version is None when TensorRT is not installed). The rule lives in the runtime
    (specrt/runtime/backends/trt_compat.py), which applies it at load time."""
    from specrt.runtime.backends import trt_compat
    try:
        return trt_compat.check_engine_compat(fields, here)
    except trt_compat.EngineMismatchError as e:
        raise EngineCompatError(str(e)) from None
