"""A toy language model behind the BatchModel protocol, for the engine's tests.

Each cache row stores the token ids written into it; the logits at a position are a
pseudo-random function of the whole prefix read back from that row. So a row that reads
another row's tokens, a stale token past its length or a token never written gives other
logits (and reading an unwritten slot fails at once): a mistake in the engine's rows,
lengths or moves changes the output. Rows never influence each other: the model is batch
invariant by construction, so any difference from a request run alone is the engine's.
"""
from __future__ import annotations

import hashlib
import threading

import numpy as np


PAD = -2        # what a padding row writes into the fake cache (row_multiple 2)


class FakeCache:
    def __init__(self, rows: int, capacity: int):
        self.rows, self.capacity = rows, capacity
        self.tokens = np.full((rows, capacity), -1, np.int64)    # [rows, capacity]: what each slot holds
        self.moves: list[tuple[int, int, int]] = []

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.tokens[dst, :length] = self.tokens[src, :length]
        self.tokens[dst, length:] = -1         # nothing valid past the moved length
        self.moves.append((src, dst, length))

    def forget(self, first_free: int) -> None:
        """Rows first_free.. are free: their tokens are dropped (as a growing cache drops their
        K/V), so an engine that forgot a row it still uses reads -1s there and answers otherwise."""
        self.tokens[first_free:] = -1


class FakeLM:
    def __init__(self, vocab: int = 16, rows: int = 4, capacity: int = 96, *, graph_tokens=None, salt: bytes = b"",
                 sharpness: float = 2.0, cache: FakeCache | None = None, min_rows: int = 1, row_multiple: int = 1):
        """salt: another salt gives another model (a draft that agrees only sometimes).
        graph_tokens: static T per graph (0: any T)."""
        self.vocab, self.salt, self.sharpness = vocab, salt, sharpness
        self.shares_cache = cache is not None
        self.cache = cache or FakeCache(rows, capacity)
        self.graph_tokens = dict(graph_tokens or {"prefill": 8, "decode": 0, "verify": 0})
        self.min_rows, self.row_multiple = min_rows, row_multiple
        self.pads: list[tuple[int, int, int]] = []            # (cache row, pad_start, T) of each padding row
        self.out = np.zeros((self.cache.rows, 64, vocab), np.float32)
        self.calls: list[tuple[str, int, int, int]] = []       # (graph, rows, T, first_row)

    def logits(self, prefix) -> np.ndarray:
        """The model's logits after `prefix` (a sequence of ids): the reference for a test."""
        h = hashlib.sha256(self.salt + np.asarray(prefix, np.int64).tobytes()).digest()
        return np.random.default_rng(int.from_bytes(h[:8], "little")).normal(size=self.vocab).astype(np.float32) \
            * self.sharpness

    def step(self, graph: str, tokens: np.ndarray, starts: np.ndarray, first_row: int = 0,
             positions: np.ndarray | None = None, pad_start: int | None = None) -> np.ndarray:
        n, T = tokens.shape
        static = self.graph_tokens.get(graph, 0)
        assert not static or T == static, (graph, T, static)
        assert n * T >= self.min_rows, (graph, n, T)
        assert first_row + n <= self.cache.rows
        self.calls.append((graph, n, T, first_row))
        if self.row_multiple == 2 and n > 1 and n * T % 2:
            # as OrtBatchModel: one padding row after the call's rows writes T slots from pad_start;
            # a row that later reads one of them fails (PAD), so a wrong pad_start shows
            r = first_row + n
            assert r < self.cache.rows and pad_start is not None, (r, self.cache.rows, pad_start)
            self.cache.tokens[r, pad_start:pad_start + T] = PAD
            self.pads.append((r, int(pad_start), T))
        for i in range(n):
            r, s = first_row + i, int(starts[i])
            assert 0 <= s and s + T <= self.cache.capacity, (s, T)
            self.cache.tokens[r, s:s + T] = tokens[i]
            for t in range(T):
                prefix = self.cache.tokens[r, :s + t + 1]
                assert (prefix != PAD).all(), f"row {r} reads a slot a padding row wrote: {prefix.tolist()}"
                assert (prefix >= 0).all(), f"row {r} reads a slot never written: {prefix.tolist()}"
                self.out[i, t] = self.logits(prefix)
        if positions is not None:      # as the batched graphs' logit_pos: only those positions
            assert positions.shape[0] == n and n * positions.shape[1] >= self.min_rows, (positions.shape, n)
            return np.take_along_axis(self.out[:n, :T], np.asarray(positions)[:, :, None], axis=1)
        return self.out[:n, :T]


class FakeTokenizer:
    """Token i is the letter chr(ord('a') + i % 26); `eos` ends a sequence."""

    def __init__(self, eos: int):
        self.eos_token_ids = frozenset({eos})

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids if int(i) not in self.eos_token_ids)


def hold_until_added(engine, n: int, monkeypatch) -> None:
    """Hold a BatchGenerator's engine thread before its next step until `n` more requests
    have been added: they all wait before the first of them is admitted, so the batches that
    follow do not depend on how the threads were scheduled. Returns once the engine thread is
    parked in the held step (a step already under way could otherwise admit the first request)."""
    added, parked, lock, count = threading.Event(), threading.Event(), threading.Lock(), [0]
    real_add, real_step = engine.add, engine.step

    def add(req, max_waiting=None):
        ok = real_add(req, max_waiting)
        with lock:
            count[0] += ok
            if count[0] >= n:
                added.set()
        return ok

    def step():
        parked.set()
        return added.wait(60) and real_step()     # never a real step before the n-th request

    monkeypatch.setattr(engine, "add", add)
    monkeypatch.setattr(engine, "step", step)
    assert parked.wait(60), "the engine thread never came back to its step"


class StepGate:
    """Replaces a BatchEngine's step (on a BatchGenerator's thread) by one that runs only when
    the test lets it: `run(k)` lets k steps run and returns once they have; `free()` lets it run
    on its own (call it in a `finally`, or the engine thread waits for ever)."""

    def __init__(self, engine, monkeypatch):
        self._permits, self._ran, self._free, real = threading.Semaphore(0), threading.Semaphore(0), False, engine.step

        def step():
            if not self._free:
                self._permits.acquire()
            try:
                return real()
            finally:
                self._ran.release()

        monkeypatch.setattr(engine, "step", step)

    def run(self, k: int = 1) -> None:
        for _ in range(k):
            self._permits.release()
            assert self._ran.acquire(timeout=60), "the engine thread did not take its step"

    def free(self) -> None:
        self._free = True
        self._permits.release()          # the step waiting now


TOY_CHARS = "012abc[],xyz-.!"       # token i is TOY_CHARS[i]; token 15 is "</s>"


def toy_tokenizer_json() -> str:
    """A byte-level tokenizer.json whose 16 tokens are the toy model's vocabulary (token i is
    TOY_CHARS[i], 15 is the special "</s>"), for grammars over the toy model (runtime/grammar.py)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(TOY_CHARS)} | {"</s>": 15}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken("</s>", special=True)])
    return t.to_str()
