"""Structured outputs under speculation, on the toy model (fake_batch.py) with a 16-token
tokenizer (runtime/grammar.py): a constrained request's tokens equal plain constrained
decoding (the target's logits masked by the grammar after the tokens before each position,
one token at a time) whatever proposes (a draft over the target's cache, a draft model with its
own cache, prompt lookup and pair guesses) and whatever shares its batch (rows without a
grammar, rows joining and leaving); constrained sampling follows the masked target
distribution exactly (goodness of fit)."""
from __future__ import annotations

import numpy as np
import pytest
from fake_batch import toy_tokenizer_json
from goodness_of_fit import goodness_of_fit
from test_batch_engine import EOS, V, Collect, make_engine

from specrt.runtime.choice import choose
from specrt.runtime.grammar import GrammarError, Grammars, Structured
from specrt.runtime.batch.request import Request
from specrt.runtime.sampling import SamplingParams, probs_from_logits

GRAMMARS = Grammars(toy_tokenizer_json(), [EOS], V)
SPECS = [Structured("regex", r"\[[abc]+(,[012]+)*\]"), Structured("regex", r"(xy|z|0)+[.!]"),
         Structured("choice", ["ab", "abc", "a0-x.", "c!"]), None]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 4], [2] * 9, list(range(14)), [7, 7, 1, 7],
           [9, 1] * 6, [3, 4, 5], [11, 12], [6, 3, 8, 6, 3, 8, 6], [1]]
SAMPLED = SamplingParams(temperature=1.0, top_k=8)


def constrained_reference(lm, prompt, n, params, seed, spec):
    """Plain constrained decoding, alone: at each position the target's logits masked by a fresh
    matcher that has consumed the tokens so far, one choice per position."""
    m = GRAMMARS.matcher(spec) if spec is not None else None
    seq, out, scratch, buf = list(prompt), [], np.zeros(V, np.float32), np.zeros(V, np.float32)
    for _ in range(n):
        logits = lm.logits(seq)
        y = choose(m.masked(logits, buf) if m else logits, params, seed, len(seq), scratch)
        if y == EOS:
            return out, "eos"
        seq.append(y)
        out.append(y)
        if m:
            assert m.consume(y)
    return out, "length"


def run(eng, requests, collect=Collect):
    """Submit (prompt, n, params, seed, spec[, Request keywords]) requests a few steps apart;
    drain; their collectors."""
    outs = []
    for i, (prompt, n, params, seed, spec, *kw) in enumerate(requests):
        c = collect()
        eng.add(Request(list(prompt), n, params, seed, sink=c,
                        grammar=GRAMMARS.matcher(spec) if spec is not None else None, **(kw[0] if kw else {})))
        outs.append(c)
        for _ in range(i % 3):
            eng.step()
    for _ in range(5000):
        if not eng.step() and eng.idle():
            break
    assert eng.idle()
    return outs


PROPOSERS = {"plain": dict(draft=False, lookup=False), "lookup": dict(draft=False, lookup=True),
             "draft": dict(draft=True, lookup=False), "own-draft": dict(draft=True, lookup=False, own_draft=True)}


@pytest.mark.parametrize("proposer", list(PROPOSERS))
def test_constrained_output_equals_plain_constrained_decoding_with_every_proposer(proposer):
    """Ten requests on three rows, greedy and seeded sampled, three grammars and rows without one
    in the same batches. Each request's tokens and finish reason equal plain constrained decoding
    alone. A draft guesses from its own masked logits with its matcher advanced along its guesses;
    left un-rolled-back (engine._rewind_guesses), the verify pass masks with a state past the
    row's tokens and the tokens differ (or the matcher fails); a mask applied at the wrong position
    changes tokens as well. A guess the grammar forbids is never verified (it could never be
    accepted: the window would be wasted): prompt lookup's are cut, a draft's are masked."""
    eng, target = make_engine(rows=3, **PROPOSERS[proposer])
    verified, real_verify = [], eng._verify

    def verify(row, logits, proposal):
        # every proposal the target verifies is one the row's grammar allows from its tokens so far
        g = row.req.grammar
        verified.append(g is None or g.allowed_prefix(proposal) == len(proposal))
        return real_verify(row, logits, proposal)
    eng._verify = verify
    requests = [(p, 14 + i, SAMPLED if i % 2 else SamplingParams(), 300 + i, SPECS[i % len(SPECS)])
                for i, p in enumerate(PROMPTS)]
    outs = run(eng, requests)
    for (prompt, n, params, seed, spec), c in zip(requests, outs):
        want, reason = constrained_reference(target, prompt, n, params, seed, spec)
        assert (c.tokens, c.done.finish_reason) == (want, reason), (prompt, params, spec)
    assert any(c.done.finish_reason == "eos" for c in outs)        # grammars completed and ended with EOS
    assert all(verified) and len(verified) > 20
    drafted = sum(c.done.metrics.drafted for c in outs)
    accepted = sum(c.done.metrics.accepted for c in outs)
    if proposer != "plain":
        assert 0 < accepted < drafted, (accepted, drafted)         # proposals were kept, and rejected
    # rows shared steps (3 rows, 10 requests; the last ones run alone, and the more tokens a draft
    # round keeps the fewer steps they share: 1.43 with the draft since 2026-12-06, was > 1.5)
    assert eng.stats.occupancy > 1.3


