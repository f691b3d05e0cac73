"""Finished run directories, read back with the benchmark their config recorded."""

import json
import logging
import math
import os
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
from evaluate.cost_schema import COST_KEYS
from evaluate.kv_cache import recorded_cache
from evaluate.score.baseline import NO_PRESS, is_baseline
from evaluate.score.bootstrap import Interval, NoInterval, headline_interval, mean_interval
from evaluate.score.likelihood import FIELDS, row_fields
from evaluate.settings import NON_RESULT_KEYS, RECORDED_DEFAULTS, TURN_DEFAULTS, without_old_defaults

logger = logging.getLogger(__name__)

DEFAULT_RUNS = Path("results/runs")
# Config keys that never distinguish two results (the fingerprint leaves them out too), the ratio or token budget
# itself (as does any compression_ratio), and the report settings an experiment preset carries; and the
# conversation settings, which a run's row_key holds (read with their defaults for runs recorded before them).
_NOT_A_VARIANT = {*NON_RESULT_KEYS, "cr", "budget", "wandb", "report", "cache", *TURN_DEFAULTS}
# A decoding-time run's own axis (config.yaml's ``decoding``): the cache size it compresses to, which its table shows
# as a column, as the cr tables show cr; its compression_interval tells its runs apart as any other setting.
_DECODING_AXIS = "target_size"
# The columns of a headline row, as RunResult.row_key holds them: runs with the same have a variant where they differ.
ROW_KEY = ("benchmark", "model", "method", "query_aware", "turns", "history", "cache")


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
        # A token-budget run has no one ratio (NaN: the ratio tables leave it to the budget tables).
        self.budget: int | None = self.record.get("budget")
        # A decoding-time press (kvpress's DecodingPress, CAM) compresses to decoding.target_size every
        # decoding.compression_interval steps and ignores cr: no ratio either; what it kept is measured in its rows.
        self.decoding: dict | None = self.record.get("decoding")
        ratio = self.record.get("compression_ratio", 0.0)
        unratioed = self.budget is not None or self.decoding is not None or ratio is None
        self.compression_ratio = float("nan") if unratioed else float(ratio)
        self.generate = bool(self.config.get("generate", RECORDED_DEFAULTS["generate"]))
        self.query_aware = bool(self.config.get("query_aware", False))
        self.tasks: dict[str, dict] = self.metrics.get("tasks", {})
        self.samples = sum(int(task.get("n", 0)) for task in self.tasks.values())
        self.score = None if self.metrics.get("score") is None else float(self.metrics["score"])  # the headline
        self.likelihood: dict = self.metrics.get("likelihood") or {}  # metrics.json's means of the likelihood fields
        self.diagnostics: dict = self.metrics.get("diagnostics") or {}  # answer retention, attention recall
        # A conversation's turns asked each on its own or in order on one cache, and the earlier answers that cache
        # holds (conf/config.yaml): a multi-turn run is never a variant nor a duplicate of its independent twin.
        self.turns, self.history = (str(self.config.get(key) or value) for key, value in TURN_DEFAULTS.items())
        # The cache it held its keys and values in, as labels name it ("" for the model's own: evaluate/kv_cache.py).
        self.cache = recorded_cache(self.config.get("cache")).label
        self.score_by_turn: dict = self.metrics.get("score_by_turn") or {}  # evaluate/score/turns.py
        self.samples_by_turn: dict = self.metrics.get("samples_by_turn") or {}
        # A row of the headline table (ROW_KEY's columns).
        self.row_key = tuple(getattr(self, name) for name in ROW_KEY)
        # What can tell it from the other runs of its row: the report names those that differ (variant_names).
        self.variant_settings = distinguishing_settings(self.config, decoding=self.decoding is not None)

    @cached_property
    def rows(self) -> list[dict]:
        return rundir.read_predictions(self.path / rundir.PREDICTIONS)

    @cached_property
    def partial_reasons(self) -> list[str]:
        """Why the run covers less than the full benchmark, as its benchmark judges; empty when it covers all."""
        return self.benchmark_object.coverage(self.rows, self.config)


# Files a run directory holds: a folder with any of them is a run directory, whatever else it holds.
RUN_FILES = (rundir.RUN, rundir.CONFIG, rundir.METRICS, rundir.PREDICTIONS)
# What the tables read of each run file, by dotted key, with the types it must have where it is present and not null.
_NUMBER = (int, float)
_SHAPES = {
    rundir.CONFIG: {
        "config": dict,
        "config.benchmark": dict,
        "config.model": dict,
        "config.model.source": dict,
        "compression_ratio": _NUMBER,
        "budget": int,
        "decoding": dict,
        "decoding.target_size": int,
        "decoding.compression_interval": int,
    },
    rundir.METRICS: {
        "tasks": dict,
        "score": _NUMBER,
        "likelihood": dict,
        "diagnostics": dict,
        "score_by_turn": dict,
        "samples_by_turn": dict,
    },
    rundir.RUN: {
        "status": str,
        "updated_at": str,
        "decoding": dict,
        "decoding.rows_compressed": int,
        "decoding.rows": int,
        **dict.fromkeys(COST_KEYS, _NUMBER),
    },
}
# What Hydra writes in ${output_dir}/multirun/<time>/ for each sweep, beside the run directories.
SWEEP_RECORD = "multirun.yaml"
_TASK_SHAPE = {"n": int, "score": _NUMBER}
_KIND_NAMES = {dict: "a mapping", str: "a string", int: "an integer", _NUMBER: "a number"}


