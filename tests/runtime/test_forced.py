"""Teacher forcing through the engine's own calls (runtime/batch/forced.py), what `specrt quality`
measures with: on every kind of folder, the forced rows on a request's own greedy output are the
rows its engine chose them from (argmax = the token, log_softmax = the logprob it reported, the
same top alternatives), so a faithfulness number describes what the folder's requests run."""
from __future__ import annotations

import numpy as np
import pytest

from specrt.errors import ConcurrentUseError, ContextLengthError, ParityError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.batch.forced import teacher_forced
from specrt.runtime.logprobs import token_logprob

PROMPT = [(7 * i + 3) % 120 + 2 for i in range(37)]     # longer than two prompt chunks of 16
KINDS = ["tiny_engines", "tiny_int4_engines", "tiny_batch_engines", "tiny_batch_int4_engines",
         "tiny_batch_b64_engines", "tiny_batch_rows_engines", "tiny_batch_rows_model_engines"]


def _greedy(gen, prompt, n=12, top=5):
    out = list(gen.tokens(prompt, max_new_tokens=n, method="plain", logprobs=top))
    return [e.token for e in out], [e.logprob for e in out]


@pytest.mark.parametrize("kind", KINDS)
def test_forced_rows_are_the_engines_own(kind, request):
    gen = SpeculativeGenerator(request.getfixturevalue(kind))
    toks, lps = _greedy(gen, PROMPT)
    rows = teacher_forced(gen.one.engine, PROMPT, toks)
    assert rows.shape == (len(toks), gen.vocab) and rows.dtype == np.float32
    assert rows.argmax(-1).tolist() == toks
    for i, (t, lp) in enumerate(zip(toks, lps)):
        assert token_logprob(rows[i], t, 5) == (lp.logprob, lp.top), (kind, i)
    # the engine is idle again and answers as before; a second forcing gives the same bits
    assert _greedy(gen, PROMPT) == (toks, lps)
    np.testing.assert_array_equal(teacher_forced(gen.one.engine, PROMPT, toks), rows)


def test_forcing_another_continuation_changes_the_rows_after_it(tiny_batch_rows_engines):
    gen = SpeculativeGenerator(tiny_batch_rows_engines)
    toks, _ = _greedy(gen, PROMPT, n=6)
    other = toks[:2] + [(toks[2] + 1) % gen.vocab] + toks[3:]
    a = teacher_forced(gen.one.engine, PROMPT, toks)
    b = teacher_forced(gen.one.engine, PROMPT, other)
    np.testing.assert_array_equal(a[:3], b[:3])          # rows 0..2 see the same context
    assert not np.array_equal(a[3], b[3])                # row 3 sees the other token


def test_one_row_rows_are_not_a_batched_engines(tiny_batch_engines):
    """The check quality runs has teeth: a folder whose batched model prompts with int8 weights
    and steps int4 ones (tiny_batch_engines) against rows forced through its one-row int4 graphs."""
    from specrt.tools.quality import _check_engine
    auto = SpeculativeGenerator(tiny_batch_engines)
    one_row = SpeculativeGenerator(tiny_batch_engines, engine="one-row")
    toks, lps = _greedy(auto, PROMPT, top=0)
    _check_engine("auto", teacher_forced(auto.one.engine, PROMPT, toks), toks, toks, [x.logprob for x in lps])
    with pytest.raises(ParityError, match="would not describe what this folder runs"):
        _check_engine("one-row", teacher_forced(one_row.one.engine, PROMPT, toks), toks, toks,
                      [x.logprob for x in lps])


def test_forcing_gives_the_cache_back(tiny_batch_rows_engines):
    """A cache that sizes itself to what its rows hold (the rows graph's) counts nothing forced
    as held after the passes, as after a request (its next fit may shrink it)."""
    gen = SpeculativeGenerator(tiny_batch_rows_engines)
    cache = gen.one.engine.target.cache
    _greedy(gen, PROMPT, n=4)
    assert not cache.end.any()
    rows = teacher_forced(gen.one.engine, PROMPT, [5] * 40)        # 76 positions: past one block
    assert len(rows) == 40 and not cache.end.any()


def test_forcing_refuses_a_busy_engine_and_a_long_continuation(tiny_batch_rows_engines):
    gen = SpeculativeGenerator(tiny_batch_rows_engines)
    stream = gen.tokens(PROMPT, max_new_tokens=4, method="plain")
    next(stream)
    with pytest.raises(ConcurrentUseError, match="idle engine"):
        teacher_forced(gen.one.engine, PROMPT, [1, 2])
    with pytest.raises(ConcurrentUseError, match="already generating"):    # the generator's own guard
        gen.teacher_forced(PROMPT, [1, 2])
    stream.close()
    assert gen.teacher_forced(PROMPT, [1, 2]).shape == (2, gen.vocab)    # free again
    room = gen.one.engine.max_context
    with pytest.raises(ContextLengthError, match=f"holds {room}"):
        teacher_forced(gen.one.engine, PROMPT, [1] * (room - len(PROMPT) + 2))
    with pytest.raises(ValueError, match="at least one forced token"):
        teacher_forced(gen.one.engine, PROMPT, [])
