"""The draft rounds of the batched engine (runtime/batch/engine.py, which inherits them): a
row's guesses from a draft model over the target's cache (`_draft`, the int8 self-draft), from a
draft model with its own cache (`_draft_own`, `_feed_draft`), or from a trained draft head
(`_draft_head`, runtime/head.py), each cut where the row's grammar forbids it (`_guess`,
`_rewind_guesses`). Split from engine.py for length only: the methods read the engine's state
(rows, models, buffers) as before."""
from __future__ import annotations

import numpy as np

from specrt.runtime.batch.policy import StepChoice
from specrt.runtime.batch.request import Row
from specrt.runtime.choice import choose
from specrt.runtime.grammar import GrammarError


class DraftRounds:
    def _guess(self, row: Row, logits_row: np.ndarray, j: int) -> tuple[int, bool]:
        """A draft's choice for row's proposal j from its logits [V], and whether the proposal
        may go on after it. A row with a grammar drafts from the masked logits and its matcher
        advances along the guess (rolled back by _rewind_guesses before the verify pass)."""
        g = row.req.grammar
        if g is None:
            return choose(logits_row, row.req.params, row.req.seed, row.position() + j, self._scratch), True
        if row.error is not None:
            return 0, False
        try:
            t = choose(g.masked(logits_row, self._masked), row.req.params, row.req.seed, row.position() + j,
                       self._scratch)
        except GrammarError as e:   # this row fails (its verify does not run); the others go on
            self._fail(row, e)
            return 0, False
        return t, g.consume(t)      # after an EOS (never consumed) nothing more is proposed

    def _rewind_guesses(self, rows: list[Row], before: list[int]) -> None:
        """Roll each row's grammar back to where it was before the draft proposed."""
        for row, n in zip(rows, before):
            g = row.req.grammar
            if g is not None and row.error is None:
                try:
                    g.rollback(g.consumed - n)
                except GrammarError as e:
                    self._fail(row, e)

    def _fail(self, row: Row, error: Exception) -> None:
        """End one row with a typed error (Failed, not Done); the others go on."""
        row.error, row.finish = error, "failed"

    def _draft(self, choice: StepChoice) -> list:
        """k steps of a shared-cache draft over all rows: its guesses go into target cache rows
        the verify pass then overwrites (row i drafts min(k, its room) tokens)."""
        rows, n, k = self.rows, len(self.rows), choice.k
        out = [np.zeros(min(k, max(r.room, 0)), np.int64) for r in rows]
        limit = [len(o) for o in out]
        before = [r.req.grammar.consumed if r.req.grammar is not None else 0 for r in rows]
        toks, starts = self._tokens[:n, :1], self._starts[:n]
        cur = [r.seq[-1] for r in rows]
        for j in range(k):
            for i, row in enumerate(rows):
                toks[i, 0] = cur[i]
                starts[i] = row.length + j
            logits = self.draft.step("decode", toks, starts, 0, pad_start=self._pad_start())
            for i, row in enumerate(rows):
                if j < limit[i]:
                    cur[i], more = self._guess(row, logits[i, 0], j)
                    out[i][j] = cur[i]
                    if not more:
                        limit[i] = j + 1
        self._rewind_guesses(rows, before)
        return [o[:m] for o, m in zip(out, limit)]

    def _draft_own(self, choice: StepChoice) -> list:
        """k steps of a draft model with its own cache: first the tokens each row's draft cache
        lacks (seq[draft_len:], ending with the row's last token), then k - 1 one-token steps.
        Row i drafts min(k, its room) tokens; a row with fewer feeds padding past its length."""
        rows, n, k = self.rows, len(self.rows), choice.k
        out = [np.zeros(min(k, max(r.room, 0)), np.int64) for r in rows]
        W = self.k_max + 1          # a catch-up this short runs in the round's first draft call
        while True:
            lag = [r.length + 1 - r.draft_len for r in rows]            # >= 1: seq[-1] is never in it
            if max(lag) <= W:
                break
            # rows far behind (rounds that did not draft) catch up in chunks; the others feed padding
            C = self.draft.graph_tokens.get("verify", 0) or max(self.prefill_tokens, W)
            feeds = [r.seq[r.draft_len:r.draft_len + min(max(g - W, 0), C)] for r, g in zip(rows, lag)]
            self._feed_draft(0, feeds, [r.draft_len for r in rows], "verify")
            for r, f in zip(rows, feeds):
                r.draft_len += len(f)
        feeds = [r.seq[r.draft_len:] for r in rows]
        logits = self._feed_draft(0, feeds, [r.draft_len for r in rows], "verify", last=True)
        limit = [len(o) for o in out]
        before = [r.req.grammar.consumed if r.req.grammar is not None else 0 for r in rows]
        cur = [0] * n
        for i, row in enumerate(rows):
            row.draft_len = row.length + 1
            if limit[i]:
                cur[i], more = self._guess(row, logits[i], 0)
                out[i][0] = cur[i]
                limit[i] = limit[i] if more else 1
        toks, starts = self._tokens[:n, :1], self._starts[:n]
        for j in range(1, k):
            for i, row in enumerate(rows):
                toks[i, 0] = cur[i]
                starts[i] = row.length + j
            logits = self.draft.step("decode", toks, starts, 0, pad_start=self._draft_pad_start())
            for i, row in enumerate(rows):
                if j < limit[i]:
                    cur[i], more = self._guess(row, logits[i, 0], j)
                    out[i][j] = cur[i]
                    row.draft_len = row.length + 1 + j        # out[i][j - 1] is in its cache now
                    if not more:
                        limit[i] = j + 1
        self._rewind_guesses(rows, before)
        return [o[:m] for o, m in zip(out, limit)]

    def _draft_head(self, choice: StepChoice) -> list:
        """k guesses of a trained draft head (runtime/head.py) for every row: first the pairs its
        cache lacks, (the target's hidden state at p, seq[p + 1]) for p in head_len..length-1, in
        one call (longer lags first in chunks of at most a prompt chunk), the last pair's logits
        giving guess 1; then k - 1 one-pair steps, each on the head's own output hidden state and
        the guess before. Its cache keeps only the pairs of target hidden states (head_len =
        length): the pairs of its own guesses are overwritten by the next round's."""
        rows, n, k, head = self.rows, len(self.rows), choice.k, self.head
        out = [np.zeros(min(k, max(r.room, 0)), np.int64) for r in rows]
        C = self.prefill_tokens
        while True:
            lag = [r.length - r.head_len for r in rows]                 # >= 1: seq[-1] has no hidden state yet
            last = max(lag) <= C
            feeds = lag if last else [min(max(g - C, 0), C) for g in lag]   # a chunk leaves each row <= C to go
            T = max(max(feeds), 1)
            F = np.zeros((n, T, head.width), np.float32)
            toks = np.zeros((n, T), np.int64)
            starts = np.array([r.head_len for r in rows], np.int64)
            for i, (r, m) in enumerate(zip(rows, feeds)):
                if m:
                    F[i, :m] = _take_feats(r, m)
                    toks[i, :m] = r.seq[r.head_len + 1:r.head_len + 1 + m]
            pos = np.array([[max(m - 1, 0)] for m in feeds], np.int64)
            logits, hid = head.step(head.fc(F.reshape(n * T, -1)).reshape(n, T, -1), toks, starts, pos)
            for r, m in zip(rows, feeds):
                r.head_len += m
            if last:
                break
        limit = [len(o) for o in out]
        before = [r.req.grammar.consumed if r.req.grammar is not None else 0 for r in rows]
        cur = np.zeros((n, 1), np.int64)
        state = np.stack([hid[i, feeds[i] - 1] for i in range(n)])[:, None]     # [n, 1, h]
        zero = np.zeros((n, 1), np.int64)
        for j in range(k):
            if j:
                logits, state = head.step(state, cur, np.array([r.length + j - 1 for r in rows], np.int64), zero)
            for i, row in enumerate(rows):
                if j < limit[i] and not self._head_may_guess(row, logits[i]):
                    limit[i] = j        # nothing the head could guess here: the row's proposal ends
                if j < limit[i]:
                    cur[i, 0], more = self._guess(row, head.full_logits(logits[i]), j)
                    out[i][j] = cur[i, 0]
                    if not more:
                        limit[i] = j + 1
            if all(j + 1 >= m for m in limit):
                break
        self._rewind_guesses(rows, before)
        return [o[:m] for o, m in zip(out, limit)]

    def _head_may_guess(self, row: Row, logits: np.ndarray) -> bool:
        """Can the head guess this row's next token: its logits are finite (a head that returns NaN
        or inf proposes nothing rather than fail the sampler), and the row's grammar allows one of
        the head's tokens (it proposes from its draft vocabulary only; a grammar that allows none
        of them, or none at all, ends the proposal here: a row whose grammar is stuck fails in its
        verify pass, as with any draft, the other rows go on)."""
        if row.error is not None or not np.isfinite(logits).all():
            return False
        g = row.req.grammar
        if g is None:
            return True
        try:
            return bool(np.isfinite(g.masked(self.head.full_logits(logits), self._masked)).any())
        except GrammarError:
            return False

    def _feed_draft(self, first_row: int, feeds: list, starts: list[int], graph: str, last: bool = False,
                    pad: int | None = None):
        """One draft call writing feeds[i] at starts[i] into draft cache row first_row + i (shorter
        feeds padded: the padding lands past the row's draft_len, which nothing reads). last:
        return each row's logits at its last fed token, [n, V] (every feed is non-empty then);
        the logits of the other positions are not computed past the model's min_rows. pad: where
        a padding row may write (default: the pending row's draft length, as for a round)."""
        n = len(feeds)
        want = max(max(len(f) for f in feeds), 1)
        static = self.draft.graph_tokens.get(graph, 0)
        P = max(-(-self.draft.min_rows // n), 1)     # logit positions a row: at least min_rows in all
        T = static or max(want, P)
        if want > T:
            raise ValueError(f"the draft's {graph} graph takes {T} tokens a row; this call needs {want}")
        toks, st, pos = self._dtokens[:n, :T], self._starts[:n], self._dpos[:n, :P]
        toks.fill(0)
        lo = [max(len(f) - P, 0) for f in feeds]     # each row's window of logit positions ends at its last token
        for i, f in enumerate(feeds):
            toks[i, :len(f)] = f
            st[i] = starts[i]
            np.add(self._doffsets[:P], lo[i], out=pos[i])
        pad = self._draft_pad_start() if pad is None else pad
        logits = self.draft.step(graph, toks, st, first_row, pos, pad_start=pad)
        if last:
            return [logits[i, len(f) - 1 - lo[i]] for i, f in enumerate(feeds)]
        return None

    def _draft_pad_start(self) -> int:
        """_pad_start for a draft with its own cache: the pending row's draft length."""
        return self.pending.draft_len if self.pending is not None else 0


def _take_feats(row: Row, m: int) -> np.ndarray:
    """The first m of a row's kept hidden states [m, F], removed from it."""
    allf = row.feats[0] if len(row.feats) == 1 else np.concatenate(row.feats)
    if len(allf) < m:
        raise AssertionError(f"a row keeps {len(allf)} hidden states, its head needs {m}")
    row.feats = [allf[m:]] if len(allf) > m else []
    return allf[:m]
