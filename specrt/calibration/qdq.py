"""Calibrated static INT8 Q/DQ graphs in TensorRT's form, made from an fp32 target.

TensorRT 11 builds INT8 only from explicit QuantizeLinear/DequantizeLinear pairs:
symmetric (zero point 0), per-channel scales on weights only (MatMul B [K, N]: axis 1,
the output channel), one scale per activation tensor. ONNX Runtime's `quantize_static`
(QDQ format) writes such graphs; this module feeds it activation ranges collected on
real prompts and checks the result against those rules.

    fp32 engines ──GraphSet──> prefill chunks, decode steps, verify windows (real KV cache)
        │                        │ one MinMax calibrator per graph (input shapes differ)
        │                        v
        │          ranges per weight MatMul input, keyed by the weight's name and merged
        │          over the three regimes (tensor names are not stable across graphs)
        v                        v
    quantize_static(graph, calibration cache) ──> Q/DQ graphs + one weights.bin
        ──> TensorRT rules check ──> parity vs fp32 on held-out prompts + step times

Only MatMuls with a learned constant weight are quantized (W8A8), by default all but the
MLP down projection (`QDQSpec.keep_float`: its input is heavy-tailed). Attention stays float:
the cache is graph input/output in the manifest's float dtype, the score/softmax/value
products have per-head ranges one per-tensor scale serves badly, and TensorRT's fused
attention takes its own path (GPU.md B5). The rotary "rotate half" MatMul (a signed
permutation constant) stays float too: quantizing its input would only add error.
Every graph gets the same activation scales, so a row rounds the same way in the
decode (T=1) and verify (T=k+1) graphs. All three attention forms of the export work
(gqa: com.microsoft.GroupQueryAttention is left alone by the quantizer; portable;
standard); only the standard form is importable by TensorRT (GPU.md B5).
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from specrt import manifest as mf
from specrt.calibration.qdq_rules import QDQRuleError, check_rules, rule_problems  # noqa: F401
from specrt.errors import BuildOutputError, ConfigError, ParityError

FORMAT = "specrt-qdq"
FILENAME = "qdq.json"
GRAPHS = ("prefill", "decode", "verify")


@dataclass(frozen=True)
class QDQSpec:
    graphs: tuple[str, ...] = GRAPHS        # which graphs to write (calibration always runs all three regimes)
    prompts: int = 16                       # calibration prompts
    eval_prompts: int = 8                   # held-out prompts for parity
    decode_steps: int = 16                  # greedy decode steps per calibration / parity prompt
    lm_head: bool = True                    # quantize the LM head MatMul too
    # weight-name suffixes whose MatMuls stay float. The MLP down projection's input,
    # SiLU(gate) * up, is heavy-tailed: one per-tensor int8 scale over its range costs most
    # of the error (SmolLM2-135M, 4 held-out prompts, decode: mean KL 0.90 -> 0.16 and
    # top-1 0.63 -> 0.79 with it float; also keeping qkv float: 0.12, same top-1)
    keep_float: tuple[str, ...] = (".down",)
    threads: int | None = None

    def __post_init__(self):
        bad = [g for g in self.graphs if g not in GRAPHS]
        if bad or not self.graphs:
            raise ConfigError(f"--graphs {','.join(self.graphs)}: choose from {','.join(GRAPHS)}")
        for name in ("prompts", "eval_prompts", "decode_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")

    def settings(self) -> dict:
        """What qdq.json records about how the graphs were quantized."""
        return {"tool": "onnxruntime.quantization.quantize_static", "quant_format": "QDQ",
                "activation_type": "QInt8", "weight_type": "QInt8", "per_channel": True,
                "weight_axis": "MatMul B [K, N]: 1 (output channel)", "activations": "per tensor",
                "extra_options": EXTRA_OPTIONS, "calibrate_method": "MinMax",
                "op_types": ["MatMul"], "lm_head_quantized": self.lm_head, "keep_float": list(self.keep_float),
                "kept_float": "attention and KV cache ops, rotary permutation MatMul"
                              + ("" if self.lm_head else ", LM head")}


EXTRA_OPTIONS = {"ActivationSymmetric": True, "WeightSymmetric": True,
                 # Q/DQ on MatMul inputs only (TensorRT/ModelOpt placement); the float output goes on
                 "OpTypesToExcludeOutputQuantization": ["MatMul"]}


# --- which MatMuls ------------------------------------------------------------------------

def weight_matmuls(model: onnx.ModelProto, vocab: int, lm_head: bool = True) -> dict[str, str]:
    """MatMul node name -> its learned weight's name: B a 2-D initializer that is not the
    rotary signed permutation; with lm_head=False the [hidden, vocab] MatMul is left out."""
    inits = {i.name: i for i in model.graph.initializer}
    out = {}
    for n in model.graph.node:
        if n.op_type != "MatMul" or n.input[1] not in inits or n.input[0] in inits:
            continue
        w = inits[n.input[1]]
        if len(w.dims) != 2 or (not lm_head and w.dims[1] == vocab) or _signed_permutation(w):
            continue
        out[n.name] = w.name
    return out


def _signed_permutation(t) -> bool:
    if t.dims[0] != t.dims[1]:
        return False
    a = numpy_helper.to_array(t)
    return bool(np.isin(a, (-1, 0, 1)).all() and (np.abs(a).sum(0) == 1).all() and (np.abs(a).sum(1) == 1).all())


# --- calibration data: the fp32 graphs stepped over real prompts ------------------------

def _feed(gs, graph: str, ids: list[int], start: int) -> dict:
    """One graph input set at the current cache contents (views, not copies: the caller
    advances the cache only after ONNX Runtime has run this feed)."""
    x = np.zeros((1, gs.tokens[graph]), np.int64)      # [1, T], padding rows hold token 0
    x[0, :len(ids)] = ids
    feed = {mf.IO_NAMES["input_ids"]: x, mf.IO_NAMES["past_len"]: np.array([start], np.int64)}
    for i in range(gs.layers):
        feed[mf.IO_NAMES["past_key"] % i] = gs.cache[2 * i]
        feed[mf.IO_NAMES["past_value"] % i] = gs.cache[2 * i + 1]
    return feed


def _prefill(gs, ids: list[int], chunk: int, yield_feeds: bool):
    for lo in range(0, len(ids), chunk):
        part = ids[lo:lo + chunk]
        if yield_feeds:
            yield _feed(gs, "prefill", part, lo)
        last = gs.step("prefill", part, lo)[-1]
    return int(last.argmax())


def regime_feeds(gs, graph: str, token_lists: list[list[int]], shapes: mf.Shapes, steps: int, seqs: dict):
    """Feeds for `graph`'s calibration, in the regime that graph serves:
    prefill: every chunk of each prompt; decode: `steps` greedy steps after the prompt (the
    continuation is stored in seqs[i]); verify: k+1 windows over that continuation."""
    width = shapes.k + 1
    for i, ids in enumerate(token_lists):
        for c in gs.cache:
            c[...] = 0
        P = len(ids)
        first = yield from _prefill(gs, ids, shapes.prefill_chunk, graph == "prefill")
        if graph == "decode":
            seq = [first]
            for j in range(steps):
                yield _feed(gs, "decode", seq[j:j + 1], P + j)
                seq.append(int(gs.step("decode", seq[j:j + 1], P + j)[0].argmax()))
            seqs[i] = seq
        elif graph == "verify":
            seq = seqs[i]
            for lo in range(0, steps, width):
                window = seq[lo:min(lo + width, steps)]
                yield _feed(gs, "verify", window, P + lo)
                gs.step("verify", window, P + lo)


class _Reader:
    """ONNX Runtime's CalibrationDataReader over a generator of feeds."""

    def __init__(self, feeds):
        self.feeds, self.count = feeds, 0

    def get_next(self):
        feed = next(self.feeds, None)
        self.count += feed is not None
        return feed


