"""Tables from finished runs: ``python -m evaluate.report [RUNS_DIR]``.

Writes CSV and Markdown under ``results/tables/`` and plots under ``results/plots/``:

- ``{benchmark}.md|csv``: headline table in the EG-ChunkKV PR's layout (benchmark x method rows, ``cr=`` columns,
  a ``no compression`` row from the ``no_press`` runs); every cell carries its bootstrap 95% interval and its
  sample count, and a ``*`` when the run covers fewer samples than the full benchmark;
- ``{benchmark}_tasks.md|csv``: task x method at each compression ratio;
- ``gate_effect.md|csv``: ``eg_chunkkv_{scorer}`` minus ``chunkkv_{scorer}`` per scorer and ratio, with a paired
  bootstrap interval; ``--diff A B`` does the same for any two methods;
- ``compare.md|csv`` (``--compare``): measured against ``results/reference/*.csv``;
- ``runs.csv``: one row per run with everything above in columns; ``report.md``: all tables in one page.
"""

import argparse
import csv
import io
import json
import logging
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from evaluate import rundir
from evaluate.bootstrap import Interval, NoInterval, PairedInterval, difference_interval, headline_interval
from evaluate.config import NON_RESULT_KEYS

logger = logging.getLogger(__name__)

DEFAULT_RUNS = Path("results/runs")
DEFAULT_TABLES = Path("results/tables")
DEFAULT_PLOTS = Path("results/plots")
DEFAULT_REFERENCE = Path("results/reference")

FINISHED = ("complete", "complete_with_errors")
NO_PRESS = "no_press"
NO_COMPRESSION = "no compression"

# The full task lists that a run is checked against (shared/reference/*/README.md). ruler_synth is measured
# against the whole of RULER, since that is what its headline stands in for.
RULER_TASKS = tuple(
    "niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue "
    "niah_multiquery vt cwe fwe qa_1 qa_2".split()
)
LONGBENCH_TASKS = tuple(
    "narrativeqa qasper multifieldqa_en hotpotqa 2wikimqa musique gov_report qmsum multi_news trec triviaqa samsum "
    "passage_count passage_retrieval_en lcc repobench-p".split()
)
LOOGLE_TASKS = ("shortdep_qa", "longdep_qa", "longdep_summarization", "shortdep_cloze")
FULL_TASKS = {"ruler": RULER_TASKS, "ruler_synth": RULER_TASKS, "longbench": LONGBENCH_TASKS, "loogle": LOOGLE_TASKS}
HUB_DATASETS = {"ruler": "simonjegou/ruler", "longbench": "Xnhyacinth/LongBench", "loogle": "simonjegou/loogle"}

# Config keys that never distinguish two results (the fingerprint leaves them out too), and the ratio itself.
_NOT_A_VARIANT = {*NON_RESULT_KEYS, "cr", "wandb"}


class ReportError(RuntimeError):
    """Nothing to report, or an input the report cannot read; the message says which."""


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        flat = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: data}


@dataclass
class RunResult:
    """One finished run directory, read back."""

    path: Path
    record: dict  # config.yaml
    metrics: dict  # metrics.json
    run: dict  # run.json
    variant: str = ""  # set when several runs would otherwise share a table cell
    interval: Interval | None = None
    interval_note: str = ""  # why a run has no interval

    @property
    def config(self) -> dict:
        return self.record.get("config", {})

    @property
    def benchmark(self) -> str:
        return self.metrics.get("benchmark") or self.config.get("benchmark", {}).get("name", "?")

    @property
    def benchmark_config(self) -> dict:
        return self.config.get("benchmark", {})

    @property
    def model(self) -> str:
        return str(self.config.get("model", {}).get("name", "?"))

    @property
    def model_id(self) -> str:
        """The hub id or local path for hub models, otherwise the model's name."""
        source = self.config.get("model", {}).get("source", {})
        return str(source.get("name_or_path") or self.model)

    @property
    def method(self) -> str:
        return str(self.record.get("method") or self.config.get("press", {}).get("method", "?"))

    @property
    def compression_ratio(self) -> float:
        return float(self.record.get("compression_ratio", 0.0))

    @property
    def query_aware(self) -> bool:
        return bool(self.config.get("query_aware", False))

    @property
    def is_reference(self) -> bool:
        return self.method == NO_PRESS

    @property
    def score(self) -> float | None:
        value = self.metrics.get("score")
        return None if value is None else float(value)

    @property
    def tasks(self) -> dict[str, dict]:
        return self.metrics.get("tasks", {})

    @property
    def samples(self) -> int:
        return sum(int(task.get("n", 0)) for task in self.tasks.values())

    @property
    def label(self) -> str:
        """Row label: method, then the settings that tell it apart from runs of the same method."""
        name = NO_COMPRESSION if self.is_reference else self.method
        if self.variant:
            name += f" [{self.variant}]"
        if self.query_aware:
            name += " (query-aware)"
        return name

    @cached_property
    def partial_reasons(self) -> list[str]:
        return partial_reasons(self)

    @property
    def partial(self) -> bool:
        return bool(self.partial_reasons)

    @property
    def kept_ratio(self) -> float | None:
        rows = self.rows
        values = [row["kept_ratio"] for row in rows if row.get("kept_ratio") is not None]
        return sum(values) / len(values) if values else None

    @cached_property
    def rows(self) -> list[dict]:
        return rundir.read_predictions(self.path / rundir.PREDICTIONS)

    @cached_property
    def benchmark_object(self):
        """The benchmark exactly as the run recorded it, for rescoring resampled rows."""
        from hydra.utils import instantiate

        return instantiate(self.benchmark_config)


