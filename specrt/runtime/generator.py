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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from specrt import manifest as mf
from specrt.errors import (
    BackendError,
    ConcurrentUseError,
    ConfigError,
    ContextLengthError,
    GraphFileError,
    PromptError,
    SamplingParamsError,
    TokenizerMismatchError,
)
from specrt.runtime.adaptive import AdaptiveK, StepCosts
from specrt.runtime.loop import Emitted, Workspace, plain_decode, prefill, speculative_decode
from specrt.runtime.metrics import Metrics
from specrt.runtime.ngrams import NgramTable
from specrt.runtime.proposers import lookup_decode
from specrt.runtime.backends import backend_for
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import IncrementalDecoder, Tokenizer

METHODS = ("speculative", "plain", "lookup")   # lookup: prompt lookup (n-gram), greedy, no draft model


@dataclass
class Chunk:
    """A piece of streamed output: the text it adds and the tokens behind it."""
    text: str
    tokens: list[int]
    from_draft: list[bool]


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    metrics: Metrics
    prompt_tokens: int = 0
    message: str = field(default="")


class SpeculativeGenerator:
    def __init__(self, engine_dir: str | Path, *, k: int | None = None, threads: int = 2,
                 memory: str = "fast", methods: Sequence[str] | None = None, verify: str = "full",
                 profile_dir: str | Path | None = None, adaptive: bool | None = None,
                 backend_options: dict | None = None):
        """Load the engines in `engine_dir` (a folder written by `specrt build`).

        backend_options: passed to the backend that opens the models, e.g. {"cuda_graphs": False}
        for ort-cuda / tensorrt (CUDA-graph replay off); ort-cpu takes none.
        adaptive: choose each round's draft length from the acceptance so far and the step
        costs the build measured, falling back to plain steps when speculation does not pay
        (runtime/adaptive.py). None (default): on when the manifest has those costs, the
        target's one-token graph is loaded and `k` is not given (an explicit k is fixed).

        methods: which decoding methods to make ready (default: all the build supports);
        a service that only speculates passes ("speculative",) and never loads the
        target's one-token graph (one session, one packed copy of the weights less).
        memory: "fast" or "shared", see ort_backend.
        verify: "full" (default) checks the sha256 of every file against the manifest while
        the sessions load (~0.6 s of one core for the default engines, mostly hidden);
        "none" checks only that the files exist and the weights have their size.
        profile_dir: record ONNX Runtime's per-operator profile into this folder (slows every
        step; `specrt profile` uses it; end it with `end_profiling()`)."""
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
        if memory == "shared" and _matmul_nbits(man.target):
            # measured on SmolLM2 int4: decode 265 ms per step unpacked vs 6.3 ms pre-packed
            raise ConfigError(f"memory='shared' does not suit this {man.target.precision} target: its MatMulNBits "
                              "graphs run ~40x slower without ONNX Runtime's pre-packing; use memory='fast' "
                              "(the weights are already small), or methods=('speculative',) to load fewer graphs")
        self.methods = tuple(methods) if methods is not None else (METHODS if man.draft else ("plain", "lookup"))
        if not self.methods or any(m not in METHODS for m in self.methods):
            raise SamplingParamsError(f"methods={methods!r}; choose from {METHODS}")
        if "speculative" in self.methods and man.draft is None:
            raise SamplingParamsError("these engines have no draft model: pass methods=('plain',) or rebuild "
                                      "with a draft (--draft int8)")
        if man.draft is not None and "speculative" in self.methods:
            _check_same_vocab(man)
        check = mf.HashCheck(man, self.root) if verify == "full" else None
        try:
            self._load(man, threads, memory, profile_dir, dict(backend_options or {}))
        except (GraphFileError, BackendError):
            if check is not None:   # a damaged file explains a load failure better than ORT's message
                try:
                    check.result()
                except GraphFileError as damaged:
                    raise damaged from None
            raise
        if check is not None:
            check.result()
        self.vocab = int(man.target.dims["vocab"])
        self.ws = Workspace(self.k, self.vocab)
        self.costs, self.adaptive = self._adaptive(man, adaptive, k)
        self.last_metrics: Metrics | None = None
        self._busy = threading.Lock()   # held by the one open generation

    def _load(self, man: mf.Manifest, threads: int, memory: str, profile_dir, extra: dict) -> None:
        if profile_dir:
            extra["profile_dir"] = Path(profile_dir)
        self.tokenizer = Tokenizer(self.root, man.tokenizer)
        target_graphs = ("prefill",) + (("decode",) if {"plain", "lookup"} & set(self.methods) else ()) \
            + (("verify",) if {"speculative", "lookup"} & set(self.methods) else ())
        self.target_graphs = target_graphs
        # a two-row decode graph (a quantized target's): pair rounds verify a guessed token in its second row
        self.pair = "decode" in target_graphs and man.target.graphs["decode"].tokens >= 2
        ngrams = (man.proposers or {}).get("ngrams")
        self.ngrams = NgramTable.load(self.root / ngrams["file"]) if ngrams and self.pair else None
        try:
            self.target = self.backend.open_model(self.root, man.target, man.shapes, threads=threads, memory=memory,
                                                  graphs=target_graphs, **extra)
        except TypeError as e:   # an option this backend does not take
            if "unexpected keyword" not in str(e):
                raise
            raise ConfigError(f"backend_options {sorted(extra)}: the {self.backend.name} backend does not take "
                              f"them ({e})") from None
        self.draft = None
        if man.draft is not None and "speculative" in self.methods:
            shared = man.draft.shares_cache_with == "target"
            self.draft = self.backend.open_model(self.root, man.draft, man.shapes, threads=threads, memory=memory,
                                  cache=self.target.cache if shared else None,
                                  graphs=("decode",) if shared else ("prefill", "decode"), **extra)

    def _adaptive(self, man: mf.Manifest, adaptive: bool | None, k: int | None):
        spec = (man.build or {}).get("speculation")
        costs = StepCosts.from_manifest(spec)
        if adaptive is None:
            return costs, costs is not None and k is None and "decode" in self.target_graphs \
                and "speculative" in self.methods
        return costs, self._check_adaptive(adaptive, costs)

    def _check_adaptive(self, adaptive, costs) -> bool:
        if adaptive not in (True, False):
            raise ConfigError(f"adaptive={adaptive!r} must be True, False or None")
        if adaptive and costs is None:
            raise ConfigError("adaptive=True needs the step costs a build measures (manifest "
                              "build.speculation.costs_ms), and these engines have none: rebuild them with "
                              "this specrt, or pass adaptive=False")
        if adaptive and "decode" not in self.target_graphs:
            raise ConfigError("adaptive=True falls back to plain decoding steps, so it needs the target's "
                              "one-token graph: include 'plain' in methods")
        return adaptive

    def _policy(self) -> AdaptiveK | None:
        """The policy of one generation under the instance's setting (None: fixed k)."""
        return self._new_policy() if self.adaptive else None

    def _new_policy(self) -> AdaptiveK:
        agree = (self.manifest.draft.parity or {}).get("agreement_with_target") or {}
        return AdaptiveK(self.costs, self.k, prior=float(agree.get("top1_agreement", 0.8)))

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
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise PromptError("the prompt is bytes: decode it to str first (e.g. prompt.decode('utf-8')), or "
                              "pass a list of token ids")
        if not isinstance(prompt, str):
            return _token_ids(prompt)
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise PromptError(f"the prompt is not valid UTF-8 text (undecodable byte at position {e.start}, "
                              "e.g. from a terminal in another encoding): pass UTF-8 text") from None
        if system is not None and not isinstance(system, str):
            raise PromptError(f"system must be a string, got {type(system).__name__}")
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def tokens(self, prompt_ids: list[int], *, max_new_tokens: int = 128, sampling: SamplingParams | dict | None = None,
               method: str = "speculative", ngram: int = 2, adaptive: bool | None = None) -> Iterator[Emitted]:
        """Yield generated tokens as they become final (EOS included; the caller stops).
        Arguments are checked here, before the first token is asked for.
        method: "speculative" (draft model), "plain", or "lookup" (prompt lookup: proposes the
        continuation of the latest earlier match of the last `ngram` tokens; greedy only).
        With adaptive k, "speculative" also verifies prompt lookup's guess (n = `ngram`) in
        rounds where that pays better than the draft; ngram=0 turns this off.
        adaptive: this call's setting (None: the instance's, see __init__)."""
        sampling = SamplingParams.coerce(sampling)    # a SamplingParams, a mapping of its fields, or None
        if not isinstance(ngram, int) or isinstance(ngram, bool) or ngram < (1 if method == "lookup" else 0):
            raise SamplingParamsError(f"ngram={ngram!r} must be an integer >= 1 (the n of the n-gram match; "
                                      "0 turns prompt lookup off in speculative decoding)")
        if method == "lookup" and not sampling.greedy:
            raise SamplingParamsError("method='lookup' (prompt lookup) is greedy only: use temperature=0, or "
                                      "method='speculative' / 'plain' to sample")
        if method not in METHODS:
            raise SamplingParamsError(f"method={method!r}; choose one of {METHODS}")
        if method not in self.methods:
            if method == "speculative" and self.manifest.draft is None:
                raise SamplingParamsError("these engines were built without a draft model (--draft none): use "
                                          "method='plain' (`specrt generate --plain`), or rebuild with a draft "
                                          "(`specrt build --draft int8`)")
            raise SamplingParamsError(f"method={method!r} was not loaded: create the generator with "
                                      f"methods including {method!r} (it has {self.methods})")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SamplingParamsError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
        prompt_ids = _token_ids(prompt_ids)
        P, C = len(prompt_ids), self.shapes.max_context
        if P == 0:
            raise ContextLengthError("the prompt is empty: give at least one token")
        if P >= C:
            raise ContextLengthError(
                f"the prompt has {P} tokens; the engines were built with max_context={C}, leaving no room to "
                f"generate: shorten the prompt or rebuild with --max-context {P + max_new_tokens}")
        if max(prompt_ids) >= self.vocab or min(prompt_ids) < 0:
            raise TokenizerMismatchError(f"prompt token ids must lie in [0, {self.vocab}): encode the prompt with "
                                         "this build's tokenizer (pass text, or gen.tokenizer.encode(text))")
        if adaptive is not None:
            self._check_adaptive(adaptive, self.costs)
        return self._tokens(prompt_ids, min(max_new_tokens, C - P), max_new_tokens, sampling, method, ngram,
                            adaptive)

    def _tokens(self, prompt_ids, budget, max_new_tokens, sampling, method, ngram=2,
                adaptive=None) -> Iterator[Emitted]:
        if not self._busy.acquire(blocking=False):
            gc.collect()   # an abandoned stream kept alive only by a reference cycle is closed here
            if not self._busy.acquire(blocking=False):
                raise ConcurrentUseError(
                    "this SpeculativeGenerator is already generating (another stream of it is open, or another "
                    "thread is using it); its caches hold one generation at a time: finish or close() the other "
                    "stream first, or give each thread or worker its own SpeculativeGenerator")
        try:
            yield from self._tokens_locked(prompt_ids, budget, max_new_tokens, sampling, method, ngram, adaptive)
        finally:
            self._busy.release()

    def _tokens_locked(self, prompt_ids, budget, max_new_tokens, sampling, method, ngram,
                       adaptive) -> Iterator[Emitted]:
        P = len(prompt_ids)
        m = self.last_metrics = Metrics(method=method, k=0 if method == "plain" else self.k, prompt_tokens=P)
        rng = np.random.default_rng(sampling.seed)
        t_start = time.perf_counter()
        try:
            first = prefill(self.target, self.manifest.target.graphs["prefill"].tokens, prompt_ids)
            if method == "speculative" and not self.draft.shares_cache:
                prefill(self.draft, self.manifest.draft.graphs["prefill"].tokens, prompt_ids)
            m.time_prefill = time.perf_counter() - t_start
            if method == "plain":
                inner = plain_decode(self.target, first, P, budget, sampling, rng, self.ws, m)
            elif method == "lookup":
                inner = lookup_decode(self.target, first, P, budget, m, seq=list(prompt_ids), n=ngram, k=self.k,
                                      choices=self.ws.argmax, pair=self.pair, table=self.ngrams)
            else:
                inner = speculative_decode(self.target, self.draft, first, P, budget, sampling, rng, self.ws, m,
                                           draft_start=P, shared_cache=self.draft.shares_cache,
                                           seq=list(prompt_ids),
                                           policy=(policy := self._policy() if adaptive is None else
                                                   self._new_policy() if adaptive else None),
                                           lookup_n=ngram if policy is not None else 0, pair=self.pair,
                                           table=self.ngrams)
            with _closing(inner):
                yield from inner
            m.finish_reason = m.finish_reason or ("length" if budget == max_new_tokens else "max_context")
        finally:
            m.time_total = time.perf_counter() - t_start

    # --- text level -------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (), chat: bool = False,
               system: str | None = None, method: str = "speculative", ngram: int = 2) -> Iterator[Chunk]:
        """Yield text chunks as tokens are accepted; stops on EOS, a stop string, the token
        budget or the maximum context (`last_metrics.finish_reason` says which)."""
        ids = self.encode_prompt(prompt, chat=chat, system=system)
        eos = self.tokenizer.eos_token_ids
        dec = IncrementalDecoder(self.tokenizer)
        stop = _stop_strings(stop)
        held = ""   # text not yet released because it may be the start of a stop string
        gen = self.tokens(ids, max_new_tokens=max_new_tokens, sampling=sampling, method=method, ngram=ngram)
        with _closing(gen):
            for e in gen:
                if e.token in eos:
                    if held:   # a held-back prefix of a stop string that never completed
                        yield Chunk(held, [], [])
                    self.last_metrics.finish_reason = "eos"
                    break
                held += dec.push(e.token)
                hit = min((i for i in (held.find(s) for s in stop) if i >= 0), default=-1)
                if hit >= 0:
                    # the token that completed the stop string is reported; its text is trimmed
                    yield Chunk(held[:hit], [e.token], [e.from_draft])
                    self.last_metrics.finish_reason = "stop"
                    break
                keep = _partial_stop_suffix(held, stop)
                out, held = held[:len(held) - keep], held[len(held) - keep:]
                yield Chunk(out, [e.token], [e.from_draft])
            else:
                if held:
                    yield Chunk(held, [], [])

    def generate(self, prompt: str | Sequence[int], **kw) -> Completion:
        chunks = list(self.stream(prompt, **kw))
        m = self.last_metrics
        msg = ""
        if m.finish_reason == "max_context":
            msg = (f"stopped at the maximum context ({self.shapes.max_context} tokens); rebuild with a larger "
                   "--max-context for longer outputs")
        return Completion("".join(c.text for c in chunks), [t for c in chunks for t in c.tokens],
                          m.finish_reason, m, m.prompt_tokens, msg)


