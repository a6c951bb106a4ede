"""Parity of exported graphs against the PyTorch reference, through ONNX Runtime.

One random token sequence runs through the Hugging Face model once; the graphs replay
it under the KV contract (prefill chunk, then one decode step, then one verify window),
so every graph is compared at real cache offsets. Also recorded: how far the verify
graph's rows drift from the decode graph's at the same position — greedy speculative
output equals plain greedy output only where that drift cannot flip an argmax.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from specrt import manifest as mf
from specrt.errors import ParityError
from specrt.runtime.ort_backend import session_options

ATOL = 1e-3


class GraphSet:
    """The build's driver for one exported model: the runtime's own ONNX Runtime CPU backend
    (`OrtModel`, the code that serves) over a fresh KV cache, so parity numbers and the
    agreement gates are measured through the same binding, output names and in-place
    cache updates as generation.

    cache: the KV buffers as [k_0, v_0, k_1, v_1, ...] (the arrays the graphs write into).
    step(graph, ids, start) -> logits [n, V], a fresh array (the runtime's buffer is reused)."""

    def __init__(self, directory: Path, graphs: dict, dims: dict, capacity: int, threads: int | None = None):
        from specrt.runtime.backends.ort_cpu import OrtModel, pool_threads
        from specrt.runtime.kv import KVCache

        directory = Path(directory)
        entry = build_entry(directory, graphs, dims)
        dtype = np.float16 if entry.kv["dtype"] == "float16" else np.float32
        self.kv = KVCache(entry.layers, int(dims["kv_heads"]), capacity, int(dims["head_dim"]), dtype=dtype)
        self.model = OrtModel(directory, entry, None, cache=self.kv, graphs=tuple(graphs),
                              threads=threads or pool_threads() or 2)   # the build's pool (BuildConfig.threads)
        self.tokens = {g: e["tokens"] for g, e in graphs.items()}
        self.layers = entry.layers
        self.cache = [a for i in range(self.layers) for a in (self.kv.keys[i], self.kv.values[i])]

    def step(self, graph: str, ids, start: int) -> np.ndarray:
        return self.model.step(graph, list(ids), start).copy()


def build_entry(directory: Path, graphs: dict, dims: dict) -> mf.ModelEntry:
    """A manifest entry for an export that has no manifest yet: the KV update mode and the
    dtypes are read off the graph's own inputs and outputs."""
    import onnx
    first = onnx.load(str(Path(directory) / next(iter(graphs.values()))["file"]), load_external_data=False)
    outputs = {o.name for o in first.graph.output}
    types = {t.name: t.type.tensor_type.elem_type for t in (*first.graph.input, *first.graph.output)}
    name = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}
    kv_dtype = name.get(types.get(mf.IO_NAMES["past_key"] % 0), "float32")
    weights = Path(directory) / "weights.bin"
    return mf.ModelEntry(
        role="build", family="", precision="", dims=dims,
        graphs={g: mf.GraphEntry(file=e["file"], tokens=e["tokens"], sha256=e.get("sha256", ""))
                for g, e in graphs.items()},
        weights={"file": weights.name, "bytes": weights.stat().st_size if weights.exists() else 0,
                 "sha256": "", "initializers": {}},
        source={},
        kv={"dtype": kv_dtype, "update": "in_place" if mf.IO_NAMES["present_key"] % 0 in outputs else "returned"},
        io={**mf.IO_NAMES, "dtypes": {"input_ids": "int64", "past_len": "int64",
                                      "logits": name.get(types.get(mf.IO_NAMES["logits"]), "float32"),
                                      "kv": kv_dtype}})


