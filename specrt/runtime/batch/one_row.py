"""A folder's one-row graphs as the batched engine's model, one row: every folder runs the one
engine (engine.py), whatever graphs it was built with.

    OneRowModel(runner)      a ModelRunner (backends/base.py: ort-cpu, ort-cuda, tensorrt) seen
                             as a BatchModel (model.py) of one cache row
    one_row_engine(...)      a BatchEngine over a folder's one-row target (prefill, decode and
                             verify graphs) and its draft (the int8 self-draft over the target's
                             cache, or a draft model with its own), policed by the build's one-row
                             step costs (build.speculation.costs_ms)

Used for folders built without `--batch`, for the GPU backends (whose runners are one-row), and
for `engine="one-row"` on a `--batch` folder (what `specrt bench` and `specrt profile` time). The
engine's rounds, accept rule, grammars and logprobs are the batch's, so a one-row folder answers
as the batched engine would over the same graphs. The batched engine pulls every position's
logits to the host: a device runner's `argmax_step` (n integers instead of n x V floats) is not
used (GPU-ONLY, never run on a GPU).
"""
from __future__ import annotations

import numpy as np

from specrt.errors import ManifestError
from specrt.runtime.costs import manifest_cost, speculation_entry

REBUILD = "the manifest was edited; rebuild the engines with this specrt (`specrt build` measures the step costs)"


class _OneRowCache:
    """The runner's cache as a BatchCache of one row: nothing ever moves (one row)."""

    rows = 1

    def __init__(self, cache):
        self.inner = cache
        self.capacity = cache.capacity

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def move_row(self, src: int, dst: int, length: int) -> None:
        if src != dst:
            raise AssertionError(f"a one-row cache has no row {max(src, dst)}")

    def forget(self, first_free: int) -> None:
        """The runner's cache is sized once (its graphs' static shapes): nothing to drop."""


class OneRowModel:
    """A ModelRunner as a BatchModel of one row. step(graph, tokens [1, T], starts [1]) runs the
    runner's graph at starts[0] (its static T; the engine pads to it) and returns logits [1, T, V]
    or, with positions [1, P], [1, P, V].

    A draft model's runner has prefill and decode graphs but no window graph: the engine's
    catch-up ("verify", the tokens a row's draft cache lacks, 1-2 after a drafting round) runs
    them as one-token decode steps, a longer run through the prefill graph."""

    def __init__(self, runner, graph_tokens: dict[str, int]):
        self.runner = runner
        self.cache = _OneRowCache(runner.cache)
        self.shares_cache = runner.shares_cache
        self.graph_tokens = dict(graph_tokens)
        self.min_rows = 1
        self._steps_for_verify = "verify" not in graph_tokens
        if self._steps_for_verify:
            self.graph_tokens["verify"] = 0          # any T: run as steps (see the class docstring)
        # a target loaded without its one-token graph runs a plain step in the verify window
        self._graph = {"decode": "verify"} if "decode" not in graph_tokens and "verify" in graph_tokens else {}
        if self._graph:
            self.graph_tokens["decode"] = self.graph_tokens["verify"]

    def step(self, graph: str, tokens: np.ndarray, starts: np.ndarray, first_row: int = 0,
             positions: np.ndarray | None = None, pad_start: int | None = None) -> np.ndarray:
        if tokens.shape[0] != 1 or first_row != 0:
            raise AssertionError(f"a one-row model runs one row, not rows {first_row}..+{tokens.shape[0]}")
        start = int(starts[0])
        if graph == "verify" and self._steps_for_verify:
            return self._steps(tokens[0], start, positions)
        logits = self.runner.step(self._graph.get(graph, graph), tokens[0], start)   # [T, V] a reused buffer
        return logits[None] if positions is None else logits[positions[0]][None]

    def _steps(self, tokens: np.ndarray, start: int, positions: np.ndarray | None) -> np.ndarray:
        """The real tokens (up to the last logit position asked for; all without positions)."""
        n = int(positions[0, -1]) + 1 if positions is not None else len(tokens)
        T = self.graph_tokens.get("prefill", 0)
        if n > 2 and T:
            out = []
            for lo in range(0, n, T):
                out.append(self.runner.step("prefill", tokens[lo:min(lo + T, n)], start + lo).copy())
            logits = np.concatenate(out)
        else:
            logits = np.stack([self.runner.step("decode", tokens[i:i + 1], start + i)[0].copy() for i in range(n)])
        return logits[None] if positions is None else logits[positions[0]][None]


def graph_tokens(entry, graphs) -> dict[str, int]:
    """{graph: its static T} of a one-row model entry's loaded graphs."""
    return {g: int(entry.graphs[g].tokens) for g in graphs}


