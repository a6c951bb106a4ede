"""Requests into rows, for the batched engine (runtime/batch/engine.py, which inherits these):
requests cancelled or past their deadline leave (`_drop_cancelled`); the oldest waiting request
takes the free cache row after the running ones (`_admit`); its prompt runs one chunk a call,
one row alone in the call (`_prefill_chunk`: a request's prompt is computed the same way
whatever else is in the batch), and after its last chunk it gets its first token
(`_first_token`) and its samples (n > 1) are copies of its row (`_fork`). Split from engine.py
for length only: the methods read the engine's state (rows, admitting, waiting, models,
buffers) as before.

Prompts of several requests in one call (`_prefill_group`), where the folder's build showed
that a row's prompt gives the same bits among others as alone (parity.prompt_rows,
builder/gates/chunks.py prompt_rows; the engine's prompt_rows > 1): waiting requests whose
prompts each fit in one chunk, admitted together (oldest first, none with samples to fork; not
beside a draft model of its own, which would prefill them too),
take the free rows after the running ones, shortest prompt first, and each call carries the
same number of tokens of every one of them: what is left of the shortest prompt, within what
one prompt call may carry. No row is padded (padding chunks of 38-64 tokens to the longest cost
more than the call saved: a first form, measured), all start at position 0 and advance
together, and the ones whose prompt ends in a call are the first rows of the group: they join
the running rows where they are, no K/V moves; the last one left goes on alone. A prompt longer
than a chunk is admitted alone, as before: its chunks already fill a call, and in a group the
oldest request's prompt would advance a chunk a call beside the others' instead of taking the
step's whole budget (8 requests of ~1000 tokens at once: time to the first token p50 x1.8, the
same total time). 24 prompts of 20 tokens in one call cost x0.76 of 24 calls of one row;
prompts of 38-64 tokens already fill a call, and gain nothing (SmolLM2 int8row, AVX2,
docs/batching.md), the same bits.
"""
from __future__ import annotations

import collections
import logging

import numpy as np

from specrt.runtime import nvtx_ranges as trace
from specrt.runtime.backends.batch_calls import prompt_call
from specrt.runtime.batch.request import Done, Request, Row
from specrt.runtime.grammar import GrammarError

log = logging.getLogger(__name__)


