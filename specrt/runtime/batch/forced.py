"""Teacher forcing through the engine's own calls: the logits a request alone would get at each
position of a given continuation, from the model the engine runs (a `--batch` folder's batched
model, else its one-row graphs, runtime/batch/one_row.py), in the calls that request would make.

    teacher_forced(engine, prompt, forced) -> logits [len(forced), V]

Row 0 is the logits of the prompt's last token (its prompt in the chunks admission.py runs, the
same window, padding and logit positions); row i > 0 those of a plain one-row step on forced[i-1]
(the T a plain round of one row runs, engine._graph_t). A greedy request's token at each
position is the argmax of its row there, and its reported logprob (runtime/logprobs.py) the row's
log_softmax: `specrt quality` checks that on every prompt (tools/quality.py), so a faithfulness
number describes what the folder's requests run, not a graph none of them runs.

The engine must be idle (no request held): the passes use cache row 0, which the next request
overwrites from its first position. The check is not atomic: callers reach it through
`SpeculativeGenerator.teacher_forced`, which holds the generator as a generation does (one at a
time; ConcurrentUseError otherwise).
"""
from __future__ import annotations

import numpy as np

from specrt.errors import ConcurrentUseError, ContextLengthError


def teacher_forced(engine, prompt: list[int], forced: list[int]) -> np.ndarray:
    if engine.active or engine.queued:
        raise ConcurrentUseError("teacher forcing steps cache row 0 of an idle engine: this one holds requests")
    if not prompt or not forced:
        raise ValueError("teacher forcing needs a prompt and at least one forced token")
    end = len(prompt) + len(forced) - 1        # positions the passes write
    if end > engine.max_context:
        raise ContextLengthError(f"{len(prompt)} prompt tokens and {len(forced)} forced tokens need {end} positions; "
                                 f"the engine holds {engine.max_context}")
    model, starts = engine.target, np.zeros(1, np.int64)
    C = engine._prompt_chunk()
    P = engine._positions.shape[1]
    for s in range(0, len(prompt), C):
        chunk = prompt[s:s + C]
        T, lo = engine._chunk_call(len(chunk), C)
        tokens = np.zeros((1, T), np.int64)
        tokens[0, :len(chunk)] = chunk
        starts[0] = s
        logits = model.step("prefill", tokens, starts, 0, (lo + np.arange(P, dtype=np.int64))[None], pad_start=0)
    rows = [logits[0, len(chunk) - 1 - lo].copy()]
    T = engine._graph_t("decode", 1, 1)
    tokens = np.zeros((1, T), np.int64)
    for i, t in enumerate(forced[:-1]):
        tokens[0, 0] = t
        starts[0] = len(prompt) + i
        rows.append(model.step("decode", tokens, starts, 0, pad_start=engine._pad_start())[0, 0].copy())
    model.cache.forget(0)
    return np.stack(rows)
