"""Rescore predictions without re-running the model.

    python -m evaluate.score RUN_DIR [RUN_DIR ...]         # rewrites each RUN_DIR/metrics.json
    python -m evaluate.score --benchmark ruler FILE.jsonl  # prints metrics JSON for rows with task, answers, prediction

A run directory is scored by the benchmark exactly as its config.yaml recorded it; a bare file by the
named benchmark's default configuration. Of several run directories (``results/runs/*/``), one that cannot be
rescored is named with why on stderr and the others are rescored; the exit status is then 2. A run that has not
answered every sample its run.json expects (interrupted, incomplete, or still running) is scored on the rows it
has, its metrics.json marked ``partial``, and a warning line says how many and how to finish it.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.errors import ConfigError, refuse
from evaluate.score.answer_length import against_baseline, own_metrics
from evaluate.score.diagnostics import diagnostics_metrics
from evaluate.score.likelihood import likelihood_metrics
from evaluate.score.tables import format_task_table
from evaluate.score.turns import turn_metrics

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# metrics.json's key for a run scored before it answered every sample it expects (:func:`coverage`).
PARTIAL = "partial"


def benchmark_from_name(name: str):
    choices = sorted(path.stem for path in (CONF_DIR / "benchmark").glob("*.yaml"))
    if name not in choices:
        raise ConfigError(f"unknown benchmark {name!r}; choose one of {', '.join(choices)}")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"benchmark={name}"])
    return instantiate(cfg.benchmark)


def not_generated(benchmark, rows: list[dict]) -> dict:
    """The metrics of a run made with ``generate=false``: no answers, so no score, only the samples per task."""
    counts = Counter(row["task"] for row in rows)
    return {
        "benchmark": benchmark.name,
        "score": None,
        "score_label": "no answers generated (generate=false): see likelihood",
        "tasks": {task: {"score": None, "n": n} for task, n in sorted(counts.items())},
    }


def check_references(benchmark, rows: list[dict], where: str) -> None:
    """Refuse a row with no reference answer (``answers`` empty) where the benchmark scores every row against its
    references: its metric would divide by nothing or index an empty list, and no number would be true."""
    if not benchmark.scored_on_references:
        return
    for number, row in enumerate(rows, start=1):
        if not row.get("answers"):
            raise ConfigError(
                f"{where} row {number} (sample {row.get('id')}): no reference answer (answers "
                f"{row.get('answers')!r}), and {benchmark.name} scores every row against its references; rerun on "
                "data whose rows have answers"
            )


def score_rows(benchmark, rows: list[dict], where: str = "predictions") -> dict:
    """The benchmark's metrics (none under ``generate=false``, whose rows hold no prediction), plus how many samples
    failed (they are scored as the wrong answers they are), the score by turn where rows are turns of conversations
    (evaluate/score/turns.py), the likelihood fields' means, the diagnostics' means (evaluate/score/diagnostics.py)
    and the answers' length in tokens
    (evaluate/score/answer_length.py). ``where`` names the rows' file in a refusal (:func:`check_references`)."""
    check_references(benchmark, rows, where)
    generated = all(row.get("prediction") is not None for row in rows)
    metrics = benchmark.score(rows) if generated else not_generated(benchmark, rows)
    failed = Counter(row["task"] for row in rows if row.get("error"))
    if failed:
        metrics["n_errors"] = sum(failed.values())
        for task, count in failed.items():
            metrics["tasks"][task]["n_errors"] = count
    metrics |= turn_metrics(benchmark, rows, generated)
    likelihood = likelihood_metrics(rows)
    if likelihood is not None:
        metrics["likelihood"] = likelihood
    diagnostics = diagnostics_metrics(rows)
    if diagnostics is not None:
        metrics["diagnostics"] = diagnostics
    answer_length = own_metrics(rows)
    if answer_length is not None:
        metrics["answer_length"] = answer_length
    return metrics


def coverage(run_directory: Path, rows: list[dict]) -> dict | None:
    """metrics.json's ``partial`` for rows short of the run: how many were scored, how many run.json expects, and
    its status; None when the rows are every expected sample, or where run.json cannot say (missing or damaged:
    rescoring needs only config.yaml and the predictions, and the report names a damaged run.json). Without a
    count (``samples_expected``), a status other than finished says the rows are short."""
    try:
        record = rundir.read_record(run_directory / rundir.RUN) or {}
    except rundir.Unreadable:
        return None
    expected, status = record.get("samples_expected"), record.get("status")
    short = len(rows) < expected if isinstance(expected, int) else status not in (None, *rundir.FINISHED)
    return {"samples": len(rows), "samples_expected": expected, "status": status} if short else None


