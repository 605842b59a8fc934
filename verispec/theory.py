"""What speculative decoding should gain, from the acceptance rate, the draft length and the costs.

Under the i.i.d. model of Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", arXiv 2211.17192, Sec. 3): each drafted token is accepted with probability a, independently,
until the first rejection. One target forward over k drafted tokens then commits on average

    E[tokens] = (1 - a^(k+1)) / (1 - a)          (k + 1 when a = 1)

tokens (accepted ones plus the recovered/bonus token). With a drafter whose cost per drafted token is
c target forwards, the wall-clock speedup over plain decoding is E[tokens] / (k c + 1). That "+1"
assumes a target forward over k+1 positions costs as much as over one; `CostCurve` replaces it with
the cost measured by `verispec roofline`, T(k+1) / T(1).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import InvalidParameter


def _check(a: float, k: float, c: float | None = None) -> None:
    if not (0.0 <= a <= 1.0):
        raise InvalidParameter(f"acceptance rate must be in [0, 1], got {a}")
    if not (k >= 0):
        raise InvalidParameter(f"draft length must be >= 0, got {k}")
    if c is not None and not (c >= 0):
        raise InvalidParameter(f"draft cost ratio must be >= 0, got {c}")


def expected_tokens(a: float, k: float) -> float:
    """Mean tokens committed per target forward (bonus included) for acceptance rate a and draft length k."""
    _check(a, k)
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_accepted(a: float, k: float) -> float:
    """Mean accepted draft tokens per step: E[tokens] - 1."""
    return expected_tokens(a, k) - 1.0


def acceptance_from_tokens(tau: float, k: float, tol: float = 1e-10) -> float:
    """Invert expected_tokens: the i.i.d. acceptance rate a that gives tau tokens per forward at draft
    length k (the "effective" a of a measured run). tau is clamped to [1, k+1]."""
    if k <= 0:
        return 0.0
    tau = min(max(tau, 1.0), k + 1.0)
    lo, hi = 0.0, 1.0
    while hi - lo > tol:  # expected_tokens is increasing in a
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class CostCurve:
    """Measured cost of one target forward over N new positions (seconds), and relative to N = 1; the
    one curve of the project (the tree budget, tree/budget.choose_budget, prices trees with it too)."""

    def __init__(self, ns: list[int], times: list[float], source: str = ""):
        if not ns or len(ns) != len(times):
            raise InvalidParameter("a cost curve needs as many times as positions, at least one")
        pairs = sorted(zip(ns, times))
        if pairs[0][0] != 1:
            raise InvalidParameter("a cost curve must include N = 1 (the plain decoding step)")
        if any(t <= 0 for _, t in pairs):
            raise InvalidParameter("forward times must be positive")
        self.ns = [int(n) for n, _ in pairs]
        self.times = [float(t) for _, t in pairs]
        self.source = source

    @classmethod
    def from_roofline(cls, data: dict | str | Path) -> "CostCurve":
        """From a roofline result (the dict, or the JSON file `verispec roofline` writes)."""
        source = ""
        if not isinstance(data, dict):
            source = str(data)
            try:
                data = json.loads(Path(data).read_text())
            except json.JSONDecodeError as exc:
                raise InvalidParameter(f"{source} is not a JSON file ({exc.msg})") from exc
        try:
            points = data["points"]
            return cls([p["n"] for p in points], [p["median_s"] for p in points], source=source)
        except (KeyError, TypeError) as exc:
            raise InvalidParameter(f"{source or 'the data'} is not a roofline result (no points with n/median_s)") from exc

    def seconds(self, n: float) -> float:
        """T(n): linear between measured sizes (exact at each), flat below the smallest, and past the
        largest growing with the last segment's slope (the compute-bound regime)."""
        ns, ts = self.ns, self.times
        if n <= ns[0]:
            return ts[0]
        for i in range(1, len(ns)):
            if n <= ns[i]:
                w = (n - ns[i - 1]) / (ns[i] - ns[i - 1])
                return ts[i - 1] * (1 - w) + ts[i] * w
        if len(ns) == 1:
            return ts[0]
        return ts[-1] + (ts[-1] - ts[-2]) / (ns[-1] - ns[-2]) * (n - ns[-1])

    def ratio(self, n: float) -> float:
        """T(n) / T(1)."""
        return self.seconds(n) / self.times[0]


def speedup(a: float, k: float, c: float, curve: CostCurve | None = None) -> float:
    """Predicted wall-clock speedup over plain decoding: E[tokens] / (k c + verification cost), where the
    verification cost of k+1 positions is 1 (flat, Leviathan et al.) or T(k+1)/T(1) from `curve`."""
    _check(a, k, c)
    verify = 1.0 if curve is None else curve.ratio(k + 1)
    return expected_tokens(a, k) / (k * c + verify)


def optimal_k(a: float, c: float, curve: CostCurve | None = None, k_max: int = 32) -> tuple[int, float]:
    """The draft length in 1..k_max with the highest predicted speedup, and that speedup.
    A best speedup below 1 means speculation does not pay at these rates."""
    _check(a, 1, c)
    if k_max < 1:
        raise InvalidParameter(f"k_max must be >= 1, got {k_max}")
    best = max(range(1, k_max + 1), key=lambda k: (speedup(a, k, c, curve), -k))
    return best, speedup(a, best, c, curve)


@dataclass
class TheoryRow:
    k: int
    expected_tokens: float
    speedup_flat: float
    speedup_curve: float | None


def table(a: float, c: float, k_max: int = 16, curve: CostCurve | None = None) -> list[TheoryRow]:
    return [TheoryRow(k, expected_tokens(a, k), speedup(a, k, c),
                      speedup(a, k, c, curve) if curve is not None else None) for k in range(1, k_max + 1)]


def simulate_tokens_per_step(a: float, k: int, steps: int = 10000, seed: int = 0) -> float:
    """Monte-Carlo check of expected_tokens: each draft position is accepted with probability a until the
    first rejection; a step commits the accepted tokens plus one."""
    _check(a, k)
    rng = random.Random(seed)
    total = 0
    for _ in range(steps):
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        total += accepted + 1
    return total / steps


def standard_error_tokens(a: float, k: int) -> float:
    """Standard deviation of the tokens committed by one step (for simulation tolerances)."""
    probs = [(a ** j) * (1 - a) for j in range(k)] + [a ** k]  # P(accepted = j)
    mean = sum((j + 1) * p for j, p in enumerate(probs))
    var = sum(((j + 1) - mean) ** 2 * p for j, p in enumerate(probs))
    return math.sqrt(var)
