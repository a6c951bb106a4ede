"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regular
expression, a choice of strings, a Lark or GBNF grammar) as a per-row matcher that masks the
target's logits, through llguidance (github.com/guidance-ai/llguidance: MIT, no dependencies,
reads the engine folder's tokenizer.json; a mask costs ~30-150 us at SmolLM2's 49,152 tokens).

    spec = Structured("json_schema", {"type": "object", ...})      # or Structured.coerce(...)
    grammars = Grammars(tokenizer_json_text, eos_ids, vocab)      # once per engine folder
    m = grammars.matcher(spec)                                    # once per request (a row)
    masked = m.masked(logits_row, out)                            # -inf where the grammar forbids
    m.consume(token); m.rollback(n); m.allowed_prefix(proposal)

Exact under speculation (runtime/batch/engine.py): the target's choice at every verified
position is made from its logits masked by the grammar state after the tokens before it, which
is the state plain constrained decoding reaches there; the matcher only ever consumes tokens
that are emitted (a draft advances it along its own guesses and rolls it back before the
verify pass), so greedy output equals plain constrained decoding and a seeded sample is the
same sample (runtime/choice.py). EOS ends a request whose grammar is complete (the mask lets
it through only then); it is never fed to the matcher.

JSON is written on one line as Python's json.dumps writes it (", " and ": ", no other
whitespace between tokens: a small model left free to indent may write whitespace until
max_tokens); `strict` is always on (the schema is enforced, as vLLM does).
"""
from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from specrt.errors import SamplingParamsError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_CACHE = 64                  # compiled grammars kept per engine folder (by spec)


class GrammarError(SamplingParamsError):
    """A structured-output request that cannot be honoured: an invalid schema, regular
    expression or grammar (the message names the problem), or a grammar on an engine that
    cannot constrain (rebuild with --batch)."""


@dataclass(frozen=True)
class Structured:
    """What a request's output must match. kind: one of KINDS; value: the JSON schema (a dict,
    or its JSON text), None for json_object, the regular expression, the list of strings, or
    the grammar's text (Lark, or GBNF as llama.cpp writes it)."""
    kind: str
    value: object = None

    def __post_init__(self) -> None:
        k, v = self.kind, self.value
        if k not in KINDS:
            raise GrammarError(f"structured output kind {k!r}; choose one of {KINDS}")
        if k == "json_schema":
            if isinstance(v, str):
                try:
                    v = json.loads(v)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"the JSON schema is not JSON ({e.msg} at character {e.pos})") from None
            if v is False:
                raise GrammarError("the JSON schema false matches nothing: give a schema an answer can match")
            if v is True:
                v = {}              # true: any JSON value, as the empty schema
            if not isinstance(v, dict):
                raise GrammarError(f"a JSON schema is an object (or true), got {type(v).__name__}")
            text = json.dumps(v, separators=(",", ":"), ensure_ascii=False)    # (key order kept: it is the output's)
            _unicode(text, "the JSON schema")
            object.__setattr__(self, "value", text)
        elif k == "json_object":
            if v is not None:
                raise GrammarError("json_object takes no value (use json_schema for a schema)")
        elif k == "choice":
            if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not v \
                    or not all(isinstance(s, str) and s for s in v):
                raise GrammarError(f"a choice is a non-empty list of non-empty strings, got {_short(v)}")
            for s in v:
                _unicode(s, "a choice")
            object.__setattr__(self, "value", tuple(v))
        elif not isinstance(v, str) or not v:
            raise GrammarError(f"a {k} is a non-empty string, got {_short(v)}")
        else:
            _unicode(v, f"the {k}")

    @classmethod
    def coerce(cls, obj) -> "Structured | None":
        """None, a Structured, or a mapping with exactly one of the keys json_schema, json_object
        (true), regex, choice, grammar (as vLLM's `structured_outputs`, with `json` for
        json_schema)."""
        if obj is None or isinstance(obj, cls):
            return obj
        if isinstance(obj, dict):
            given = {("json_schema" if k == "json" else k): v for k, v in obj.items() if v is not None and v is not False}
            if len(given) != 1 or next(iter(given)) not in KINDS:
                raise GrammarError(f"structured output {_short(obj)}: give exactly one of {KINDS}")
            kind, value = next(iter(given.items()))
            return cls(kind, None if kind == "json_object" else value)
        raise GrammarError(f"structured={_short(obj)}: pass a specrt.runtime.grammar.Structured or a mapping "
                           "such as {'json_schema': {...}} or {'regex': '...'}")

    def grammar(self) -> str:
        """The llguidance grammar text of this spec (not yet checked: `Grammars.compile` does)."""
        try:
            return self._grammar()
        except ValueError as e:         # what llguidance's builders raise on what they cannot take
            raise GrammarError(f"the {self.kind.replace('_', ' ')} cannot be used: {e}") from None

    def _grammar(self) -> str:
        import llguidance as llg
        compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        if self.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(self.value, overrides=compact)
        if self.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=compact)
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in self.value))
        try:
            return llg.grammar_from("grammar", self.value)     # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise GrammarError(f"the grammar does not parse: {e}") from None