def score_run(benchmark, rows: list[dict], run_directory: Path) -> dict:
    """A run directory's metrics: :func:`score_rows`, its answers' length against its uncompressed baseline's
    where one lies beside it (evaluate/score/answer_length.py), and ``partial`` (:func:`coverage`) for a run whose
    rows are short of the samples it expects."""
    metrics = score_rows(benchmark, rows, where=str(run_directory / rundir.PREDICTIONS))
    record = rundir.read_record(run_directory / rundir.CONFIG) or {}
    drift = against_baseline(run_directory, record, rows)
    if drift is not None:
        metrics["answer_length"]["against_uncompressed"] = drift
    partial = coverage(run_directory, rows)
    if partial is not None:
        metrics[PARTIAL] = partial
    return metrics


def partial_warning(run_directory: Path, partial: dict) -> str:
    """One line for a rescored run that is not finished: what was scored of what, and how to finish it."""
    expected = partial["samples_expected"]
    scored = f"{partial['samples']} of {expected} expected" if expected is not None else str(partial["samples"])
    return (
        f"warning: {run_directory} is unfinished (run.json status {partial['status']}): {scored} samples scored, "
        f"so metrics.json is marked {PARTIAL}; rerun the command that made the run to answer the rest (it resumes "
        "where it stopped and rescores the whole run)"
    )


def rescore_run(run_directory: Path) -> dict:
    """Rewrite the run's metrics.json from its predictions; ConfigError, naming the file and why in one line, for a
    run whose config or predictions cannot be read, before metrics.json is touched."""
    config_file = run_directory / rundir.CONFIG
    record = rundir.read_record(config_file)
    if record is None:
        raise ConfigError(f"{run_directory} has no {rundir.CONFIG}; is it a run directory?")
    settings = record.get("config")
    if not isinstance(settings, dict) or not isinstance(settings.get("benchmark"), dict):
        raise ConfigError(f"{config_file}: no config.benchmark mapping to rebuild the benchmark from")
    try:
        benchmark = instantiate(settings["benchmark"])
    except Exception as error:  # a benchmark this code base no longer builds
        raise ConfigError(f"{config_file}: cannot rebuild its benchmark ({' '.join(str(error).split())})") from None
    predictions = run_directory / rundir.PREDICTIONS
    try:
        metrics = score_run(benchmark, rundir.read_predictions(predictions), run_directory)
    except (KeyError, TypeError, AttributeError) as error:  # rows of JSON objects without the fields it scores
        raise ConfigError(f"{predictions}: rows the benchmark cannot score ({error!r})") from None
    rundir.write_json(run_directory / rundir.METRICS, metrics)
    return metrics


def rescore_all(paths: list[Path]) -> bool:
    """Rescore every run directory of ``paths`` and print its table; one that cannot be rescored gets a line on
    stderr naming the file and why, and the others go on. Returns whether all were rescored."""
    done = True
    for path in paths:
        try:
            if not path.is_dir():
                raise ConfigError(f"{path} is not a run directory; to score a file, pass --benchmark NAME")
            # A damaged predictions file is refused before metrics.json is touched.
            metrics = rescore_run(path)
        except ConfigError as error:
            if len(paths) == 1:
                refuse(error)
            print(f"error: {error}", file=sys.stderr)
            done = False
            continue
        print(format_task_table(metrics, title=str(path)))
        if PARTIAL in metrics:
            print(partial_warning(path, metrics[PARTIAL]), file=sys.stderr)
    return done


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evaluate.score", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "paths", nargs="+", type=Path, help="run directories, or one predictions .jsonl file with --benchmark"
    )
    parser.add_argument("--benchmark", help="score a bare predictions file as this benchmark (e.g. ruler)")
    args = parser.parse_args(argv)
    if args.benchmark is None:
        if not rescore_all(args.paths):
            sys.exit(2)
        return
    try:
        if len(args.paths) != 1 or not args.paths[0].is_file():
            raise ConfigError(f"--benchmark scores one predictions file; {' '.join(map(str, args.paths))} is not one")
        rows = rundir.read_predictions(args.paths[0])
        metrics = score_rows(benchmark_from_name(args.benchmark), rows, where=str(args.paths[0]))
    except ConfigError as error:
        refuse(error)
    json.dump(metrics, sys.stdout, indent=2)
    print()
