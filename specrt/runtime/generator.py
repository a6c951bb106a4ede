"""`SpeculativeGenerator`: the public runtime API.

    gen = SpeculativeGenerator("artifacts/smollm2")
    for chunk in gen.stream("Tell me a joke.", chat=True, max_new_tokens=64):
        print(chunk.text, end="", flush=True)
    print(gen.last_metrics.summary())

Everything it knows comes from the manifest; it imports neither torch, transformers,
nor the exporter. One instance runs one generation at a time (its buffers and caches
are reused across calls): a second generation started while one is open, from another
thread or by interleaving two streams, raises `ConcurrentUseError` at once instead of
mixing their caches. A service runs one instance per worker.
"""
from __future__ import annotations

import gc
import secrets
import threading
from pathlib import Path
from typing import Iterator, Sequence

from specrt import manifest as mf
from specrt.errors import ConcurrentUseError, ConfigError, SamplingParamsError
from specrt.runtime.backends import backend_for
from specrt.runtime.batch.generator import matcher
from specrt.runtime.batch.one_row import check_memory, check_same_vocab, draft_prior, open_folder
from specrt.runtime.costs import StepCosts
from specrt.runtime.logprobs import check_logprobs
from specrt.runtime.methods import METHODS, Method
from specrt.runtime.metrics import Metrics
from specrt.runtime.one import BatchOfOne, Emitted, one_engine
from specrt.runtime.prompt import check_request, encode_prompt
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.text import Chunk, Completion, TextStreaming

__all__ = ["SpeculativeGenerator", "Chunk", "Completion", "METHODS"]