def partial_reasons(run: RunResult) -> list[str]:
    """Why a run covers less than the full benchmark; empty when it covers all of it."""
    reasons = []
    benchmark = run.benchmark_config
    counts = {task: int(values.get("n", 0)) for task, values in run.tasks.items()}
    limit = run.config.get("limit")
    num_samples = benchmark.get("num_samples")
    if num_samples is not None and counts and min(counts.values()) < int(num_samples):
        reasons.append(f"{min(counts.values())} of {num_samples} samples per task")
    elif limit is not None and counts and max(counts.values()) >= int(limit):
        reasons.append(f"limit={limit} samples per task")
    for fraction in (run.config.get("fraction"), benchmark.get("fraction")):
        if fraction is not None and float(fraction) < 1:
            reasons.append(f"fraction={fraction}")
    full = FULL_TASKS.get(run.benchmark)
    if full is not None:
        missing = [task for task in full if task not in counts]
        if missing:
            shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
            reasons.append(f"{len(full) - len(missing)} of {len(full)} tasks (missing {shown})")
    hub = HUB_DATASETS.get(run.benchmark)
    if hub is not None:
        if benchmark.get("path"):
            reasons.append(f"local data benchmark.path={benchmark['path']}, not the hub dataset {hub}")
        elif benchmark.get("dataset", hub) != hub:
            reasons.append(f"dataset {benchmark['dataset']}, not the hub dataset {hub}")
    errors = int(run.metrics.get("n_errors", 0) or 0)
    if errors:
        reasons.append(f"{errors} samples failed")
    return reasons


def load_run(path: Path) -> RunResult:
    record = rundir.read_yaml(path / rundir.CONFIG)
    metrics = rundir.read_json(path / rundir.METRICS)
    run = rundir.read_json(path / rundir.RUN) or {}
    if record is None:
        raise ReportError(f"{path} has no {rundir.CONFIG}")
    if metrics is None:
        raise ReportError(f"{path} has no {rundir.METRICS}; rescore it with python -m evaluate.score {path}")
    return RunResult(path=path, record=record, metrics=metrics, run=run)


def collect_runs(runs_dir: Path) -> tuple[list[RunResult], list[tuple[Path, str]]]:
    """Every finished run under ``runs_dir`` (searched recursively), and the directories skipped with why."""
    if not runs_dir.is_dir():
        raise ReportError(f"{runs_dir} is not a directory; pass the folder that holds the run directories")
    runs, skipped = [], []
    for run_file in sorted(runs_dir.rglob(rundir.RUN)):
        path = run_file.parent
        status = (rundir.read_json(run_file) or {}).get("status", "unknown")
        if status not in FINISHED:
            skipped.append((path, f"status {status}"))
            continue
        try:
            runs.append(load_run(path))
        except (ReportError, ValueError) as error:
            skipped.append((path, str(error)))
    runs, duplicates = _assign_variants(runs)
    return runs, skipped + duplicates


def _row_key(run: RunResult) -> tuple:
    return (run.benchmark, run.model, run.method, run.query_aware)


def _assign_variants(runs: list[RunResult]) -> tuple[list[RunResult], list[tuple[Path, str]]]:
    """Label runs of one method that differ in a setting (seed, window size, ...) so they never share a cell.

    The label lists the config keys whose values differ within the method's runs, ignoring the compression
    ratio. Runs that still collide (the same configuration found twice) keep the one with more samples.
    """
    groups: dict[tuple, list[RunResult]] = defaultdict(list)
    for run in runs:
        groups[_row_key(run)].append(run)
    for members in groups.values():
        flats = []
        for run in members:
            flat = _flatten(run.config)
            flats.append(
                {
                    key: value
                    for key, value in flat.items()
                    if key.split(".")[0] not in _NOT_A_VARIANT and key.split(".")[-1] != "compression_ratio"
                }
            )
        keys = sorted({key for flat in flats for key in flat})
        differing = [key for key in keys if len({json.dumps(flat.get(key), sort_keys=True) for flat in flats}) > 1]
        for run, flat in zip(members, flats, strict=True):
            run.variant = ", ".join(f"{key}={json.dumps(flat.get(key))}" for key in differing)
    kept: dict[tuple, RunResult] = {}
    duplicates = []
    for run in runs:
        key = (*_row_key(run), run.variant, round(run.compression_ratio, 6))
        other = kept.get(key)
        if other is None:
            kept[key] = run
            continue
        better, worse = sorted(
            (run, other), key=lambda r: (r.samples, r.run.get("updated_at", "")), reverse=True
        )  # more samples first, then the most recent
        kept[key] = better
        duplicates.append((worse.path, f"same configuration as {better.path}, which has more samples or is newer"))
    return list(kept.values()), duplicates


