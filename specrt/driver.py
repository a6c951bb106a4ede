"""Drive one exported model's ONNX graphs without torch: what every build check runs.

    GraphSet(dir, graphs, dims, capacity)      the runtime's ONNX Runtime CPU backend over a fresh cache
      .step(graph, ids, start) -> logits [n, V]    a fresh array (the runtime's buffer is reused)
      .cache   the KV buffers [k_0, v_0, k_1, v_1, ...], each [1, kv_heads, capacity, head_dim]
    graph_set(dir, part, capacity, providers)  GraphSet, or plain sessions on other providers (CUDA)
    greedy(gs, prompt, n)                      prefill in chunks, then greedy decode steps -> Greedy
    greedy_steps(gs, prompt, n, out)           the same, pausing before each step (calibration feeds)
    encode_prompts(tokenizer, texts)           chat template -> ids, as the runtime encodes a prompt
    kl_rows(p, q)                              KL(softmax p || softmax q) per row

Imports neither torch nor transformers: the gates of a build, `specrt qdq` (ONNX folders in,
an ONNX folder out) and scripts on a GPU machine run it as they are. The export's parity
against torch (export/parity.py) steps its graphs through here too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from specrt import manifest as mf


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

    def reset(self) -> None:
        """Zero every cache row (a fresh sequence never reads another's stale rows)."""
        for c in self.cache:
            c[...] = 0


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
        io={**mf.IO_NAMES, **({"hidden_states": mf.HIDDEN_STATES} if mf.HIDDEN_STATES in outputs else {}),
            "dtypes": {"input_ids": "int64", "past_len": "int64",
                                      "logits": name.get(types.get(mf.IO_NAMES["logits"]), "float32"),
                                      "kv": kv_dtype}})


class SessionGraphSet:
    """Plain ORT sessions over one exported model with a numpy cache of the graphs' KV dtype,
    on any execution providers. Only for comparing against providers the runtime has no
    backend for yet (scripts/gpu_check.py with CUDA); the build uses GraphSet."""

    def __init__(self, directory: Path, part: dict, capacity: int, threads: int, providers: Sequence[str]):
        import onnxruntime as ort

        from specrt.runtime.backends.ort_cpu import session_options
        directory, graphs, dims = Path(directory), part["graphs"], part["dims"]
        if "CUDAExecutionProvider" in providers and hasattr(ort, "preload_dlls"):
            ort.preload_dlls()   # the nvidia-* wheels' CUDA/cuDNN libraries (GPU.md A9)
        self.sessions = {g: ort.InferenceSession(str(directory / e["file"]), session_options(threads),
                                                 providers=list(providers))   # the runtime's thread pool
                         for g, e in graphs.items()}
        for g, sess in self.sessions.items():
            # ONNX Runtime falls back to the CPU when a provider fails to load (a missing CUDA
            # library): a comparison that ran on the CPU would pass without checking anything
            if sess.get_providers()[0] != providers[0]:
                raise RuntimeError(f"{g}: ONNX Runtime runs it on {sess.get_providers()} although "
                                   f"{providers[0]} was asked for (the provider failed to load: see "
                                   "ONNX Runtime's log above, e.g. a missing CUDA library)")
        self.tokens = {g: e["tokens"] for g, e in graphs.items()}
        self.layers = int(dims["layers"])
        shape = (1, int(dims["kv_heads"]), capacity, int(dims["head_dim"]))
        dtype = {"float32": np.float32, "float16": np.float16}[part.get("kv_dtype", "float32")]
        self.cache = [np.zeros(shape, dtype) for _ in range(2 * self.layers)]

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


def graph_set(directory: Path, part: dict, capacity: int, threads: int = 2,
              providers: Sequence[str] | None = None) -> GraphSet | SessionGraphSet:
    """The graphs of `part` on the runtime's CPU backend (KV dtype read off the graphs), or,
    for other execution providers (scripts/gpu_check.py passes CUDAExecutionProvider on a
    GPU machine), plain sessions with a cache of the graphs' dtype."""
    if not providers or tuple(providers) == ("CPUExecutionProvider",):
        return GraphSet(directory, part["graphs"], part["dims"], capacity, threads)
    return SessionGraphSet(directory, part, capacity, threads, providers)


# --- greedy decoding over a graph set ------------------------------------------------------

@dataclass
class Greedy:
    """What a greedy run produced: tokens [m] (m <= n; the last one is the EOS when it stopped
    early); rows [m] x [V] float32, the logits row that chose each token (keep_rows); prompt_rows
    [P, V], the prefill's rows at every prompt position (keep_prompt_rows)."""
    keep_rows: bool = False
    keep_prompt_rows: bool = False
    tokens: list[int] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    prompt_rows: np.ndarray | None = None


def greedy_steps(gs, prompt: Sequence[int], n: int, out: Greedy, *,
                 eos: Iterable[int] = ()) -> Iterator[tuple[str, list[int], int]]:
    """Prefill `prompt` in chunks of the prefill graph's width, then decode greedily until `out`
    holds n tokens or an EOS; yields (graph, ids, start) just before running each step (a
    calibrator reads the step's inputs, the cache included, at that moment) and fills `out`.
    Only the steps that choose a token run: n tokens cost n - 1 decode steps."""
    chunk, eos = gs.tokens["prefill"], frozenset(eos)
    prompt_rows = []
    for lo in range(0, len(prompt), chunk):
        ids = list(prompt[lo:lo + chunk])
        yield "prefill", ids, lo
        rows = gs.step("prefill", ids, lo)                       # [len(ids), V]
        if out.keep_prompt_rows:
            prompt_rows.append(rows.copy())
        row = rows[len(ids) - 1]
    if out.keep_prompt_rows:
        out.prompt_rows = np.concatenate(prompt_rows)
    pos = len(prompt)
    while n > 0:
        tok = int(row.argmax())
        out.tokens.append(tok)
        if out.keep_rows:
            out.rows.append(row.copy())
        if len(out.tokens) >= n or tok in eos:
            return
        yield "decode", [tok], pos
        row = gs.step("decode", [tok], pos)[0]                   # [V]
        pos += 1


def greedy(gs, prompt: Sequence[int], n: int, *, eos: Iterable[int] = (), keep_rows: bool = False,
           keep_prompt_rows: bool = False) -> Greedy:
    """Greedy continuation of `prompt` (n tokens, fewer when an EOS comes first): see greedy_steps."""
    out = Greedy(keep_rows=keep_rows, keep_prompt_rows=keep_prompt_rows)
    for _ in greedy_steps(gs, prompt, n, out, eos=eos):
        pass
    return out


# --- prompts and comparisons -----------------------------------------------------------------

def encode_prompts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text as the runtime feeds a prompt: one user turn in the chat template
    (with the generation prompt) when the model has one, else the plain text with the
    tokenizer's special tokens. `tokenizer`: the runtime's (specrt.runtime.tokenizer.Tokenizer,
    over the build's tokenizer.json and the manifest's chat template)."""
    out = []
    for text in texts:
        if tokenizer.chat_template:
            ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                   add_special_tokens=False)
        else:
            ids = tokenizer.encode(text)
        out.append([int(i) for i in ids])
    return out


def kl_rows(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row; p, q: [n, V] -> [n]."""
    lp = p_logits - p_logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = q_logits - q_logits.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    return (np.exp(lp) * (lp - lq)).sum(-1)