def _token_ids(prompt) -> list[int]:
    """A sequence of token ids as plain ints; anything else is a PromptError."""
    if isinstance(prompt, (str, bytes, bytearray, memoryview)):
        raise PromptError(f"expected a sequence of token ids, got {type(prompt).__name__}")
    try:
        ids = list(prompt)
    except TypeError:
        raise PromptError(f"the prompt must be text or a sequence of token ids, got {type(prompt).__name__}") from None
    out = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise PromptError(f"token ids must be integers, got {t!r} ({type(t).__name__}): pass text, or "
                              "gen.tokenizer.encode(text)")
        out.append(int(t))
    return out


def _stop_strings(stop) -> list[str]:
    """`stop` is one string or a sequence of strings (a bare string is ONE stop, not its characters)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    try:
        stops = list(stop)
    except TypeError:
        raise SamplingParamsError(f"stop must be a string or a list of strings, got {type(stop).__name__}") from None
    for s in stops:
        if not isinstance(s, str):
            raise SamplingParamsError(f"stop strings must be str, got {s!r} ({type(s).__name__})")
    return [s for s in stops if s]


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best


class _closing:
    """Close a generator when leaving the block, so its `finally` rewinds the caches."""

    def __init__(self, gen):
        self.gen = gen

    def __enter__(self):
        return self.gen

    def __exit__(self, *exc):
        self.gen.close()
        return False


def _matmul_nbits(entry: mf.ModelEntry) -> bool:
    """Were this model's weights quantized to ONNX Runtime's MatMulNBits (int8/int4 targets)?"""
    q = (entry.source or {}).get("quantization") or {}
    return "MatMulNBits" in str(q.get("method", ""))


def _check_same_vocab(man: mf.Manifest) -> None:
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
