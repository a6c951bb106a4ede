"""The checks behind scripts/gpu_check.sh. GPU-ONLY: ran once, on an H100 with the tiny model
(2026-12-05, docs/gpu.md); the default model's run has not finished on a GPU yet.

Per model (the tiny random llama always; the default SmolLM2 when its GGUF is present):
  1. export gqa and standard graphs at fp32 and fp16 (specrt.export.onnx_export)
  2. fp16 vs fp32 on ONNX Runtime CPU (the reference the GPU runs are held to)
  3. ort-cuda (when onnxruntime-gpu sees the GPU): fp16 graphs (gqa with a constant
     total_sequence_length, standard) on CUDAExecutionProvider vs fp32 on CPU, and the fp32
     standard graph on CUDA vs CPU; gqa with a computed total_sequence_length reported as
     INFO only (the CUDA backends refuse it: wrong prompt logits on the first run)
  4. tensorrt (when TensorRT imports): `polygraphy run --trt --onnxrt` on the fp16
     standard verify graph
  5. per GPU backend available (ort-cuda, tensorrt): `specrt build --backend B` of the
     model, then the generator (runtime/backends/ort_cuda.py, trt_runtime.py) with CUDA
     graphs on and off: greedy plain and speculative (or prompt lookup, for engines
     without a draft) must agree with each other; their output against the fp32 CPU
     engines' plain greedy output, with the first divergence and the fp32 top-2 margin
     there (fp16 may flip near-ties); speculative vs plain decode tok/s; graph capture
     counts and any eager fallback; for the tiny model also a build with a truncated
     draft (speculative = plain, and the verify window captured)
Greedy comparisons report the first divergence and the fp32 top-2 logit margin there: a
flip at a margin within the logit tolerance is a near-tie (fp16 may flip those), a flip
at a wider margin fails.

Exit status: 0 all ran and passed; 1 a check failed; 2 no GPU; 3 some checks NOT RUN.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CUDA = ("CUDAExecutionProvider", "CPUExecutionProvider")


class Results:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    def add(self, name: str, status: str, detail: str = "") -> None:
        self.rows.append((name, status, detail))
        print(f"gpu_check: {status:8} {name}  {detail}", flush=True)

    def run(self, name: str, fn) -> None:
        try:
            status, detail = fn()
        except Exception as e:   # a check that crashes is a failed check  # noqa: BLE001
            status, detail = "FAIL", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        self.add(name, status, detail)

    def code(self) -> int:
        statuses = {s for _, s, _ in self.rows}
        return 1 if "FAIL" in statuses else 3 if "NOT RUN" in statuses else 0


def greedy_status(report: dict) -> tuple[str, str]:
    g, tol = report["greedy"], report["tolerance"]
    deltas = ", ".join(f"{k} {v['max_abs_logit_delta']:.3g}" for k, v in report["graphs"].items())
    detail = f"max|dlogit| {deltas} (tol {tol:.3g}); greedy identical for {g['identical_prefix']}/{g['tokens']}"
    if "first_divergence" not in g:
        return "PASS", detail
    d = g["first_divergence"]
    detail += f"; first divergence at {d['position']}: fp32 margin {d['fp32_top2_margin']:.3g}"
    return ("PASS", detail + " (near-tie)") if d["fp32_top2_margin"] <= tol else ("FAIL", detail)


def check_model(name: str, src: Path, shapes, out: Path, probe, results: Results, *, polygraphy: str) -> None:
    from specrt.builder.gates import precision
    from specrt.errors import ParityError
    from specrt.export import onnx_export, sources

    lm = sources.load_source(src)
    vocab = int(lm.dims.vocab)
    prompt = [(7 * i + 5) % vocab for i in range(24)]
    ex = {}
    for att in ("gqa", "standard"):
        for prec in ("fp32", "fp16"):
            d = out / name / f"{att}-{prec}"
            ex[att, prec] = (d, onnx_export.export_model(lm, shapes, d, attention=att, precision=prec))
    # the form the ORT CUDA backend captures: constant total_sequence_length (graph._forward_gqa)
    d = out / name / "gqa-fp16-static"
    ex["gqa", "fp16s"] = (d, onnx_export.export_model(lm, shapes, d, attention="gqa", precision="fp16",
                                                      static_total=True))

    def cmp(att, providers=None, low="fp16"):
        (d32, p32), (dlo, plo) = ex[att, "fp32"], ex[att, low]
        return greedy_status(precision.compare(d32, p32, dlo, plo, shapes, prompt=prompt, providers=providers))

    for att in ("gqa", "standard"):
        results.run(f"{name} {att}: fp16 vs fp32, both on ORT CPU", lambda att=att: cmp(att))
    results.run(f"{name} gqa static total: fp16 vs fp32, both on ORT CPU", lambda: cmp("gqa", low="fp16s"))
    if probe.ort_cuda:
        for att, low in (("gqa", "fp16s"), ("standard", "fp16")):
            results.run(f"{name} {att} {low}: on ORT CUDA vs fp32 on ORT CPU",
                        lambda att=att, low=low: cmp(att, CUDA, low=low))

        def computed_total():
            # the CPU form (total_sequence_length computed from past_len): the CUDA backends
            # refuse it (ort_cuda._check_static_total); reported, not gated, to see whether a
            # later ONNX Runtime fixes it (2026-12-05, ORT 1.31.1, H100: prefill off by 17)
            try:
                status, detail = cmp("gqa", CUDA, low="fp16")
            except ParityError as e:
                status, detail = "FAIL", str(e)
            return "INFO", f"refused on CUDA by the runtime; {status}: {detail}"

        results.run(f"{name} gqa fp16, computed total_sequence_length: on ORT CUDA vs fp32 on ORT CPU",
                    computed_total)
        results.run(f"{name} standard: fp32 on ORT CUDA vs fp32 on ORT CPU",
                    lambda: cmp("standard", CUDA, low="fp32"))
    else:
        results.add(f"{name}: ORT CUDA checks", "NOT RUN", "onnxruntime-gpu (CUDAExecutionProvider) is not installed")
    if probe.tensorrt:
        verify = ex["standard", "fp16"][0] / "verify.onnx"

        def poly():
            cmd = [polygraphy, "run", str(verify), "--trt", "--onnxrt", "--atol", "5e-2", "--rtol", "5e-2",
                   "--val-range", f"input_ids:[0,{vocab - 1}]", f"past_len:[0,{shapes.max_context - shapes.k - 1}]",
                   "--seed", "42"]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
            return ("PASS" if p.returncode == 0 else "FAIL"), " | ".join(tail)

        results.run(f"{name} standard fp16 verify: polygraphy --trt vs --onnxrt", poly)
    else:
        results.add(f"{name}: TensorRT checks", "NOT RUN", "TensorRT is not installed")
    cpu = _build(src, shapes, out / name / "engines-ort-cpu-fp32", "ort-cpu")
    for backend, present in (("ort-cuda", probe.ort_cuda), ("tensorrt", probe.tensorrt)):
        if not present:
            results.add(f"{name} {backend}: build and generator", "NOT RUN", f"{backend} is not available here")
            continue
        engines = {}
        results.run(f"{name} {backend}: specrt build --backend {backend}",
                    lambda b=backend: _built(engines, b, _build(src, shapes, out / name / f"engines-{b}", b)))
        if backend in engines:
            for graphs_on in (True, False):
                results.run(f"{name} {backend}: generator, CUDA graphs {'on' if graphs_on else 'off'}",
                            lambda b=backend, on=graphs_on: check_generator(engines[b], cpu, {"cuda_graphs": on},
                                                                            prompt))
        if backend in engines and name == "tiny":
            # a draft model, so that every round verifies: prompt lookup rarely finds a guess in a
            # random model's output, and the verify graph then never reaches capture (first run)
            results.run(f"{name} {backend}: build with --draft truncate:1",
                        lambda b=backend: _built(engines, b + "-draft", _build(
                            src, shapes, out / name / f"engines-{b}-draft", b, draft="truncate:1")))
            if backend + "-draft" in engines:
                results.run(f"{name} {backend}: speculative (truncated draft) vs plain, CUDA graphs on",
                            lambda b=backend: check_generator(engines[b + "-draft"], cpu, {"cuda_graphs": True},
                                                              prompt, proposer="speculative"))


def _build(src: Path, shapes, out: Path, backend: str, draft: str = "none") -> Path:
    """engines for `backend`, by default no draft (speculation is then prompt lookup): the GPU
    backends' default draft; the CPU reference is the fp32 target's plain greedy output."""
    from specrt.builder.config import BuildConfig
    from specrt.builder.pipeline import build
    return build(BuildConfig(target=str(src), out=str(out), draft=draft, max_context=shapes.max_context,
                             prefill_chunk=shapes.prefill_chunk, k=shapes.k, backend=backend,
                             measure_costs=False), progress=False, force=True)


def _built(store: dict, backend: str, path: Path) -> tuple[str, str]:
    import json as _json
    store[backend] = path
    man = _json.loads((Path(path) / "manifest.json").read_text())
    return "PASS", f"{path}: device {man['device']}; engines {man.get('engines', {}).get('tensorrt_version', '-')}"


def check_generator(engines: Path, cpu: Path, options: dict, prompt: list[int], n: int = 48,
                    proposer: str = "lookup") -> tuple[str, str]:
    """Greedy on the GPU engines vs the fp32 CPU engines; plain vs `proposer` ("lookup", or
    "speculative" on engines with a draft) on the GPU. options: the backend's (e.g.
    {"cuda_graphs": False})."""
    import numpy as np

    from specrt.builder.gates.precision import FP16_ATOL, FP16_RTOL
    from specrt.runtime import SpeculativeGenerator
    from specrt.runtime.batch.one_row import prefill

    ref_gen = SpeculativeGenerator(cpu, engine="one-row")   # its one-row graphs: stepped directly below
    gen = SpeculativeGenerator(engines, backend_options=options)
    prompts = [prompt, prompt[::-1], prompt[:7] * 3]
    detail, status, tps = [], "PASS", {"plain": [], proposer: []}
    for p in prompts:
        ref = [e.token for e in ref_gen.tokens(p, max_new_tokens=n, method="plain")]
        got = {}
        for method in ("plain", proposer):
            got[method] = [e.token for e in gen.tokens(p, max_new_tokens=n, method=method)]
            tps[method].append(gen.last_metrics.decode_tokens_per_s)
        if got[proposer] != got["plain"]:
            status = "FAIL"
            detail.append(f"{proposer} output differs from plain on the GPU (must be identical)")
        same = next((i for i, (a, b) in enumerate(zip(ref, got["plain"])) if a != b), None)
        if same is None:
            detail.append(f"{len(ref)}/{len(ref)} identical to fp32 CPU")
            continue
        logits = prefill(ref_gen.target, ref_gen.manifest.target.graphs["prefill"].tokens, p + ref[:same])
        top2 = np.sort(logits)[-2:]
        margin, tol = float(top2[1] - top2[0]), FP16_ATOL + FP16_RTOL * float(np.abs(logits).max())
        detail.append(f"first divergence at {same}: fp32 margin {margin:.3g} (tol {tol:.3g})")
        if margin > tol:
            status = "FAIL"
    stats = getattr(gen.target, "graph_stats", lambda: {})()
    if getattr(gen, "draft", None) is not None:
        stats = {"target": stats, "draft": getattr(gen.draft, "graph_stats", lambda: {})()}
    fallbacks = getattr(gen.target, "eager_fallbacks", {})
    plain, look = sum(tps["plain"]) / len(prompts), sum(tps[proposer]) / len(prompts)
    detail.append(f"decode tok/s plain {plain:.1f}, {proposer} {look:.1f} (x{look / plain:.2f}); graphs {stats}; "
                  f"eager fallbacks {fallbacks or 'none'}")
    return status, " | ".join(detail)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/specrt-gpu-check"))
    ap.add_argument("--skip-default", action="store_true", help="only the tiny model")
    ap.add_argument("--skip-tiny", action="store_true", help="only the default model")
    args = ap.parse_args(argv)
    from specrt.builder.config import DEFAULT_MODEL
    from specrt.builder.backend import probe, select_backend
    from specrt.manifest import Shapes

    p = probe()
    if not p.gpu:
        print("gpu_check: FAILED: CUDA reports no GPU (cuda-python missing or no device): the GPU checks cannot "
              "run here; this script never passes on a CPU machine", file=sys.stderr)
        return 2
    print(f"gpu_check: probe {p}; auto backend -> {select_backend('auto', p)}", flush=True)
    results = Results()
    polygraphy = str(Path(sys.executable).parent / "polygraphy")
    if args.skip_tiny:
        results.add("tiny model", "NOT RUN", "--skip-tiny")
    else:
        import tiny_models
        tiny = tiny_models.make_tiny_model_dir(args.out / "tiny-model", "llama", layers=2)
        check_model("tiny", tiny, Shapes(batch=1, max_context=64, prefill_chunk=16, k=3), args.out, p, results,
                    polygraphy=polygraphy)
    default = ROOT / DEFAULT_MODEL
    if args.skip_default:
        results.add("default model", "NOT RUN", "--skip-default")
    elif not default.exists():
        results.add("default model", "NOT RUN", f"{default} is missing: `make model`")
    else:
        check_model("default", default, Shapes(batch=1, max_context=1024, prefill_chunk=64, k=4), args.out, p,
                    results, polygraphy=polygraphy)
    (args.out / "gpu_check.json").write_text(json.dumps(results.rows, indent=1))
    code = results.code()
    print(f"gpu_check: {'PASSED' if code == 0 else 'FAILED' if code == 1 else 'INCOMPLETE'} (exit {code}); "
          f"results in {args.out / 'gpu_check.json'}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
