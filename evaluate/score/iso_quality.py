"""Compression at iso-quality: the largest compression ratio at which a method's score stays within a threshold of
the uncompressed score, with a paired-bootstrap interval.

Definition. A series is one method's runs at several ratios ``cr_1 < cr_2 < ... < cr_m``, scoring ``s_1 ... s_m``,
that share one uncompressed baseline (evaluate/score/baseline.py), scoring ``b``. A threshold ``t`` is either

- absolute, ``t = b − δ`` (δ ≥ 0 points; δ = 1 by default), or
- relative, ``t = ρ × b`` (0 < ρ ≤ 1; ρ = 0.95 by default).

A point passes when ``s_i ≥ t``. Let ``k`` be the first point that fails, scanning up from the smallest ratio: the
series stays within the threshold up to ``cr_{k−1}`` and leaves it by ``cr_k`` (a point past the first failure that
passes again does not count: the series did not *stay* within). The iso-quality cr is then

- ``cr_{k−1} + (cr_k − cr_{k−1}) × (s_{k−1} − t) / (s_{k−1} − s_k)``, the ratio where the straight line between
  the last passing and the first failing point crosses ``t``, marked **interpolated** (``≈``); it is
  ``cr_{k−1}`` itself, marked **measured**, when ``s_{k−1} = t`` exactly;
- ``cr_m`` marked **≥** when every point passes: the series stays within up to its largest measured ratio, and
  where it leaves is not measured;
- ``cr_1`` marked **<** when the smallest ratio already fails: it leaves below every measured ratio.

Interval. Every run of the series and its baseline are resampled together: each draw resamples the contexts they
all answered once (within each task, :func:`evaluate.score.bootstrap.paired_resamples`), scores every point and the
baseline on that draw, and computes that draw's iso-quality cr by the definition above (a ``≥`` draw counts as
``cr_m``, a ``<`` draw as ``cr_1``). The interval is the 2.5th and 97.5th percentiles over draws; a bound at
``cr_m`` that ``≥`` draws reach reads "≥ cr_m", one at ``cr_1`` that ``<`` draws reach "< cr_1" (the draws only
bound the iso-quality cr there).

Budgets. A series of token-budget runs (``budget=N``) at budgets ``N_1 > N_2 > ... > N_m`` compresses more as the
budget falls, so its iso-quality figure is the *smallest* budget whose score stays within the threshold, scanning
down from the largest. It is the definition above on the axis ``x = −N`` (ascending x, descending budget: from the
least to the most compression), mapped back (:func:`iso_budget`, :func:`budget_interval`): the interpolation is
linear in the budget, ``≥ cr_m`` becomes **≤** the smallest budget (every point passes), ``< cr_1`` becomes **>**
the largest (the largest budget already fails), and an interval's bounds swap.
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from evaluate.errors import ConfigError
from evaluate.score.bootstrap import _percentiles, paired_resamples

DEFAULT_DELTA = 1.0  # points below the uncompressed score
DEFAULT_RELATIVE = 0.95  # share of the uncompressed score
MEASURED, INTERPOLATED, AT_LEAST, BELOW = "measured", "interpolated", "≥", "<"
AT_MOST, ABOVE = "≤", ">"  # a budget series' bounds: ≥ and < on the axis −budget
_ON_BUDGETS = {AT_LEAST: AT_MOST, BELOW: ABOVE}  # a mark on the axis −budget, as it reads in budgets
_DIGITS = 4  # an interpolated ratio's decimals


def check_thresholds(delta: float, relative: float) -> None:
    """ConfigError, in one line, for a threshold out of range: δ must be ≥ 0 (and finite), ρ in (0, 1]."""
    if not np.isfinite(delta) or delta < 0:
        raise ConfigError(
            f"--iso-delta {delta}: the absolute threshold is points below the uncompressed score; pass 0 or more"
        )
    if not np.isfinite(relative) or not 0 < relative <= 1:
        raise ConfigError(
            f"--iso-relative {relative}: the relative threshold is a share of the uncompressed score; "
            "pass a number in (0, 1]"
        )


@dataclass(frozen=True)
class Threshold:
    name: str  # "absolute" or "relative"
    value: float  # δ or ρ

    def of(self, baseline):
        """The score a point must reach (works on floats and arrays alike)."""
        return baseline - self.value if self.name == "absolute" else self.value * baseline

    @property
    def text(self) -> str:
        return f"score ≥ baseline − {self.value:g}" if self.name == "absolute" else f"score ≥ {self.value:g} × baseline"


def thresholds(delta: float = DEFAULT_DELTA, relative: float = DEFAULT_RELATIVE) -> tuple[Threshold, Threshold]:
    check_thresholds(delta, relative)
    return Threshold("absolute", float(delta)), Threshold("relative", float(relative))


@dataclass(frozen=True)
class IsoCr:
    cr: float
    mark: str  # MEASURED, INTERPOLATED, AT_LEAST or BELOW

    @property
    def text(self) -> str:
        shown = f"{self.cr:.{_DIGITS - 1}f}".rstrip("0").rstrip(".") if self.mark == INTERPOLATED else f"{self.cr:g}"
        return {INTERPOLATED: "≈", AT_LEAST: "≥", BELOW: "<", AT_MOST: "≤", ABOVE: ">"}.get(self.mark, "") + shown


def iso_cr(ratios: Sequence[float], scores: Sequence[float], threshold: float) -> IsoCr:
    """The iso-quality cr of points (``ratios`` ascending, their ``scores``) against the score ``threshold``, as
    the module's docstring defines it."""
    if not ratios or len(ratios) != len(scores) or list(ratios) != sorted(ratios):
        raise ValueError("iso_cr needs one score per ratio, ratios ascending")
    failing = [i for i, score in enumerate(scores) if not score >= threshold]
    if not failing:
        return IsoCr(float(ratios[-1]), AT_LEAST)
    k = failing[0]
    if k == 0:
        return IsoCr(float(ratios[0]), BELOW)
    (c0, s0), (c1, s1) = (ratios[k - 1], scores[k - 1]), (ratios[k], scores[k])
    if s0 == threshold:
        return IsoCr(float(c0), MEASURED)
    return IsoCr(round(c0 + (c1 - c0) * (s0 - threshold) / (s0 - s1), _DIGITS), INTERPOLATED)


