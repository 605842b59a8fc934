"""Goodness-of-fit helpers for distribution tests: a chi-square test of samples against exact
probabilities, with rare outcomes pooled so that every cell expects at least 5 samples."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy import stats


def chi_square_pvalue(samples: list[tuple], exact: dict[tuple, float]) -> float:
    n = len(samples)
    counts = Counter(samples)
    unexpected = sum(c for k, c in counts.items() if k not in exact)
    if unexpected:
        return 0.0  # an outcome of probability zero was sampled: certainly wrong
    keys = sorted(exact, key=lambda k: -exact[k])
    obs, exp = [], []
    pool_o = pool_e = 0.0
    for k in keys:
        e = exact[k] * n
        if e >= 5:
            obs.append(counts.get(k, 0))
            exp.append(e)
        else:
            pool_o += counts.get(k, 0)
            pool_e += e
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    obs, exp = np.array(obs, float), np.array(exp, float)
    exp *= obs.sum() / exp.sum()
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def marginals(samples: list[tuple], exact: dict[tuple, float], position: int):
    s = [(x[position],) for x in samples]
    e: dict[tuple, float] = {}
    for k, p in exact.items():
        e[(k[position],)] = e.get((k[position],), 0.0) + p
    return s, e


def shift_mass(exact: dict[tuple, float], amount: float, hi: int, lo: int) -> dict[tuple, float]:
    """The exact distribution with `amount` of probability moved from first token `hi` to first token
    `lo`: a planted bias that the tests must be able to detect."""
    first: dict[int, float] = {}
    for k, p in exact.items():
        first[k[0]] = first.get(k[0], 0.0) + p
    out = {}
    for k, p in exact.items():
        if k[0] == hi:
            out[k] = p * (1 - amount / first[hi])
        elif k[0] == lo:
            out[k] = p * (1 + amount / first[lo])
        else:
            out[k] = p
    return out