class SessionGraphSet:
    """Plain ORT sessions over one exported model with a numpy cache, on any execution
    providers. Only for comparing against providers the runtime has no backend for yet
    (scripts/gpu_check.py with CUDA); the build uses GraphSet."""

    def __init__(self, directory: Path, graphs: dict, dims: dict, capacity: int, threads: int = 2):
        so = session_options(threads)   # the runtime's: one process-wide thread pool
        self.sessions = {g: ort.InferenceSession(str(directory / e["file"]), so, providers=["CPUExecutionProvider"])
                         for g, e in graphs.items()}
        self.tokens = {g: e["tokens"] for g, e in graphs.items()}
        self.layers = int(dims["layers"])
        shape = (1, int(dims["kv_heads"]), capacity, int(dims["head_dim"]))
        self.cache = [np.zeros(shape, np.float32) for _ in range(2 * self.layers)]

    def step(self, graph: str, ids, start: int) -> np.ndarray:
        T, n = self.tokens[graph], len(ids)
        feed = {"input_ids": np.zeros((1, T), np.int64), "past_len": np.array([start], np.int64)}
        feed["input_ids"][0, :n] = ids
        names = [mf.IO_NAMES[kv] % i for i in range(self.layers) for kv in ("past_key", "past_value")]
        feed.update(zip(names, self.cache))
        out = self.sessions[graph].run(None, feed)
        for c, new in zip(self.cache, out[1:]):
            # returned K/V hold T rows; an in-place graph's present_* hold the whole cache
            c[:, :, start:start + n] = new[:, :, :n] if new.shape[2] == T else new[:, :, start:start + n]
        return out[0][0, :n]


def check_parity(reference: torch.nn.Module, directory: Path, export: dict, shapes: mf.Shapes, *,
                 rtol: float, seed: int = 0) -> dict:
    """Compare each graph with the reference; raises ParityError above atol + rtol * max|logit|."""
    dims, graphs = export["dims"], export["graphs"]
    C, k = shapes.prefill_chunk, shapes.k
    n_prompt = min(C - 3, shapes.max_context - k - 3)   # leaves room for decode + verify
    S = n_prompt + 1 + (k + 1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(dims["vocab"]), (1, S), generator=g)
    with torch.no_grad():
        ref = reference(ids).logits[0].float().numpy()                       # [S, V]
    gs = GraphSet(directory, graphs, dims, shapes.kv_capacity)
    seq = ids[0].tolist()
    got = {}
    if "prefill" in graphs:
        got["prefill"] = (gs.step("prefill", seq[:n_prompt], 0), slice(0, n_prompt))
    else:  # a graph set without prefill (shared-cache draft) is fed by decode steps
        for i in range(n_prompt):
            gs.step("decode", seq[i:i + 1], i)
    if "decode" in graphs:
        got["decode"] = (gs.step("decode", seq[n_prompt:n_prompt + 1], n_prompt), slice(n_prompt, n_prompt + 1))
    if "verify" in graphs:
        lo = n_prompt + 1
        got["verify"] = (gs.step("verify", seq[lo:lo + k + 1], lo), slice(lo, lo + k + 1))
    report = {}
    scale = float(np.abs(ref).max())
    tol = ATOL + rtol * scale
    for name, (logits, rows) in got.items():
        r = ref[rows]
        delta = float(np.abs(logits - r).max())
        agree = float((logits.argmax(-1) == r.argmax(-1)).mean())
        report[name] = {"max_abs_logit_delta": delta, "argmax_agreement": agree, "positions": rows.stop - rows.start}
        if delta > tol:
            raise ParityError(f"{name} graph: max |logit delta| {delta:.3g} vs PyTorch exceeds the tolerance "
                              f"{tol:.3g} (atol {ATOL} + rtol {rtol} x max|logit| {scale:.3g})")
    if "decode" in graphs and "verify" in graphs:
        report["decode_vs_verify"] = _decode_vs_verify(gs, seq, n_prompt, k)
    return {"reference": "transformers (torch fp32)", "tolerance": tol, "graphs": report}


def _decode_vs_verify(gs: GraphSet, seq: list[int], start: int, k: int) -> dict:
    """Max logit difference between the verify graph's rows and decode steps over the same tokens."""
    window = seq[start:start + k + 1]
    v = gs.step("verify", window, start).copy()
    d = np.stack([gs.step("decode", window[i:i + 1], start + i)[0] for i in range(len(window))])
    return {"max_abs_logit_delta": float(np.abs(v - d).max()),
            "argmax_agreement": float((v.argmax(-1) == d.argmax(-1)).mean())}