def one_row_costs(man):
    """The build's one-row step costs (build.speculation.costs_ms: target_decode, target_verify,
    draft_decode, in ms) as BatchCosts of one row, or None when the build measured none. The
    decode cost is recorded at the decode graph's own T (two on a quantized target's two-row
    graph, so a pair round costs a plain step), the verify cost at the verify window's."""
    from specrt.runtime.batch.policy import BatchCosts
    c = speculation_entry((man.build or {}).get("speculation"), "costs_ms", REBUILD)
    if not c:
        return None
    where = "build.speculation.costs_ms"
    if "target_decode" not in c or "target_verify" not in c:
        raise ManifestError(f"{where} lacks target_decode or target_verify; {REBUILD}")
    decode_t = int(man.target.graphs["decode"].tokens) if "decode" in man.target.graphs else 1
    verify_t = int(man.target.graphs["verify"].tokens) if "verify" in man.target.graphs else man.shapes.k + 1
    target = {decode_t: {1: manifest_cost(c["target_decode"], f"{where}.target_decode", REBUILD)},
              verify_t: {1: manifest_cost(c["target_verify"], f"{where}.target_verify", REBUILD)}}
    draft = None
    if c.get("draft_decode") is not None:
        draft = {1: manifest_cost(c["draft_decode"], f"{where}.draft_decode", REBUILD)}
    return BatchCosts(target, draft)


def draft_prior(man) -> float:
    """The one-row draft's prior acceptance: the build's measured top-1 agreement of draft and
    target (models.draft.parity.agreement_with_target; 0.8 when not recorded)."""
    parity = (man.draft.parity if man.draft is not None else None) or {}
    agree = parity.get("agreement_with_target") if isinstance(parity, dict) else None
    v = (agree or {}).get("top1_agreement", 0.8) if isinstance(agree, (dict, type(None))) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
        raise ManifestError(f"manifest models.draft.parity.agreement_with_target.top1_agreement={v!r} is not a number "
                            "in [0, 1]: the manifest is damaged; rebuild the engines")
    return float(v)


def open_one_row(root, man, backend, *, threads: int, memory: str = "fast", extra: dict | None = None,
                 draft: bool = True, graphs: tuple[str, ...] = ("prefill", "decode", "verify")):
    """(target runner, draft runner or None) of the folder's one-row graphs, through the backend
    the manifest was built for. extra: the backend's options (profile_dir, cuda_graphs, ...).
    graphs: the target graphs to load (a generator that only speculates leaves out the one-token
    graph, one pre-packed copy of the weights less: plain steps then run in the verify window)."""
    extra = dict(extra or {})
    graphs = tuple(g for g in graphs if g in man.target.graphs)
    try:
        target = backend.open_model(root, man.target, man.shapes, threads=threads, memory=memory, graphs=graphs,
                                    **extra)
    except TypeError as e:   # an option this backend does not take
        if "unexpected keyword" not in str(e):
            raise
        from specrt.errors import ConfigError
        raise ConfigError(f"backend_options {sorted(extra)}: the {backend.name} backend does not take them ({e})") \
            from None
    runner = None
    if draft and man.draft is not None:
        runner = backend.open_model(root, man.draft, man.shapes, threads=threads, memory=memory,
                                    cache=target.cache if man.draft.shares_cache_with == "target" else None,
                                    graphs=_draft_graphs(man), **extra)
    return target, runner


def check_memory(man, memory: str) -> None:
    """memory="shared" on a target whose weights are ONNX Runtime's MatMulNBits (int8/int4) is
    refused: without pre-packing its graphs run ~40x slower (SmolLM2 int4: a decode step 265 ms
    unpacked vs 6.3 ms pre-packed)."""
    q = (man.target.source or {}).get("quantization") or {}
    if memory == "shared" and "MatMulNBits" in str(q.get("method", "")):
        from specrt.errors import ConfigError
        raise ConfigError(f"memory='shared' does not suit this {man.target.precision} target: its MatMulNBits "
                          "graphs run ~40x slower without ONNX Runtime's pre-packing; use memory='fast' "
                          "(the weights are already small), or methods=('speculative',) to load fewer graphs")


def check_same_vocab(man) -> None:
    """A draft speculates for the target only with the target's own tokenizer."""
    from specrt.errors import TokenizerMismatchError
    t, d = man.target, man.draft
    if int(t.dims["vocab"]) != int(d.dims["vocab"]):
        raise TokenizerMismatchError(
            f"draft vocabulary ({d.dims['vocab']}) differs from the target's ({t.dims['vocab']}): speculative "
            "decoding needs one shared tokenizer; pick a draft from the same model family")
    td, dd = t.source.get("tokenizer_sha256"), d.source.get("tokenizer_sha256")
    if td and dd and td != dd:
        raise TokenizerMismatchError(
            "draft and target were built from different tokenizers (tokenizer.json hashes differ): "
            "speculative decoding needs one shared tokenizer")


