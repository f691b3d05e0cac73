"""Rescore predictions without re-running the model.

    python -m evaluate.score RUN_DIR                       # rewrites RUN_DIR/metrics.json
    python -m evaluate.score --benchmark ruler FILE.jsonl  # prints metrics JSON for rows with task, answers, prediction

A run directory is scored by the benchmark exactly as its config.yaml recorded it; a bare file by the
named benchmark's default configuration.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.engine.likelihood import likelihood_metrics
from evaluate.errors import ConfigError, refuse
from evaluate.score.tables import format_task_table

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


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
    failed (they are scored as the wrong answers they are) and the likelihood fields' means. ``where`` names the
    rows' file in a refusal (:func:`check_references`)."""
    check_references(benchmark, rows, where)
    generated = all(row.get("prediction") is not None for row in rows)
    metrics = benchmark.score(rows) if generated else not_generated(benchmark, rows)
    failed = Counter(row["task"] for row in rows if row.get("error"))
    if failed:
        metrics["n_errors"] = sum(failed.values())
        for task, count in failed.items():
            metrics["tasks"][task]["n_errors"] = count
    likelihood = likelihood_metrics(rows)
    if likelihood is not None:
        metrics["likelihood"] = likelihood
    return metrics


def rescore_run(run_directory: Path) -> dict:
    record = rundir.read_yaml(run_directory / rundir.CONFIG)
    if record is None:
        raise ConfigError(f"{run_directory} has no {rundir.CONFIG}; is it a run directory?")
    benchmark = instantiate(record["config"]["benchmark"])
    predictions = run_directory / rundir.PREDICTIONS
    metrics = score_rows(benchmark, rundir.read_predictions(predictions), where=str(predictions))
    rundir.write_json(run_directory / rundir.METRICS, metrics)
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evaluate.score", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a run directory, or a predictions .jsonl file with --benchmark")
    parser.add_argument("--benchmark", help="score a bare predictions file as this benchmark (e.g. ruler)")
    args = parser.parse_args(argv)
    try:
        if args.benchmark is not None:
            if not args.path.is_file():
                raise ConfigError(f"{args.path} is not a file")
            rows = rundir.read_predictions(args.path)
            metrics = score_rows(benchmark_from_name(args.benchmark), rows, where=str(args.path))
            json.dump(metrics, sys.stdout, indent=2)
            print()
            return
        if not args.path.is_dir():
            raise ConfigError(f"{args.path} is not a run directory; to score a file, pass --benchmark NAME")
        # A damaged predictions file is refused before metrics.json is touched.
        metrics = rescore_run(args.path)
    except ConfigError as error:
        refuse(error)
    print(format_task_table(metrics, title=str(args.path)))