def collect_ranges(src: Path, graphs: dict, dims: dict, shapes: mf.Shapes, token_lists: list[list[int]],
                   spec: QDQSpec, tmp: Path, threads: int) -> tuple[dict, dict]:
    """Min/max of every weight MatMul's input over the three regimes, merged by weight name.
    Returns ({weight: (lo, hi)}, {regime: steps})."""
    import onnxruntime as ort
    from onnxruntime.quantization.calibrate import MinMaxCalibrater

    from specrt.calibration.quantize import quiet_logging
    from specrt.export.parity import GraphSet
    from specrt.runtime.backends.ort_cpu import session_options

    gs = GraphSet(src, graphs, dims, shapes.kv_capacity, threads=threads)
    merged, counts, seqs = {}, {}, {}
    for g in ("prefill", "decode", "verify"):          # decode before verify: verify replays its tokens
        path = src / graphs[g]["file"]
        model = onnx.load(str(path))
        acts, nodes = {}, weight_matmuls(model, int(dims["vocab"]))
        for n in model.graph.node:
            if n.name in nodes:
                acts.setdefault(n.input[0], []).append(n.input[1])
        with quiet_logging():
            cal = MinMaxCalibrater(path, ["MatMul"], augmented_model_path=str(tmp / f"augmented-{g}.onnx"),
                                   use_external_data_format=True, symmetric=True)
            cal.augment_graph()
            # the process-wide thread pool GraphSet set up refuses per-session pools:
            # the runtime's session options, unoptimized as ORT's own calibrator runs it
            so = session_options(threads)
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            cal.infer_session = ort.InferenceSession(cal.augmented_model_path, so, providers=["CPUExecutionProvider"])
            reader = _Reader(regime_feeds(gs, g, token_lists, shapes, spec.decode_steps, seqs))
            cal.collect_data(reader)
            data = cal.compute_data()
        counts[g] = reader.count
        for act, weights in acts.items():
            lo, hi = data[act].range_value                 # scalars: one range per tensor
            lo, hi = float(np.min(lo)), float(np.max(hi))
            for w in weights:
                old = merged.get(w, (0.0, 0.0))
                merged[w] = (min(old[0], lo), max(old[1], hi))
        del cal, model
        for f in tmp.glob("augmented-*"):
            f.unlink()
    return merged, counts