def find_run_directories(runs_dir: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The run directories under ``runs_dir`` (itself included), and what else the tree holds that leads to no run,
    with why: a stray file, an empty folder, a folder that cannot be listed. Hidden files (.gitkeep) are no stray
    files, a run directory's other files (.lock, a repair's .damaged lines) are its own, and a sweep's folder of
    Hydra's (its multirun.yaml) is neither run nor stray."""
    found, other = [], []

    def unlistable(error: OSError) -> None:
        other.append((Path(error.filename), f"folder cannot be listed ({error.strerror})"))

    for folder, folders, files in os.walk(runs_dir, onerror=unlistable):
        if set(RUN_FILES) & {*folders, *files}:
            found.append(Path(folder))
            folders.clear()  # a run file that is a folder is the run's damage, not a tree to search
            continue
        if SWEEP_RECORD in files:  # Hydra's record of a sweep (conf/config.yaml's hydra.sweep.dir), no stray file
            folders.clear()
            continue
        folders.sort()
        other += [(Path(folder, name), "stray file, in no run directory") for name in files if name[0] != "."]
        if not folders and not files:
            other.append((Path(folder), "empty folder, no run in it"))
    return sorted(found), sorted(other)


def misshapen(data: dict, shape: dict[str, type | tuple[type, ...]]) -> str | None:
    """The first dotted key of ``shape`` whose value in ``data`` has another type, as a reason; None when all fit.
    A missing value fits, and a null one where a scalar is wanted: the tables show it as missing."""
    for key, kind in shape.items():
        value, parts = data, key.split(".")
        while parts and isinstance(value, dict) and parts[0] in value:
            value = value[parts.pop(0)]
        fits = (
            parts or (value is None and kind is not dict) or (isinstance(value, kind) and not isinstance(value, bool))
        )
        if not fits:
            return f"{key} is {json.dumps(value, default=str)[:60]}, not {_KIND_NAMES[kind]}"
    return None


def _misshapen_tasks(metrics: dict) -> str | None:
    for name, task in metrics.get("tasks", {}).items():
        wrong = misshapen(task, _TASK_SHAPE) if isinstance(task, dict) else "not a mapping"
        if wrong:
            return f"task {name}: {wrong}"
    return None


def read_run_file(path: Path) -> dict | None:
    """A run file as the mapping the tables read, None when missing; ReportError naming the file and why, in one
    line, for one that cannot be read, is not JSON or YAML, is no mapping or holds a field of the wrong type."""
    try:
        data = rundir.read_record(path)
    except rundir.Unreadable as error:
        raise ReportError(str(error)) from None
    if data is None:
        return None
    wrong = misshapen(data, _SHAPES[path.name])
    if wrong is None and path.name == rundir.METRICS:
        wrong = _misshapen_tasks(data)
    if wrong:
        raise ReportError(f"{path}: {wrong}")
    return data


def unfinished(path: Path, run: dict) -> str:
    """Why a run is not reported yet, as its run.json and its lock tell it, with what to do."""
    status = run.get("status", "unknown")
    if status == "running" and not rundir.held(path):
        return (
            "status running, but no process holds it: it stopped without closing (killed, or its disk filled); "
            "rerun it to resume"
        )
    if status == "incomplete":
        unanswered = f"{run.get('unanswered')} samples unanswered ({run.get('error')})"
        return f"status incomplete: {unanswered}; rerun it to answer them"
    reason = run.get("signal") or run.get("error")
    return f"status {status}" + (f" ({reason})" if reason else "")


def read_run(path: Path) -> RunResult:
    """The finished run in ``path``; ReportError (or ValueError, for damaged predictions) saying why it cannot be
    reported, naming the file at fault."""
    run = read_run_file(path / rundir.RUN)
    if run is None:
        raise ReportError(f"{path} has no {rundir.RUN}")
    if run.get("status", "unknown") not in rundir.FINISHED:
        raise ReportError(unfinished(path, run))
    record, metrics = read_run_file(path / rundir.CONFIG), read_run_file(path / rundir.METRICS)
    if record is None:
        raise ReportError(f"{path} has no {rundir.CONFIG}")
    if metrics is None:
        raise ReportError(f"{path} has no {rundir.METRICS}; rescore it with python -m evaluate.score {path}")
    settings = record.get("config", {}).get("benchmark")
    if not settings:
        raise ReportError(f"{path / rundir.CONFIG}: no config.benchmark to judge the run by")
    try:
        benchmark = instantiate(settings)
    except Exception as error:  # a benchmark this code base no longer builds: the run cannot be judged
        raise ReportError(f"cannot rebuild its benchmark from {rundir.CONFIG}: {error}") from error
    result = RunResult(path, record, metrics, run, benchmark)
    _ = result.rows  # read now: a run whose predictions are damaged is skipped here, naming the line
    return result


