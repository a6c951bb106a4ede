"""Token sampling and the speculative-decoding accept rule, in plain numpy.

The rule is Leviathan et al. 2023 (Alg. 1) / Chen et al. 2023: a draft token x
proposed with probability q(x) is kept with probability min(1, p(x) / q(x));
at the first rejection a token is drawn from norm(max(0, p - q)). Whatever the
draft does, every emitted token is then distributed exactly as the target's p.
"p" here is the *warped* distribution (temperature, top-k, top-p, min-p); the rule is
exact for that p, so draft and target must go through the same
`probs_from_logits` with the same `SamplingParams`.

Glossary (the vocabulary follows vLLM's rejection sampler):

    draft tokens      the k tokens x_0..x_{k-1} the proposer suggests for one step.
    verify positions  the k+1 target positions scored in one target call:
                      position i holds p(. | prefix, x_0..x_{i-1}).
    accepted tokens   the leading draft tokens that passed the accept test.
    recovered token   the token drawn from the residual at the first rejection;
                      it replaces the rejected draft token.
    bonus token       the token drawn from p at position k when all k draft tokens
                      were accepted; it comes free with the verify call.

Each verify step therefore emits n_accepted + 1 tokens (accepted, then exactly
one recovered-or-bonus token), between 1 and k+1.

Reproducibility: random decisions use only `rng.random()`, one draw per
decision (one per draft token, one for the final token), so a seeded
`numpy.random.Generator` replays the same tokens.
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
    "Verdict",
    "accept_probability",
    "probs_from_logits",
    "residual_distribution",
    "residual_without",
    "sample",
    "sample_at",
    "verify_greedy",
    "verify_sampled",
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
    seed: seed for the caller's `numpy.random.default_rng`; None means unseeded.
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
                # numpy.random.default_rng rejects negative seeds; fail here, at construction.
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

    Apply the same params to draft and target: the accept rule is exact for the p it
    is given, so the warp is part of the definition of the target distribution.
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


def sample(
    probs: np.ndarray,  # probs: [V], non-negative, sum 1 (+- rounding)
    rng: np.random.Generator,
) -> int:
    """Draw one token by inverse CDF with a single `rng.random()` (see `sample_at`)."""
    return sample_at(probs, rng.random)


def sample_at(
    probs: np.ndarray,  # probs: [V], non-negative, sum 1 (+- rounding)
    u,  # a float in [0, 1), or a callable returning one (drawn after the checks)
) -> int:
    """The token at uniform u by inverse CDF: i with cdf[i-1] <= u * total < cdf[i].

    The CDF is scaled by its own total, so rows summing to 1 +- 1e-6 (float32
    rounding) are fine. A zero-probability token is never returned: each returned
    index i satisfies cdf[i-1] <= u * total < cdf[i], i.e. probs[i] > 0. The same u
    gives the same token for the same probs: a position-keyed u (runtime/batch/choice.py)
    makes sampled output independent of how rounds and batches were formed.
    """
    cdf = np.cumsum(probs, dtype=np.float64)
    total = cdf[-1] if cdf.size else 0.0
    if not (total > 0 and np.isfinite(total)):
        raise ValueError(
            f"probs sums to {total}; pass a [V] distribution with positive finite mass"
        )
    u = u() if callable(u) else u
    i = int(np.searchsorted(cdf, u * total, side="right"))
    if i >= cdf.size:
        # u * total rounded up to total; take the last token with positive mass.
        i = int(np.flatnonzero(probs > 0)[-1])
    return i


def accept_probability(p_x: float, q_x: float) -> float:
    """min(1, p(x) / q(x)): the chance of keeping draft token x.

    q(x) == 0 happens when the proposer has no distribution (greedy draft, n-gram
    lookup) or its warp cut x; we never divide then: keep x iff the target allows it.
    """
    if q_x <= 0.0:
        return 1.0 if p_x > 0.0 else 0.0
    return min(1.0, float(p_x) / float(q_x))


def residual_distribution(
    p: np.ndarray,  # p: [V] target probs at the rejected position
    q: np.ndarray,  # q: [V] draft probs at the same position
    out: np.ndarray,  # out: [V] float32, overwritten
) -> np.ndarray:  # -> out: [V]
    """norm(max(0, p - q)) into `out`: where the recovered token is drawn from.

    The residual is all zero only when p == q, where a rejection cannot happen
    (every accept probability is 1); fall back to p rather than divide by zero.
    """
    np.subtract(p, q, out=out)
    np.maximum(out, 0.0, out=out)
    return _normalised_or_p(out, p)


def residual_without(
    p: np.ndarray,  # p: [V] target probs at the rejected position
    x: int,  # the rejected token of a deterministic proposal (q one-hot on x)
    out: np.ndarray,  # out: [V] float32, overwritten
) -> np.ndarray:  # -> out: [V]
    """The residual norm(max(0, p - q)) when q is one-hot on x (prompt lookup, a table guess):
    p with x removed, renormalised. The same numbers `residual_distribution` gives for a
    one-hot q row, without materialising the row."""
    np.copyto(out, p)
    out[x] = 0.0
    return _normalised_or_p(out, p)


def _normalised_or_p(out: np.ndarray, p: np.ndarray) -> np.ndarray:
    """out / out.sum() in place; p itself when out is all zero (p == q: no rejection happens)."""
    total = out.sum()
    if total > 0.0:
        np.divide(out, total, out=out)
    else:
        np.copyto(out, p)
    return out


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one step of k draft tokens.

    The step emits draft_tokens[:n_accepted] followed by next_token.
    """

    n_accepted: int  # 0..k draft tokens kept
    next_token: int  # recovered token (at first rejection) or bonus token (all accepted)
    bonus: bool  # True when all k were accepted and next_token came from p[k]