# --- quantization -------------------------------------------------------------------------

def quantize_graph(src: Path, dst: Path, ranges: dict, vocab: int, spec: QDQSpec, tmp: Path) -> onnx.ModelProto:
    """quantize_static on one graph with the merged ranges given as its calibration cache."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import TensorsData, save_tensors_data

    from specrt.calibration.quantize import quiet_logging

    model = onnx.load(str(src))
    nodes = {n: w for n, w in weight_matmuls(model, vocab, spec.lm_head).items()
             if not any(w.endswith(k) for k in spec.keep_float)}
    act_range: dict[str, tuple[float, float]] = {}
    for n in model.graph.node:
        if n.name in nodes:
            lo, hi = ranges[nodes[n.name]]
            old = act_range.get(n.input[0], (lo, hi))
            act_range[n.input[0]] = (min(old[0], lo), max(old[1], hi))
    cache = tmp / f"ranges-{dst.stem}.json"
    save_tensors_data(TensorsData(CalibrationMethod.MinMax, {
        t: (np.array(lo, np.float32), np.array(hi, np.float32)) for t, (lo, hi) in act_range.items()}), cache)
    del model
    with quiet_logging():
        quantize_static(str(src), str(dst), None, calibration_cache_path=str(cache),
                        calibrate_method=CalibrationMethod.MinMax, quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=["MatMul"], nodes_to_quantize=list(nodes), per_channel=True,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        use_external_data_format=True, extra_options=dict(EXTRA_OPTIONS))
    return onnx.load(str(dst))


# --- parity and step time on ONNX Runtime CPU ---------------------------------------------

def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class _Tally:
    def __init__(self):
        self.n = self.agree = 0
        self.kl = self.delta = 0.0

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:   # [n, V] each
        lp, lq = _log_softmax(ref.astype(np.float64)), _log_softmax(got.astype(np.float64))
        self.kl += float((np.exp(lp) * (lp - lq)).sum())
        self.agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        self.delta = max(self.delta, float(np.abs(got - ref).max()))
        self.n += len(ref)

    def result(self) -> dict:
        return {"positions": self.n, "top1_agreement": self.agree / max(self.n, 1),
                "mean_kl": self.kl / max(self.n, 1), "max_abs_logit_delta": self.delta}


def parity(ref_gs, q_gs, graphs: tuple[str, ...], token_lists: list[list[int]], shapes: mf.Shapes,
           steps: int) -> dict:
    """Teacher-forced on the fp32 greedy continuation of each held-out prompt: every row of
    each Q/DQ graph against the fp32 row at the same position (prompt rows: fp32 prefill;
    later rows: fp32 decode). The Q/DQ graphs build their own cache (prompt by prefill, or
    by decode steps when prefill is not among them)."""
    C, width = shapes.prefill_chunk, shapes.k + 1
    tally = {g: _Tally() for g in graphs}
    total = _Tally()
    for ids in token_lists:
        P = len(ids)
        for c in ref_gs.cache:
            c[...] = 0
        rows = [ref_gs.step("prefill", ids[lo:lo + C], lo) for lo in range(0, P, C)]
        seq = list(ids) + [int(rows[-1][-1].argmax())]
        for j in range(steps):
            rows.append(ref_gs.step("decode", seq[P + j:P + j + 1], P + j))
            seq.append(int(rows[-1][0].argmax()))
        ref = np.concatenate(rows)                            # [P + steps, V]: positions 0 .. P+steps-1
        for g in [g for g in ("prefill", "decode", "verify") if g in graphs]:
            for c in q_gs.cache:
                c[...] = 0
            got = ([q_gs.step("prefill", ids[lo:lo + C], lo) for lo in range(0, P, C)] if "prefill" in graphs
                   else [q_gs.step("decode", ids[i:i + 1], i) for i in range(P)])
            if g == "decode":
                got = [q_gs.step("decode", seq[P + j:P + j + 1], P + j) for j in range(steps)]
            elif g == "verify":
                got = [q_gs.step("verify", seq[lo:min(lo + width, P + steps)], lo)
                       for lo in range(P, P + steps, width)]
            got = np.concatenate(got)
            want = ref[:P] if g == "prefill" else ref[P:]
            tally[g].add(got, want)
            total.add(got, want)
    return {"graphs": {g: t.result() for g, t in tally.items()}, "all": total.result(),
            "prompts": len(token_lists), "new_tokens_per_prompt": steps,
            "how": "teacher-forced on the fp32 greedy continuation of held-out prompts; KL(fp32 || Q/DQ) per row"}


def step_times(ref_gs, q_gs, graphs: tuple[str, ...], shapes: mf.Shapes, threads: int, reps: int = 20) -> dict:
    """Median ms per step of each graph, fp32 and Q/DQ interleaved in one run, full windows."""
    out = {}
    for g in graphs:
        T = ref_gs.tokens[g]
        start = 0 if g == "prefill" else min(shapes.prefill_chunk, shapes.max_context - T)
        ids = [5] * T
        times = {"fp32": [], "qdq": []}
        for r in range(reps + 2):
            for name, gs in (("fp32", ref_gs), ("qdq", q_gs)):
                t0 = time.perf_counter()
                gs.step(g, ids, start)
                if r >= 2:                                       # two warm-up rounds
                    times[name].append(time.perf_counter() - t0)
        f, q = (float(np.median(times[k])) * 1e3 for k in ("fp32", "qdq"))
        out[g] = {"fp32_ms": f, "qdq_ms": q, "qdq_over_fp32": q / f, "tokens": T}
    return {"graphs": out, "reps": reps, "threads": threads, "backend": "onnxruntime CPUExecutionProvider"}


# --- prompts ------------------------------------------------------------------------------

def prompt_sets(n_cal: int, n_eval: int) -> tuple[list[str], list[str], str]:
    """(calibration texts, held-out texts, where they come from): the shipped set's
    calibration/evaluation split, or specrt.prompts.PROMPTS split in two when it is absent."""
    try:
        from specrt.calibration.dataset import load_prompts, split
        cal, held = split(load_prompts())
        return [p.text for p in cal[:n_cal]], [p.text for p in held[:n_eval]], \
            "specrt/calibration/data/prompts.jsonl, dataset.split (seed 0)"
    except (ImportError, ConfigError):
        from specrt.prompts import PROMPTS
        n_eval = min(n_eval, len(PROMPTS) // 2)
        cal, held = PROMPTS[:len(PROMPTS) - n_eval], PROMPTS[len(PROMPTS) - n_eval:]
        return cal[:n_cal], held, "specrt.prompts.PROMPTS (first part calibration, last part held out)"


def tokenize(engines: Path, man: mf.Manifest, texts: list[str], limit: int) -> list[list[int]]:
    """Chat-formatted ids of each text, cut to `limit` tokens."""
    from specrt.runtime.tokenizer import Tokenizer
    tok = Tokenizer(engines, man.tokenizer)
    out = []
    for t in texts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False) \
            if tok.chat_template else tok.encode(t)
        out.append([int(i) for i in ids[:limit]] or [0])
    return out


# --- the output folder --------------------------------------------------------------------

def check_out(out: Path) -> Path:
    """Refuse a file, the working folder or its parents, and a non-empty folder that is not a
    previous `specrt qdq` output (nothing of the user's is ever deleted)."""
    import os
    path = Path(os.path.abspath(Path(out).expanduser()))
    cwd = Path.cwd()
    if path == cwd or path in cwd.parents:
        raise BuildOutputError(f"--out {out} is the current folder or one of its parents: name a new subfolder")
    if path.exists() and not path.is_dir():
        raise BuildOutputError(f"--out {out} is an existing file: choose a folder name")
    if path.is_dir() and any(path.iterdir()):
        known = _previous_files(path) or set()
        foreign = sorted(str(p.relative_to(path)) for p in path.rglob("*")
                         if (p.is_file() or p.is_symlink()) and str(p.relative_to(path)) not in known)
        if not known or foreign:
            shown = ", ".join((foreign or ["(no readable qdq.json)"])[:5])
            raise BuildOutputError(f"--out {out} is not empty and not a previous `specrt qdq` output ({shown}): "
                                   "choose a new folder or move those files away")
    return path


def _previous_files(folder: Path) -> set[str] | None:
    try:
        info = json.loads((folder / FILENAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not isinstance(info.get("files"), list):
        return None
    return {FILENAME, *map(str, info["files"])}


# --- the command --------------------------------------------------------------------------

def make_qdq(engines: str | Path, out: str | Path, spec: QDQSpec = QDQSpec(), progress=print) -> dict:
    """Calibrate, quantize, check and measure; writes out/ and returns the qdq.json content."""
    import onnxruntime as ort

    from specrt import outdir
    from specrt.calibration.quantize import quiet_logging
    from specrt.export import weights as wpack
    from specrt.export.parity import GraphSet
    from specrt.runtime.backends.ort_cpu import pool_threads

    t0 = time.time()
    engines = Path(engines)
    man = mf.load(engines)
    target, shapes = man.target, man.shapes
    path = check_out(Path(out))
    # GraphSet reads weights.bin beside the graphs: address the target's own folder
    src = engines / Path(target.weights["file"]).parent
    graphs = {g: {"file": str(Path(e.file).relative_to(src.relative_to(engines))), "tokens": e.tokens,
                  "sha256": e.sha256} for g, e in target.graphs.items()}
    dims, vocab = target.dims, int(target.dims["vocab"])
    threads = spec.threads or pool_threads() or 2
    cal_texts, eval_texts, source = prompt_sets(spec.prompts, spec.eval_prompts)
    limit = shapes.max_context - spec.decode_steps - shapes.k - 1
    cal_ids, eval_ids = tokenize(engines, man, cal_texts, limit), tokenize(engines, man, eval_texts, limit)
    tmp = outdir.make_partial(path)
    try:
        work = Path(tempfile.mkdtemp(prefix="specrt-qdq-"))
        try:
            progress(f"calibrating on {len(cal_ids)} prompts (prefill, decode, verify regimes)")
            ranges, counts = collect_ranges(src, graphs, dims, shapes, cal_ids, spec, work, threads)
            protos = {}
            for g in spec.graphs:
                progress(f"quantizing {g}")
                protos[g] = quantize_graph(src / graphs[g]["file"], work / f"{g}.onnx", ranges, vocab, spec,
                                           work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rules = check_rules(protos)
        if not rules["passed"]:
            raise QDQRuleError("the Q/DQ graphs break TensorRT's INT8 rules: " + "; ".join(rules["problems"][:5])
                               + " (nothing was written; report this with the ONNX Runtime version)")
        entries, winfo = wpack.save_graphs(protos, tmp, {g: graphs[g]["tokens"] for g in protos})
        del protos
        winfo = {"file": winfo["file"], "bytes": winfo["bytes"], "sha256": winfo["sha256"]}
        progress(f"parity on {len(eval_ids)} held-out prompts")
        with quiet_logging():
            ref_gs = GraphSet(src, graphs, dims, shapes.kv_capacity, threads=threads)
            q_gs = GraphSet(tmp, entries, dims, shapes.kv_capacity, threads=threads)
        par = parity(ref_gs, q_gs, spec.graphs, eval_ids, shapes, spec.decode_steps)
        _check_finite(par)
        timing = step_times(ref_gs, q_gs, spec.graphs, shapes, threads)
        del ref_gs, q_gs
        info = {
            "format": FORMAT, "version": 1,
            "source": {"engines": str(engines.resolve()), "manifest_sha256": mf.sha256_file(engines / mf.FILENAME),
                       "target_graphs": {g: graphs[g]["sha256"] for g in spec.graphs},
                       "precision": target.precision, "attention_ops": _attention_ops(src / graphs["decode"]["file"])},
            "graphs": entries, "weights": winfo, "files": sorted([*(e["file"] for e in entries.values()), winfo["file"]]),
            "dims": dims, "shapes": asdict(shapes), "io": {**target.io, "kv": target.kv},
            "quantization": {**spec.settings(), "graphs": list(spec.graphs)},
            "calibration": {"prompts": len(cal_ids), "source": source, "regimes": counts,
                            "decode_steps_per_prompt": spec.decode_steps,
                            "method": "MinMax per weight-MatMul input, merged by weight over the regimes; "
                                      "the same scales in every graph",
                            "max_abs_input": {w: round(max(-lo, hi), 4) for w, (lo, hi) in ranges.items()}},
            "rules": rules, "parity": {**par, "held_out_source": source}, "timing": timing,
            "tools": {"onnxruntime": ort.__version__, "onnx": onnx.__version__, "numpy": np.__version__,
                      "specrt": man.tools.get("specrt", "")},
            "seconds": round(time.time() - t0, 1),
        }
        (tmp / FILENAME).write_text(json.dumps(info, indent=2))
        outdir.commit(tmp, path)
    except BaseException:
        outdir.discard(tmp)
        raise
    return info


def _check_finite(par: dict) -> None:
    for g, r in par["graphs"].items():
        if not all(math.isfinite(v) for v in r.values()):
            raise ParityError(f"the Q/DQ {g} graph gives non-finite logits or KL ({r}): a scale is broken")


def _attention_ops(path: Path) -> list[str]:
    m = onnx.load(str(path), load_external_data=False)
    return sorted({f"{n.domain or 'ai.onnx'}.{n.op_type}" for n in m.graph.node
                   if n.op_type in ("GroupQueryAttention", "Attention", "Softmax", "TensorScatter")})