def collect_runs(runs_dir: Path) -> tuple[list[RunResult], list[tuple[Path, str]]]:
    """Every finished run under ``runs_dir`` (searched recursively), and what was skipped with why, in one line each:
    runs that are not finished or cannot be read, and whatever else the tree holds that is no run."""
    if not runs_dir.is_dir():
        raise ReportError(f"{runs_dir} is not a directory; pass the folder that holds the run directories")
    folders, skipped = find_run_directories(runs_dir)
    runs = []
    for path in folders:
        try:
            runs.append(read_run(path))
        except (ReportError, ValueError) as error:
            skipped.append((path, " ".join(str(error).split())))
    runs, duplicates = _assign_variants(runs)
    return runs, skipped + duplicates


def _tells_apart(key: str, decoding: bool) -> bool:
    last = key.split(".")[-1]
    return (
        key.split(".")[0] not in _NOT_A_VARIANT
        and last != "compression_ratio"
        and not (decoding and last == _DECODING_AXIS)
    )


def distinguishing_settings(config: dict, decoding: bool = False) -> dict[str, str]:
    """The settings of a run's config (config.yaml's ``config``) that can tell it from another run of its method, by
    dotted key, each as canonical JSON: not those that never change a result, nor its ratio, budget or (``decoding``)
    target size; a setting recorded before it existed at the value those runs ran with (keys.RECORDED_DEFAULTS),
    so that a variant never reads ``generate=null`` for runs that generated."""
    flat = {key: value for key, value in flatten(without_old_defaults(config)).items() if _tells_apart(key, decoding)}
    return {key: json.dumps(value, sort_keys=True) for key, value in {**RECORDED_DEFAULTS, **flat}.items()}


def variant_names(settings: Sequence[dict[str, str]], rows: Sequence[tuple]) -> list[str]:
    """Each run's variant, by position: ``key=value`` for every setting (:func:`distinguishing_settings`) whose values
    differ among the runs of its row (``rows``, a key per run), a missing one as null. Whatever runs are given alone
    count: a table or figure passes its own, so that it names only what tells its runs apart."""
    table = pd.DataFrame(list(settings), index=range(len(settings))).fillna("null")
    names = [""] * len(table)
    for _, members in table.groupby(pd.Series(list(rows), index=table.index, dtype=object), sort=False):
        differing = sorted((key for key in members.columns if members[key].nunique() > 1), key=lambda k: (len(k), k))
        # One setting can sit under several keys (press: ${scorer.press}, min_context: ${.press.window_size}); keys
        # whose values go together in every run of the method name it once, by the shortest of them.
        named = sorted(members[differing].T.drop_duplicates().index)
        for position in members.index:
            names[position] = ", ".join(f"{key}={members.at[position, key]}" for key in named)
    return names


def _assign_variants(runs: list[RunResult]) -> tuple[list[RunResult], list[tuple[Path, str]]]:
    """Label runs of one method that differ in a setting (seed, window size, ...; the config keys whose values differ
    but the ratio) so they never share a cell; of runs that still collide, the same configuration found twice, keep
    the one with more samples."""
    names = variant_names([run.variant_settings for run in runs], [run.row_key for run in runs])
    for run, name in zip(runs, names, strict=True):
        run.variant = name
    kept: dict[tuple, RunResult] = {}
    duplicates = []
    for run in runs:
        ratio = None if math.isnan(run.compression_ratio) else round(run.compression_ratio, 6)
        key = (*run.row_key, run.variant, run.budget, ratio, (run.decoding or {}).get(_DECODING_AXIS))
        if key in kept:  # more samples wins, then the most recent; on a tie, the run found later
            worse, kept[key] = sorted((kept[key], run), key=lambda r: (r.samples, r.run.get("updated_at", "")))
            reason = f"same configuration as {kept[key].path}, which has more samples or is newer"
            duplicates.append((worse.path, reason))
        else:
            kept[key] = run
    return list(kept.values()), duplicates


def find_baselines(runs: Sequence[RunResult]) -> list[int | None]:
    """Each run's uncompressed baseline among ``runs`` (evaluate/score/baseline.py), by position; None for the
    ``no_press`` runs themselves and for runs that have none."""
    references = [(position, run) for position, run in enumerate(runs) if run.method == NO_PRESS]
    found: list[int | None] = []
    for run in runs:
        ids = {row["id"] for row in run.rows}
        matches = (
            position
            for position, reference in references
            if is_baseline(reference.record, lambda reference=reference: reference.rows, run.config, ids)
        )
        found.append(None if run.method == NO_PRESS else next(matches, None))
    return found


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
