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
        ──> TensorRT rules check ──> parity vs fp32 (qdq_parity.py) ──> an engine folder
            with the fp32 folder's tokenizer and draft (qdq_engine.py: `specrt qdq`)

Only MatMuls with a learned constant weight are quantized (W8A8), by default all but the
MLP down projection (`QDQSpec.keep_float`: its input is heavy-tailed). Attention stays float:
the cache is graph input/output in the manifest's float dtype, the score/softmax/value
products have per-head ranges one per-tensor scale serves badly, and TensorRT's fused
attention takes its own path (GPU.md B5). The rotary "rotate half" MatMul (a signed
permutation constant) stays float too: quantizing its input would only add error.
Every graph gets the same activation scales; the decode graph is the quantized verify
graph behind a one-token interface (qdq_engine.decode_graph), so plain decoding rounds
every row exactly as the verify pass does. All three attention forms of the export work
(gqa: com.microsoft.GroupQueryAttention is left alone by the quantizer; portable;
standard); only the standard form is importable by TensorRT (GPU.md B5).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from specrt import manifest as mf
from specrt.calibration.quantize import is_signed_permutation
from specrt.calibration.qdq_rules import QDQRuleError, check_rules, rule_problems  # noqa: F401
from specrt.driver import GraphSet, Greedy, encode_prompts, greedy_steps
from specrt.errors import ConfigError

GRAPHS = ("prefill", "decode", "verify")


@dataclass(frozen=True)
class QDQSpec:
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
        for name in ("prompts", "eval_prompts", "decode_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")

    def settings(self) -> dict:
        """How the graphs were quantized (the manifest's `models.target.source.quantization`)."""
        return {"method": "static Q/DQ", "bits": 8, "block_size": "per output channel", "symmetric": True,
                "compute": "int8 (static per-tensor activation scales)",
                "tool": "onnxruntime.quantization.quantize_static", "quant_format": "QDQ",
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
        if len(w.dims) != 2 or (not lm_head and w.dims[1] == vocab) or is_signed_permutation(w):
            continue
        out[n.name] = w.name
    return out


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


def regime_feeds(gs, graph: str, token_lists: list[list[int]], shapes: mf.Shapes, steps: int, seqs: dict):
    """Feeds for `graph`'s calibration, in the regime that graph serves:
    prefill: every chunk of each prompt; decode: `steps` greedy steps after the prompt (the
    continuation is stored in seqs[i]); verify: k+1 windows over that continuation."""
    width = shapes.k + 1
    for i, ids in enumerate(token_lists):
        gs.reset()
        run = Greedy()
        for step, step_ids, start in greedy_steps(gs, ids, steps + 1 if graph == "decode" else 1, run):
            if step == graph:
                yield _feed(gs, step, step_ids, start)
        if graph == "decode":
            seqs[i] = run.tokens                          # [steps + 1]: the prompt's greedy continuation
        elif graph == "verify":
            seq, P = seqs[i], len(ids)
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
    """Chat-formatted ids of each text (driver.encode_prompts), cut to `limit` tokens."""
    from specrt.runtime.tokenizer import Tokenizer
    return [ids[:limit] or [0] for ids in encode_prompts(Tokenizer(engines, man.tokenizer), texts)]
