"""A report: every table of a set of finished runs, written as Markdown and CSV files and as one page."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from evaluate import rundir
from evaluate.report.answer_length import answer_length_table
from evaluate.report.bytes_at_iso_quality import bytes_table
from evaluate.report.capacity import DEFAULT_MEMORY_GB, capacity_table, check_memory
from evaluate.report.compare import compare_tables, load_references
from evaluate.report.decoding import decoding_table
from evaluate.report.diagnostics import diagnostics_table
from evaluate.report.differences import Effect, diff_table, effect_table, load_effects
from evaluate.report.frame import runs_frame, split_by_axis
from evaluate.report.iso_quality import BUDGET as ISO_BUDGET
from evaluate.report.iso_quality import iso_table
from evaluate.report.runs import RunResult, compute_intervals
from evaluate.report.tables import (
    BUDGET,
    Table,
    cost_table,
    headline_table,
    likelihood_tables,
    runs_table,
    task_table,
)
from evaluate.report.turns import turn_table
from evaluate.score.iso_quality import DEFAULT_DELTA, DEFAULT_RELATIVE, Threshold, thresholds


@dataclass
class Report:
    runs: list[RunResult]
    frame: pd.DataFrame  # the runs, a row per run x task
    skipped: list[tuple[Path, str]]
    headline: list[Table]
    tasks: list[Table]
    differences: list[Table]
    comparisons: list[Table]
    likelihood: list[Table]  # the likelihood table and its per-task table, where runs have the fields
    unmatched_references: int = 0
    iso: list[Table] = field(default_factory=list)  # the iso-quality tables by cr and by budget, where runs have each
    iso_series: pd.DataFrame | None = None  # the series by cr with their figures, for the plots
    capacity: list[Table] = field(default_factory=list)  # the serving-capacity table, where runs recorded KV bytes
    budgets: list[Table] = field(default_factory=list)  # the headline by token budget, where runs have one
    iso_budget_series: pd.DataFrame | None = None  # the series by token budget with their figures, for the plots
    answer_length: list[Table] = field(default_factory=list)  # per benchmark, where runs recorded answer token ids
    turns: list[Table] = field(default_factory=list)  # per benchmark, where runs have a score by turn
    decoding: list[Table] = field(default_factory=list)  # per benchmark, where it has decoding-time runs
    diagnostics: list[Table] = field(default_factory=list)  # per benchmark, where runs have answer retention

    def tables(self) -> list[Table]:
        tables = [*self.headline, *self.budgets, *self.decoding, *self.tasks, *self.differences, *self.iso]
        tables += self.capacity
        tables += self.comparisons
        tables += [*self.likelihood, *self.diagnostics, *self.answer_length, *self.turns]
        return [*tables, cost_table(self.frame), runs_table(self.frame)]

    def page(self, runs_dir: Path, resamples: int) -> str:
        """All tables as one Markdown page; per-task tables are linked rather than inlined."""
        interval = f" [bootstrap 95% interval, {resamples} resamples of contexts within each task]" if resamples else ""
        cells = f"Cells: headline score{interval} n=samples; \\* partial (fewer samples than the full benchmark)."
        paragraphs = ["# PressBench results", f"{len(self.runs)} finished runs from `{runs_dir}`.", cells]
        for table in self.headline:
            paragraphs += [table.page(), f"Per task: [{table.name}_tasks.md]({table.name}_tasks.md)"]
        paragraphs += [table.page() for table in [*self.budgets, *self.decoding]]
        paragraphs += [table.page() for table in [*self.differences, *self.iso, *self.capacity, *self.comparisons]]
        for table in self.likelihood[:1]:
            paragraphs += [table.page(), "Per task: [likelihood_tasks.md](likelihood_tasks.md)"]
        paragraphs += [table.page() for table in [*self.diagnostics, *self.answer_length, *self.turns]]
        if self.unmatched_references:
            paragraphs.append(f"{self.unmatched_references} published figures have no matching run.")
        if self.skipped:
            paragraphs += ["### Skipped", "\n".join(f"- `{path}`: {reason}" for path, reason in self.skipped)]
        return "\n\n".join(paragraphs) + "\n"


def build_report(
    runs: list[RunResult],
    skipped: list[tuple[Path, str]],
    resamples: int = 1000,
    seed: int = 0,
    diffs: Sequence[tuple[str, str]] = (),
    reference_dir: Path | None = None,
    effects: Sequence[Effect] | None = None,
    iso_delta: float = DEFAULT_DELTA,
    iso_relative: float = DEFAULT_RELATIVE,
    serving_memory_gb: float = DEFAULT_MEMORY_GB,
) -> Report:
    """Every table of ``runs``; ``effects`` defaults to conf/report.yaml's; ``iso_delta`` and ``iso_relative`` are
    the iso-quality table's thresholds (evaluate/score/iso_quality.py; ConfigError when out of range);
    ``serving_memory_gb`` the memory of the serving-capacity table (evaluate/report/capacity.py; ConfigError unless
    above 0 and finite)."""
    chosen = thresholds(iso_delta, iso_relative)
    check_memory(serving_memory_gb)
    compute_intervals(runs, resamples, seed)
    frame = runs_frame(runs)
    # The tables by cr read the runs at a ratio; token-budget runs (budget=N) get their own headline table, and
    # decoding-time runs (which ignore cr) their own table by what they kept.
    by_ratio, by_budget, by_decoding = split_by_axis(frame)
    at_ratio = [run for run in runs if run.budget is None and run.decoding is None]
    differences = _difference_tables(at_ratio, effects, diffs, resamples, seed)
    comparisons, unmatched = (
        compare_tables(at_ratio, load_references(reference_dir), resamples, seed) if reference_dir else ([], 0)
    )
    headline, tasks, budgets = _headline_tables(by_ratio, by_budget)
    # The rest of Report's fields come from helpers by name, so that none of them lands in another's place.
    return Report(
        runs,
        frame,
        skipped,
        headline,
        tasks,
        differences,
        comparisons=comparisons,
        unmatched_references=unmatched,
        budgets=budgets,
        **_iso_fields(runs, by_ratio, by_budget, chosen, resamples, seed),
        **_per_run_fields(runs, frame, by_decoding, serving_memory_gb),
    )


def _difference_tables(
    at_ratio: list[RunResult],
    effects: Sequence[Effect] | None,
    diffs: Sequence[tuple[str, str]],
    resamples: int,
    seed: int,
) -> list[Table]:
    """The effect tables (conf/report.yaml's where ``effects`` is None) that have a pair of runs, then a table per
    ``--diff`` pair; ReportError for a pair without runs."""
    effects = load_effects() if effects is None else effects
    differences = [table for effect in effects if (table := effect_table(at_ratio, effect, resamples, seed))]
    differences += [diff_table(at_ratio, a, b, resamples, seed) for a, b in diffs]
    return differences


def _headline_tables(by_ratio: pd.DataFrame, by_budget: pd.DataFrame) -> tuple[list[Table], list[Table], list[Table]]:
    """Per benchmark, by name: the headline table by cr, its per-task table, and the headline by token budget."""
    benchmarks = sorted(by_ratio.benchmark.unique())
    headline = [headline_table(by_ratio, benchmark) for benchmark in benchmarks]
    tasks = [task_table(by_ratio, benchmark) for benchmark in benchmarks]
    budgets = [headline_table(by_budget, benchmark, BUDGET) for benchmark in sorted(by_budget.benchmark.unique())]
    return headline, tasks, budgets


def _iso_fields(
    runs: list[RunResult],
    by_ratio: pd.DataFrame,
    by_budget: pd.DataFrame,
    chosen: Sequence[Threshold],
    resamples: int,
    seed: int,
) -> dict[str, Any]:
    """:class:`Report`'s iso-quality fields: the tables by cr, by token budget and in bytes that have runs, and the
    series by cr and by budget."""
    iso, series = iso_table(runs, by_ratio, chosen, resamples, seed)
    iso_budget, budget_series = iso_table(runs, by_budget, chosen, resamples, seed, ISO_BUDGET)
    # Where runs held a quantized cache: eviction and quantization against bytes (cache=quantized).
    in_bytes = bytes_table(runs, by_ratio, chosen[0].value, resamples, seed)
    return {
        "iso": [table for table in (iso, iso_budget, in_bytes) if table],
        "iso_series": series,
        "iso_budget_series": budget_series,
    }


def _per_run_fields(
    runs: list[RunResult], frame: pd.DataFrame, by_decoding: pd.DataFrame, serving_memory_gb: float
) -> dict[str, Any]:
    """:class:`Report`'s tables with a row per run: decoding-time runs, likelihood, diagnostics, serving capacity,
    answer length and score by turn, each where some run has what it shows."""
    decoding = [decoding_table(by_decoding, benchmark) for benchmark in sorted(by_decoding.benchmark.unique())]
    # A row per run, each saying what it keeps: cr, budget or target size.
    likelihood = likelihood_tables(frame)
    capacity = capacity_table(runs, frame, serving_memory_gb)
    names = sorted(frame.benchmark.unique())
    lengths = [table for benchmark in names if (table := answer_length_table(frame, benchmark))]
    # By turn: the runs at a ratio and the token-budget runs in one table, each row saying what it keeps.
    turns = [table for benchmark in names if (table := turn_table(frame, benchmark))]
    diagnostics = [table for benchmark in names if (table := diagnostics_table(frame, benchmark))]
    return {
        "diagnostics": diagnostics,
        "decoding": decoding,
        "likelihood": likelihood,
        "capacity": [capacity] if capacity else [],
        "answer_length": lengths,
        "turns": turns,
    }


def write_report(report: Report, out: Path, runs_dir: Path, resamples: int) -> list[Path]:
    """Every table as Markdown (where it has any) and CSV, then the whole page; returns the files written."""
    files = []
    for table in report.tables():
        files += [(out / f"{table.name}.md", table.page() + "\n")] if table.markdown else []
        files.append((out / f"{table.name}.csv", table.csv))
    for path, text in [*files, (out / "report.md", report.page(runs_dir, resamples))]:
        rundir.write_atomic(path, text)
    return [path for path, _ in files] + [out / "report.md"]
