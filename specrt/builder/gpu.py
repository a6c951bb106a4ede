"""`specrt build --backend ort-cuda | tensorrt`: the GPU builds (the backend is resolved and
every GPU refusal made before, in builder/backend.py).

    build_gpu      per model (target; a truncate:N or separate draft):
                     fp32 export (the backend's variant) ─ parity vs torch
                     fp16 export (same variant) ─ gates/precision.compare: fp16 vs fp32 on ONNX Runtime
                       CPU (max|dlogit| <= FP16_ATOL + FP16_RTOL * max|logit|, greedy agreement)
                     [ort-cuda on a GPU with onnxruntime-gpu: the same comparison on CUDA]
                   draft: top-1 agreement with the fp16 target; target: decode vs verify rows
                   tensorrt: engines/trt_build.add_engines ─ engine fields into manifest.json

ort-cuda graphs need no GPU to build: an explicit `--backend ort-cuda` on a CPU machine
is a cross-build (a warning, and `device.cuda_execution_verified: false`). The fp32
exports are only references and are deleted; the folder holds the fp16 graphs (and the
TensorRT plans), described entirely by manifest.json.

The CUDA comparison is GPU-ONLY and ran once on an H100 (tiny model, docs/gpu.md); the
TensorRT engine build is GPU-ONLY, NOT YET RUN ON A GPU (tested on CPU with a fake
`tensorrt` and a pretend probe).
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from specrt import manifest as mf
from specrt.builder import steps
from specrt.builder.config import BuildConfig

log = logging.getLogger(__name__)
CUDA_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
GREEDY_TOKENS = 32       # greedy tokens compared fp16 vs fp32 (fewer when max_context is small)


def build_gpu(cfg: BuildConfig, out: Path, tmp: Path, progress: bool, choice: dict) -> Path:
    from tqdm.auto import tqdm

    from specrt.builder import manifest_writer
    from specrt.builder.gates import measure
    from specrt.export import sources
    from specrt.runtime.tokenizer import Tokenizer

    shapes, kind = cfg.shapes, cfg.draft_kind
    n_draft = 2 if kind in ("truncate", "model") else 0
    bar = tqdm(total=3 + n_draft + 2 + (3 + n_draft if cfg.backend == "tensorrt" else 0), desc="build",
               unit="step", disable=not progress)
    t_start = time.perf_counter()

    def step(msg):
        bar.set_postfix_str(msg)
        bar.update(1)

    tgt = sources.load_source(cfg.target)
    steps.check_window(tgt, shapes)
    dm = None
    if kind == "model":   # refuse a mismatched draft before the long export
        dm = sources.load_source(cfg.draft)
        steps.check_same_tokenizer(tgt, dm)
    tok_info = steps.save_tokenizer(tgt, tmp)
    prompts = steps.prompt_ids(Tokenizer(tmp, tok_info), tgt.dims.vocab)
    providers = CUDA_PROVIDERS if choice["cuda_verified"] else None
    part = _fp16_model(cfg, tgt, tgt.model, tmp, "target", ("prefill", "decode", "verify"), prompts, providers, step)
    part["parity"]["identity"] = _identity(tmp / "target", part, shapes, prompts, cfg.k)
    part["source"] = {**tgt.identity, "tokenizer_sha256": tok_info["sha256"]}
    parts = {"target": part}
    if kind in ("truncate", "model"):
        layers, derived = None, {}
        if kind == "truncate":
            dm, layers = tgt, cfg.truncate_layers
            if layers >= tgt.dims.layers:
                from specrt.errors import SpecrtError
                raise SpecrtError(f"draft={cfg.draft!r}: the target has only {tgt.dims.layers} layers")
            derived = {"derived": f"first {layers} of {tgt.dims.layers} target layers"}
        reference = steps.truncated_reference(tgt.model, layers) if layers else dm.model
        d = _fp16_model(cfg, dm, reference, tmp, "draft", ("prefill", "decode"), prompts, providers, step,
                        layers=layers)
        d["parity"]["agreement_with_target"] = measure.draft_agreement(
            tmp / "target", part, tmp / "draft", d, shapes, prompts, shared_cache=False)
        d["source"] = {**dm.identity, **derived, "tokenizer_sha256": tok_info["sha256"]}
        parts["draft"] = d
    step("parity checked")
    build_info = {"config": cfg.as_dict(), "backend": choice, "seconds": None}
    man = manifest_writer.assemble_manifest(shapes, parts, tok_info, build_info, _device(cfg.backend, choice))
    if cfg.backend == "tensorrt":   # GPU-ONLY, NOT YET RUN ON A GPU (a fake tensorrt in the tests)
        from specrt.engines import trt_build
        man = trt_build.add_engines(man, tmp, progress=lambda s: step(f"{s.role} {s.graph} engine built"))
    from dataclasses import replace
    man = replace(man, build={**build_info, "seconds": round(time.perf_counter() - t_start, 1)})
    manifest_writer.save_manifest(man, tmp)
    step("manifest written")
    bar.close()
    log.info("built %s (%s) in %.0fs", out, cfg.backend, time.perf_counter() - t_start)
    return out


def _fp16_model(cfg: BuildConfig, lm, reference, tmp: Path, role: str, graphs: tuple[str, ...], prompts,
                providers, step, layers: int | None = None) -> dict:
    """One model's fp16 graphs in the backend's variant, with parity: the fp32 export of the
    same variant against torch, and the fp16 graphs against that fp32 export."""
    from specrt.builder.gates import precision
    from specrt.export import onnx_export, parity
    spec, shapes = cfg.spec, cfg.shapes
    kw = dict(graphs=graphs, layers=layers, attention=cfg.attention, static_total=spec.static_total)
    ref_dir = tmp / f"_fp32_{role}"
    fp32 = onnx_export.export_model(lm, shapes, ref_dir, **kw)
    fp32_parity = parity.check_parity(reference, ref_dir, fp32, shapes, rtol=lm.spec.parity_rtol)
    part = onnx_export.export_model(lm, shapes, tmp / role, precision=spec.graph_precision,
                                    progress=lambda g: step(f"{role} {g} exported"), **kw)
    n = min(GREEDY_TOKENS, shapes.max_context // 3)
    prompt = prompts[0][: shapes.max_context - n - 1]
    report = precision.compare(ref_dir, fp32, tmp / role, part, shapes, prompt=prompt, new_tokens=n)
    par = {"fp32_export": fp32_parity, "fp16_vs_fp32": {**report, "provider": "CPUExecutionProvider"}}
    if providers:   # GPU-ONLY, ran once on an H100 (docs/gpu.md): the fp16 graphs on CUDA against fp32 on the CPU
        par["fp16_cuda_vs_fp32_cpu"] = {**precision.compare(ref_dir, fp32, tmp / role, part, shapes, prompt=prompt,
                                                            new_tokens=n, providers=providers),
                                        "provider": providers[0]}
    shutil.rmtree(ref_dir)
    kv = {**steps.kv(cfg, None), "dtype": part["kv_dtype"]}
    if spec.static_total:
        kv["total_sequence_length"] = "static: the graphs' GroupQueryAttention sees kv_capacity (required on CUDA)"
    part.update(subdir=role, family=lm.spec.family, precision=spec.graph_precision, kv=kv, parity=par)
    return part


def _identity(model_dir: Path, part: dict, shapes: mf.Shapes, prompts, k: int) -> dict:
    """Decode vs verify rows of the fp16 target on ONNX Runtime CPU, recorded, not a gate:
    GPU kernels round differently, so plain and speculative greedy output must be compared
    again on the GPU (a CPU near-tie says nothing about the GPU's)."""
    from specrt.builder.gates import identity
    r = identity.decode_verify_agreement(model_dir, part, shapes, prompts)
    r["plain_decoding"] = f"the decode graph (T=1); speculation verifies with the verify graph (T={k + 1})"
    r["guarantee"] = "measured on ONNX Runtime CPU only; not a guarantee for the GPU kernels"
    return r


def _device(backend: str, choice: dict) -> dict:
    verified = choice["cuda_verified"]
    facts = {"verified_on": f"CUDAExecutionProvider ({choice['gpu']})" if verified else "CPUExecutionProvider",
             "cuda_execution_verified": verified}
    if backend == "ort-cuda":
        facts["cross_build"] = not verified
        return mf.gpu_device("onnxruntime", **facts)
    facts["engine_outputs_verified"] = False   # engines are built, never run, by the build
    return mf.gpu_device("tensorrt", **facts)
