"""The one goodness-of-fit check of the sampling tests: counts observed over cells against
an exact distribution over the same cells, by a chi-square test and a total-variation bound.

TV bound: E[TV] <= 0.5 * sum_i sqrt(p_i / n) <= 0.5 * sqrt(C+ / n) (Jensen, then
Cauchy-Schwarz over the C+ cells with p_i > 0), and TV moves by at most 1/n per sample,
so McDiarmid gives P(TV > E[TV] + t) <= exp(-2 n t^2); t = sqrt(ln(1e6) / 2n). An exact
sampler therefore stays under the bound with probability >= 1 - 1e-6.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import chisquare

P_VALUE_FLOOR = 1e-3     # an exact sampler must pass at this level
P_VALUE_CEILING = 1e-6   # a wrong one must fail far below it


@dataclass(frozen=True)
class Fit:
    p_value: float        # chi-square; 0.0 when any sample fell outside the support
    tv: float             # total variation between the empirical and the exact distribution
    tv_bound: float       # what TV stays below with probability >= 1 - 1e-6 for an exact sampler
    outside_support: int  # samples in cells the exact distribution gives probability 0

    @property
    def passes(self) -> bool:
        return self.p_value > P_VALUE_FLOOR and self.tv < self.tv_bound


def goodness_of_fit(observed: np.ndarray, exact: np.ndarray, outside: int = 0) -> Fit:
    """observed: [C] counts; exact: [C] probabilities (sum 1); outside: samples in no cell
    at all (e.g. a sequence the enumeration of the support never reached).

    Chi-square pools the cells expected fewer than 5 times, so its asymptotics hold; a
    pooled cell still under 5 is folded into the smallest remaining one.
    """
    observed = np.asarray(observed, np.float64)
    exact = np.asarray(exact, np.float64)
    support = exact > 0
    n = observed.sum() + outside
    outside += int(observed[~support].sum())
    tv = 0.5 * float(np.abs(observed[support] / n - exact[support]).sum() + outside / n)
    tv_bound = 0.5 * math.sqrt(support.sum() / n) + math.sqrt(math.log(1e6) / (2 * n))

    order = np.argsort(-exact[support], kind="stable")
    obs, exp = observed[support][order], exact[support][order] * n
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
        if exp[-1] < 5 and exp.size > 1:
            obs = np.append(obs[:-2], obs[-2:].sum())
            exp = np.append(exp[:-2], exp[-2:].sum())
    p_value = 0.0 if outside else float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)
    return Fit(p_value, tv, tv_bound, outside)
