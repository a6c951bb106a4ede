"""Sampling parameters and the warp from logits to the distribution a token is drawn from, in
plain numpy.

"p" is the *warped* distribution (temperature, top-k, top-p, min-p): the target's
distribution a sampled request follows, so a proposer that samples (a draft model) goes
through the same `probs_from_logits` with the same `SamplingParams`. The accept rule itself
(which token the target chooses at a position, and how much of a proposal is kept) is
runtime/choice.py, one rule for a single stream and every row of a batch.

Glossary (the vocabulary follows vLLM's rejection sampler):

    draft tokens      the k tokens x_0..x_{k-1} the proposer suggests for one step.
    verify positions  the k+1 target positions scored in one target call:
                      position i holds p(. | prefix, x_0..x_{i-1}).
    accepted tokens   the leading draft tokens equal to the target's choices.
    recovered token   the target's choice at the first position where they differ;
                      it replaces the rejected draft token.
    bonus token       the target's choice at position k when all k draft tokens
                      were accepted; it comes free with the verify call.

Each verify step therefore emits n_accepted + 1 tokens (accepted, then exactly
one recovered-or-bonus token), between 1 and k+1.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from specrt.errors import SamplingParamsError

__all__ = [
    "SamplingParams",
    "probs_from_logits",
]


def _is_real(x: object) -> bool:
    # bool is an int subclass; `temperature=True` is a bug, not 1.0.
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the target (and draft) logits.

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep only the k most likely tokens; 0 disables.
    top_p: keep the smallest set of most likely tokens with mass >= top_p; 1.0 disables.
    min_p: keep only tokens with probability >= min_p * (the most likely token's); 0.0 disables.
    seed: the request's seed: the same seed, the same sampled tokens, whatever the method, k,
          proposer or batch (runtime/choice.py); None draws one per request.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_real(t):
            raise SamplingParamsError(
                f"temperature={t!r} is not a number; pass a float >= 0 (0 means greedy)"
            )
        if not math.isfinite(t) or t < 0:
            raise SamplingParamsError(
                f"temperature={t!r} is outside [0, inf); pass a finite float >= 0 (0 means greedy)"
            )
        k = self.top_k
        if not _is_int(k):
            raise SamplingParamsError(
                f"top_k={k!r} is not an integer; pass an int >= 0 (0 disables top-k)"
            )
        if k < 0:
            raise SamplingParamsError(
                f"top_k={k!r} is outside [0, inf); pass an int >= 0 (0 disables top-k)"
            )
        tp = self.top_p
        if not _is_real(tp):
            raise SamplingParamsError(
                f"top_p={tp!r} is not a number; pass a float in (0, 1] (1.0 disables nucleus sampling)"
            )
        if not math.isfinite(tp) or not 0.0 < tp <= 1.0:
            raise SamplingParamsError(
                f"top_p={tp!r} is outside (0, 1]; use 1.0 to disable nucleus sampling"
            )
        mp = self.min_p
        if not _is_real(mp):
            raise SamplingParamsError(
                f"min_p={mp!r} is not a number; pass a float in [0, 1] (0 disables min-p sampling)"
            )
        if not math.isfinite(mp) or not 0.0 <= mp <= 1.0:
            raise SamplingParamsError(
                f"min_p={mp!r} is outside [0, 1]; use 0 to disable min-p sampling"
            )
        s = self.seed
        if s is not None:
            if not _is_int(s):
                raise SamplingParamsError(
                    f"seed={s!r} is not an integer; pass an int >= 0 or None for an unseeded run"
                )
            if s < 0:
                raise SamplingParamsError(
                    f"seed={s!r} is outside [0, inf); pass an int >= 0 or None for an unseeded run"
                )

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature == 0)."""
        return self.temperature == 0

    @classmethod
    def coerce(cls, obj: "SamplingParams | Mapping | None") -> "SamplingParams":
        """`obj` as SamplingParams: None is the default (greedy), a mapping gives the fields
        by name (`{"temperature": 0.5}`); anything else is a SamplingParamsError."""
        if obj is None:
            return cls()
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, Mapping):
            names = {f.name for f in fields(cls)}
            unknown = sorted(str(k) for k in obj if k not in names)
            if unknown:
                raise SamplingParamsError(
                    f"sampling has unknown fields {unknown}; SamplingParams takes {sorted(names)}"
                )
            return cls(**obj)
        raise SamplingParamsError(
            f"sampling={obj!r} ({type(obj).__name__}): pass a SamplingParams, a mapping such as "
            '{"temperature": 0.5, "top_p": 0.9}, or None for greedy decoding'
        )


