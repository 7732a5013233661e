"""Say in words what shape a measured sequence has, from its numbers: the trend sentences of the chapters."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


def trend_shape(ys, tol: float = 0.0) -> str:
    """Return the shape of a sequence: "flat", "rises", "falls", "dips" (down then up), "peaks" (up then down), "mixed".

    tol: steps no larger than this count as level. A level step does not break a run.
    """
    ys = [float(y) for y in ys]
    if len(ys) < 2:
        raise ValueError(f"a trend needs at least two values, got {len(ys)}")
    moves = [1 if b > a else -1 for a, b in zip(ys, ys[1:]) if not abs(b - a) <= tol]  # level steps left out
    if not moves:
        return "flat"
    changes = sum(1 for a, b in zip(moves, moves[1:]) if a != b)
    if changes == 0:
        return "rises" if moves[0] > 0 else "falls"
    if changes == 1:
        return "dips" if moves[0] < 0 else "peaks"
    return "mixed"


SHAPE_WORDS = {"flat": "stays level", "rises": "rises", "falls": "falls", "dips": "falls, then rises",
               "peaks": "rises, then falls", "mixed": "moves up and down"}


def shape_words(ys, tol: float = 0.0) -> str:
    """Return a sequence's shape as a verb phrase for a title: "falls", "falls, then rises", "moves up and down", ..."""
    return SHAPE_WORDS[trend_shape(ys, tol)]


def describe_trend(xs, ys, fmt: str = "{:.3f}", x_name: str = "x", tol: float = 0.0) -> str:
    """Return a phrase without subject for how ys moves along xs: "falls from a at x = 1 to b at x = 16", ..."""
    xs, ys = list(xs), [float(y) for y in ys]
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys need the same length, got {len(xs)} and {len(ys)}")
    shape = trend_shape(ys, tol)
    at = [f"{fmt.format(y)} at {x_name} = {x}" for x, y in zip(xs, ys)]
    if shape == "flat":
        if fmt.format(ys[0]) == fmt.format(ys[-1]):  # "from 25.6 at k = 2 to 25.6 at k = 4" says it twice
            return f"stays level at {fmt.format(ys[0])} from {x_name} = {xs[0]} to {x_name} = {xs[-1]}"
        return f"stays level, from {at[0]} to {at[-1]}"
    if shape in ("rises", "falls"):
        return f"{shape} from {at[0]} to {at[-1]}"
    if shape in ("dips", "peaks"):
        k = min(range(len(ys)), key=ys.__getitem__) if shape == "dips" else max(range(len(ys)), key=ys.__getitem__)
        first, then, extreme = ("falls", "rises", "lowest") if shape == "dips" else ("rises", "falls", "highest")
        return f"{first} from {at[0]} to its {extreme}, {at[k]}, then {then} to {at[-1]}"
    lo, hi = min(range(len(ys)), key=ys.__getitem__), max(range(len(ys)), key=ys.__getitem__)
    return (f"moves up and down without one direction ({', '.join(fmt.format(y) for y in ys)}): lowest "
            f"{at[lo]}, highest {at[hi]}")


def ranks(values) -> list[float]:
    """Return the ranks of `values` (1 = smallest), ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def rank_correlation(xs, ys) -> float:
    """Return Spearman's rank correlation of two equally long sequences: how well one orders like the other
    (1: the same order, -1: reversed; chapter 09 sets the planner's predicted step times against measured ones)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"rank correlation needs two sequences of one length, at least 2; got {len(xs)} and {len(ys)}")
    return statistics.correlation(ranks(xs), ranks(ys))


@dataclass(frozen=True)
class PolynomialFit:
    """y ≈ coeffs[0] + coeffs[1]·x + coeffs[2]·x² + …: a least-squares fit of measured points (chapter 00 fits the
    activation bytes with a line in the batch and a quadratic in the sequence length)."""

    coeffs: tuple  # lowest power first

    def __call__(self, x: float) -> float:
        """Return the fitted value at `x`."""
        return sum(c * x**k for k, c in enumerate(self.coeffs))

    def max_rel_deviation(self, xs, ys) -> float:
        """Return the largest |fit - measured| / |measured| over the points."""
        return max(abs(self(x) - y) / abs(y) for x, y in zip(xs, ys))


def fit_polynomial(xs, ys, degree: int) -> PolynomialFit:
    """Fit a polynomial of `degree` to the points (xs, ys) by least squares (in float64)."""
    if len(xs) != len(ys) or len(xs) < degree + 1:
        raise ValueError(f"a degree-{degree} fit needs at least {degree + 1} points (x, y); got {len(xs)} and "
                         f"{len(ys)} values")
    import torch
    a = torch.tensor([[float(x) ** k for k in range(degree + 1)] for x in xs], dtype=torch.float64)
    b = torch.tensor([float(y) for y in ys], dtype=torch.float64)[:, None]
    return PolynomialFit(tuple(torch.linalg.lstsq(a, b).solution.flatten().tolist()))
