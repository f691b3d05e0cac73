"""kvpress leaderboard submissions: ``python -m evaluate.leaderboard [RUNS_DIR] --out DIR``.

Every finished RULER-4096 run (``benchmark=ruler``, hub dataset ``simonjegou/ruler``, data_dir ``4096``) becomes
a directory that the kvpress leaderboard reads, named as kvpress's evaluation names its results:

    DIR/{dataset}__{data_dir}__{model with / as --}__{method}__{cr:.2f}[__query_aware]/
        config.yaml      kvpress's evaluation fields (press_init_command is the press repr)
        metrics.json     {task: {"string_match": score}} for the 13 tasks
        predictions.csv  the dataset columns except context, plus predicted_answer and compression_ratio
    DIR/leaderboard.csv  one row per exported run; score = unweighted 13-task mean, rounded to 2

Partial runs (a sample limit or fraction, fewer than 13 tasks, data other than the hub dataset, failed
samples) are refused with their reasons unless ``--allow-partial``. Each directory is assembled in a staging
folder beside DIR and renamed into place only once complete, so a refused or failed export leaves nothing
that looks like a submission.
"""

import argparse
import csv
import io
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from evaluate import rundir
from evaluate.report import DEFAULT_RUNS, RULER_TASKS, ReportError, RunResult, collect_runs

DATASET = "ruler"
HUB_DATASET = "simonjegou/ruler"
DATA_DIR = "4096"
# kvpress's RULER-4096 hub data: 500 samples for each of the 13 tasks (shared/reference/ruler/README.md).
SAMPLES_PER_TASK = 500

LEADERBOARD_COLUMNS = "dataset data_dir model method compression_ratio score query_aware press_init_command".split()
PREDICTION_COLUMNS = "question answer_prefix answer task max_new_tokens predicted_answer compression_ratio".split()


class Refused(Exception):
    """A run that cannot be exported; the message gives every reason."""


@dataclass
class Submission:
    run: RunResult
    name: str
    config: dict
    metrics: dict
    score: float


def is_ruler_4096(run: RunResult) -> bool:
    return run.benchmark == DATASET and str(run.benchmark_config.get("data_dir")) == DATA_DIR


def refusal_reasons(run: RunResult) -> list[str]:
    """Why a finished RULER-4096 run is not a full leaderboard run."""
    reasons = []
    limit = run.config.get("limit")
    if limit is not None and int(limit) < SAMPLES_PER_TASK:
        reasons.append(f"limit={limit} (samples per task); rerun with limit=null")
    fraction = run.config.get("fraction", run.benchmark_config.get("fraction"))
    if fraction is not None and float(fraction) < 1:
        reasons.append(f"fraction={fraction}")
    missing = [task for task in RULER_TASKS if task not in run.tasks]
    if missing:
        reasons.append(f"{len(RULER_TASKS) - len(missing)} of 13 tasks (missing {', '.join(missing)})")
    extra = sorted(set(run.tasks) - set(RULER_TASKS))
    if extra:
        reasons.append(f"tasks outside RULER's 13: {', '.join(extra)}")
    benchmark = run.benchmark_config
    if benchmark.get("path"):
        reasons.append(f"local data benchmark.path={benchmark['path']}, not the hub dataset {HUB_DATASET}")
    elif benchmark.get("dataset") != HUB_DATASET:
        reasons.append(f"dataset {benchmark.get('dataset')}, not the hub dataset {HUB_DATASET}")
    errors = int(run.metrics.get("n_errors", 0) or 0)
    if errors:
        reasons.append(f"{errors} samples failed")
    if not _is_hub_id(run.model_id):
        reasons.append(f"model {run.model_id} is not a hub id; the leaderboard names models as org/name")
    return reasons


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


def submission_name(run: RunResult) -> str:
    parts = [DATASET, DATA_DIR, run.model_id.replace("/", "--"), run.method, f"{run.compression_ratio:.2f}"]
    if run.query_aware:
        parts.append("query_aware")
    return "__".join(parts)


def leaderboard_score(metrics: dict) -> float:
    """The leaderboard's figure: the unweighted mean of the tasks' string_match, rounded to 2."""
    values = [task["string_match"] for task in metrics.values()]
    return round(sum(values) / len(values), 2)


