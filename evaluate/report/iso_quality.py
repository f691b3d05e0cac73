"""The iso-quality tables: for each method series of the report (its runs at several ratios that share one
uncompressed baseline), the largest cr whose score stays within the absolute and the relative threshold of the
baseline's, with a paired-bootstrap interval (the definition: evaluate/score/iso_quality.py); and, for its token-budget
runs (``budget=N``), the smallest budget, in a table of its own (``iso_quality_budget``)."""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from evaluate.report.frame import labelled, run_level
from evaluate.report.runs import NO_PRESS, RunResult
from evaluate.report.tables import Table, fmt_number, row_method
from evaluate.score.bootstrap import NoInterval
from evaluate.score.iso_quality import (
    IsoCr,
    IsoInterval,
    Threshold,
    budget_axis,
    budget_interval,
    iso_cr,
    iso_intervals,
    on_budgets,
)

logger = logging.getLogger(__name__)

NAME = "iso_quality"
_KEYS = ["benchmark", "model", "query_aware", "method", "variant", "label"]
NO_BASELINE = "no uncompressed run to compare with"


@dataclass(frozen=True)
class IsoAxis:
    """What a series is measured along: the compression ratio, or the token budget, whose series run from the
    largest budget down (the least compression first) and are measured on the axis −budget
    (evaluate/score/iso_quality.py, "Budgets")."""

    column: str  # the runs frame's column
    name: str  # the table's name
    word: str  # what the table calls a point: cr, budget
    csv: str  # the stem of the CSV's columns: iso_cr_absolute, iso_budget_absolute
    title: str
    cells: str  # what a cell holds
    marks: str  # how its marks read

    @property
    def budgets(self) -> bool:
        return self.column == "budget"

    def measured_on(self, values: Sequence[float]) -> list[float]:
        return budget_axis(values) if self.budgets else list(values)

    def figure(self, found: IsoCr) -> IsoCr:
        return on_budgets(found) if self.budgets else found

    def interval(self, found: IsoInterval) -> IsoInterval:
        return budget_interval(found) if self.budgets else found


RATIO = IsoAxis(
    "cr",
    NAME,
    "cr",
    "iso_cr",
    "Compression at iso-quality: the largest cr whose score stays ",
    "the largest cr up to which every measured score stays within the threshold",
    "≈ interpolated linearly between the last cr that passes and the first that fails; ≥ every measured cr passes "
    "(the largest shown); < the smallest measured cr already fails.",
)
BUDGET = IsoAxis(
    "budget",
    f"{NAME}_budget",
    "budget",
    "iso_budget",
    "Compression at iso-quality: the smallest token budget whose score stays ",
    "the smallest budget (KV pairs kept of each context) down to which every measured score stays within the "
    "threshold, from the largest budget down",
    "≈ interpolated linearly in the budget between the last budget that passes and the first that fails; ≤ every "
    "measured budget passes (the smallest shown); > the largest measured budget already fails.",
)


def iso_series(runs: Sequence[RunResult], frame: pd.DataFrame, axis: IsoAxis = RATIO) -> pd.DataFrame:
    """The compressed, scored runs of ``frame`` along ``axis`` as series: one row per method (with its variant,
    model, query-awareness and benchmark) and baseline, with ``runs`` (positions, by cr ascending or budget
    descending: from the least compression), ``ratios`` (their crs or budgets), ``scores``, ``baseline`` (the
    baseline run's position, NA for none) and ``baseline_score``."""
    level = run_level(frame)
    compressed = labelled(level[~level.reference & level.score.notna() & level[axis.column].notna()])
    compressed = compressed.sort_values(axis.column, ascending=not axis.budgets, kind="stable")
    if compressed.empty:
        return pd.DataFrame(columns=[*_KEYS, "row", "baseline", "baseline_score", "runs", "ratios", "scores"])
    compressed = compressed.assign(row=row_method(compressed), baseline_key=compressed.baseline.fillna(-1))
    found = []
    for keys, members in compressed.groupby([*_KEYS, "row", "baseline_key"], sort=True):
        baseline = members.baseline.iloc[0]
        score = runs[int(baseline)].score if pd.notna(baseline) else None
        found.append(
            {
                **dict(zip([*_KEYS, "row"], keys[:-1], strict=True)),
                "baseline": baseline,
                "baseline_score": score,
                "runs": members.run.tolist(),
                "ratios": members[axis.column].tolist(),
                "scores": members.score.tolist(),
            }
        )
    return pd.DataFrame(found)


def _measure(
    series: dict, runs: Sequence[RunResult], chosen: Sequence[Threshold], resamples: int, seed: int, axis: IsoAxis
) -> dict:
    """A series' iso-quality cr (or budget) per threshold, its interval, and the note when there is none."""
    out: dict = {"note": ""}
    if pd.isna(series["baseline"]) or series["baseline_score"] is None:
        out["note"] = NO_BASELINE if pd.isna(series["baseline"]) else "its uncompressed run has no score"
        return out
    measured_on = axis.measured_on(series["ratios"])
    for threshold in chosen:
        out[threshold.name] = axis.figure(iso_cr(measured_on, series["scores"], threshold.of(series["baseline_score"])))
    try:
        baseline = runs[int(series["baseline"])]
        members = [runs[position] for position in series["runs"]]
        intervals = iso_intervals(
            baseline.benchmark_object,
            baseline.rows,
            [run.benchmark_object for run in members],
            [run.rows for run in members],
            measured_on,
            chosen,
            resamples,
            seed,
        )
    except NoInterval as reason:
        out["note"] = str(reason)
        intervals = None
    except Exception as error:  # a benchmark that cannot score the resampled rows: the figure stays, alone
        logger.warning("no iso-quality interval for %s: %s", series["label"], error)
        intervals = None
    for threshold, interval in zip(chosen, intervals or [None] * len(chosen), strict=True):
        out[f"{threshold.name}_interval"] = None if interval is None else axis.interval(interval)
    return out