_TINIEST_T = np.finfo(np.float32).smallest_subnormal


def _check_vector(name: str, a: np.ndarray, v: int) -> None:
    if a.shape != (v,):
        raise ValueError(f"{name} has shape {a.shape}; expected ({v},), one entry per vocabulary token")


def probs_from_logits(
    logits: np.ndarray,  # logits: [V] float32, one position
    params: SamplingParams,
    out: np.ndarray,  # out: [V] float32, overwritten
) -> np.ndarray:  # -> out: [V], the warped distribution
    """Write the warped next-token distribution for one position into `out` and return `out`.

    Order: divide by temperature, softmax, top-k, top-p, min-p, renormalising after each
    cut (top-p sees the top-k-renormalised distribution, min-p the top-p-renormalised one:
    Hugging Face's warper chain, TemperatureLogitsWarper -> TopK -> TopP -> MinP).

    - Greedy params give a one-hot row on argmax(logits) (first index on ties), so
      callers can treat greedy and sampled decoding uniformly.
    - The temperature-only path (top_k == 0 or >= V, top_p == 1) works in place in
      `out` and allocates no V-sized array.
    - top-k keeps exactly k tokens (ties at the boundary broken by `np.argpartition`)
      and allocates an index array; top-p allocates a sort order and a cumulative sum.
    - top-p keeps the smallest set of highest-probability tokens whose mass is
      >= top_p, and always at least one token.
    - min-p keeps the tokens with probability >= min_p * max probability (the most likely
      token always stays, min_p <= 1); it allocates a mask. vLLM applies min-p before
      top-k/top-p instead: the same tokens unless top-p is also set.

    Apply the same params to draft and target: the warp is part of the definition of the
    target distribution, and a draft warped the same way is coupled to it closely.
    """
    if logits.ndim != 1:
        raise ValueError(f"logits has shape {logits.shape}; pass one position, shape [V]")
    v = logits.shape[0]
    _check_vector("out", out, v)

    m = logits.max()
    if not np.isfinite(m):
        raise ValueError(
            f"logits max is {m}; logits must contain a finite maximum and no NaN "
            "(mask tokens with -inf, not NaN)"
        )

    if params.greedy:
        out.fill(0.0)
        out[int(np.argmax(logits))] = 1.0
        return out

    # Subtract the max before dividing so a tiny temperature cannot overflow to inf.
    # The division is float32: a temperature below float32's smallest subnormal would
    # round to 0 (0/0 = NaN at the argmax), so it divides by that subnormal instead,
    # which is the limit t -> 0+ (all mass on the maxima). Any larger t is unchanged.
    np.subtract(logits, m, out=out)
    with np.errstate(over="ignore"):    # (x - m) / tiny t -> -inf: exp gives the intended 0
        np.divide(out, max(np.float32(params.temperature), _TINIEST_T), out=out)
    np.exp(out, out=out)
    np.divide(out, out.sum(), out=out)

    if 0 < params.top_k < v:
        drop = np.argpartition(out, v - params.top_k)[: v - params.top_k]
        out[drop] = 0.0
        np.divide(out, out.sum(), out=out)

    if params.top_p < 1.0:
        order = np.argsort(-out, kind="stable")
        mass = np.cumsum(out[order], dtype=np.float64)
        # First index where the running mass reaches top_p; rounding can leave the
        # total just under top_p, hence the clamp to V.
        n_keep = min(int(np.searchsorted(mass, params.top_p, side="left")) + 1, v)
        out[order[n_keep:]] = 0.0
        np.divide(out, out.sum(), out=out)

    if params.min_p > 0.0:
        out[out < np.float32(params.min_p) * out.max()] = 0.0
        np.divide(out, out.sum(), out=out)

    return out
