"""Prompt lookup's free evidence on real graphs (policy.observe_guess): in steps of one row the
guess a row had is scored against the token it emitted; in a batch it is not. The tiny fp32
rows build (`--batch --batch-attention rows`), windows priced out so steps are plain."""
from __future__ import annotations

from fake_batch import hold_until_added

from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.policy import BatchCosts

PROMPTS = ["a b a b a b a b a b", "the cat the cat the cat", "hello there"]
NEW = 24


def test_lookup_learns_from_the_steps_it_does_not_win(tiny_batch_rows_engines, monkeypatch):
    """Windows priced out (every step plain, save lookup's probes): at each plain step where
    prompt lookup had a guess, the engine scores it (policy.observe_guess) against the token
    the row emitted at that step; the answer is unchanged."""
    with open_batch(tiny_batch_rows_engines, max_num_seqs=1) as g:
        want = g.generate(PROMPTS[0], max_new_tokens=NEW).tokens
        g.engine.policy.costs = BatchCosts({1: {1: 1.0, 8: 1.0}, 2: {1: 100.0, 8: 100.0}, 4: {1: 100.0, 8: 100.0}})
        calls = []
        orig = g.engine.policy.observe_guess

        def spy(row, emitted):
            calls.append((list(row.unverified), list(emitted), len(row.seq) - len(row.req.prompt)))
            return orig(row, emitted)
        monkeypatch.setattr(g.engine.policy, "observe_guess", spy)
        got = g.generate(PROMPTS[0], max_new_tokens=NEW).tokens
    assert got == want
    scored = [c for c in calls if c[0]]
    assert len(scored) >= 3, calls                # a repeating prompt: guesses at many steps
    for guess, emitted, at in scored:
        assert emitted == [want[at]], (guess, emitted, at)      # a plain step: the row's next token


def test_a_batch_s_lookup_estimates_learn_from_their_own_rounds_only(tiny_batch_rows_engines, monkeypatch):
    """Guesses are scored against emitted tokens in steps of one row only (policy.observe_guess:
    in a batch a lookup step costs every row a window); the answers are the ones alone."""
    with open_batch(tiny_batch_rows_engines, max_num_seqs=3) as g:
        eng = g.engine
        eng.policy.costs = BatchCosts({1: {1: 1.0, 8: 1.0}, 2: {1: 100.0, 8: 100.0}, 4: {1: 100.0, 8: 100.0}})
        sizes = []
        orig = eng.policy.observe_guess
        monkeypatch.setattr(eng.policy, "observe_guess", lambda row, e: sizes.append(len(eng.rows)) or orig(row, e))
        hold_until_added(eng, 3, monkeypatch)
        got = [c.tokens for c in g.generate_batch(PROMPTS[:3], max_new_tokens=NEW)]
        assert eng.stats.row_steps > eng.stats.steps          # rows did share steps
    assert set(sizes) <= {1}
    with open_batch(tiny_batch_rows_engines, max_num_seqs=1) as g:
        assert got == [g.generate(p, max_new_tokens=NEW).tokens for p in PROMPTS[:3]]