class Grammars:
    """The tokenizer llguidance masks with (built on first use: ~0.4 s) and the compiled grammars
    of one engine folder, shared by every row; thread-safe (requests compile on their callers'
    threads, the engine thread only uses matchers)."""

    def __init__(self, tokenizer_json: str, eos_ids, vocab: int):
        self._json, self.eos = tokenizer_json, sorted(int(i) for i in eos_ids)
        self.vocab = vocab
        self._tok = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[Structured, str] = OrderedDict()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                try:
                    import llguidance as llg
                except ImportError as e:     # a core dependency: only a broken install lacks it
                    raise GrammarError(f"structured outputs need llguidance ({e}): pip install 'llguidance>=1.9'") \
                        from None
                if not self.eos:
                    raise GrammarError("this engine folder's tokenizer names no EOS token: a grammar could never end")
                self._tok = llg.LLTokenizer(self._json, eos_token=self.eos)
            return self._tok

    def compile(self, spec: Structured) -> str:
        """The checked grammar of `spec` (cached); a GrammarError names what is wrong with it."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        import llguidance as llg
        text = spec.grammar()
        err = llg.LLMatcher.validate_grammar(text, self.tokenizer)
        if err:
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} cannot be used: {err.strip()}")
        with self._lock:
            self._compiled[spec] = text
            while len(self._compiled) > _CACHE:
                self._compiled.popitem(last=False)
        return text

    def matcher(self, spec: Structured) -> "Matcher":
        return Matcher(self, self.compile(spec))

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a byte-level piece of a character too), special tokens
        as their text: what OpenAI's logprobs `bytes` report."""
        return self.tokenizer.decode_bytes([int(token)])


class Matcher:
    """One request's grammar state: the tokens it has consumed are the row's emitted tokens
    (plus, while a draft proposes, the draft's own guesses, rolled back before the verify)."""

    def __init__(self, grammars: Grammars, grammar: str):
        import llguidance as llg
        self.g = grammars
        self.m = llg.LLMatcher(grammars.tokenizer, grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"the grammar cannot be used: {self.m.get_error().strip()}")
        n = grammars.tokenizer.vocab_size
        self._bits = np.zeros((n + 31) // 32, np.int32)
        self._allowed = np.zeros(grammars.vocab, bool)
        self.consumed = 0

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next (EOS only where it is complete)."""
        m = self.m
        if m.is_error():
            raise GrammarError(f"the grammar matcher failed: {m.get_error().strip()}")
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        n = min(self.g.vocab, self.g.tokenizer.vocab_size)
        self._allowed[:n] = bits[:n]
        self._allowed[n:] = False           # ids past the tokenizer's (a padded model vocabulary): never
        return self._allowed

    def masked(self, logits: np.ndarray, out: np.ndarray) -> np.ndarray:
        """logits [V] with the forbidden tokens at -inf, written into out [V] float32."""
        allowed = self.allowed()
        if not allowed.any():
            raise GrammarError("the grammar allows no token here (the matcher is stuck): report this grammar")
        np.copyto(out, logits)
        out[~allowed] = -np.inf
        return out

    def consume(self, token: int) -> bool:
        """Advance along an emitted (or drafted) token; False for an EOS (never consumed) or a
        token the grammar forbids (the matcher is then in an error state)."""
        if token in self.g.eos:
            return False
        if not self.m.consume_token(int(token)):
            return False
        self.consumed += 1
        return True

    def rollback(self, n: int) -> None:
        if n:
            if not self.m.rollback(n):
                raise GrammarError(f"the grammar matcher could not roll back {n} tokens: {self.m.get_error()}")
            self.consumed -= n

    def allowed_prefix(self, tokens) -> int:
        """How many leading `tokens` the grammar accepts from here (the state is unchanged)."""
        toks = [int(t) for t in tokens]
        stop = next((i for i, t in enumerate(toks) if t in self.g.eos), len(toks))
        n = self.m.validate_tokens(toks[:stop]) if stop else 0
        # an EOS right after an accepted prefix is allowed where the grammar is complete there
        if n == stop < len(toks) and self._accepting_after(toks[:stop]):
            n += 1
        return n

    def _accepting_after(self, toks: list[int]) -> bool:
        if not toks:
            return self.m.is_accepting()
        ok = self.m.consume_tokens(toks)
        accepting = ok and self.m.is_accepting()
        self.m.rollback(len(toks))
        return accepting


def _unicode(text: str, what: str) -> None:
    """JSON's \\ud800 escapes decode to lone surrogates, which are not text: a GrammarError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GrammarError(f"{what} holds a lone UTF-16 surrogate ({text[e.start]!a} at character {e.start}), "
                           "which is not Unicode text") from None


@functools.lru_cache(maxsize=4)
def grammars_for(tokenizer_json: str, eos_ids: tuple[int, ...], vocab: int) -> "Grammars":
    """One Grammars per engine folder's tokenizer in a process: the server's validator and its
    engine share the mask tokenizer (built once, ~0.4 s) and the compiled grammars."""
    return Grammars(tokenizer_json, eos_ids, vocab)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