def iso_table(
    runs: Sequence[RunResult],
    frame: pd.DataFrame,
    chosen: Sequence[Threshold],
    resamples: int,
    seed: int = 0,
    axis: IsoAxis = RATIO,
) -> tuple[Table | None, pd.DataFrame]:
    """The ``iso_quality`` table along ``axis`` (``iso_quality_budget`` for :data:`BUDGET`; None without a
    compressed, scored run) and its series with their figures (``absolute``, ``relative``:
    :class:`~evaluate.score.iso_quality.IsoCr` or None; a budget where ``axis`` is :data:`BUDGET`), for the plots."""
    series = iso_series(runs, frame, axis)
    if series.empty:
        return None, series
    measured = pd.DataFrame(
        [_measure(row, runs, chosen, resamples, seed, axis) for row in series.to_dict("records")], index=series.index
    )
    series = pd.concat([series, measured.reindex(columns=_measured_columns(chosen))], axis=1)
    series = series.sort_values(["benchmark", "model", "query_aware", "method", "variant"], kind="stable")
    series = series.reset_index(drop=True)
    models = {"model": series.model} if series.model.nunique() > 1 else {}
    shown = pd.DataFrame({"benchmark": series.benchmark, **models, "method": series.label})
    shown["no compression"] = series.baseline_score.map(fmt_number)
    shown[f"{axis.word} measured"] = series.ratios.map(lambda ratios: ", ".join(f"{cr:g}" for cr in ratios))
    data = series[["benchmark", "model", "row", "query_aware"]].rename(columns={"row": "method"})
    data["baseline_score"] = series.baseline_score.astype(float)
    points = "budgets" if axis.budgets else "compression_ratios"
    data[points] = series.ratios.map(lambda ratios: " ".join(f"{cr:g}" for cr in ratios))
    for threshold in chosen:
        heading = threshold.text.removeprefix("score ")
        shown[heading] = [_cell(row, threshold) for row in series.to_dict("records")]
        data[f"threshold_{threshold.name}"] = threshold.value
        found, intervals = series[threshold.name], series[f"{threshold.name}_interval"]
        data[f"{axis.csv}_{threshold.name}"] = found.map(lambda value: None if _none(value) else value.cr).astype(float)
        data[f"iso_mark_{threshold.name}"] = found.map(lambda value: "" if _none(value) else value.mark)
        data[f"iso_low_{threshold.name}"] = intervals.map(lambda i: None if _none(i) else i.low).astype(float)
        data[f"iso_high_{threshold.name}"] = intervals.map(lambda i: None if _none(i) else i.high).astype(float)
        data[f"iso_interval_{threshold.name}"] = intervals.map(lambda i: "" if _none(i) else i.text)
    data["note"] = series.note
    series.attrs["thresholds"] = {threshold.name: threshold.value for threshold in chosen}
    series.attrs["axis"] = axis.column
    notes = _notes(series, chosen, resamples, axis)
    return Table(axis.name, axis.title + _thresholds(chosen), data, [("", shown)], notes), series


def _measured_columns(chosen: Sequence[Threshold]) -> list[str]:
    return ["note", *(name for t in chosen for name in (t.name, f"{t.name}_interval"))]


def _none(value) -> bool:
    return value is None or (isinstance(value, float) and pd.isna(value))


def _cell(row: dict, threshold: Threshold) -> str:
    found, interval = row[threshold.name], row[f"{threshold.name}_interval"]
    if _none(found):
        return "-"
    return found.text + ("" if _none(interval) else f" {interval.text}")


def _thresholds(chosen: Sequence[Threshold]) -> str:
    return " / ".join(t.text.removeprefix("score ") for t in chosen)


def _notes(series: pd.DataFrame, chosen: Sequence[Threshold], resamples: int, axis: IsoAxis) -> list[str]:
    interval = (
        f" [paired bootstrap 95% interval: {resamples} draws of the contexts, each scoring every point and the "
        "baseline]"
        if series[[f"{t.name}_interval" for t in chosen]].map(lambda i: not _none(i)).any().any()
        else ""
    )
    notes = [
        f"Cells: {axis.cells} ({'; '.join(t.text for t in chosen)}){interval}. {axis.marks} Definition: "
        "docs/results.md#compression-at-iso-quality."
    ]
    missing = series[series.note == NO_BASELINE]
    if not missing.empty:
        listed = ", ".join(dict.fromkeys(missing.benchmark + " " + missing.label))
        notes.append(
            f"{NO_BASELINE[0].upper()}{NO_BASELINE[1:]} for {listed}: no `{NO_PRESS}` run here has the same data, "
            "samples and settings but the press; run `press=none` with their settings for one."
        )
    others = series.note[(series.note != "") & (series.note != NO_BASELINE)].value_counts().sort_index()
    notes += [f"{note[0].upper()}{note[1:]} ({count} series)." for note, count in others.items()]
    return notes