def prepare(run: RunResult, allow_partial: bool) -> Submission:
    reasons = refusal_reasons(run)
    if reasons and not allow_partial:
        raise Refused("; ".join(reasons))
    metrics = {task: {"string_match": float(values["score"])} for task, values in sorted(run.tasks.items())}
    if not metrics:
        raise Refused("metrics.json has no task scores")
    samples = run.samples
    config = {
        "dataset": DATASET,
        "data_dir": DATA_DIR,
        "model": run.model_id,
        "press_name": run.method,
        "compression_ratio": run.compression_ratio,
        "query_aware": run.query_aware,
        "fraction": 1.0 if not reasons else round(samples / (SAMPLES_PER_TASK * len(RULER_TASKS)), 4),
        "max_new_tokens": None,  # each task's own generation length, as in the hub data
        "max_context_length": run.config.get("max_context_length"),
        "seed": run.config.get("seed"),
        "press_init_command": str(run.record.get("press")),
    }
    return Submission(run, submission_name(run), config, metrics, leaderboard_score(metrics))


def _answers_cell(answers) -> str:
    return repr([str(answer) for answer in answers])


def predictions_csv(run: RunResult) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(PREDICTION_COLUMNS)
    for row in run.rows:
        writer.writerow(
            [
                row["question"],
                row["answer_prefix"],
                _answers_cell(row["answers"]),
                row["task"],
                row["max_new_tokens"],
                row["prediction"],
                run.compression_ratio,
            ]
        )
    return buffer.getvalue()


def write_submission(submission: Submission, out: Path) -> Path:
    """Assemble the directory beside ``out`` and rename it into place; an old export of the run is replaced."""
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{submission.name}.", dir=out.parent))
    target = out / submission.name
    try:
        (staging / "predictions.csv").write_text(predictions_csv(submission.run), encoding="utf-8")
        (staging / "metrics.json").write_text(json.dumps(submission.metrics, indent=4) + "\n", encoding="utf-8")
        (staging / "config.yaml").write_text(yaml.safe_dump(submission.config, sort_keys=False), encoding="utf-8")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def write_leaderboard_csv(submissions: list[Submission], out: Path) -> Path:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(LEADERBOARD_COLUMNS)
    for s in sorted(submissions, key=lambda s: (s.config["model"], s.run.method, s.run.compression_ratio)):
        writer.writerow(
            [
                DATASET,
                DATA_DIR,
                s.config["model"],
                s.run.method,
                s.run.compression_ratio,
                f"{s.score:.2f}",
                s.run.query_aware,
                s.config["press_init_command"],
            ]
        )
    path = out / "leaderboard.csv"
    rundir.write_atomic(path, buffer.getvalue())
    return path


def export(runs_dir: Path, out: Path, allow_partial: bool = False) -> tuple[list[Submission], list[tuple[Path, str]]]:
    """Write every exportable run; return what was written and what was refused or skipped, with why."""
    runs, skipped = collect_runs(runs_dir)
    refused = list(skipped)
    written: list[Submission] = []
    names: dict[str, Path] = {}
    for run in runs:
        if not is_ruler_4096(run):
            refused.append((run.path, f"not a ruler {DATA_DIR} run (benchmark {run.benchmark})"))
            continue
        try:
            submission = prepare(run, allow_partial)
        except Refused as reason:
            refused.append((run.path, f"partial: {reason}; pass --allow-partial to export it anyway"))
            continue
        if submission.name in names:
            refused.append((run.path, f"{submission.name} is already exported from {names[submission.name]}"))
            continue
        names[submission.name] = run.path
        write_submission(submission, out)
        written.append(submission)
    if written:
        write_leaderboard_csv(written, out)
    return written, refused


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evaluate.leaderboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", nargs="?", type=Path, default=DEFAULT_RUNS, help="default: %(default)s")
    parser.add_argument("--out", type=Path, required=True, help="submission folder (one subdirectory per run)")
    parser.add_argument("--allow-partial", action="store_true", help="export partial runs too (fraction < 1)")
    args = parser.parse_args(argv)
    try:
        written, refused = export(args.runs_dir, args.out, args.allow_partial)
    except ReportError as error:
        raise SystemExit(f"error: {error}") from None
    for path, reason in refused:
        print(f"refused {path}: {reason}", file=sys.stderr)
    for submission in written:
        print(f"{args.out / submission.name}  score {submission.score:.2f}")
    if not written:
        raise SystemExit(f"error: nothing exported from {args.runs_dir}")
    print(f"{len(written)} submissions and {args.out / 'leaderboard.csv'}")


if __name__ == "__main__":
    main()