def open_folder(root, man, backend, *, threads: int, verify: str, graphs: tuple[str, ...], draft: bool,
                memory: str = "fast", extra: dict | None = None):
    """A folder's one-row graphs as one engine of one row: (BatchEngine, Tokenizer, fixed, target
    runner, draft runner or None), for `SpeculativeGenerator` and `open_batch(max_num_seqs=1)`.
    verify "full" hashes every file while the sessions load, and a load failure is explained by
    the damaged file when there is one (better than ONNX Runtime's message). fixed: the build
    measured no one-row step costs (rounds are then fixed-k)."""
    from specrt import manifest as mf
    from specrt.errors import BackendError, GraphFileError
    from specrt.runtime.tokenizer import Tokenizer
    check_memory(man, memory)
    if draft and man.draft is not None:
        check_same_vocab(man)
    check = mf.HashCheck(man, root) if verify == "full" else None
    try:
        tokenizer = Tokenizer(root, man.tokenizer)
        target, runner = open_one_row(root, man, backend, threads=threads, memory=memory, extra=extra, draft=draft,
                                      graphs=graphs)
    except (GraphFileError, BackendError):
        if check is not None:
            try:
                check.result()
            except GraphFileError as damaged:
                raise damaged from None
        raise
    if check is not None:
        check.result()
    engine, fixed = one_row_engine(root, man, target, runner, tokenizer, graphs)
    return engine, tokenizer, fixed, target, runner


def _draft_graphs(man) -> tuple[str, ...]:
    """The one-row draft's graphs the engine runs: the int8 self-draft (over the target's cache)
    its one-token step, a draft model with its own cache its prompt chunk too."""
    return ("decode",) if man.draft.shares_cache_with == "target" else ("prefill", "decode")


def one_row_engine(root, man, target, draft, tokenizer, graphs: tuple[str, ...] = ("prefill", "decode", "verify")):
    """(BatchEngine of one row over the opened one-row runners, fixed: whether its rounds are
    fixed-k, the build having measured no step costs). The policy: plain steps, prompt lookup,
    pair rounds (a two-row decode graph) and the draft, chosen by the build's one-row costs."""
    from specrt.runtime.batch.engine import BatchEngine
    from specrt.runtime.batch.policy import BatchPolicy
    from specrt.runtime.grammar import grammars_for
    from specrt.runtime.ngrams import NgramTable
    from specrt.runtime.proposers import Chain, OneGram, PromptLookup, TableGuess
    k = man.shapes.k
    model = OneRowModel(target, graph_tokens(man.target, [g for g in graphs if g in man.target.graphs]))
    dmodel = None if draft is None else OneRowModel(draft, graph_tokens(man.draft, _draft_graphs(man)))
    costs = one_row_costs(man)
    ngrams = (man.proposers or {}).get("ngrams")
    pair = "decode" in graphs and model.graph_tokens.get("decode", 1) >= 2
    table = [TableGuess(NgramTable.load(root / ngrams["file"]))] if ngrams and pair else []
    has_draft = dmodel is not None and (costs is None or costs.draft(1) is not None)
    policy = BatchPolicy(costs, k, lookup=PromptLookup(2, k), pair_guess=Chain([OneGram()] + table), draft=has_draft,
                         priors={"draft": draft_prior(man)} if has_draft else None, pair=pair)
    vocab = int(man.target.dims["vocab"])
    engine = BatchEngine(model, max_num_seqs=1, max_context=man.shapes.max_context,
                         prefill_tokens=man.shapes.prefill_chunk, k_max=k, vocab=vocab,
                         policy=policy, tokenizer=tokenizer, min_tokens=1, draft=dmodel)
    engine.grammars = grammars_for((root / man.tokenizer["file"]).read_text(encoding="utf-8"),
                                   tuple(sorted(tokenizer.eos_token_ids)), vocab)
    return engine, costs is None


def prefill(runner, chunk: int, prompt) -> np.ndarray:
    """Feed `prompt` through a one-row runner's prefill graph in chunks of `chunk` tokens; the
    logits row [V] of its last token (a reused buffer). For tools that step a folder's one-row
    graphs directly (scripts/gpu_check.py, tests; `specrt quality` forces through the engine:
    runtime/batch/forced.py)."""
    last = None
    for start in range(0, len(prompt), chunk):
        part = prompt[start:start + chunk]
        last = runner.step("prefill", part, start)[len(part) - 1]
    runner.cache.rewind_to(len(prompt))
    return last
