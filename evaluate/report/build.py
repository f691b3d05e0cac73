"""A report: every table of a set of finished runs, written as Markdown and CSV files and as one page."""

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from evaluate import rundir
from evaluate.report.answer_length import answer_length_table
from evaluate.report.capacity import DEFAULT_MEMORY_GB, capacity_table, check_memory
from evaluate.report.compare import compare_tables, load_references
from evaluate.report.differences import Effect, diff_table, effect_table, load_effects
from evaluate.report.frame import runs_frame
from evaluate.report.iso_quality import iso_table
from evaluate.report.runs import RunResult, compute_intervals
from evaluate.report.tables import Table, cost_table, headline_table, likelihood_tables, runs_table, task_table
from evaluate.score.iso_quality import DEFAULT_DELTA, DEFAULT_RELATIVE, thresholds


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
    iso: list[Table] = field(default_factory=list)  # the iso-quality table, where there are compressed runs
    iso_series: pd.DataFrame | None = None  # its series with their figures, for the plots
    capacity: list[Table] = field(default_factory=list)  # the serving-capacity table, where runs recorded KV bytes
    answer_length: list[Table] = field(default_factory=list)  # per benchmark, where runs recorded answer token ids

    def tables(self) -> list[Table]:
        tables = [*self.headline, *self.tasks, *self.differences, *self.iso, *self.capacity, *self.comparisons]
        tables += [*self.likelihood, *self.answer_length]
        return [*tables, cost_table(self.frame), runs_table(self.frame)]

    def page(self, runs_dir: Path, resamples: int) -> str:
        """All tables as one Markdown page; per-task tables are linked rather than inlined."""
        interval = f" [bootstrap 95% interval, {resamples} resamples of contexts within each task]" if resamples else ""
        cells = f"Cells: headline score{interval} n=samples; \\* partial (fewer samples than the full benchmark)."
        paragraphs = ["# PressBench results", f"{len(self.runs)} finished runs from `{runs_dir}`.", cells]
        for table in self.headline:
            paragraphs += [table.page(), f"Per task: [{table.name}_tasks.md]({table.name}_tasks.md)"]
        paragraphs += [table.page() for table in [*self.differences, *self.iso, *self.capacity, *self.comparisons]]
        for table in self.likelihood[:1]:
            paragraphs += [table.page(), "Per task: [likelihood_tasks.md](likelihood_tasks.md)"]
        paragraphs += [table.page() for table in self.answer_length]
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
    effects = load_effects() if effects is None else effects
    differences = [table for effect in effects if (table := effect_table(runs, effect, resamples, seed))]
    differences += [diff_table(runs, a, b, resamples, seed) for a, b in diffs]
    compared = compare_tables(runs, load_references(reference_dir), resamples, seed) if reference_dir else ([], 0)
    benchmarks = sorted(frame.benchmark.unique())
    headline = [headline_table(frame, benchmark) for benchmark in benchmarks]
    tasks = [task_table(frame, benchmark) for benchmark in benchmarks]
    comparisons, unmatched = compared
    iso, series = iso_table(runs, frame, chosen, resamples, seed)
    likelihood = likelihood_tables(frame)
    capacity = capacity_table(runs, frame, serving_memory_gb)
    lengths = [table for benchmark in benchmarks if (table := answer_length_table(frame, benchmark))]
    return Report(
        runs,
        frame,
        skipped,
        headline,
        tasks,
        differences,
        comparisons,
        likelihood,
        unmatched,
        [iso] if iso else [],
        series,
        [capacity] if capacity else [],
        lengths,
    )


def write_report(report: Report, out: Path, runs_dir: Path, resamples: int) -> list[Path]:
    """Every table as Markdown (where it has any) and CSV, then the whole page; returns the files written."""
    files = []
    for table in report.tables():
        files += [(out / f"{table.name}.md", table.page() + "\n")] if table.markdown else []
        files.append((out / f"{table.name}.csv", table.csv))
    for path, text in [*files, (out / "report.md", report.page(runs_dir, resamples))]:
        rundir.write_atomic(path, text)
    return [path for path, _ in files] + [out / "report.md"]