def verify_greedy(
    target_argmax: np.ndarray,  # target_argmax: [k+1] int, target argmax at each verify position
    draft_tokens: np.ndarray,  # draft_tokens: [k] int
) -> Verdict:
    """Greedy verification: keep draft tokens while they equal the target's argmax.

    At the first mismatch i the recovered token is target_argmax[i]; if all k match,
    the bonus token is target_argmax[k]. The output equals plain greedy decoding.
    """
    k = draft_tokens.shape[0]
    if draft_tokens.ndim != 1 or target_argmax.shape != (k + 1,):
        raise ValueError(
            f"target_argmax has shape {target_argmax.shape} and draft_tokens {draft_tokens.shape}; "
            "expected [k+1] and [k] (one verify position per draft token plus the bonus position)"
        )
    mismatch = np.flatnonzero(target_argmax[:k] != draft_tokens)
    if mismatch.size:
        i = int(mismatch[0])
        return Verdict(n_accepted=i, next_token=int(target_argmax[i]), bonus=False)
    return Verdict(n_accepted=k, next_token=int(target_argmax[k]), bonus=True)


def verify_sampled(
    p: np.ndarray,  # p: [k+1, V] warped target probs at each verify position
    q: np.ndarray | None,  # q: [k, V] warped draft probs, or None: each x_i is a deterministic guess
    draft_tokens: np.ndarray,  # draft_tokens: [k] int, x_i was drawn from q[i]
    rng: np.random.Generator,
    scratch: np.ndarray,  # scratch: [V] float32, residual work buffer
) -> Verdict:
    """Speculative sampling: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)).

    At the first rejection the recovered token is drawn from norm(max(0, p_i - q_i));
    if all k are accepted the bonus token is drawn from p[k]. Emitted tokens are then
    distributed exactly as p, for any q (provided x_i really was drawn from q[i]).
    q None: the proposal has no distribution (prompt lookup, a table): q is one-hot on each
    x_i, so x_i is kept with probability p_i(x_i) and the residual is p_i without x_i.

    Uses k' + 1 draws of `rng.random()`, where k' is the number of draft tokens
    examined. The test is `u < a` with u in [0, 1), so P(accept) is exactly a and a
    token the target gives probability 0 is never accepted.
    """
    k = draft_tokens.shape[0]
    if p.ndim != 2 or draft_tokens.ndim != 1 or p.shape[0] != k + 1 or (q is not None and q.shape != (k, p.shape[1])):
        raise ValueError(
            f"p has shape {p.shape}, q {q.shape}, draft_tokens {draft_tokens.shape}; "
            "expected p [k+1, V], q [k, V], draft_tokens [k]"
        )
    _check_vector("scratch", scratch, p.shape[1])

    for i in range(k):
        x = int(draft_tokens[i])
        a = accept_probability(float(p[i, x]), 1.0 if q is None else float(q[i, x]))
        if rng.random() < a:
            continue
        residual = residual_without(p[i], x, scratch) if q is None else residual_distribution(p[i], q[i], scratch)
        return Verdict(n_accepted=i, next_token=sample(residual, rng), bonus=False)
    return Verdict(n_accepted=k, next_token=sample(p[k], rng), bonus=True)
