"""Speculation chosen per step, for the whole batch, by measured cost.

A step runs every running row through one target pass of T tokens per row. Candidates:

    plain   T = the decode graph's              rate = n / c(n, T)
    pair    T = 2 (a two-row decode graph)      rate = sum_r (1 + a_pair,r [r has a guess]) / c(n, 2)
    lookup  T = the verify graph's              rate = sum_r E(a_lookup,r, g_r) / c(n, T)
    draft   k draft steps + verify              rate = sum_r E(a_draft,r, k_r) / (k d(n) + c(n, T))

c(n, T): the target's measured step time over n rows of T tokens; d(n): a draft step over
n rows (manifest `build.speculation.batch_costs_ms`, measured by the build; a folder's one-row
graphs, run as a batch of one, have the one-row costs `costs_ms` at n = 1: batch/one_row.py);
a T between two measured ones is priced linearly between them. E(a, k): for a draft, 1 + a_0 +
a_0 a_1 + ... + a_0...a_(k-1) from the row's own estimates of the draft's acceptance at each
position of a round (Betas with forgetting, shrunk toward its pooled rate; runtime/costs.py
Acceptance); for lookup and pair guesses the geometric series (1 - a^(k+1)) / (1 - a) of the
row's pooled rate per proposer (positions made lookup rounds look better than they were: the
int4 folder's batch of one x0.92 against x0.98, 2026-12-06). A row's estimates start from
the engine's pooled estimate for the draft (every row's verdicts so far, scaled down to a
few rounds' worth: row_accept), not from the build's prior alone; prompt lookup's also learn
from the steps it does not win (observe_guess). Guesses (prompt lookup, the 1-gram match, the
n-gram table) are per row. Which step runs changes only the speed: every row emits the
target's own choices (runtime/choice.py), so greedy output equals the request run alone and a
seeded sample is the same whatever the batch.

A choice by rate gathers no evidence about a proposer it passes over, so the policy probes
(`_probe`): a draft not run for a row's probe gap (16 plain steps) drafts one round (the gap
doubles while the draft does not pay, up to 256); on one row, a lookup guess passed over 4
times is verified once.

Without measured batch costs the policy runs plain steps only (it cannot know what pays), or,
with `fixed`, fixed-k rounds (one-row graphs whose build measured no costs, `adaptive=False`).
The build's table is corrected in the loop (`BatchCosts.observe`, on by default: `live_costs`):
the build timed every shape once, for a few seconds, on a machine that may have been busy, and
the shape of its table decides the single stream (two builds of the same graphs: x0.93 and
x0.99 of the one-request loop, 2026-12-06). Choices then depend on the clock, never the tokens
(runtime/choice.py); `SPECRT_LIVE_COSTS=0` (or `live_costs=False`) prices with the build's table
alone, so the choices are a function of the verdicts and reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

import numpy as np

from specrt.errors import ManifestError
from specrt.runtime.batch.live_costs import LiveCorrection
from specrt.runtime.costs import Acceptance, expected_tokens, manifest_cost, speculation_entry
from specrt.runtime.proposers.base import Proposer

NONE = np.zeros(0, np.int64)
POOLED_WEIGHT, POOLED_FORGET = 4.0, 0.98   # the estimate over every row: prior weight, forgetting per verdict
ROW_WEIGHT, ROW_FORGET = 16.0, 0.9         # a row's own: rounds' worth it starts with from the pooled one, forgetting
REBUILD = ("the manifest was edited; rebuild the engines with `specrt build ... --batch` (it measures the batched "
           "step costs)")


class RoundKind(str, Enum):
    """What a step verifies: nothing (PLAIN, one token a row), a draft model's k tokens (DRAFT),
    prompt lookup's guess (LOOKUP), or one guessed token in a two-token decode graph's second
    position (PAIR: a quantized target's, builder/gates/rows.py; a verify for a plain step's price)."""
    PLAIN = "plain"
    DRAFT = "draft"
    LOOKUP = "lookup"
    PAIR = "pair"

    @property
    def graph(self) -> str:
        """The target graph the round runs: the decode graph for a plain step or a pair round,
        the verify graph for a proposal of up to k_max tokens."""
        return "decode" if self in (RoundKind.PLAIN, RoundKind.PAIR) else "verify"


@dataclass(frozen=True)
class StepChoice:
    kind: RoundKind
    tokens: int                          # T of the target pass
    proposals: Sequence[np.ndarray]      # per row: the tokens to verify (empty: just `cur`)
    k: int = 0                           # draft steps (kind DRAFT; proposals are made by the engine)
    rate: float = 0.0                    # expected tokens per ms
    probe: bool = False                  # run to test a proposer the rates passed over (_probe)


class BatchCosts:
    """Step costs (ms) measured at some row counts; other counts interpolate linearly between
    the nearest measured ones (and extrapolate from the last two beyond them); a table of one
    count scales in proportion to the rows (cost(n) = cost(m) * n / m). Token counts between
    two measured ones interpolate linearly too (`target`).

    target: {T: {n: ms}} for the target's passes; draft: {n: ms} for one draft step."""

    def __init__(self, target: dict[int, dict[int, float]], draft: dict[int, float] | None = None):
        if not target:
            raise ValueError("no target costs")
        self._target = {int(T): {int(n): float(v) for n, v in by_n.items()} for T, by_n in target.items()}
        self._draft = {int(n): float(v) for n, v in (draft or {}).items()}
        self.live = LiveCorrection()

    @classmethod
    def from_manifest(cls, speculation: dict | None) -> "BatchCosts | None":
        """The build's `build.speculation.batch_costs_ms` ({"target": {"T": {"n": ms}}, "draft":
        {"n": ms}}, JSON keys), or None when absent. A damaged table (an empty one, a count that
        is not a positive integer, a cost that is not a positive finite number) is refused here,
        when the engine is opened (ManifestError), never at a request's first step."""
        where = "build.speculation.batch_costs_ms"
        c = speculation_entry(speculation, "batch_costs_ms", REBUILD)
        if c is None:
            return None
        if not isinstance(c.get("target"), dict) or not c["target"]:
            raise ManifestError(f"{where}.target={c.get('target')!r}: expected {{T: {{rows: ms}}}}; {REBUILD}")
        target = {_count(T, f"{where}.target"): _table(by_n, f"{where}.target.{T}")
                  for T, by_n in c["target"].items()}
        draft = None if c.get("draft") is None else _table(c["draft"], f"{where}.draft")
        return cls(target, draft)

    def with_draft(self, draft: dict, where: str) -> "BatchCosts":
        """The same target costs with another draft's step costs ({rows: ms}, checked as the
        manifest's are: a trained head's, recorded in its head.json)."""
        return BatchCosts(self._target, _table(draft, where))

    def target(self, n: int, T: int) -> float:
        """A pass of n rows of T tokens: the table's cost (`table_target`) times its correction
        from the passes observed in the loop (`observe`; 1 before any)."""
        return self.table_target(n, T) * self.live.factor(("target", T, n))

    def draft(self, n: int) -> float | None:
        """One draft step over n rows: the table's, times its correction (`observe_draft`)."""
        d = self.table_draft(n)
        return None if d is None else d * self.live.factor(("draft", n))

    def observe(self, n: int, T: int, ms: float) -> None:
        """A target pass of n rows of T tokens took `ms` in the loop (BatchEngine._round)."""
        self.live.observe(("target", T, n), ms / self.table_target(n, T))

    def observe_draft(self, n: int, steps: int, ms: float) -> None:
        """A draft round of `steps` steps over n rows took `ms` in all (its feeds and host work
        included: what a round costs beside its verify pass)."""
        d = self.table_draft(n)
        if d is not None and steps > 0:
            self.live.observe(("draft", n), ms / (steps * d))

    def table_target(self, n: int, T: int) -> float:
        """The build's cost of a pass of n rows of T tokens: between two measured T, linear in T (the build measures
        T = 1, 2 and k + 1: a draft round of 2 tokens runs T = 3, which the nearest measured T
        priced as a pair round and so chose k = 2 at any acceptance; on the fp32 folder a batch of
        one drafted 2 where 4 paid, 2026-12-06); beyond them, the nearest one's cost."""
        Ts = sorted(self._target)
        lo = max([x for x in Ts if x <= T], default=Ts[0])
        hi = min([x for x in Ts if x >= T], default=Ts[-1])
        if lo == hi:
            return _interp(self._target[lo], n)
        a, b = _interp(self._target[lo], n), _interp(self._target[hi], n)
        return a + (b - a) * (T - lo) / (hi - lo)

    def table_draft(self, n: int) -> float | None:
        return _interp(self._draft, n) if self._draft else None


