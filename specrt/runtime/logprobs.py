"""Log-probabilities of emitted tokens, as OpenAI's `logprobs` / `top_logprobs` report them.

The value is the target's *raw* log-probability at the token's position: log_softmax of the
logits the verify pass (or the prompt's last chunk) computed there, before temperature,
top-k/top-p/min-p and any grammar mask (vLLM's default `logprobs_mode="raw_logprobs"` names
the same thing, though vLLM's include its grammar mask). A position's logits do not depend on
the window or the batch they are computed in (the build's invariance gates), so the values
are the same with or without speculation and whatever the batch; a greedy request's token is
always the most likely one.
"""
from __future__ import annotations

import numpy as np

from specrt.errors import SamplingParamsError

MAX_TOP = 20          # OpenAI's limit on top_logprobs


def check_logprobs(n) -> int | None:
    """None, or the number of most likely alternatives to report (0..MAX_TOP)."""
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP:
        raise SamplingParamsError(f"logprobs={n!r}: give None (no log-probabilities) or an integer in [0, {MAX_TOP}], "
                                  "the number of most likely alternatives reported with each token")
    return n


def token_logprob(logits: np.ndarray, token: int, top: int):
    """(logprob of token, ((id, logprob) of the `top` most likely, most likely first)) from
    logits [V] (float32), computed in float64."""
    x = logits.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    lp = float(x[token] - lse)
    if not top:
        return lp, ()
    idx = np.argpartition(-x, top - 1)[:top] if top < x.shape[0] else np.arange(x.shape[0])
    idx = idx[np.lexsort((idx, -x[idx]))]          # most likely first; ties: the lower id
    return lp, tuple((int(i), float(x[i] - lse)) for i in idx)
