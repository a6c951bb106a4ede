"""The engine fields of a TensorRT build, written into manifest.json.

GPU-ONLY, NOT YET RUN ON A GPU (tested with a fake `tensorrt`, tests/gpu_fakes/test_build_backend.py
and test_tensorrt_builder.py).

    ONNX manifest (fp16 or fp32 `standard` graphs, or `specrt qdq` INT8 Q/DQ graphs)
        ─ tensorrt.plan_engines ─ TensorRTBuilder.build per graph ─ <role>/<graph>.plan
        ─ add_engines -> the manifest with
              models.<role>.graphs.<graph>.engine = {"file", "sha256", "bytes"}
              engines = {"tensorrt_version", "gpu_name", "compute_capability",
                         "hardware_compatibility_level", "builder", "timing_cache", "build_log"}
              device = {"backend": "tensorrt", "kind": "cuda", "gpu_name", "compute_capability", ...}
"""
from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from specrt import manifest as mf
from specrt.engines import tensorrt as trt
from specrt.engines.errors import EngineBuildError, EngineCompatError
from specrt.engines.tensorrt import BuilderSettings, EngineSpec, TensorRTBuilder

BUILD_LOG_LINES = 200    # TensorRT warnings and errors kept in the manifest (all lines go to logging)


def default_timing_cache(tensorrt_version: str, gpu: dict) -> Path:
    """One timing cache per (TensorRT version, GPU), outside the engine folder (a build
    replaces that folder; the cache outlives it): $SPECRT_CACHE or ~/.cache/specrt."""
    root = Path(os.environ.get("SPECRT_CACHE") or Path.home() / ".cache" / "specrt")
    slug = "".join(c if c.isalnum() else "-" for c in gpu["gpu_name"]).strip("-").lower()
    return root / "tensorrt" / f"timing-{tensorrt_version}-sm{gpu['compute_capability']}-{slug}.cache"


def add_engines(man: mf.Manifest, directory: Path, settings: BuilderSettings = BuilderSettings(), *,
                builder: TensorRTBuilder | None = None, gpu: dict | None = None, timing_cache: Path | None = None,
                progress=None, log=None) -> mf.Manifest:
    """Build every planned engine of the ONNX build `man` (its files in `directory`) into
    directory/<role>/<graph>.plan and return the manifest with the engine fields: each graph's
    `engine` {"file", "sha256", "bytes"}, the top-level `engines` (TensorRT version, GPU,
    compute capability, hardware-compatibility level, builder settings, timing cache, the
    build's warnings) and a TensorRT device. The caller saves it. GPU-only (a fake `builder`
    in the tests). `log(severity, msg)` also receives every TensorRT log line."""
    import logging
    from dataclasses import replace

    pylog = logging.getLogger(__name__)
    directory = Path(directory)
    specs = trt.plan_engines(man)
    _refuse_bad_qdq(man, directory, specs)     # before any GPU time is spent
    kept: list[str] = []

    def sink(severity: str, msg: str) -> None:
        pylog.debug("TensorRT [%s] %s", severity, msg)
        if log is not None:
            log(severity, msg)
        if ("WARNING" in severity or "ERROR" in severity) and len(kept) < BUILD_LOG_LINES:
            kept.append(f"[{severity.rsplit('.', 1)[-1]}] {msg}")

    gpu = gpu or trt.gpu_identity()
    if builder is None:
        module = trt.load_tensorrt()
        builder = TensorRTBuilder(settings, timing_cache or default_timing_cache(str(module.__version__), gpu),
                                  trt=module, log=sink)
    reused = builder.timing_cache.is_file()
    built: dict[tuple[str, str], dict] = {}
    for spec in specs:
        plan = directory / spec.plan_file
        builder.build(spec, directory / spec.onnx, plan)
        built[spec.role, spec.graph] = {"file": spec.plan_file, "sha256": mf.sha256_file(plan),
                                        "bytes": plan.stat().st_size}
        if progress:
            progress(spec)
    models = {role: replace(m, graphs={g: replace(e, engine=built[role, g]) for g, e in m.graphs.items()})
              for role, m in man.models.items()}
    engines = {"tensorrt_version": str(builder.trt.__version__), "gpu_name": gpu["gpu_name"],
               "compute_capability": gpu["compute_capability"],
               "hardware_compatibility_level": settings.hardware_compatibility, "builder": asdict(settings),
               "timing_cache": {"file": str(builder.timing_cache), "reused": reused},
               "build_log": kept}
    device = {**man.device, **mf.gpu_device("tensorrt", gpu_name=gpu["gpu_name"],
                                            compute_capability=gpu["compute_capability"])}
    return replace(man, models=models, engines=engines, device=device,
                   tools={**man.tools, "tensorrt": engines["tensorrt_version"]})


def engine_view(man: mf.Manifest, role: str, graph: str) -> dict:
    """One engine's fields, flattened from the manifest (its graph entry's `engine` and the
    top-level `engines`): the shape `engine_fields` gives and the compatibility check reads."""
    e, g = man.engines, man.models[role].graphs[graph]
    if e is None or g.engine is None:
        raise EngineCompatError(f"the {role} {graph} graph has no TensorRT engine in this manifest: build one "
                                "with `specrt build --backend tensorrt`")
    return {**g.engine, "tokens": g.tokens, "tensorrt_version": e["tensorrt_version"], "gpu_name": e["gpu_name"],
            "compute_capability": e["compute_capability"],
            "hardware_compatibility_level": e["hardware_compatibility_level"], "builder": e["builder"]}


def build_engines(onnx_dir: Path, out_dir: Path | None = None, settings: BuilderSettings = BuilderSettings(), *,
                  builder: TensorRTBuilder | None = None, gpu: dict | None = None, log=None) -> dict:
    """Engines for an existing `--attention standard` ONNX build: its files are copied into
    out_dir (default: built in place), the plans built beside them and the engine fields
    written into out_dir/manifest.json. Returns {"backend", "engines": role -> graph ->
    engine_view}. GPU-only."""
    import shutil
    man = mf.load(onnx_dir)
    out = Path(out_dir or onnx_dir)
    if out.resolve() != Path(onnx_dir).resolve():
        for rel, _ in mf.artifact_files(man):
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(onnx_dir) / rel, out / rel)
    man = add_engines(man, out, settings, builder=builder, gpu=gpu, log=log)
    mf.check_files(man, out, hashes=True)
    man.save(out)
    return {"backend": "tensorrt",
            "engines": {role: {g: engine_view(man, role, g) for g in m.graphs} for role, m in man.models.items()}}


def _refuse_bad_qdq(man: mf.Manifest, directory: Path, specs: list[EngineSpec]) -> None:
    for spec in specs:   # refuse an INT8 graph TensorRT cannot build before any GPU time is spent
        if man.models[spec.role].precision == "int8-qdq":
            import onnx
            problems = trt.qdq_problems(onnx.load(str(Path(directory) / spec.onnx)))
            if problems:
                raise EngineBuildError(f"{spec.onnx}: {len(problems)} Q/DQ node(s) TensorRT cannot build: "
                                       + "; ".join(problems[:5]) + ": re-quantize symmetrically (zero point 0, "
                                       "per-channel on weights only)")