def _draw_iso_crs(ratios: np.ndarray, scores: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, ...]:
    """Vectorised :func:`iso_cr` over draws: ``scores`` is draws x points, ``thresholds`` one per draw. Returns each
    draw's cr and whether it was a ``≥`` or a ``<`` draw."""
    passes = scores >= thresholds[:, None]
    all_pass = passes.all(axis=1)
    k = np.where(all_pass, 0, np.argmin(passes, axis=1))  # first failing point
    below = ~all_pass & (k == 0)
    inside = ~all_pass & (k > 0)
    values = np.where(all_pass, ratios[-1], ratios[0]).astype(float)
    rows = np.nonzero(inside)[0]
    if len(rows):
        k1 = k[rows]
        c0, c1 = ratios[k1 - 1], ratios[k1]
        s0, s1 = scores[rows, k1 - 1], scores[rows, k1]
        values[rows] = c0 + (c1 - c0) * (s0 - thresholds[rows]) / (s0 - s1)
    return values, all_pass, below


@dataclass(frozen=True)
class IsoInterval:
    low: float
    high: float
    low_mark: str  # "" or BELOW: the bound is cr_1, reached by draws below every ratio; AT_LEAST: cr_m, by draws within
    high_mark: str  # the same for the high bound
    resamples: int
    contexts: int

    @property
    def text(self) -> str:
        def bound(value: float, mark: str) -> str:
            return mark + f"{value:.3f}".rstrip("0").rstrip(".")

        return f"[{bound(self.low, self.low_mark)}, {bound(self.high, self.high_mark)}]"


def _bound_mark(value: float, ratios: np.ndarray, below: bool, at_least: bool, prefer: str) -> str:
    """A bound's mark: BELOW where it is the smallest ratio and some draws fail there, AT_LEAST where it is the
    largest and some draws pass everywhere (``prefer`` decides for a series of one ratio, where both can hold)."""
    marks = {BELOW: below and value <= ratios[0], AT_LEAST: at_least and value >= ratios[-1]}
    order = [prefer, *(mark for mark in marks if mark != prefer)]
    return next((mark for mark in order if marks[mark]), "")


def iso_intervals(
    baseline_benchmark,
    baseline_rows: Sequence[dict],
    benchmarks: Sequence,
    row_sets: Sequence[Sequence[dict]],
    ratios: Sequence[float],
    chosen: Sequence[Threshold],
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> list[IsoInterval] | None:
    """The paired-bootstrap interval of the iso-quality cr for each threshold of ``chosen``, from the same draws:
    the runs (``row_sets`` at ``ratios`` ascending) and their baseline resampled together over the contexts all of
    them answered. None without a headline to resample; NoInterval when a task has a single shared context."""
    if resamples <= 0:
        return None
    paired = paired_resamples([baseline_benchmark, *benchmarks], [baseline_rows, *row_sets], resamples, seed)
    if paired is None:
        return None
    baseline, *points = paired.values
    scores, grid = np.column_stack(points), np.asarray(ratios, dtype=float)
    found = []
    for threshold in chosen:
        values, at_least, below = _draw_iso_crs(grid, scores, threshold.of(baseline))
        low, high = _percentiles(values, level, digits=None)
        low, high = round(low, _DIGITS), round(high, _DIGITS)
        found.append(
            IsoInterval(
                low,
                high,
                low_mark=_bound_mark(low, grid, bool(below.any()), bool(at_least.any()), prefer=BELOW),
                high_mark=_bound_mark(high, grid, bool(below.any()), bool(at_least.any()), prefer=AT_LEAST),
                resamples=len(baseline),
                contexts=paired.contexts,
            )
        )
    return found


def budget_axis(budgets: Sequence[float]) -> list[float]:
    """The axis a budget series is measured on: ``x = −budget``, ascending where ``budgets`` descend (from the least
    to the most compression, as ratios ascend)."""
    return [-float(budget) for budget in budgets]


def on_budgets(found: IsoCr) -> IsoCr:
    """An iso-quality figure measured on :func:`budget_axis`, as a budget: ≥ reads ≤, < reads >."""
    return IsoCr(-found.cr + 0.0, _ON_BUDGETS.get(found.mark, found.mark))  # + 0.0: never −0


def budget_interval(interval: IsoInterval) -> IsoInterval:
    """An interval measured on :func:`budget_axis`, in budgets: the bounds swap, with their marks."""
    return replace(
        interval,
        low=-interval.high + 0.0,
        high=-interval.low + 0.0,
        low_mark=_ON_BUDGETS.get(interval.high_mark, interval.high_mark),
        high_mark=_ON_BUDGETS.get(interval.low_mark, interval.low_mark),
    )


def iso_budget(budgets: Sequence[float], scores: Sequence[float], threshold: float) -> IsoCr:
    """The smallest budget (``budgets`` descending, their ``scores``) whose score stays within ``threshold``: the
    module's definition on :func:`budget_axis`."""
    if list(budgets) != sorted(budgets, reverse=True):
        raise ValueError("iso_budget needs the budgets descending (from the least to the most compression)")
    return on_budgets(iso_cr(budget_axis(budgets), scores, threshold))