class Admission:
    def _drop_cancelled(self) -> None:
        now = self.clock()

        def why(req: Request) -> str | None:
            if self.closing:        # whatever state it is in (waiting, being admitted, prefilled, running)
                req.cancel()
            if req.cancelled.is_set():
                return "cancelled"
            if req.poll_cancel is not None:
                try:
                    gone = req.poll_cancel()
                except Exception:       # a broken poll must not stop the engine's other requests
                    log.exception("request %d: poll_cancel failed; it is not polled again", req.id)
                    req.poll_cancel, gone = None, False
                if gone:
                    req.cancel()
                    return "cancelled"
            return "timeout" if req.deadline is not None and now >= req.deadline else None

        with self._lock:
            kept = collections.deque()
            for req in self.waiting:
                reason = why(req)
                if reason:
                    for r in (req, *req.siblings):      # samples not yet forked share its fate
                        r.sink(Done(reason, len(r.prompt), 0, Row(r, 0, None, {}, 0).metrics))
                else:
                    kept.append(req)
            self.waiting = kept
        for row in self.rows + self.admitting:
            reason = why(row.req)
            if reason and row.finish is None:
                row.finish = reason

    def _admit(self) -> None:
        if self.admitting or len(self.rows) >= self.max_num_seqs:
            return
        with self._lock:
            # a request with siblings waits until a row is free for each of them (oldest first)
            if not self.waiting or len(self.rows) + 1 + len(self.waiting[0].siblings) > self.max_num_seqs:
                return
            group = [self.waiting[0]]
            while len(self.waiting) > len(group) and self._joins(group, self.waiting[len(group)]):
                group.append(self.waiting[len(group)])
        # their rows are made while the requests still wait (a Row that raises loses none: fail_all
        # tells the waiting), shortest prompt first (stable: equal lengths keep their order)
        rows = [Row(req, min(req.max_new_tokens, self.max_context - len(req.prompt)), self.tokenizer,
                    self.policy.row_accept(), self.k_max) for req in sorted(group, key=lambda req: len(req.prompt))]
        with self._lock:        # (only this thread takes from `waiting`: its first requests are still these)
            taken = [self.waiting.popleft() for _ in group]
        assert taken == group, "the waiting queue changed under admission"
        self.admitting = rows

    def _joins(self, group: list[Request], nxt: Request) -> bool:
        """Does the waiting request `nxt` share the prompt calls of `group` (module docstring)?
        A free row for it, every prompt within one chunk, none with samples to fork, no draft
        model of its own, and the group's first call (rows x its shortest prompt) within what
        one prompt call may carry."""
        if len(group) >= self.prompt_rows or group[0].siblings or nxt.siblings or self._own_draft \
                or len(self.rows) + len(group) >= self.max_num_seqs \
                or max(len(group[0].prompt), len(nxt.prompt)) > self.prefill_tokens:
            return False
        shortest = min(len(nxt.prompt), *(len(req.prompt) for req in group))
        return (len(group) + 1) * shortest <= self._carry()

    def _carry(self) -> int:
        """The prompt tokens one call of several requests may carry: the step's prefill_budget,
        else a chunk (a request alone's larger chunk when no row runs)."""
        return self.prefill_budget or (self.prefill_tokens if self.rows else self.lone_prefill_tokens)

    def _prefill_chunk(self) -> int:
        """One chunk of the admitted rows' prompts; returns its tokens."""
        if len(self.admitting) > 1:
            return self._prefill_group()
        row, slot = self.admitting[0], len(self.rows)
        C = self._prompt_chunk()
        chunk = row.req.prompt[row.length:row.length + C]
        T, lo = self._chunk_call(len(chunk), C)
        self._tokens[0, :T] = 0
        self._tokens[0, :len(chunk)] = chunk
        self._starts[0] = row.length
        positions = self._positions[:1]
        np.add(self._offsets, lo, out=positions[0])
        # (a padding row, where the model pads odd calls, goes after the pending row: free)
        trace.push("prefill")
        logits = self.target.step("prefill", self._tokens[:1, :T], self._starts[:1], slot, positions, pad_start=0)
        trace.pop()
        if self.head is not None:  # the prompt's pairs go into the head's cache at its first draft round
            row.feats.append(self.target.hidden[0, :len(chunk)].copy())
        if self._own_draft:
            # the same chunk into the draft's cache row (its logits are not read: its first
            # proposal comes from the round's catch-up of the row's last token)
            self._feed_draft(slot, [chunk], [row.length], "prefill", pad=0)
            row.draft_len = row.length + len(chunk)
        row.length += len(chunk)
        self.stats.prefill_chunks += 1
        if not row.prefilled:
            return len(chunk)
        self.admitting = []
        self.rows.append(row)
        last = logits[0, len(chunk) - 1 - lo][None]
        # its samples still to fork: fail_all tells them too if this step fails before they are rows
        self._unforked = list(row.req.siblings)
        self._first_token(row, last)
        while self._unforked:
            self._fork(row, slot, last)
        return len(chunk)

    def _prompt_chunk(self) -> int:
        """The prompt tokens the next call of one request's prompt carries: a request alone (no
        row running, no draft model of its own) the larger chunk (the same bits,
        builder/gates/chunks.py), as nothing waits on this step; beside running rows the
        folder's chunk bounds their wait."""
        return self.lone_prefill_tokens if not self.rows and not self._own_draft else self.prefill_tokens

    def _chunk_call(self, n: int, chunk: int) -> tuple[int, int]:
        """(T, lo) of a one-row prompt call carrying n tokens in chunks of `chunk`: its token
        window (the chunk, padded, for a graph of static T; a graph with a symbolic T runs it
        unpadded, so a short prompt's last chunk costs its own tokens; the row is alone in the
        call, so its T depends on its prompt only) and the first of the
        positions whose logits it returns: the chunk's last token's, over at least min_rows
        positions (the LM head is a fifth of a chunk's cost). Also forced.py's."""
        T = chunk if self.target.graph_tokens.get("prefill", 0) else max(n, self.target.min_rows, self.min_tokens)
        return T, max(n - self._positions.shape[1], 0)

    def _prefill_group(self) -> int:
        """The next chunk of every admitted row's prompt, in one call (module docstring);
        returns their tokens. The rows whose prompt ends here join the running rows."""
        group, slot = self.admitting, len(self.rows)
        n = len(group)
        C = min(self.prefill_tokens, min(len(row.req.prompt) - row.length for row in group), max(self._carry() // n, 1))
        chunks = [row.req.prompt[row.length:row.length + C] for row in group]
        P = self._positions.shape[1]
        T, lows = prompt_call([len(c) for c in chunks], P, self.min_tokens, self.target.min_rows)
        toks, starts, positions = self._tokens[:n, :T], self._starts[:n], self._positions[:n]
        toks.fill(0)
        for i, (row, chunk) in enumerate(zip(group, chunks)):
            toks[i, :len(chunk)] = chunk
            starts[i] = row.length
            np.add(self._offsets, lows[i], out=positions[i])
        trace.push("prefill")
        # (a padding row, where the model pads odd calls, goes after the group's rows: a free row)
        logits = self.target.step("prefill", toks, starts, slot, positions, pad_start=0)
        trace.pop()
        if self.head is not None:
            for i, (row, chunk) in enumerate(zip(group, chunks)):
                row.feats.append(self.target.hidden[i, :len(chunk)].copy())
        # (no draft model of its own beside a group: _joins; a shared-cache draft needs no prompt)
        for row, chunk in zip(group, chunks):
            row.length += len(chunk)
        self.stats.prefill_chunks += 1
        done = sum(row.prefilled for row in group)
        if not all(row.prefilled for row in group[:done]):
            raise AssertionError("the rows whose prompt ended are not the group's first: admission sorts them")
        lasts = [logits[i, len(chunks[i]) - 1 - lows[i]].copy() for i in range(done)]
        # all of them rows before any first token (one that raises leaves none in neither list:
        # fail_all tells the rows)
        self.admitting = group[done:]
        self.rows.extend(group[:done])
        for row, last in zip(group[:done], lasts):
            self._first_token(row, last[None])
        return sum(len(c) for c in chunks)

    def _close_up(self) -> None:
        """Rows being prefilled that were cancelled (or timed out) leave, told first; the others
        move down to close the gaps, in their order (engine.py _evict, after the running rows)."""
        if all(p.finish is None for p in self.admitting):
            return
        base = len(self.rows)
        kept = [(src, p) for src, p in enumerate(self.admitting) if p.finish is None]
        gone = [p for p in self.admitting if p.finish is not None]
        self.admitting = [p for _, p in kept]
        for p in gone:
            self._finish(p)
        for dst, (src, p) in enumerate(kept):
            if src != dst:
                self._move(base + src, base + dst, p)

    def _fork(self, row: Row, slot: int, last: np.ndarray) -> None:
        """The next sample in `_unforked` of row's prompt, just prefilled in cache row `slot`: the
        prompt's K/V copied into the next free row (and the draft's, with its own cache), its first
        token chosen from the same logits with its own seed and grammar. It leaves `_unforked` only
        as it becomes a row (or is told it was cancelled): a copy that raises leaves it there, for
        fail_all to tell."""
        req = self._unforked[0]
        if req.cancelled.is_set():
            self._unforked.pop(0)
            req.sink(Done("cancelled", len(req.prompt), 0, Row(req, 0, None, {}, 0).metrics))
            return
        child = Row(req, row.budget, self.tokenizer, self.policy.row_accept(), self.k_max)
        dst = len(self.rows)
        self.target.cache.move_row(slot, dst, row.length)      # a copy: the source row keeps its K/V
        child.length = row.length
        if self._own_draft:
            self.draft.cache.move_row(slot, dst, row.draft_len)
            child.draft_len = row.draft_len
        if self.head is not None:
            self.head.move_row(slot, dst, row.head_len)
            child.head_len, child.feats = row.head_len, list(row.feats)
        self._unforked.pop(0)
        self.rows.append(child)
        self._first_token(child, last)

    def _first_token(self, row: Row, last: np.ndarray) -> None:
        """A row's first token, from the logits [1, V] at its prompt's last position."""
        try:
            first = self._verify(row, last, ())[1]
        except GrammarError as e:
            self._fail(row, e)
            return
        self._logprobs(row, last, [first])
        self._emit(row, (), first)