def _count(key, where: str) -> int:
    """A table key: a positive integer (a token or row count), as an int or as JSON's string."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and not key.startswith("0"):
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key > 0:
        return key
    raise ManifestError(f"{where} has the key {key!r}: counts are positive integers; {REBUILD}")


def _table(by_n, where: str) -> dict[int, float]:
    """{rows: ms} with at least one entry, each a positive count and a positive finite cost."""
    if not isinstance(by_n, dict) or not by_n:
        raise ManifestError(f"{where}={by_n!r}: expected {{rows: ms}} with at least one entry; {REBUILD}")
    return {_count(n, where): manifest_cost(v, f"{where}.{n}", REBUILD) for n, v in by_n.items()}


def _interp(by_n: dict[int, float], n: int) -> float:
    ns = sorted(by_n)
    if n in by_n:
        return by_n[n]
    if len(ns) == 1:
        return by_n[ns[0]] * n / ns[0]
    lo = max([x for x in ns if x < n], default=ns[0])
    hi = min([x for x in ns if x > n], default=ns[-1])
    if lo == hi:                      # beyond the measured range: extend the last segment
        lo, hi = (ns[-2], ns[-1]) if n > ns[-1] else (ns[0], ns[1])
        v = by_n[lo] + (by_n[hi] - by_n[lo]) * (n - lo) / (hi - lo)
        # a segment whose slope is timing noise (8 rows measured faster than 4) would reach 0 ms and
        # below: more rows never cost less than the largest count measured, fewer never less than
        # the smallest count's cost in proportion (positive, so every rate is finite)
        return max(v, by_n[ns[-1]]) if n > ns[-1] else max(v, by_n[ns[0]] * n / ns[0])
    return by_n[lo] + (by_n[hi] - by_n[lo]) * (n - lo) / (hi - lo)


class BatchPolicy:
    def __init__(self, costs: BatchCosts | None, k_max: int, *, lookup: Proposer | None = None,
                 pair_guess: Proposer | None = None, draft: bool = False, priors: dict[str, float] | None = None,
                 pair: bool = True, fixed: bool = False, cooldown: int = 16, max_cooldown: int = 256,
                 lookup_cooldown: int | None = 4, pooled: dict | None = None):
        """lookup: prompt lookup (per row); pair_guess: the one-token guessers after lookup's own
        (the 1-gram match, the n-gram table); draft: a draft model is loaded; pair: the target can
        run a two-token decode step. fixed: no choice by cost (`_fixed`): every round drafts k_max
        tokens with the draft, or without one verifies lookup's guess (a pair round for a guess
        shorter than two tokens), else a plain step; what a build that measured no costs runs on
        its one-row graphs, and `adaptive=False`. cooldown, max_cooldown, lookup_cooldown: how
        often proposers the rates pass over are tried anyway (`_probe`; lookup_cooldown None: lookup
        guesses are not retried). The defaults are the one-request loop's before issue 27
        (AdaptiveK's). Measured against 64/1024/None with per-position estimates for every
        proposer (2026-12-06, a batch of one, the 10 held-out prompts x 128 tokens, one
        interleaved run; lookup has since gone back to its pooled rate, not measured again):
        x1.01 on the fp32 folder, x1.07 on the int4 folder's one-row graphs, x1.01 on its batched
        model. 64/1024/None had been chosen with the pooled estimate for the draft. In a batch,
        _probe waits longer (see there)."""
        self.costs, self.k_max, self.lookup, self.pair_guess = costs, k_max, lookup, pair_guess
        self.has_draft, self.has_pair, self.fixed = draft, pair, fixed
        self.cooldown, self.max_cooldown, self.lookup_cooldown = cooldown, max_cooldown, lookup_cooldown
        self.priors = {"draft": 0.8, "lookup": 0.5, "pair": 0.3, **(priors or {})}
        # every row's verdicts about the draft, kept across requests (pooled: another policy's,
        # so a batch of one's per-request policies share them): where a new row starts (row_accept)
        self.pooled = pooled if pooled is not None else \
            {"draft": Acceptance(self.priors["draft"], POOLED_WEIGHT, POOLED_FORGET)}

    def choose(self, rows, graph_t: Callable[[str, int, int], int]) -> StepChoice:
        """graph_t(graph, tokens wanted per row, rows) -> T the step will run."""
        n = len(rows)
        self._graph_t = graph_t                  # _draft_pays prices windows as choose does
        plain_t = graph_t("decode", 1, n)
        plain = StepChoice(RoundKind.PLAIN, plain_t, [NONE] * n)
        if self.fixed:
            return self._fixed(rows, graph_t, plain)
        if self.costs is None:
            return plain
        c = self.costs
        best = StepChoice(RoundKind.PLAIN, plain_t, plain.proposals, rate=n / c.target(n, plain_t))
        rooms = [max(min(self.k_max, r.room), 0) for r in rows]
        guesses = [self._guess(r.seq, room) for r, room in zip(rows, rooms)] if self.lookup else [NONE] * n
        for r, g in zip(rows, guesses):
            r.unverified = g                  # scored against what the row emits if not verified (observe_guess)
        if self.has_pair and any(rooms):
            ones = [g[:1] if len(g) else (self._one(r.seq) if room else NONE) for r, g, room in zip(rows, guesses, rooms)]
            if any(len(o) for o in ones):
                T = graph_t("decode", 2, n)
                if T == 2:
                    e = sum(expected_tokens(r.accept["pair"].mean, len(o)) for r, o in zip(rows, ones))
                    best = _better(best, StepChoice(RoundKind.PAIR, T, ones, rate=e / c.target(n, T)))
        if any(len(g) for g in guesses):
            T = graph_t("verify", 1 + max(len(g) for g in guesses), n)
            e = sum(expected_tokens(r.accept["lookup"].mean, len(g)) for r, g in zip(rows, guesses))
            best = _better(best, StepChoice(RoundKind.LOOKUP, T, guesses, rate=e / c.target(n, T)))
        d = c.draft(n) if self.has_draft else None
        drafts = self._draft_rates(rows, rooms, d, graph_t) if d is not None and any(rooms) else []
        for rate, k, T in drafts:
            best = _better(best, StepChoice(RoundKind.DRAFT, T, [NONE] * n, k=k, rate=rate))
        return self._probe(rows, rooms, guesses, best, graph_t, d, drafts)

    def _draft_rates(self, rows, rooms, d: float, graph_t) -> list[tuple[float, int, int]]:
        """(tokens per ms, k, T) of a draft round of k = 1..k_max over these rows (row i drafts
        min(k, its room)), from each row's E(0..room) computed once."""
        n = len(rows)
        es = [r.accept["draft"].expected_upto(room) for r, room in zip(rows, rooms)]
        out = []
        for k in range(1, self.k_max + 1):
            T = graph_t("verify", k + 1, n)
            e = sum(E[min(k, room)] for E, room in zip(es, rooms))
            out.append((e / (k * d + self.costs.target(n, T)), k, T))
        return out

    def _probe(self, rows, rooms, guesses, best: StepChoice, graph_t, d: float | None,
               drafts: list[tuple[float, int, int]]) -> StepChoice:
        """A choice by rate gathers no evidence about a proposer it passes over, so now and then
        the policy tries it anyway. A lookup guess passed over `lookup_cooldown` times in a row is
        verified once, on one row only (matches come in runs: a passage quoted from the prompt;
        None: never). A draft not run
        for a row's `probe_gap` plain steps drafts one round at the k its estimate likes best; a
        probe after which the draft still does not pay doubles that row's gap (up to
        `max_cooldown`), and the draft paying again resets it (observe), so a draft that never
        pays (an int4 target's int8 self-draft costs more than a target step) costs ever fewer
        probes. In a batch a probe runs for every row, so it waits until every row that could
        take part is due, each after n times its gap in a batch of n (one row: AdaptiveK's rule).
        Probes count steps, not time: with the build's table alone (`live_costs` off) the
        choices are a function of the verdicts."""
        n = len(rows)
        if best.kind is not RoundKind.LOOKUP and self.lookup_cooldown is not None and n == 1 and len(guesses[0]):
            # one row only: in a batch the row with a guess would make every row pay a verify
            # window (int4 folder, 4 and 8 rows: 17-39 such probes in 12 answers, x0.92-0.93 of
            # plain steps, where the batch without them was level with plain, 2026-12-06)
            row = rows[0]
            row.lookup_refused += 1
            if row.lookup_refused > self.lookup_cooldown:
                row.lookup_refused = 0
                return StepChoice(RoundKind.LOOKUP, graph_t("verify", 1 + len(guesses[0]), 1), guesses, probe=True)
        elif best.kind is RoundKind.LOOKUP:
            for r in rows:
                r.lookup_refused = 0
        # a draft probe costs every row its draft steps and a verify window: in a batch of n rows
        # each row waits n times its gap (one row: AdaptiveK's rule)
        due = [r.plain_run >= self._gap(r) * n for r, room in zip(rows, rooms) if room]
        if d is not None and best.kind in (RoundKind.PLAIN, RoundKind.PAIR) and due and all(due) \
                and self._draft_can_pay(n, d, graph_t):
            _, k, T = max(drafts, key=lambda x: (x[0], -x[1]))      # ties: the shorter round
            return StepChoice(RoundKind.DRAFT, T, [NONE] * n, k=k, probe=True)
        return best

    def _fixed(self, rows, graph_t, plain: StepChoice) -> StepChoice:
        n = len(rows)
        rooms = [max(min(self.k_max, r.room), 0) for r in rows]
        if not any(rooms):
            return plain
        if self.has_draft:
            return StepChoice(RoundKind.DRAFT, graph_t("verify", self.k_max + 1, n), [NONE] * n, k=self.k_max)
        if self.lookup is None:
            return plain
        guesses = [self._guess(r.seq, room) for r, room in zip(rows, rooms)]
        if self.has_pair and all(len(g) < 2 for g in guesses) and graph_t("decode", 2, n) == 2:
            ones = [g if len(g) else (self._one(r.seq) if room else NONE) for r, g, room in zip(rows, guesses, rooms)]
            if any(len(o) for o in ones):
                return StepChoice(RoundKind.PAIR, 2, ones)
        if any(len(g) for g in guesses):
            return StepChoice(RoundKind.LOOKUP, graph_t("verify", 1 + max(len(g) for g in guesses), n), guesses)
        return plain

    def row_accept(self) -> dict:
        """A new row's acceptance estimates. The draft's starts from the pooled one (every row's
        verdicts so far; the build's prior before any) scaled down to ROW_WEIGHT rounds: how
        often a self-draft agrees is a property of the two models more than of the prompt, and
        starting every request from the build's prior with the weight of 4 rounds, one early
        rejection at the second position put that position at 0.54 where the int8 self-draft
        keeps 0.98 (fp32 folder, 2026-12-06), so a request's first rounds drafted 1-2 tokens
        where 4 paid. Prompt lookup's and the pair guess's start from their priors: whether a
        prompt is quoted is the prompt's own (a pooled start for lookup cost x1.008 more on the
        int4 folder, priced by the table over 40 held-out prompts). ROW_WEIGHT: with lookup's
        start pooled too, fp32 x0.963 of the old loop at 4 and x0.980 at 16 in one run, x0.973 at
        16 and x0.971 at 64 in another (docs/speculation.md has the runs of this rule)."""
        return {kind: self.pooled[kind].start(ROW_WEIGHT, ROW_FORGET) if kind in self.pooled
                else Acceptance(p, 4.0, ROW_FORGET) for kind, p in self.priors.items()}

    def observe(self, row, kind: RoundKind, k: int, accepted: int, *, probe: bool | None = None,
                rows: int = 1) -> None:
        """A row's verdict: k tokens proposed by `kind`'s proposer, `accepted` of them kept, in a
        step of `rows` rows; probe: whether the round was a probe (StepChoice.probe; None: a
        draft round after the row's gap counts as one)."""
        if kind in (RoundKind.PLAIN, RoundKind.PAIR):
            row.plain_run += 1               # no evidence about the draft
        if kind is not RoundKind.PLAIN and k:
            row.accept[kind.value].observe(k, accepted)
            if kind.value in self.pooled:
                self.pooled[kind.value].observe(k, accepted)
        if kind is RoundKind.DRAFT:
            if probe is None:
                probe = row.plain_run >= self._gap(row)
            row.plain_run = 0
            if self._draft_pays(row, rows):
                row.probe_gap = self.cooldown
            elif probe:                      # probed and the draft still does not pay: wait longer
                row.probe_gap = min(2 * self._gap(row), self.max_cooldown)

    def observe_guess(self, row, emitted) -> None:
        """Free evidence about prompt lookup: the guess it had at this step's start (choose), not
        verified because another round ran, scored against the tokens the row emitted. A row's
        tokens do not depend on the round (runtime/choice.py), so lookup would have kept exactly
        the guess's prefix that equals them: j tokens and a rejection if they differ at j; all of
        a guess no longer than what was emitted; and where the guess is longer and agrees with
        all m tokens emitted, at least m (observed as a round of m guesses, all kept). Without it
        the estimate learns only from the rounds it wins and the probes (`_probe`): on the fp32
        folder a row's estimate sat at 0.35-0.5 where its guesses of 4 kept 0.56 a token
        (12 held-out prompts, every position with a guess), and the policy drafted instead.
        The engine scores guesses in steps of one row only: in a batch a lookup step costs every
        row a verify window, and the steps chosen on these estimates at 4 rows were priced
        dearer by the table than before (x1.026 on the 12 held-out prompts, x1.003 on 40
        others; 2026-12-06), so a batch's lookup estimates learn as they did."""
        g = row.unverified
        row.unverified = ()
        if not len(g) or "lookup" not in row.accept:
            return
        m, L = len(emitted), len(g)
        j = 0
        while j < min(L, m) and int(g[j]) == int(emitted[j]):
            j += 1
        k, kept = (L, j) if j < min(L, m) else (min(L, m), min(L, m))
        row.accept["lookup"].observe(k, kept)

    def _draft_can_pay(self, n: int, d: float, graph_t) -> bool:
        """Could a draft round beat a plain step over n rows if every proposal were accepted?
        If not (an int4 target's int8 self-draft: a draft step costs more than a target step),
        no verdict can make it pay and a probe is pure cost (the int4 folder's batch of one: 13
        probes in 12 answers, x0.92 of the same engine without the draft, 2026-12-06)."""
        c = self.costs
        plain = 1.0 / c.target(n, graph_t("decode", 1, n))
        return any((k + 1) / (k * d + c.target(n, graph_t("verify", k + 1, n))) > plain
                   for k in range(1, self.k_max + 1))

    def _gap(self, row) -> int:
        return self.cooldown if row.probe_gap is None else row.probe_gap

    def _draft_pays(self, row, n: int = 1) -> bool:
        """Would the draft beat a plain step for this row in a step of n rows, at its best k?
        (Priced at n: a draft that pays alone but not in the batch backs off there.)"""
        c = self.costs
        d = c.draft(n) if c is not None else None
        if d is None or "draft" not in row.accept:
            return True
        a = row.accept["draft"]
        graph_t = getattr(self, "_graph_t", None) or (lambda graph, want, n: want)
        plain = 1.0 / c.target(n, graph_t("decode", 1, n))
        return any(a.expected(k) / (k * d + c.target(n, graph_t("verify", k + 1, n))) > plain
                   for k in range(1, self.k_max + 1))

    def _guess(self, seq, room: int) -> np.ndarray:
        return self.lookup.propose(seq, room).tokens.copy() if room else NONE

    def _one(self, seq) -> np.ndarray:
        return self.pair_guess.propose(seq, 1).tokens.copy() if self.pair_guess is not None else NONE


def _better(a: StepChoice, b: StepChoice) -> StepChoice:
    return b if b.rate > a.rate else a