class SpeculativeGenerator(TextStreaming):
    def __init__(self, engine_dir: str | Path, *, k: int | None = None, threads: int = 2,
                 memory: str = "fast", methods: Sequence[str] | None = None, verify: str = "full",
                 profile_dir: str | Path | None = None, adaptive: bool | None = None,
                 backend_options: dict | None = None, engine: str = "auto", head: str | Path | None = None):
        """Load the engines in `engine_dir` (a folder written by `specrt build`).

        backend_options: passed to the backend that opens the models, e.g. {"cuda_graphs": False}
        for ort-cuda / tensorrt (CUDA-graph replay off); ort-cpu takes none.
        adaptive: choose each round (a plain step, the draft's k tokens, prompt lookup's guess, a
        pair round) by the step costs the build measured and each proposer's acceptance so far
        (runtime/batch/policy.py). None (default): on when the manifest has those costs and, on
        one-row graphs, `k` is not given (an explicit k is fixed there). False: fixed-k rounds
        (one-row graphs only: a batched model always chooses by cost).

        methods: which decoding methods to make ready (default: all the build supports); on
        one-row graphs a service that only speculates passes ("speculative",) and never loads the
        target's one-token graph (one session, one packed copy of the weights less; every round
        then drafts k), and one that never speculates passes ("plain",) and loads no draft.
        memory: "fast" or "shared", see runtime/backends/ort_cpu.py.
        verify: "full" (default) checks the sha256 of every file against the manifest while
        the sessions load (~0.6 s of one core for the default engines, mostly hidden);
        "none" checks only that the files exist and the weights have their size.
        profile_dir: record ONNX Runtime's per-operator profile into this folder (slows every
        step; `specrt profile` uses it; end it with `end_profiling()`).
        engine: every request runs on the batched engine (runtime/batch/engine.py) as a batch of
        one (runtime/one.py). "auto" (default): over the folder's batched model when it has one
        (`specrt build --batch`), the model its server runs, so both give the same tokens
        (speculating as far as the batched model can: not at all with `--batch-attention gqa`);
        over its one-row graphs otherwise (batch/one_row.py). "one-row": over the one-row graphs
        in any case (what `specrt bench` and `specrt profile` time; on a `--batch` folder their
        answers may differ from the batched server's).
        head: a folder written by `specrt train-draft`: the trained head is the draft (the folder's
        batched model, built with --hidden-layers; docs/speculation.md#trained-heads)."""
        if verify not in mf.VERIFY_MODES:
            raise ConfigError(f"verify={verify!r}; choose one of {mf.VERIFY_MODES}")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ConfigError(f"threads={threads!r} must be an integer >= 1 (ONNX Runtime's intra-op threads)")
        self.root = Path(engine_dir)
        self.manifest = man = mf.load(self.root)
        self.backend = backend_for(man)    # the registered backend for man.device, or a ManifestError
        self.backend.check_device(man)
        mf.check_files(man, self.root)
        self.shapes = man.shapes
        if k is not None and (not isinstance(k, int) or isinstance(k, bool)):
            raise SamplingParamsError(f"k={k!r} must be an integer in [1, {man.shapes.k}]")
        self.k = man.shapes.k if k is None else k
        if self.k < 1:
            raise SamplingParamsError(f"k={k} is outside [1, {man.shapes.k}]: pass 1 <= k <= {man.shapes.k} (or use method='plain')")
        if self.k > man.shapes.k:
            raise SamplingParamsError(
                f"k={k} is outside [1, {man.shapes.k}]: the verify graph was built for k={man.shapes.k}; "
                f"rebuild with --k {k} for a larger window")
        if memory not in self.backend.memory_modes:
            raise SamplingParamsError(f"memory={memory!r}; choose one of {self.backend.memory_modes}")
        check_memory(man, memory)
        if head is not None and (engine != "auto" or not one_engine(man)):
            raise ConfigError("a draft head drafts inside the folder's batched model: open a folder built with "
                              "`specrt build ... --batch --hidden-layers ...`, with engine='auto'")
        self.head = head
        if methods is None:
            methods = tuple(m for m in Method if man.draft is not None or head is not None or not m.needs_draft)
        if isinstance(methods, str) or not methods or any(m not in METHODS for m in methods):
            raise SamplingParamsError(f"methods={methods!r}; choose from {METHODS}")
        self.methods = tuple(Method(m) for m in methods)
        if engine not in ("auto", "one-row"):
            raise ConfigError(f"engine={engine!r}; choose 'auto' or 'one-row'")
        self.one = None
        if engine == "auto" and one_engine(man):
            self._open_one(man, threads, verify, memory, profile_dir, backend_options, adaptive)
            return
        if any(m.needs_draft for m in self.methods) and man.draft is None:
            raise SamplingParamsError("these engines were built without a draft model (--draft none): pass "
                                      "methods=('plain',) or ('plain', 'lookup') (`specrt generate --plain`, or "
                                      "--lookup 2 for prompt lookup), or rebuild with a draft "
                                      "(`specrt build ... --draft int8`)")
        if man.draft is not None and "speculative" in self.methods:
            check_same_vocab(man)
        if adaptive not in (None, True, False):
            raise ConfigError(f"adaptive={adaptive!r} must be True, False or None")
        extra = dict(backend_options or {})
        if profile_dir:
            extra["profile_dir"] = Path(profile_dir)
        graphs = ("prefill",) + tuple(g for g in ("decode", "verify") if any(g in m.target_graphs for m in self.methods))
        StepCosts.from_manifest((man.build or {}).get("speculation"))   # damaged costs: refused here
        draft_prior(man)       # a damaged prior is a ManifestError now, not a TypeError mid-request
        engine, self.tokenizer, fixed, self.target, self.draft = open_folder(
            self.root, man, self.backend, threads=threads, verify=verify, graphs=graphs,
            draft=Method.SPECULATIVE in self.methods, memory=memory, extra=extra)
        # without the one-token graph a plain step costs a verify pass: every round drafts k
        fixed = fixed or adaptive is False or (adaptive is None and k is not None) or "decode" not in graphs
        if adaptive is True and "decode" not in graphs:
            raise ConfigError("adaptive=True falls back to plain decoding steps, so it needs the target's "
                              "one-token graph: include 'plain' in methods")
        if adaptive is True and not engine.policy.costs:
            raise ConfigError("adaptive=True needs the step costs a build measures (manifest "
                              "build.speculation.costs_ms), and these engines have none: rebuild them with "
                              "this specrt, or pass adaptive=False")
        self.one = BatchOfOne(engine, self.tokenizer, k=self.k, fixed=fixed, one_row=True)
        self._plain_graph = "decode" in graphs
        self.vocab = int(man.target.dims["vocab"])
        self.costs = engine.policy.costs
        self.adaptive = self.costs is not None and not fixed     # rounds chosen by measured cost
        self.last_metrics: Metrics | None = None
        self._busy = threading.Lock()   # held by the one open generation

    def _open_one(self, man, threads, verify, memory, profile_dir, backend_options, adaptive) -> None:
        """The batched model as a batch of one (runtime/one.py): the folder's one engine."""
        one_row = "; pass engine='one-row' to run the one-row graphs"
        if memory != "fast" or profile_dir or backend_options:
            raise ConfigError("memory='shared' (--memory shared), profile_dir and backend_options set up the one-row "
                              "graphs; this folder runs its batched model for every request (the engine its batched "
                              f"server runs): leave them out{one_row}")
        if adaptive is False:
            raise ConfigError(f"this folder's batched engine chooses every round by measured cost{one_row} with "
                              "fixed-k rounds")
        if any(m.needs_draft for m in self.methods) and man.draft is None and self.head is None:
            raise SamplingParamsError("these engines were built without a draft model (--draft none): pass "
                                      "methods=('plain',) or ('plain', 'lookup'), or a trained head (head=)")
        StepCosts.from_manifest((man.build or {}).get("speculation"))   # damaged one-row costs: refused here too
        self.one = BatchOfOne.open(self.root, threads=threads, verify=verify, k=self.k, head=self.head)
        self.tokenizer, self.vocab = self.one.tokenizer, int(man.batch.dims["vocab"])
        self.target = self.draft = None
        self.costs = self.one.full.costs
        self.adaptive = True
        self.last_metrics = None
        self._busy = threading.Lock()

    @property
    def pair(self) -> bool:
        """Can a round carry one guessed token in the target's two-token decode step (a pair round)?"""
        return self.one.full.has_pair and self.one.engine._graph_t("decode", 2) == 2

    @property
    def ngrams(self):
        """The build's n-gram table the pair rounds guess from (runtime/ngrams.py), or None."""
        chain = self.one.full.pair_guess
        return next((p.table for p in getattr(chain, "proposers", ()) if hasattr(p, "table")), None)

    @property
    def default_method(self) -> Method:
        """What a call without `method` runs: the draft model when loaded, else plain decoding
        (an engine folder built with --draft none speculates only when asked, with method='lookup')."""
        if Method.SPECULATIVE in self.methods:
            return Method.SPECULATIVE
        return Method.PLAIN if Method.PLAIN in self.methods else self.methods[0]

    def end_profiling(self) -> dict[str, str]:
        """Stop profiling (see profile_dir); "role/graph" -> the trace file ONNX Runtime wrote."""
        out = {}
        for role, model in (("target", self.target), ("draft", self.draft)):
            if model is not None:
                out.update({f"{role}/{g}": f for g, f in model.end_profiling().items()})
        return out

    # --- token level ------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = False,
                      system: str | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat=chat, system=system)

    def tokens(self, prompt_ids: list[int], *, max_new_tokens: int = 128, sampling: SamplingParams | dict | None = None,
               method: str | None = None, ngram: int = 2, adaptive: bool | None = None, structured=None,
               ignore_eos: bool = False, logprobs: int | None = None) -> Iterator[Emitted]:
        """Yield generated tokens as they become final (EOS included; the caller stops).
        Arguments are checked here, before the first token is asked for.
        method: None (default): "speculative" when this generator loaded a draft, else "plain";
        "speculative" (draft model), "plain", or "lookup" (prompt lookup: proposes the
        continuation of the latest earlier match of the last `ngram` tokens; greedy only).
        With adaptive k, "speculative" also verifies prompt lookup's guess (n = `ngram`) in
        rounds where that pays better than the draft; ngram=0 turns this off.
        adaptive: this call's setting (None: the instance's, see __init__).
        structured: the output must match it (runtime/grammar.py: a Structured or a mapping such as
        {"json_schema": {...}}).
        ignore_eos: only checked against `structured` here (the caller decides where to stop).
        logprobs: None, or n in [0, 20]: each Emitted carries its TokenLogprob with the n most likely
        alternatives (runtime/logprobs.py)."""
        sampling = SamplingParams.coerce(sampling)    # a SamplingParams, a mapping of its fields, or None
        if method is None:
            method = self.default_method
        if not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < (1 if method == "lookup" else 0):
            raise SamplingParamsError(f"ngram={ngram!r} must be an integer >= 1 (the n of the n-gram match; "
                                      "0 turns prompt lookup off in speculative decoding)")
        if method == Method.LOOKUP and not sampling.greedy:
            raise SamplingParamsError("method='lookup' (prompt lookup) is greedy only: use temperature=0, or "
                                      "method='speculative' / 'plain' to sample")
        method = Method.parse(method)
        if method not in self.methods:
            if method.needs_draft and self.manifest.draft is None and self.head is None:
                raise SamplingParamsError("these engines were built without a draft model (--draft none): use "
                                          "method='plain' (`specrt generate --plain`), or rebuild with a draft "
                                          "(`specrt build --draft int8`)")
            raise SamplingParamsError(f"method={method!r} was not loaded: create the generator with "
                                      f"methods including {method!r} (it has {self.methods})")
        prompt_ids = check_request(prompt_ids, max_new_tokens, self.shapes.max_context, self.vocab)
        grammar, logprobs = None, check_logprobs(logprobs)
        if structured is not None:
            grammar = matcher(self.one.engine.grammars, structured, ignore_eos)
        fixed = None                 # the instance's setting
        if adaptive is not None:
            if adaptive not in (True, False):
                raise ConfigError(f"adaptive={adaptive!r} must be True, False or None")
            if self.target is None and adaptive is False:
                raise ConfigError("this folder's batched engine chooses every round by measured cost: adaptive must "
                                  "be None or True (engine='one-row' runs fixed-k rounds)")
            if adaptive and self.costs is None:
                raise ConfigError("adaptive=True needs the step costs a build measures (manifest "
                                  "build.speculation.costs_ms), and these engines have none: rebuild them with "
                                  "this specrt, or pass adaptive=False")
            if adaptive and self.target is not None and not self._plain_graph:
                raise ConfigError("adaptive=True falls back to plain decoding steps, so it needs the target's "
                                  "one-token graph: include 'plain' in methods")
            fixed = adaptive is False if self.target is not None else None
        return self._tokens(prompt_ids, max_new_tokens, sampling, method, ngram, fixed, grammar, logprobs)

    def teacher_forced(self, prompt_ids: list[int], forced: list[int]):
        """The logits [len(forced), V] this folder's engine gives at each position of `forced` after
        `prompt_ids`, in the calls a request alone makes (runtime/batch/forced.py; `specrt
        quality`). Holds the generator as a generation does: refused while one runs."""
        from specrt.runtime.batch.forced import teacher_forced
        self._acquire()
        try:
            return teacher_forced(self.one.engine, list(prompt_ids), list(forced))
        finally:
            self._busy.release()

    def _acquire(self) -> None:
        if not self._busy.acquire(blocking=False):
            gc.collect()   # an abandoned stream kept alive only by a reference cycle is closed here
            if not self._busy.acquire(blocking=False):
                raise ConcurrentUseError(
                    "this SpeculativeGenerator is already generating (another stream of it is open, or another "
                    "thread is using it); its caches hold one generation at a time: finish or close() the other "
                    "stream first, or give each thread or worker its own SpeculativeGenerator")

    def _tokens(self, prompt_ids, max_new_tokens, sampling, method, ngram, fixed, grammar, logprobs) \
            -> Iterator[Emitted]:
        self._acquire()
        try:
            P = len(prompt_ids)
            m = self.last_metrics = Metrics(method=method.value, k=0 if method is Method.PLAIN else self.k,
                                            prompt_tokens=P)
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
            yield from self.one.tokens(prompt_ids, max_new_tokens, sampling, seed, m, method, ngram, grammar, logprobs,
                                       fixed)
        finally:
            self._busy.release()