def test_a_grammar_changes_the_output_and_every_answer_matches_it():
    """The grammar is applied, not just carried: the toy model left alone writes tokens the
    grammar forbids, and each constrained answer is a full match of its grammar."""
    import re
    eng, target = make_engine(rows=3, draft=True)
    spec = SPECS[0]
    requests = [(p, 24, SamplingParams(), 0, spec) for p in PROMPTS[:4]]
    outs = run(eng, requests)
    from fake_batch import TOY_CHARS
    for (prompt, *_), c in zip(requests, outs):
        assert c.done.finish_reason == "eos"
        assert re.fullmatch(spec.value, "".join(TOY_CHARS[t] for t in c.tokens))
        free, _ = constrained_reference(target, prompt, 24, SamplingParams(), 0, None)
        assert free != c.tokens


def _exact_distribution(lm, prompt, params, spec, depth):
    """{output tokens (EOS-terminated): probability} of constrained sampling, by enumeration."""
    out, buf, scratch = {}, np.zeros(V, np.float32), np.zeros(V, np.float32)

    def walk(seq, toks, prob, m):
        if len(toks) == depth:
            out[tuple(toks)] = out.get(tuple(toks), 0.0) + prob
            return
        p = probs_from_logits(m.masked(lm.logits(seq), buf), params, scratch).astype(np.float64)
        p /= p.sum()
        for y in np.flatnonzero(p > 0):
            y = int(y)
            if y == EOS:
                out[tuple(toks) + ("eos",)] = out.get(tuple(toks) + ("eos",), 0.0) + prob * p[y]
                continue
            m.consume(y)
            walk(seq + [y], toks + [y], prob * p[y], m)
            m.rollback(1)
    walk(list(prompt), [], 1.0, GRAMMARS.matcher(spec))
    return out


def test_constrained_sampling_follows_the_masked_target_distribution():
    """1600 seeded samples of one prompt with a draft model that agrees with the target only
    sometimes (its own cache, rejections every few tokens): the outputs' distribution fits the
    exact one, enumerated from the target's masked and warped probabilities (goodness_of_fit.py).
    A draft whose guess was kept where the target's masked choice differs, or an unmasked
    target, puts mass on other outputs and fails."""
    eng, target = make_engine(rows=8, draft=True, lookup=False, own_draft=True)
    params = SamplingParams(temperature=1.3)
    spec = Structured("regex", r"[abc][0x]?[12]?[.!]")
    prompt = [3, 4, 5, 3, 4]
    exact = _exact_distribution(target, prompt, params, spec, depth=5)
    N = 1600
    outs = run(eng, [(prompt, 5, params, seed, spec) for seed in range(N)])
    cells = {k: i for i, k in enumerate(exact)}
    counts, outside = np.zeros(len(cells)), 0
    for c in outs:
        key = tuple(c.tokens) + (("eos",) if c.done.finish_reason == "eos" else ())
        if key in cells:
            counts[cells[key]] += 1
        else:
            outside += 1
    fit = goodness_of_fit(counts, np.array(list(exact.values())), outside)
    assert fit.passes, fit
    assert sum(c.done.metrics.drafted for c in outs) > sum(c.done.metrics.accepted for c in outs) > 0


def test_grammar_errors_name_the_problem():
    with pytest.raises(GrammarError, match="regex"):
        GRAMMARS.matcher(Structured("regex", "[a-"))
    with pytest.raises(GrammarError, match="not JSON"):
        Structured("json_schema", "{nope")
    with pytest.raises(GrammarError, match="choice"):
        Structured("choice", [])
    with pytest.raises(GrammarError, match="exactly one"):
        Structured.coerce({"regex": "a", "choice": ["a"]})
    with pytest.raises(GrammarError, match="kind"):
        Structured("yaml", "a: b")
    assert Structured.coerce({"json": {"type": "object"}}) == Structured("json_schema", {"type": "object"})
    assert Structured.coerce({"json_object": True}) == Structured("json_object")


def test_a_proposal_is_cut_where_the_grammar_forbids_it():
    m = GRAMMARS.matcher(SPECS[0])          # \[[abc]+(,[012]+)*\]
    assert m.allowed_prefix([6, 3, 8, 0, 9, 1]) == 4          # "[a,0" then "x" is forbidden
    assert m.allowed_prefix([6, 3, 7, EOS, 3]) == 4           # "[a]" then EOS: complete
    assert m.allowed_prefix([6, EOS]) == 1                    # "[" then EOS: not complete
    assert m.consumed == 0 and m.allowed_prefix([6]) == 1     # the state did not move
