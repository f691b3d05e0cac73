"""Finished run directories, read back with the benchmark their config recorded."""

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.utils import instantiate
from tqdm.auto import tqdm

from evaluate import rundir
from evaluate.benchmarks import Benchmark
from evaluate.score.bootstrap import Interval, NoInterval, headline_interval, mean_interval
from evaluate.score.likelihood import FIELDS, row_fields
from evaluate.spec.config import NON_RESULT_KEYS

logger = logging.getLogger(__name__)

DEFAULT_RUNS = Path("results/runs")
NO_PRESS = "no_press"
# Config keys that never distinguish two results (the fingerprint leaves them out too), the ratio itself (as does
# any compression_ratio), and the report settings an experiment preset carries.
_NOT_A_VARIANT = {*NON_RESULT_KEYS, "cr", "wandb", "report"}


class ReportError(RuntimeError):
    """Nothing to report, or an input the report cannot read; the message says which."""


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one dict with dotted keys."""
    if not isinstance(data, dict):
        return {prefix[:-1]: data}
    return {key: leaf for name, value in data.items() for key, leaf in flatten(value, f"{prefix}{name}.").items()}


@dataclass
class RunResult:
    """One finished run directory, read back; :func:`~evaluate.report.frame.runs_frame` tabulates the rest."""

    path: Path
    record: dict  # config.yaml
    metrics: dict  # metrics.json
    run: dict  # run.json
    benchmark_object: Benchmark  # the benchmark exactly as the run recorded it
    variant: str = ""  # set when several runs would otherwise share a table cell
    interval: Interval | None = None
    interval_note: str = ""  # why a run has no interval
    likelihood_intervals: dict[str, Interval] = field(default_factory=dict)  # a likelihood field: its interval

    def __post_init__(self) -> None:
        self.config: dict = self.record.get("config", {})
        self.benchmark: str = self.metrics.get("benchmark") or self.config.get("benchmark", {}).get("name", "?")
        self.model = str(self.config.get("model", {}).get("name", "?"))
        # The hub id or local path for hub models, otherwise the model's name.
        self.model_id = str(self.config.get("model", {}).get("source", {}).get("name_or_path") or self.model)
        self.method = str(self.record.get("method") or self.config.get("press", {}).get("method", "?"))
        self.compression_ratio = float(self.record.get("compression_ratio", 0.0))
        self.query_aware = bool(self.config.get("query_aware", False))
        self.tasks: dict[str, dict] = self.metrics.get("tasks", {})
        self.samples = sum(int(task.get("n", 0)) for task in self.tasks.values())
        self.score = None if self.metrics.get("score") is None else float(self.metrics["score"])  # the headline
        self.likelihood: dict = self.metrics.get("likelihood") or {}  # metrics.json's means of the likelihood fields
        self.row_key = (self.benchmark, self.model, self.method, self.query_aware)  # a row of the headline table

    @cached_property
    def rows(self) -> list[dict]:
        return rundir.read_predictions(self.path / rundir.PREDICTIONS)

    @cached_property
    def partial_reasons(self) -> list[str]:
        """Why the run covers less than the full benchmark, as its benchmark judges; empty when it covers all."""
        return self.benchmark_object.coverage(self.rows, self.config)


def collect_runs(runs_dir: Path) -> tuple[list[RunResult], list[tuple[Path, str]]]:
    """Every finished run under ``runs_dir`` (searched recursively), and the directories skipped with why."""
    if not runs_dir.is_dir():
        raise ReportError(f"{runs_dir} is not a directory; pass the folder that holds the run directories")
    runs, skipped = [], []
    for run_file in sorted(runs_dir.rglob(rundir.RUN)):
        path, run = run_file.parent, rundir.read_json(run_file) or {}
        try:
            if run.get("status", "unknown") not in rundir.FINISHED:
                raise ReportError(f"status {run.get('status', 'unknown')}")
            record, metrics = rundir.read_yaml(path / rundir.CONFIG), rundir.read_json(path / rundir.METRICS)
            if record is None:
                raise ReportError(f"{path} has no {rundir.CONFIG}")
            if metrics is None:
                raise ReportError(f"{path} has no {rundir.METRICS}; rescore it with python -m evaluate.score {path}")
            try:
                benchmark = instantiate(record.get("config", {}).get("benchmark", {}))
            except Exception as error:  # a benchmark this code base no longer builds: the run cannot be judged
                raise ReportError(f"cannot rebuild its benchmark from {rundir.CONFIG}: {error}") from error
            result = RunResult(path, record, metrics, run, benchmark)
            _ = result.rows  # read now: a run whose predictions are damaged is skipped here, naming the line
            runs.append(result)
        except (ReportError, ValueError) as error:
            skipped.append((path, str(error)))
    runs, duplicates = _assign_variants(runs)
    return runs, skipped + duplicates


def _tells_apart(key: str) -> bool:
    return key.split(".")[0] not in _NOT_A_VARIANT and key.split(".")[-1] != "compression_ratio"


def _assign_variants(runs: list[RunResult]) -> tuple[list[RunResult], list[tuple[Path, str]]]:
    """Label runs of one method that differ in a setting (seed, window size, ...; the config keys whose values differ
    but the ratio) so they never share a cell; of runs that still collide, the same configuration found twice, keep
    the one with more samples."""
    flats = [{k: v for k, v in flatten(run.config).items() if _tells_apart(k)} for run in runs]
    # Each setting as JSON, a missing one as null; a setting differs when its runs of one method hold several values.
    settings = pd.DataFrame([{key: json.dumps(value, sort_keys=True) for key, value in flat.items()} for flat in flats])
    settings = settings.fillna("null")
    for _, members in settings.groupby(pd.Series([run.row_key for run in runs]), sort=False):
        differing = sorted((key for key in members.columns if members[key].nunique() > 1), key=lambda k: (len(k), k))
        # One setting can sit under several keys (press: ${scorer.press}, min_context: ${.press.window_size}); keys
        # whose values go together in every run of the method name it once, by the shortest of them.
        named = sorted(members[differing].T.drop_duplicates().index)
        for position in members.index:
            runs[position].variant = ", ".join(f"{key}={json.dumps(flats[position].get(key))}" for key in named)
    kept: dict[tuple, RunResult] = {}
    duplicates = []
    for run in runs:
        key = (*run.row_key, run.variant, round(run.compression_ratio, 6))
        if key in kept:  # more samples wins, then the most recent; on a tie, the run found later
            worse, kept[key] = sorted((kept[key], run), key=lambda r: (r.samples, r.run.get("updated_at", "")))
            reason = f"same configuration as {kept[key].path}, which has more samples or is newer"
            duplicates.append((worse.path, reason))
        else:
            kept[key] = run
    return list(kept.values()), duplicates


def compute_intervals(runs: Sequence[RunResult], resamples: int, seed: int = 0) -> None:
    """Attach a bootstrap 95% interval of the headline, and of each likelihood field's headline, to every run (in
    place)."""
    if resamples <= 0:
        return
    for run in tqdm(runs, desc="bootstrap", unit="run", disable=len(runs) < 2, dynamic_ncols=True):
        rows = [row for row in run.rows if row_fields(row)]
        if rows and run.likelihood:
            try:
                values = {name: [row[name] for row in rows] for name in FIELDS}
                run.likelihood_intervals = {name: mean_interval(rows, values[name], resamples, seed) for name in FIELDS}
            except NoInterval:
                pass  # the score's interval_note below names the single-context task
        try:
            run.interval = headline_interval(run.benchmark_object, run.rows, resamples=resamples, seed=seed)
        except NoInterval as reason:
            run.interval_note = str(reason)
        except Exception as error:  # a benchmark that cannot score these rows still gets its table row
            run.interval_note = f"no interval: {error}"
            logger.warning("no bootstrap interval for %s: %s", run.path.name, error)