def compute_intervals(runs: Sequence[RunResult], resamples: int, seed: int = 0) -> None:
    """Attach a bootstrap 95% interval of the headline to every run (in place)."""
    if resamples <= 0:
        return
    for run in tqdm(runs, desc="bootstrap", unit="run", disable=len(runs) < 2, dynamic_ncols=True):
        try:
            run.interval = headline_interval(run.benchmark_object, run.rows, resamples=resamples, seed=seed)
        except NoInterval as reason:
            run.interval_note = str(reason)
        except Exception as error:  # a benchmark that cannot be rebuilt here still gets its table row
            run.interval_note = f"no interval: {error}"
            logger.warning("no bootstrap interval for %s: %s", run.path.name, error)


# ---------------------------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------------------------


def fmt_number(value: float | None, signed: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def fmt_cell(run: RunResult) -> str:
    """``score [low, high] n=N``, with ``*`` when the run is partial."""
    text = fmt_number(run.score)
    if run.interval is not None:
        text += f" [{fmt_number(run.interval.low)}, {fmt_number(run.interval.high)}]"
    text += f" n={run.samples}"
    return text + ("*" if run.partial else "")


def fmt_cr(cr: float) -> str:
    return f"cr={cr:.2f}" if round(cr, 2) == round(cr, 6) else f"cr={cr:g}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    def escape(cell: str) -> str:
        return str(cell).replace("|", "\\|")

    lines = ["| " + " | ".join(escape(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def csv_text(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """CSV of dict rows; ``columns`` gives the header when there may be no row."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns or rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: _csv_value(value) for key, value in row.items()} for row in rows)
    return buffer.getvalue()


def _interval_fields(interval: Interval | None) -> dict:
    return {"ci_low": interval.low if interval else None, "ci_high": interval.high if interval else None}


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return round(value, 4)
    return value


# ---------------------------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Table:
    """One table, as Markdown (for people) and CSV (for programs)."""

    name: str  # file stem under the tables directory
    title: str
    markdown: str
    csv: str
    notes: list[str] = field(default_factory=list)

    def page(self) -> str:
        parts = [f"### {self.title}", "", self.markdown]
        for note in self.notes:  # one paragraph each, so Markdown keeps them apart
            parts += ["", note]
        return "\n".join(parts)


def benchmarks_of(runs: Sequence[RunResult]) -> list[str]:
    return sorted({run.benchmark for run in runs})


def _compressed_ratios(runs: Sequence[RunResult]) -> list[float]:
    return sorted({round(run.compression_ratio, 6) for run in runs if not run.is_reference})


def _ordered_rows(runs: Sequence[RunResult]) -> list[tuple[tuple, list[RunResult]]]:
    """Runs grouped into table rows: no compression first, then methods by name, per model and query-awareness."""
    rows: dict[tuple, list[RunResult]] = defaultdict(list)
    for run in runs:
        rows[(run.model, run.query_aware, not run.is_reference, run.method, run.variant)].append(run)
    return sorted(rows.items())


def _settings_note(runs: Sequence[RunResult]) -> str:
    """The benchmark settings every run shares, so that a table says which data it was measured on."""
    flats = [_flatten(run.benchmark_config) for run in runs]
    shared = {
        key: value
        for key, value in flats[0].items()
        if key not in ("_target_", "name")
        and value is not None
        and not isinstance(value, list)
        and all(flat.get(key) == value for flat in flats[1:])
    }
    return "Settings: " + ", ".join(f"{key}={value}" for key, value in sorted(shared.items())) if shared else ""


def _partial_note(runs: Sequence[RunResult]) -> str:
    reasons: dict[str, int] = defaultdict(int)
    for run in runs:
        for reason in run.partial_reasons:
            reasons[reason] += 1
    if not reasons:
        return ""
    listed = "; ".join(f"{reason} ({count} of {len(runs)} runs)" for reason, count in sorted(reasons.items()))
    return f"\\* partial: fewer samples than the full benchmark: {listed}."


# Below this many contexts per task the percentile bootstrap sees too few distinct resamples to show the noise.
FEW_CONTEXTS = 10


def _interval_notes(items: Iterable) -> list[str]:
    """Why some cells have no interval, once per reason; and a warning when intervals rest on few contexts."""
    counts: dict[str, int] = defaultdict(int)
    fewest = None
    for item in items:
        if item.interval_note:
            counts[item.interval_note] += 1
        if item.interval is not None:
            fewest = item.interval.contexts if fewest is None else min(fewest, item.interval.contexts)
    notes = [f"{note[0].upper()}{note[1:]} ({count} cells)." for note, count in sorted(counts.items())]
    if fewest is not None and fewest < FEW_CONTEXTS:
        notes.append(
            f"Some intervals resample only {fewest} contexts per task: with fewer than {FEW_CONTEXTS} the bootstrap "
            "understates the noise; read them as a lower bound on the uncertainty."
        )
    return notes


def headline_table(benchmark: str, runs: Sequence[RunResult]) -> Table:
    """Rows benchmark x method (x model when several), columns cr; no compression repeated in every column."""
    runs = [run for run in runs if run.benchmark == benchmark]
    ratios = _compressed_ratios(runs) or [0.0]
    several_models = len({run.model for run in runs}) > 1
    header = ["benchmark", *(["model"] if several_models else []), "method", *(fmt_cr(cr) for cr in ratios)]
    md_rows, csv_rows = [], []
    for (model, query_aware, _, method, _), members in _ordered_rows(runs):
        by_cr = {round(run.compression_ratio, 6): run for run in members}
        cells = [members[0]] * len(ratios) if members[0].is_reference else [by_cr.get(cr) for cr in ratios]
        md_rows.append(
            [benchmark, *([model] if several_models else []), members[0].label]
            + [fmt_cell(run) if run else "" for run in cells]
        )
        line = {
            "benchmark": benchmark,
            "model": model,
            "method": members[0].label if members[0].variant else method,
            "query_aware": query_aware,
        }
        for cr, run in zip(ratios, cells, strict=True):
            name = fmt_cr(cr)
            interval = run.interval if run else None
            line[name] = run.score if run else None
            line[f"{name} ci_low"], line[f"{name} ci_high"] = _interval_fields(interval).values()
            line[f"{name} n"] = run.samples if run else None
            line[f"{name} partial"] = run.partial if run else None
        csv_rows.append(line)
    notes = [note for note in (_settings_note(runs), _partial_note(runs)) if note] + _interval_notes(runs)
    if not any(run.is_reference for run in runs):
        notes.append(f"No `{NO_PRESS}` run: run `press=none` for the no-compression row.")
    return Table(
        name=benchmark,
        title=f"{benchmark}: headline score by compression ratio",
        markdown=markdown_table(header, md_rows),
        csv=csv_text(csv_rows),
        notes=notes,
    )


def task_table(benchmark: str, runs: Sequence[RunResult]) -> Table:
    """Task x method at each compression ratio; the no-compression column is repeated in every section."""
    runs = [run for run in runs if run.benchmark == benchmark]
    tasks = sorted({task for run in runs for task in run.tasks})
    references = [run for run in runs if run.is_reference]
    several_models = len({run.model for run in runs}) > 1
    sections, csv_rows = [], []

    def column(run: RunResult) -> str:
        return f"{run.label} ({run.model})" if several_models else run.label

    def cell(run: RunResult, task: str) -> str:
        values = run.tasks.get(task)
        if values is None:
            return ""
        return f"{fmt_number(values.get('score'))} n={values.get('n', 0)}" + ("*" if run.partial else "")

    for cr in _compressed_ratios(runs) or [0.0]:
        compressed = sorted(
            (run for run in runs if not run.is_reference and round(run.compression_ratio, 6) == cr),
            key=lambda run: (run.model, run.query_aware, run.method, run.variant),
        )
        columns = references + compressed
        if not columns:
            continue
        body = [[task, *(cell(run, task) for run in columns)] for task in tasks]
        body.append(["**score**", *(fmt_number(run.score) for run in columns)])
        sections.append(f"#### {fmt_cr(cr)}\n\n" + markdown_table(["task", *(column(run) for run in columns)], body))
    for run in sorted(runs, key=lambda r: (r.compression_ratio, r.model, r.query_aware, r.method, r.variant)):
        for task, values in sorted(run.tasks.items()):
            csv_rows.append(
                {
                    "benchmark": benchmark,
                    "model": run.model,
                    "method": run.label if run.variant else run.method,
                    "query_aware": run.query_aware,
                    "compression_ratio": run.compression_ratio,
                    "task": task,
                    "score": values.get("score"),
                    "n": values.get("n", 0),
                    "partial": run.partial,
                }
            )
    return Table(
        name=f"{benchmark}_tasks",
        title=f"{benchmark}: per-task scores",
        markdown="\n\n".join(sections),
        csv=csv_text(csv_rows, "benchmark model method query_aware compression_ratio task score n partial".split()),
        notes=[note for note in (_partial_note(runs),) if note],
    )


@dataclass
class Difference:
    """headline(a) - headline(b) for two runs that differ only in their method."""

    a: RunResult
    b: RunResult
    interval: PairedInterval | None = None
    interval_note: str = ""

    @property
    def delta(self) -> float | None:
        if self.a.score is None or self.b.score is None:
            return None
        return round(self.a.score - self.b.score, 2)

    @property
    def partial(self) -> bool:
        return self.a.partial or self.b.partial

    def cell(self) -> str:
        text = fmt_number(self.delta, signed=True)
        interval = self.interval
        if interval is not None:
            text += f" [{fmt_number(interval.low, signed=True)}, {fmt_number(interval.high, signed=True)}]"
            text += f" n={interval.shared_samples}"
            if not interval.same_samples:
                text += "†"
        return text + ("*" if self.partial else "")


def differences(
    runs: Sequence[RunResult], method_a: str, method_b: str, resamples: int, seed: int = 0
) -> list[Difference]:
    """Every (a, b) pair of runs of the two methods on the same benchmark, model, query-awareness and ratio.

    ``no_press`` runs are recorded at cr 0, so a difference against ``no_press`` pairs each run of the other
    method with the no-compression run of its benchmark and model. When a method has several variants, a run
    pairs with the partner of the same variant label.
    """

    def key(run: RunResult) -> tuple:
        ratio = None if method_b == NO_PRESS else round(run.compression_ratio, 6)
        return (run.benchmark, run.model, run.query_aware, ratio)

    partners: dict[tuple, list[RunResult]] = defaultdict(list)
    for run in runs:
        if run.method == method_b:
            partners[key(run)].append(run)
    pairs = []
    for run in runs:
        if run.method != method_a or method_a == NO_PRESS:
            continue
        candidates = partners.get(key(run), [])
        if len(candidates) > 1:
            candidates = [partner for partner in candidates if partner.variant == run.variant]
        if len(candidates) == 1:
            pairs.append(Difference(run, candidates[0]))
        elif candidates:
            logger.warning(
                "%s: several %s runs could be its partner; left out of %s - %s",
                run.path.name,
                method_b,
                method_a,
                method_b,
            )
    for pair in tqdm(pairs, desc=f"{method_a} - {method_b}", unit="pair", disable=len(pairs) < 2, leave=False):
        if resamples > 0:
            try:
                pair.interval = difference_interval(
                    pair.a.benchmark_object, pair.a.rows, pair.b.benchmark_object, pair.b.rows, resamples, seed
                )
            except NoInterval as reason:
                pair.interval_note = str(reason)
            except Exception as error:
                logger.warning("no paired interval for %s - %s: %s", pair.a.path.name, pair.b.path.name, error)
    return sorted(pairs, key=lambda d: (d.a.benchmark, d.a.model, d.a.query_aware, d.a.variant, d.a.compression_ratio))


_DIFF_NOTES = [
    "Cells: a − b [paired bootstrap 95% interval] n=samples both runs answered. "
    "An interval that contains 0 means the difference is within the noise.",
]


def _difference_table(name: str, title: str, rows: list[tuple[str, Difference]], row_header: str) -> Table:
    """Rows keyed by ``row`` (scorer, or benchmark/model), columns cr."""
    ratios = sorted({round(d.a.compression_ratio, 6) for _, d in rows})
    grouped: dict[tuple, dict[float, Difference]] = defaultdict(dict)
    for row, d in rows:
        grouped[(d.a.benchmark, d.a.model, d.a.query_aware, row)][round(d.a.compression_ratio, 6)] = d
    several_models = len({d.a.model for _, d in rows}) > 1
    header = ["benchmark", *(["model"] if several_models else []), row_header, *(fmt_cr(cr) for cr in ratios)]
    body = []
    for (benchmark, model, query_aware, row), cells in sorted(grouped.items()):
        label = row + (" (query-aware)" if query_aware else "")
        body.append(
            [benchmark, *([model] if several_models else []), label]
            + [cells[cr].cell() if cr in cells else "" for cr in ratios]
        )
    csv_rows = [
        {
            "benchmark": d.a.benchmark,
            "model": d.a.model,
            "query_aware": d.a.query_aware,
            "row": row,
            "method_a": d.a.label,
            "method_b": d.b.label,
            "compression_ratio": d.a.compression_ratio,
            "score_a": d.a.score,
            "score_b": d.b.score,
            "delta": d.delta,
            **_interval_fields(d.interval),
            "shared_samples": d.interval.shared_samples if d.interval else None,
            "partial": d.partial,
        }
        for row, d in rows
    ]
    notes = list(_DIFF_NOTES) + _interval_notes(d for _, d in rows)
    if any(d.interval is not None and not d.interval.same_samples for _, d in rows):
        notes.append("† the two runs answered different samples; the interval covers the samples both answered.")
    if any(d.partial for _, d in rows):
        notes.append("\\* at least one of the two runs is partial.")
    return Table(name, title, markdown_table(header, body), csv_text(csv_rows), notes)


def gate_effect_table(runs: Sequence[RunResult], resamples: int, seed: int = 0) -> Table | None:
    """``eg_chunkkv_{scorer}`` minus ``chunkkv_{scorer}`` for every scorer both were run with."""
    scorers = sorted(
        {run.method.removeprefix("eg_chunkkv_") for run in runs if run.method.startswith("eg_chunkkv_")}
        & {run.method.removeprefix("chunkkv_") for run in runs if run.method.startswith("chunkkv_")}
    )
    rows = []
    for scorer in scorers:
        for d in differences(runs, f"eg_chunkkv_{scorer}", f"chunkkv_{scorer}", resamples, seed):
            rows.append((scorer + (f" [{d.a.variant}]" if d.a.variant else ""), d))
    if not rows:
        return None
    return _difference_table(
        "gate_effect", "Gate effect: eg_chunkkv_{scorer} − chunkkv_{scorer}", rows, row_header="inner scorer"
    )


def diff_table(runs: Sequence[RunResult], method_a: str, method_b: str, resamples: int, seed: int = 0) -> Table:
    found = {run.method for run in runs}
    for method in (method_a, method_b):
        if method not in found:
            raise ReportError(
                f"--diff: no finished run of method {method!r}; methods found: {', '.join(sorted(found))}"
            )
    rows = [(d.a.variant or "all", d) for d in differences(runs, method_a, method_b, resamples, seed)]
    if not rows:
        raise ReportError(
            f"--diff {method_a} {method_b}: no pair of runs on the same benchmark, model, query-awareness and cr"
        )
    return _difference_table(f"diff__{method_a}__{method_b}", f"{method_a} − {method_b}", rows, row_header="settings")


# ---------------------------------------------------------------------------------------------------------------
# Published numbers
# ---------------------------------------------------------------------------------------------------------------

_SCORE_COLUMNS = ("benchmark", "model", "method", "query_aware", "compression_ratio", "score")
_DELTA_COLUMNS = ("benchmark", "model", "method_a", "method_b", "query_aware", "compression_ratio", "delta")


@dataclass(frozen=True)
class Reference:
    """One published figure: a score, or a difference between two methods when ``method_b`` is set."""

    benchmark: str
    settings: tuple[tuple[str, str], ...]
    model: str
    method: str
    method_b: str
    query_aware: bool
    compression_ratio: float
    value: float
    metric: str
    source: str
    file: str


def _parse_bool(text: str, where: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no", ""):
        return False
    raise ReportError(f"{where}: query_aware must be true or false, got {text!r}")


def _parse_settings(text: str, where: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ReportError(f"{where}: benchmark_settings must be key=value pairs separated by ';', got {item!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def load_references(folder: Path) -> list[Reference]:
    """Rows of every CSV in ``folder`` that carries either the score or the difference columns."""
    files = sorted(folder.glob("*.csv"))
    if not files:
        raise ReportError(f"--compare: no reference CSV in {folder}")
    references = []
    for path in files:
        with path.open(encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            columns = set(reader.fieldnames or [])
            is_delta = set(_DELTA_COLUMNS) <= columns
            if not is_delta and not set(_SCORE_COLUMNS) <= columns:
                raise ReportError(
                    f"{path}: needs the columns {', '.join(_SCORE_COLUMNS)} (a score) "
                    f"or {', '.join(_DELTA_COLUMNS)} (a difference)"
                )
            for line, row in enumerate(reader, start=2):
                where = f"{path}:{line}"
                try:
                    references.append(
                        Reference(
                            benchmark=row["benchmark"],
                            settings=_parse_settings(row.get("benchmark_settings") or "", where),
                            model=row["model"],
                            method=row["method_a"] if is_delta else row["method"],
                            method_b=row["method_b"] if is_delta else "",
                            query_aware=_parse_bool(row["query_aware"], where),
                            compression_ratio=float(row["compression_ratio"]),
                            value=float(row["delta"] if is_delta else row["score"]),
                            metric=row.get("metric", ""),
                            source=row.get("source", ""),
                            file=path.name,
                        )
                    )
                except ValueError as error:
                    raise ReportError(f"{where}: {error}") from error
    return references


def _same_model(published: str, run: RunResult) -> bool:
    """Hub ids match exactly, or by their last component (a local copy of the weights keeps the repo name)."""
    ids = {run.model_id, run.model}
    return published in ids or published.rstrip("/").split("/")[-1] in {i.rstrip("/").split("/")[-1] for i in ids}


def _matches(reference: Reference, run: RunResult, method: str) -> bool:
    return (
        run.benchmark == reference.benchmark
        and all(str(run.benchmark_config.get(key)) == value for key, value in reference.settings)
        and _same_model(reference.model, run)
        and run.method == method
        and run.query_aware == reference.query_aware
        and abs(run.compression_ratio - reference.compression_ratio) < 5e-4
    )


def compare_tables(
    runs: Sequence[RunResult], references: Sequence[Reference], resamples: int, seed: int = 0
) -> tuple[list[Table], int]:
    """Measured vs published, side by side; returns the tables and the number of unmatched references."""
    score_rows, delta_rows, unmatched = [], [], 0
    for reference in references:
        if reference.method_b:
            found = [
                d
                for d in differences(runs, reference.method, reference.method_b, resamples, seed)
                if _matches(reference, d.a, reference.method)
            ]
            delta_rows += [(reference, d) for d in found]
        else:
            found = [run for run in runs if _matches(reference, run, reference.method)]
            score_rows += [(reference, run) for run in found]
        unmatched += not found
    notes = ["delta = measured − published. \\* partial run: the measured figure covers fewer samples."]
    tables = []
    if score_rows:
        body, csv_rows = [], []
        for reference, run in score_rows:
            delta = None if run.score is None else round(run.score - reference.value, 2)
            common = [
                run.benchmark,
                reference.model,
                run.label,
                str(run.query_aware).lower(),
                f"{run.compression_ratio:g}",
            ]
            body.append(
                [*common, fmt_cell(run), fmt_number(reference.value), fmt_number(delta, signed=True), reference.source]
            )
            csv_rows.append(
                {
                    **dict(
                        zip(("benchmark", "model", "method", "query_aware", "compression_ratio"), common, strict=True)
                    ),
                    "measured": run.score,
                    **_interval_fields(run.interval),
                    "n": run.samples,
                    "partial": run.partial,
                    "published": reference.value,
                    "delta": delta,
                    "metric": reference.metric,
                    "source": reference.source,
                    "reference_file": reference.file,
                    "run_dir": str(run.path),
                }
            )
        header = ["benchmark", "model", "method", "query_aware", "cr", "measured", "published", "delta", "source"]
        tables.append(
            Table("compare", "Measured vs published scores", markdown_table(header, body), csv_text(csv_rows), notes)
        )
    if delta_rows:
        body, csv_rows = [], []
        for reference, d in delta_rows:
            gap = None if d.delta is None else round(d.delta - reference.value, 2)
            pair = f"{d.a.label} − {d.b.label}"
            common = [d.a.benchmark, reference.model, pair, str(d.a.query_aware).lower(), f"{d.a.compression_ratio:g}"]
            body.append(
                [
                    *common,
                    d.cell(),
                    fmt_number(reference.value, signed=True),
                    fmt_number(gap, signed=True),
                    reference.source,
                ]
            )
            csv_rows.append(
                {
                    **dict(
                        zip(("benchmark", "model", "methods", "query_aware", "compression_ratio"), common, strict=True)
                    ),
                    "measured": d.delta,
                    **_interval_fields(d.interval),
                    "partial": d.partial,
                    "published": reference.value,
                    "delta": gap,
                    "metric": reference.metric,
                    "source": reference.source,
                    "reference_file": reference.file,
                }
            )
        header = ["benchmark", "model", "a − b", "query_aware", "cr", "measured", "published", "delta", "source"]
        tables.append(
            Table(
                "compare_differences",
                "Measured vs published differences",
                markdown_table(header, body),
                csv_text(csv_rows),
                notes,
            )
        )
    return tables, unmatched


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


def runs_table(runs: Sequence[RunResult]) -> Table:
    """Every run with every figure the other tables show, one row each."""
    rows = [
        {
            "benchmark": run.benchmark,
            "model": run.model,
            "model_id": run.model_id,
            "method": run.method,
            "variant": run.variant,
            "query_aware": run.query_aware,
            "compression_ratio": run.compression_ratio,
            "score": run.score,
            **_interval_fields(run.interval),
            "n": run.samples,
            "partial": run.partial,
            "partial_reasons": "; ".join(run.partial_reasons),
            "status": run.run.get("status", ""),
            "kept_ratio": run.kept_ratio,
            "wall_seconds": run.run.get("wall_seconds"),
            "peak_memory_mb": run.run.get("peak_memory_mb"),
            "run_dir": str(run.path),
        }
        for run in sorted(runs, key=lambda r: (r.benchmark, r.model, r.method, r.variant, r.compression_ratio))
    ]
    return Table("runs", "Runs", "", csv_text(rows))


@dataclass
class Report:
    runs: list[RunResult]
    skipped: list[tuple[Path, str]]
    headline: list[Table]
    tasks: list[Table]
    differences: list[Table]
    comparisons: list[Table]
    unmatched_references: int = 0

    def tables(self) -> list[Table]:
        return [*self.headline, *self.tasks, *self.differences, *self.comparisons, runs_table(self.runs)]

    def page(self, runs_dir: Path, resamples: int) -> str:
        """All tables as one Markdown page; per-task tables are linked rather than inlined."""
        lines = [
            "# PressBench results",
            "",
            f"{len(self.runs)} finished runs from `{runs_dir}`.",
            "",
            "Cells: headline score"
            + (f" [bootstrap 95% interval, {resamples} resamples of contexts within each task]" if resamples else "")
            + " n=samples; \\* partial (fewer samples than the full benchmark).",
        ]
        for table in self.headline:
            lines += ["", table.page(), "", f"Per task: [{table.name}_tasks.md]({table.name}_tasks.md)"]
        for table in [*self.differences, *self.comparisons]:
            lines += ["", table.page()]
        if self.unmatched_references:
            lines += ["", f"{self.unmatched_references} published figures have no matching run."]
        if self.skipped:
            lines += ["", "### Skipped", ""] + [f"- `{path}`: {reason}" for path, reason in self.skipped]
        return "\n".join(lines) + "\n"


def build_report(
    runs: list[RunResult],
    skipped: list[tuple[Path, str]],
    resamples: int = 1000,
    seed: int = 0,
    diffs: Sequence[tuple[str, str]] = (),
    reference_dir: Path | None = None,
) -> Report:
    compute_intervals(runs, resamples, seed)
    benchmarks = benchmarks_of(runs)
    difference_tables = [table for table in (gate_effect_table(runs, resamples, seed),) if table is not None]
    difference_tables += [diff_table(runs, a, b, resamples, seed) for a, b in diffs]
    comparisons, unmatched = ([], 0)
    if reference_dir is not None:
        comparisons, unmatched = compare_tables(runs, load_references(reference_dir), resamples, seed)
    return Report(
        runs=runs,
        skipped=skipped,
        headline=[headline_table(benchmark, runs) for benchmark in benchmarks],
        tasks=[task_table(benchmark, runs) for benchmark in benchmarks],
        differences=difference_tables,
        comparisons=comparisons,
        unmatched_references=unmatched,
    )


def write_report(report: Report, out: Path, runs_dir: Path, resamples: int) -> list[Path]:
    written = []
    for table in report.tables():
        if table.markdown:
            path = out / f"{table.name}.md"
            rundir.write_atomic(path, table.page() + "\n")
            written.append(path)
        path = out / f"{table.name}.csv"
        rundir.write_atomic(path, table.csv)
        written.append(path)
    path = out / "report.md"
    rundir.write_atomic(path, report.page(runs_dir, resamples))
    written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evaluate.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", nargs="?", type=Path, default=DEFAULT_RUNS, help="default: %(default)s")
    parser.add_argument("--out", type=Path, default=DEFAULT_TABLES, help="tables folder (default: %(default)s)")
    parser.add_argument("--plots", type=Path, default=DEFAULT_PLOTS, help="plots folder (default: %(default)s)")
    parser.add_argument("--no-plots", action="store_true", help="write tables only")
    parser.add_argument(
        "--diff", nargs=2, action="append", default=[], metavar=("A", "B"), help="add a table of method A − method B"
    )
    parser.add_argument("--compare", action="store_true", help="compare with the published numbers in --reference")
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE, help="default: %(default)s")
    parser.add_argument(
        "--bootstrap", type=int, default=1000, metavar="N", help="resamples per interval; 0 disables (default: 1000)"
    )
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    parser.add_argument(
        "--wandb",
        nargs="?",
        const="online",
        choices=["offline", "online"],
        help="also log the tables and plots to one wandb summary run (bare --wandb: online)",
    )
    parser.add_argument("--wandb-project", default="pressbench", help="default: %(default)s")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")

    try:
        runs, skipped = collect_runs(args.runs_dir)
        if not runs:
            detail = "".join(f"\n  {path}: {reason}" for path, reason in skipped)
            raise ReportError(f"no finished run under {args.runs_dir}{detail}")
        report = build_report(
            runs,
            skipped,
            resamples=args.bootstrap,
            seed=args.seed,
            diffs=[tuple(pair) for pair in args.diff],
            reference_dir=args.reference if args.compare else None,
        )
    except ReportError as error:
        raise SystemExit(f"error: {error}") from None

    written = write_report(report, args.out, args.runs_dir, args.bootstrap)
    plots = []
    if not args.no_plots:
        from evaluate.plots import plot_all

        plots = plot_all(report.runs, args.plots)
    print(report.page(args.runs_dir, args.bootstrap))
    for path, reason in skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    print(f"tables: {', '.join(str(path) for path in written)}")
    if plots:
        print(f"plots: {', '.join(str(path) for path in plots)}")
    if args.wandb:
        from evaluate.tracking import log_report

        url = log_report(report, plots, mode=args.wandb, project=args.wandb_project)
        print(f"wandb summary run: {url}")


if __name__ == "__main__":
    main()
