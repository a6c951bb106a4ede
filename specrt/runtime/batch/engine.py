"""Continuous batching: many requests, one model, one step at a time for all of them.

Each call to `step()`:

    1. drop requests that were cancelled or passed their deadline (waiting or running)
    2. admit the oldest waiting request into the free cache row after the running ones,
       if a row is free and no other prompt is being prefilled; where the folder's prompt graph
       gives a row the same bits among others (the build's gate, parity.prompt_rows), the
       next waiting requests join it, up to what one prompt call may carry
    3. one round for every running row: plain, pair, lookup or draft, chosen for the batch
       by measured cost (policy.py); each row keeps its own agreeing prefix and its own
       length, and emits the target's choices (runtime/choice.py), so its tokens do not depend on
       what else is in the batch
    4. one prefill chunk of the admitted request (so a running stream waits for at most
       one chunk per step), or of each admitted request in one call; after its last chunk a
       request gets its first token and runs. With a prefill_budget, chunks (of these requests,
       then of the next ones admitted in turn) go on until the step has prefilled that many
       prompt tokens
    5. rows that finished (EOS, a stop string, max_new_tokens, the maximum context) leave;
       the last running row moves into the gap so rows stay contiguous (model.py)

A draft model runs inside the batch in one of two ways (model.py):
    shared cache   (the int8 self-draft) its steps write target cache rows past each row's
                   length, which the verify pass overwrites: nothing to keep in step.
    its own cache  (a separate draft model) row r of its cache holds K/V for row.seq[:draft_len];
                   it prefills each prompt chunk beside the target, and a draft round first
                   feeds every row the tokens its cache lacks (1 after a round it drafted, 2
                   when all its k proposals were accepted, more after rounds it did not draft,
                   in chunks), reading each row's logits at its own last token; after the
                   verify pass a row keeps only the draft K/V of the tokens it accepted
                   (draft_len rewound), and a row that moves takes its draft rows with it.

Steps 1, 2 and 4 live in admission.py, the draft rounds in drafting.py (both inherited).

Single-threaded by design: `step()` runs on one thread (runtime/batch/generator.py starts
it); `add()` and `Request.cancel()` may be called from any thread.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from specrt.runtime import nvtx_ranges as trace
from specrt.runtime.batch.admission import Admission
from specrt.runtime.batch.drafting import DraftRounds
from specrt.runtime.batch.model import BatchModel
from specrt.runtime.batch.live_costs import live_costs_default
from specrt.runtime.batch.policy import BatchPolicy, RoundKind
from specrt.runtime.batch.request import Delta, Done, Failed, Request, Row, TokenLogprob
from specrt.runtime.choice import choose, first_mismatch
from specrt.runtime.grammar import GrammarError
from specrt.runtime.logprobs import token_logprob

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    steps: int = 0                      # decode/verify steps over the running rows
    prefill_chunks: int = 0
    row_steps: int = 0                  # sum over steps of the rows in them (occupancy = row_steps / steps)
    tokens: int = 0
    finished: int = 0
    choices: collections.Counter = field(default_factory=collections.Counter)   # step kind -> count
    live: object = None                 # the policy's LiveCorrection once a pass was observed (live_costs.py)

    @property
    def occupancy(self) -> float:
        return self.row_steps / self.steps if self.steps else 0.0


class BatchEngine(Admission, DraftRounds):
    def __init__(self, target: BatchModel, *, max_num_seqs: int, max_context: int, prefill_tokens: int,
                 k_max: int, vocab: int, policy: BatchPolicy, tokenizer=None, eos=frozenset(),
                 draft: BatchModel | None = None, clock=time.monotonic, min_tokens: int = 1,
                 prefill_budget: int | None = None, head=None, live_costs: bool | None = None,
                 lone_prefill_tokens: int | None = None, prompt_rows: int = 1):
        """tokenizer: gives text and stop strings (None: tokens only, EOS from `eos`).
        min_tokens: tokens a row of every target pass (a plain step is padded): 2 where the
        one-token kernels round differently from the windows a speculating batch verifies
        (manifest parity window_invariance, builder/gates/batch.py).
        prefill_budget: prompt tokens a step may prefill (None: one chunk a step, however short);
        each chunk is still its own call of one row; with a larger budget a step goes on with the
        same prompt's next chunk, or admits and prefills the next waiting request, until the
        budget is spent, so requests that arrive together join in fewer steps (running rows
        wait longer for that step). A row's tokens do not depend on it.
        head: a trained draft head (runtime/head.py) instead of a draft model: it reads the
        target's hidden states (the target model must return them: `hidden`), kept per row until
        its next draft round feeds them (_draft_head).
        live_costs: correct the policy's cost table with the times of this loop's own passes
        (policy.py BatchCosts.observe; None: on unless SPECRT_LIVE_COSTS=0). Choices only: a
        row's tokens never depend on it.
        lone_prefill_tokens: the prompt chunk of a request alone (no row running beside it, the
        model's prompt graph taking any T): a larger one the build showed gives the same bits
        (backends/batch_calls.py; None: prefill_tokens). Beside running rows, and with a
        draft model of its own (whose buffers hold prefill_tokens), chunks stay prefill_tokens.
        prompt_rows: the most requests whose prompt chunks share one call (admission.py
        _prefill_group), where the build showed a row's prompt gives the same bits among others
        (backends/batch_calls.py prompt_rows; 1: one row a call, a graph of static T always).
        Each such call stays within what one prompt call may carry (prefill_budget, else the
        chunk, or a request alone's larger chunk when no row runs)."""
        rows = getattr(target, "rows", target.cache.rows)     # (a model that pads odd calls keeps a spare row)
        if max_num_seqs < 1 or max_num_seqs > rows:
            raise ValueError(f"max_num_seqs={max_num_seqs} must be in [1, {rows}] (the model's rows)")
        if head is not None and (draft is not None or not getattr(target, "hidden_width", 0)):
            raise ValueError("a draft head needs a target that returns hidden states, and no draft model beside it")
        self.target, self.draft, self.policy, self.head = target, draft, policy, head
        self.max_num_seqs, self.max_context, self.k_max, self.vocab = max_num_seqs, max_context, k_max, vocab
        self.prefill_tokens = prefill_tokens
        lone = prefill_tokens if lone_prefill_tokens is None else int(lone_prefill_tokens)
        if lone < prefill_tokens:
            raise ValueError(f"lone_prefill_tokens={lone} is below prefill_tokens={prefill_tokens}")
        self.lone_prefill_tokens = lone if not target.graph_tokens.get("prefill", 0) else prefill_tokens
        if prefill_budget is not None and (not isinstance(prefill_budget, int) or isinstance(prefill_budget, bool)
                                           or prefill_budget < 1):
            raise ValueError(f"prefill_budget={prefill_budget!r} must be a positive number of tokens")
        self.prefill_budget = prefill_budget
        if type(prompt_rows) is not int or prompt_rows < 1:
            raise ValueError(f"prompt_rows={prompt_rows!r} must be a positive number of rows")
        self.prompt_rows = 1 if target.graph_tokens.get("prefill", 0) else min(prompt_rows, max_num_seqs)
        self.closing = False        # set by the owner's close(): every request held is cancelled at the next step
        self.tokenizer, self.clock, self.min_tokens = tokenizer, clock, min_tokens
        self.live_costs = live_costs_default() if live_costs is None else bool(live_costs)
        self.eos = frozenset(tokenizer.eos_token_ids) if tokenizer is not None else frozenset(eos)
        self.rows: list[Row] = []           # running, in cache rows 0..n-1
        self.admitting: list[Row] = []      # being prefilled, in cache rows len(self.rows).., shortest prompt first
        self.waiting: collections.deque[Request] = collections.deque()
        self.stats = EngineStats()
        self._lock = threading.Lock()
        T = max(self._graph_t("verify", k_max + 1), self._graph_t("decode", 2), prefill_tokens, 2, min_tokens)
        self._tokens = np.zeros((max_num_seqs, max(T, self.lone_prefill_tokens)), np.int64)   # [n, T] token windows
        self._starts = np.zeros(max_num_seqs, np.int64)          # [n] each row's past length
        self._scratch = np.zeros(vocab, np.float32)
        self._masked = np.zeros(vocab, np.float32)                # a row's logits under its grammar
        self.grammars = None        # runtime/grammar.py Grammars of the folder's tokenizer (open_batch sets it)
        self._unforked: list[Request] = []       # samples of the row just prefilled, not yet in rows
        P = max(target.min_rows, 1)        # a prefill chunk's logit rows: its last P positions
        if draft is not None and not draft.shares_cache:
            # a draft with its own cache: its calls' token windows and logit positions
            Td = max(prefill_tokens, k_max + 1, draft.min_rows, *[t for t in draft.graph_tokens.values() if t])
            static = draft.graph_tokens.get("prefill", 0)
            if static and static < prefill_tokens:
                raise ValueError(f"the draft's prefill graph takes {static} tokens; prompt chunks are {prefill_tokens}")
            self._dtokens = np.zeros((max_num_seqs, Td), np.int64)
            self._dpos = np.zeros((max_num_seqs, max(draft.min_rows, 1)), np.int64)
            self._doffsets = np.arange(max(draft.min_rows, 1), dtype=np.int64)
        self._positions, self._offsets = np.zeros((max_num_seqs, P), np.int64), np.arange(P, dtype=np.int64)

    # --- any thread -----------------------------------------------------------------------
    def add(self, req: Request, max_waiting: int | None = None) -> bool:
        """Queue `req`; False (not queued) when `max_waiting` requests already wait. The check and
        the append hold one lock, so callers on many threads never overfill the queue."""
        with self._lock:
            if max_waiting is not None and len(self.waiting) >= max_waiting:
                return False
            self.waiting.append(req)
            return True

    @property
    def queued(self) -> int:
        return len(self.waiting)

    @property
    def pending(self) -> Row | None:
        """The first request being prefilled (in cache row len(rows)), if any."""
        return self.admitting[0] if self.admitting else None

    @property
    def active(self) -> int:
        return len(self.rows) + len(self.admitting)

    def idle(self) -> bool:
        return not self.rows and not self.admitting and not self.waiting

    # --- the engine thread ------------------------------------------------------------------
    def step(self) -> bool:
        """One iteration (see the module docstring). Returns False when there was nothing to do."""
        self._drop_cancelled()
        self._evict()           # a row cancelled or timed out leaves now: no round, its reason kept, its row free
        self._admit()
        did = False
        if self.rows:
            self._round()
            did = True
        if any(r.finish is not None for r in self.admitting):
            did = True                     # cancelled before its prefill: it leaves in _evict below
        spent = 0
        while self.admitting and all(r.finish is None for r in self.admitting):
            if spent and any(r.req.cancelled.is_set() for r in self.admitting):
                break                      # cancelled since the step began: the next step drops it
            spent += self._prefill_chunk()
            did = True
            if self.prefill_budget is None or spent >= self.prefill_budget:
                break
            if not self.admitting:         # they joined the rows: the next waiting requests, if rows are free
                self._admit()
        self._evict()
        return did

    def drive(self, req: Request):
        """Run `req` from the calling thread on an engine that no thread steps (a batch of one):
        yields its events (Delta, then Done) as the steps make them. Closing the generator early
        cancels the request and frees its row."""
        events: collections.deque = collections.deque()
        req.sink = events.append
        self.add(req)
        done = False
        try:
            while not done:
                self.step()
                while events:
                    ev = events.popleft()
                    done = isinstance(ev, (Done, Failed))
                    if isinstance(ev, Failed):
                        raise ev.error
                    yield ev
        finally:
            if not done:
                req.cancel()
                self.step()         # the cancelled row leaves (no round: it is dropped first)

    def fail_all(self, error: Exception) -> None:
        """Fail every request (the model raised): the engine cannot go on safely."""
        with self._lock:
            queued = [r.req for r in self.admitting] + list(self.waiting)
            reqs = [r.req for r in self.rows] + [r for q in queued for r in (q, *q.siblings)] + self._unforked
            self._unforked = []
            self.rows, self.admitting = [], []
            self.waiting.clear()
            self._free_rows()
        for req in reqs:
            req.sink(Failed(error))

    @property
    def _own_draft(self) -> bool:
        """A draft model with its own cache (it prefills prompts and keeps each row's draft_len)."""
        return self.draft is not None and not self.draft.shares_cache and self.policy.has_draft

    @property
    def _head_on(self) -> bool:
        """A trained draft head drafts. The target's hidden states are kept for it whenever the
        engine has one, whatever the policy (a batch of one switches policies per request), so
        a row's kept states always cover head_len..length: at most its context's worth
        (max_context x the tapped width x 4 bytes; 7 MB a row for SmolLM2 at 1024)."""
        return self.head is not None and self.policy.has_draft

    def _round(self) -> None:
        rows = self.rows
        n = len(rows)
        choice = self.policy.choose(rows, self._graph_t)
        self.stats.steps += 1
        self.stats.row_steps += n
        self.stats.choices[choice.kind.value] += 1
        proposals = choice.proposals
        t0 = time.perf_counter()           # each phase's time goes to every row in the step (Metrics)
        if choice.kind is RoundKind.DRAFT:
            trace.push("draft")
            proposals = self._draft_head(choice) if self._head_on else \
                self._draft_own(choice) if self._own_draft else self._draft(choice)
            trace.pop()
        else:
            # a guess (prompt lookup, a pair round's) is cut where the row's grammar forbids it
            proposals = [p[:r.req.grammar.allowed_prefix(p)] if r.req.grammar is not None and len(p) else p
                         for r, p in zip(rows, proposals)]
        T = choice.tokens
        toks, starts = self._tokens[:n, :T], self._starts[:n]
        toks.fill(0)
        for i, row in enumerate(rows):
            p = proposals[i]
            toks[i, 0] = row.seq[-1]
            toks[i, 1:1 + len(p)] = p
            starts[i] = row.length
        t1 = time.perf_counter()
        trace.push("decode" if choice.kind is RoundKind.PLAIN else "verify")
        logits = self.target.step(choice.kind.graph, toks, starts, 0, pad_start=self._pad_start())   # [n, T, V]
        trace.pop()
        t2 = time.perf_counter()
        costs = self.policy.costs
        if self.live_costs and costs is not None:
            costs.observe(n, T, (t2 - t1) * 1e3)
            self.stats.live = costs.live
            if choice.kind is RoundKind.DRAFT:
                costs.observe_draft(n, choice.k, (t1 - t0) * 1e3)
        trace.push("accept")
        for i, row in enumerate(rows):
            p = proposals[i]
            if row.error is not None:        # failed while its draft guessed: it leaves at the end of the step
                continue
            try:
                accepted, nxt = self._verify(row, logits[i, :len(p) + 1], p)
            except GrammarError as e:
                self._fail(row, e)
                continue
            self._logprobs(row, logits[i], list(p[:accepted]) + [nxt])
            if self.head is not None:  # the hidden states of the positions the round keeps, for the head
                row.feats.append(self.target.hidden[i, :accepted + 1].copy())
            if choice.kind is RoundKind.DRAFT:
                # the draft's own cache keeps K/V of seq[:length + 1] and of the proposals it fed
                # after the first (draft_len = length + len(p)); only the accepted ones stay valid
                row.draft_len = min(row.draft_len, row.length + 1 + accepted)
            self.policy.observe(row, choice.kind, len(p), accepted, probe=choice.probe, rows=n)
            row.metrics.record_iteration(len(p), accepted)
            row.metrics.pair_rounds += choice.kind is RoundKind.PAIR
            row.metrics.lookup_rounds += choice.kind is RoundKind.LOOKUP and len(p) > 0
            row.metrics.plain_steps += choice.kind is RoundKind.PLAIN
            if n == 1 and choice.kind is not RoundKind.LOOKUP and row.req.grammar is None:
                # (one row only: policy.observe_guess says why)
                self.policy.observe_guess(row, [*p[:accepted], nxt])
            self._emit(row, p[:accepted], nxt)
        trace.pop()
        t3 = time.perf_counter()
        for row in rows:
            m = row.metrics
            m.time_draft += t1 - t0 if choice.kind is RoundKind.DRAFT else 0.0
            m.time_verify += t2 - t1
            m.time_accept += t3 - t2

    def _verify(self, row: Row, logits: np.ndarray, proposal) -> tuple[int, int]:
        """(n accepted, the next token) of a row's round: logits [len(proposal) + 1, V] at
        [last token, proposal...]. A row with a grammar chooses from the target's logits masked by
        the grammar state after the tokens before each position (the state plain constrained
        decoding reaches there), and its matcher consumes exactly the tokens emitted."""
        g = row.req.grammar
        if g is None:
            return first_mismatch(logits, proposal, row.req.params, row.req.seed, row.position(), self._scratch)
        k = len(proposal)
        for j in range(k + 1):
            y = choose(g.masked(logits[j], self._masked), row.req.params, row.req.seed, row.position() + j,
                       self._scratch)
            g.consume(y)            # (an EOS is not consumed: the row ends with it)
            if j == k or int(proposal[j]) != y:
                return j, y
        raise AssertionError("unreachable")

    def _logprobs(self, row: Row, logits: np.ndarray, tokens: list) -> None:
        """The round's emitted tokens' log-probabilities (a request that asked for them): token j
        from logits[j], the position that chose it."""
        n = row.req.logprobs
        if n is not None:
            row.lps = [TokenLogprob(int(t), *token_logprob(logits[j], int(t), n)) for j, t in enumerate(tokens)]

    def _pad_start(self) -> int:
        """Where a padding row after the running rows may write (a model that pads odd calls to an
        even number of rows, runtime/batch/model.py): from the length of the row being prefilled
        there (its next chunk overwrites it), else from 0 (a free row)."""
        return self.pending.length if self.pending is not None else 0

    def _emit(self, row: Row, accepted, nxt: int) -> None:
        """Append the round's tokens to the row, stopping at EOS (unless ignored), a stop string,
        a stop token or the budget."""
        text, toks, flags, lps = [], [], [], []
        for j, (tok, from_draft) in enumerate([(int(t), True) for t in accepted] + [(int(nxt), False)]):
            row.seq.append(tok)
            row.emitted += 1
            row.metrics.tokens += 1
            self.stats.tokens += 1
            if row.text is not None:
                chunk, reason = row.text.push(tok, from_draft)
                if chunk is not None:
                    text.append(chunk.text)
                    toks += chunk.tokens
                    flags += chunk.from_draft
                    lps += row.lps[j:j + 1] * len(chunk.tokens)     # (a chunk holds the token pushed, or none)
            else:
                reason = "eos" if tok in self.eos and not row.req.ignore_eos else \
                    "stop" if tok in row.req.stop_token_ids else None
                if reason is None:
                    toks.append(tok)
                    flags.append(from_draft)
                    lps += row.lps[j:j + 1]
            if reason is None and row.emitted >= row.budget:
                reason = "length" if row.budget == row.req.max_new_tokens else "max_context"
                if row.text is not None and (rest := row.text.flush()) is not None:
                    text.append(rest.text)
            if reason:
                row.finish = reason
                break
        row.length = len(row.seq) - 1
        if text or toks:
            row.req.sink(Delta("".join(text), tuple(toks), tuple(flags),
                               tuple(lps) if row.req.logprobs is not None else None))

    def _evict(self) -> None:
        """Finished rows leave; the last running row moves into each gap, and the rows being
        prefilled (after the running ones) move down with them, in their order."""
        i = 0
        while i < len(self.rows):
            row = self.rows[i]
            if row.finish is None:
                i += 1
                continue
            last = len(self.rows) - 1
            moved = self.rows.pop()            # the last row, which takes the gap (or row itself)
            if i != last:
                self.rows[i] = moved
            # told before any move below can raise: it is in no list fail_all reads any more
            self._finish(row)
            if i != last:
                self._move(last, i, moved)
            for j, p in enumerate(self.admitting):      # keep them right after the running rows
                self._move(last + 1 + j, last + j, p)
        self._close_up()            # rows cancelled while their prompt was being prefilled (admission.py)
        self._free_rows()

    def _free_rows(self) -> None:
        """Tell the caches which rows hold no request now: the running rows and the one being
        prefilled are rows 0..live-1 (a growing cache, runtime/backends/batch_kv.py BatchKV,
        then keeps only the positions those hold)."""
        live = len(self.rows) + len(self.admitting)
        self.target.cache.forget(live)
        if self.draft is not None and not self.draft.shares_cache:
            self.draft.cache.forget(live)

    def _move(self, src: int, dst: int, row: Row) -> None:
        self.target.cache.move_row(src, dst, row.length)
        if self.draft is not None and not self.draft.shares_cache:
            self.draft.cache.move_row(src, dst, row.draft_len)
        if self.head is not None:
            self.head.move_row(src, dst, row.head_len)

    def _finish(self, row: Row) -> None:
        if not row.prefilled:       # left before its prompt was prefilled: its samples not yet forked too
            for sib in row.req.siblings:
                sib.sink(Done(row.finish if row.finish in ("cancelled", "timeout") else "cancelled",
                              len(sib.prompt), 0, Row(sib, 0, None, {}, 0).metrics))
        self.stats.finished += 1
        row.metrics.finish_reason = row.finish
        if row.error is not None:
            row.req.sink(Failed(row.error))
            return
        row.req.sink(Done(row.finish, len(row.req.prompt), row.emitted, row.metrics))

    def _graph_t(self, graph: str, want: int, n: int = 1) -> int:
        """T of a step of n rows through `graph` that carries `want` tokens a row: the graph's
        static T; for a graph with a dynamic T, `want`, raised so that the call has at least the
        model's min_rows rows (kernels whose single-row path rounds differently never run it)."""
        static = self.target.graph_tokens.get(graph, 0)
        if static:
            return static
        return max(want, self.min_tokens, -(-self.target.min_rows // n))
