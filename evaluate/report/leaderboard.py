"""kvpress leaderboard submissions: ``python -m evaluate.report.leaderboard [RUNS_DIR] --out DIR``.

Every finished RULER-4096 run (``benchmark=ruler``, hub dataset ``simonjegou/ruler``, data_dir ``4096``) becomes
a directory that the kvpress leaderboard reads, named as kvpress's evaluation names its results:

    DIR/{dataset}__{data_dir}__{model with / as --}__{method}__{cr:.2f}[__query_aware]/
        config.yaml      kvpress's evaluation fields (press_init_command is the press repr)
        metrics.json     {task: {"string_match": score}} for the 13 tasks
        predictions.csv  the dataset columns except context, plus predicted_answer and compression_ratio
    DIR/leaderboard.csv  one row per submission folder in DIR; score = unweighted 13-task mean, rounded to 2; and
                         its method's compression at iso-quality (iso_* columns, evaluate/score/iso_quality.py)

Partial runs (a sample limit or fraction, fewer than 13 tasks, data other than the hub dataset, failed
samples) are refused with their reasons unless ``--allow-partial``; runs the format has no place for (a token
budget, a decoding-time press, ``turns=multi``, ``generate=false``) are refused whatever the flag, each saying why.
Each directory is assembled in a staging folder beside DIR and renamed into place only once complete, so a refused or
failed export leaves nothing that looks like a submission.

Exports into one DIR add up: leaderboard.csv is rebuilt from every submission folder DIR holds, so it lists what an
earlier export wrote from other runs too. A submission already in DIR is left as it is when the export would write
the same files, and refused when it would write others (another run of that configuration, or the run since
resumed or rescored) unless ``--replace``.
"""

import argparse
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.benchmarks import failure_coverage, fraction_coverage
from evaluate.benchmarks.ruler import Ruler
from evaluate.errors import ConfigError, refuse
from evaluate.report.frame import runs_frame
from evaluate.report.iso_quality import iso_table
from evaluate.report.runs import DEFAULT_RUNS, NO_PRESS, ReportError, RunResult, collect_runs
from evaluate.score.iso_quality import thresholds

# The leaderboard's dataset is RULER's hub data as the Ruler benchmark defines it (shared/reference/ruler/README.md).
DATASET = Ruler.name
DATA_DIR = Ruler.source.data_dir

LEADERBOARD_COLUMNS = "dataset data_dir model method compression_ratio score query_aware press_init_command".split()
# Each row's method at iso-quality: the largest cr within 1 point and within 95 % of its uncompressed baseline's score,
# and each figure's mark (interpolated, measured, ≥, <); iso_note says why a method has none.
ISO_COLUMNS = "iso_cr_absolute iso_mark_absolute iso_cr_relative iso_mark_relative iso_note".split()
PREDICTION_COLUMNS = "question answer_prefix answer task max_new_tokens predicted_answer compression_ratio".split()


LEADERBOARD_CSV = "leaderboard.csv"
SUBMISSION_FILES = ("config.yaml", "metrics.json", "predictions.csv")


class Refused(Exception):
    """A run that cannot be exported, even with ``--allow-partial``: the leaderboard's format has no place for it."""


class Partial(Refused):
    """A run short of a full leaderboard run, which ``--allow-partial`` exports; the message gives every reason."""


class Taken(Exception):
    """A submission folder already in --out that holds another export of the same name."""


@dataclass
class Submission:
    run: RunResult
    method: str  # the leaderboard's name for it
    name: str
    config: dict
    metrics: dict
    score: float


def is_ruler_4096(run: RunResult) -> bool:
    benchmark = run.benchmark_object
    return run.benchmark == DATASET and isinstance(benchmark, Ruler) and str(benchmark.data_dir) == DATA_DIR


def refusal_reasons(run: RunResult) -> list[str]:
    """Why a finished RULER-4096 run is not a full leaderboard run: its benchmark's coverage, held to every task
    listed and to every sample of the hub data, and a model named by its hub id."""
    benchmark: Ruler = run.benchmark_object
    reasons = []
    limit = run.config.get("limit")
    if limit is not None and int(limit) < benchmark.source.samples_per_task:
        reasons.append(f"limit={limit} (samples per task); rerun with limit=null")
    reasons += fraction_coverage(run.config) + benchmark.task_coverage(run.tasks, shown=None)
    extra = sorted(set(run.tasks) - set(benchmark.all_tasks))
    if extra:
        reasons.append(f"tasks outside RULER's {len(benchmark.all_tasks)}: {', '.join(extra)}")
    reasons += benchmark.source_coverage() + failure_coverage(run.rows)
    if not _is_hub_id(run.model_id):
        reasons.append(f"model {run.model_id} is not a hub id; the leaderboard names models as org/name")
    return reasons


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and not Path(name).exists()


class Unmappable(Exception):
    """A run whose method has no leaderboard name: it would pass for a registry entry it is not."""


def leaderboard_method(run: RunResult) -> str:
    """The press name the leaderboard shows for the run's method.

    This is the one place where a harness method name becomes a leaderboard name (submission directory,
    config.yaml's press_name, leaderboard.csv). The harness names its methods as kvpress's registry does
    (evaluate/registry.py), so a name maps to itself, except a ``_variant`` (named after an entry it is not) and a
    registry name whose recorded press is not that entry (runs recorded before names followed the registry).
    """
    # Only kvpress can build its entries to compare with what a run recorded: imported here, so that reading a
    # results tree (and importing this module) needs neither kvpress nor torch.
    from evaluate import registry

    method = run.method
    if registry.is_variant(method):
        raise Unmappable(f"{method} is not kvpress's {method.removesuffix(registry.VARIANT_SUFFIX)} entry")
    recorded = run.config.get("press", {}).get("press")
    if method in registry.PRESS_REGISTRY and recorded is not None:
        if not registry.same_press(instantiate(recorded), registry.PRESS_REGISTRY[method]()):
            raise Unmappable(f"{method} was run with {run.record.get('press')}, not kvpress's {method} entry")
    return method


def submission_name(run: RunResult) -> str:
    parts = [
        DATASET,
        DATA_DIR,
        run.model_id.replace("/", "--"),
        leaderboard_method(run),
        f"{run.compression_ratio:.2f}",
    ]
    if run.query_aware:
        parts.append("query_aware")
    return "__".join(parts)


def leaderboard_score(metrics: dict) -> float:
    """The leaderboard's figure: the unweighted mean of the tasks' string_match, rounded to 2."""
    values = [task["string_match"] for task in metrics.values()]
    return round(sum(values) / len(values), 2)


def prepare(run: RunResult, allow_partial: bool) -> Submission:
    method = leaderboard_method(run)
    # What --allow-partial cannot lift comes first, so that a refusal never advises a flag that would not help.
    if run.budget is not None:  # a budget gives each context its own ratio: the submission would have no one ratio
        raise Refused(
            f"budget={run.budget}: kvpress's leaderboard places each submission at one compression ratio, and a token "
            "budget compresses each context at its own; rerun with cr= to submit it"
        )
    if run.decoding is not None:  # it compresses to a target while decoding: the submission would have no ratio
        raise Refused(
            f"a decoding-time press (target_size={run.decoding['target_size']}, compression_interval="
            f"{run.decoding['compression_interval']}) reads no compression ratio, and kvpress's leaderboard places "
            "each submission at one; its score is in the report's decoding table"
        )
    if run.cache:  # its submission would share the name of the same press's run on the model's own cache
        raise Refused(
            f"a quantized cache ({run.cache}): kvpress's leaderboard holds each press's keys and values at the model's "
            "dtype; its score is in the report's bytes_at_iso_quality table"
        )
    if run.turns != "independent":  # its submission would share the name of the same press's independent run
        raise Refused(f"turns={run.turns}: kvpress's leaderboard asks each question on its own (turns=independent)")
    if run.score is None:  # the likelihood fields alone: the leaderboard has no place for them
        raise Refused("made with generate=false: no generated answers to score; rerun with generate=true")
    reasons = refusal_reasons(run)
    if reasons and not allow_partial:
        raise Partial("; ".join(reasons))
    # Only the task scores: the likelihood means in metrics.json stay behind (kvpress's format has no place for them).
    metrics = {task: {"string_match": float(values["score"])} for task, values in sorted(run.tasks.items())}
    if not metrics:
        raise Refused("metrics.json has no task scores")
    every_sample = Ruler.source.samples_per_task * len(Ruler.all_tasks)
    config = {
        "dataset": DATASET,
        "data_dir": DATA_DIR,
        "model": run.model_id,
        "press_name": method,
        "compression_ratio": run.compression_ratio,
        "query_aware": run.query_aware,
        "fraction": 1.0 if not reasons else round(run.samples / every_sample, 4),
        "max_new_tokens": run.config.get("max_new_tokens"),  # null: each task's own generation length (the hub data)
        "max_context_length": run.config.get("max_context_length"),
        "seed": run.config.get("seed"),
        "press_init_command": str(run.record.get("press")),
    }
    return Submission(run, method, submission_name(run), config, metrics, leaderboard_score(metrics))


def predictions_csv(run: RunResult) -> str:
    """The dataset columns but the context, the prediction and the ratio, one row per sample."""
    rows = pd.DataFrame(run.rows)
    answers = rows.answers.map(lambda answers: repr([str(answer) for answer in answers]))
    table = rows.assign(answer=answers, predicted_answer=rows.prediction, compression_ratio=run.compression_ratio)
    return table[PREDICTION_COLUMNS].to_csv(index=False, lineterminator="\n")


def _differing_files(staging: Path, target: Path) -> list[str]:
    """The submission files whose content in ``target`` differs from the freshly staged ones (or is missing)."""
    return [
        name
        for name in SUBMISSION_FILES
        if not (target / name).is_file() or (target / name).read_bytes() != (staging / name).read_bytes()
    ]


def write_submission(submission: Submission, out: Path, replace: bool = False) -> str:
    """Assemble the directory beside ``out`` and rename it into place. Returns what became of it: ``written``, or
    ``unchanged`` when ``out`` already holds these very files, or ``replaced`` (only under ``replace``) when it held
    others by that name; without ``replace`` those are kept and :class:`Taken` says so."""
    out.mkdir(parents=True, exist_ok=True)
    staging = rundir.staging_folder(out.parent, f".{submission.name}.")
    target = out / submission.name
    try:
        (staging / "predictions.csv").write_text(predictions_csv(submission.run), encoding="utf-8")
        (staging / "metrics.json").write_text(json.dumps(submission.metrics, indent=4) + "\n", encoding="utf-8")
        (staging / "config.yaml").write_text(yaml.safe_dump(submission.config, sort_keys=False), encoding="utf-8")
        outcome = "written"
        if target.exists():
            differing = _differing_files(staging, target)
            if not differing:
                shutil.rmtree(staging)
                return "unchanged"
            if not replace:
                raise Taken(
                    f"{target} already holds another export by that name (its {', '.join(differing)} would "
                    "change); pass --replace to replace it, or --out another folder to keep both"
                )
            shutil.rmtree(target)
            outcome = "replaced"
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return outcome


def _leaderboard_row(folder: Path) -> list:
    """A submission folder's leaderboard.csv row, read back from its own config.yaml and metrics.json; ValueError
    (or KeyError, TypeError, OSError) for a folder that is no readable submission."""
    missing = [name for name in SUBMISSION_FILES[:2] if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"no {' nor '.join(missing)}")
    config = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    metrics = json.loads((folder / "metrics.json").read_text(encoding="utf-8"))
    score = leaderboard_score(metrics)
    ratio = float(config["compression_ratio"])
    head = [config["dataset"], config["data_dir"], str(config["model"]), str(config["press_name"]), ratio]
    return [*head, f"{score:.2f}", bool(config["query_aware"]), config["press_init_command"]]


def iso_columns(submissions: list[Submission], runs: list[RunResult]) -> dict[str, list]:
    """Each compressed submission's ISO_COLUMNS, by submission name: its method series (the submissions of one
    method, variant, model and query-awareness with one baseline) at iso-quality, against the baseline that
    evaluate/score/baseline.py pairs its runs with among the ``no_press`` runs of ``runs``; without intervals (the
    report's iso_quality table has them)."""
    if not submissions:  # nothing exported this time: no series to place
        return {}
    members = [submission.run for submission in submissions]
    pool = members + [run for run in runs if run.method == NO_PRESS and all(run is not m for m in members)]
    chosen = thresholds()
    _, series = iso_table(pool, runs_frame(pool), chosen, resamples=0)
    found = {}
    for row in series.to_dict("records"):
        figures = []
        for threshold in chosen:
            value = row.get(threshold.name)
            figures += [None, ""] if value is None or isinstance(value, float) else [value.cr, value.mark]
        for position in row["runs"]:
            if position < len(submissions):
                found[submissions[position].name] = [*figures, row["note"]]
    return found


def write_leaderboard_csv(out: Path, iso: dict[str, list] | None = None) -> tuple[int, list[tuple[Path, str]]]:
    """Rebuild leaderboard.csv from every submission folder in ``out``, whichever export wrote it, so that the file
    and the folders always agree; returns its row count and the folders left out, with why (hidden staging folders
    are none). ``iso`` holds the iso-quality columns by submission name (:func:`iso_columns`); a folder without
    them keeps what leaderboard.csv held for its row (an earlier export's), else leaves them empty (the
    no-compression run)."""
    rows, left_out = [], []
    iso = iso or {}
    earlier = _earlier_iso_columns(out / LEADERBOARD_CSV)
    for folder in sorted(path for path in out.iterdir() if path.is_dir() and not path.name.startswith(".")):
        try:
            row = _leaderboard_row(folder)
            kept = earlier.get(tuple("" if value is None else str(value) for value in row), [None, "", None, "", ""])
            rows.append(row + iso.get(folder.name, kept))
        except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, yaml.YAMLError) as error:
            reason = f"{type(error).__name__}: {error}" if not isinstance(error, ValueError) else str(error)
            left_out.append((folder, f"not a submission, left out of {LEADERBOARD_CSV} ({reason})"))
    rows.sort(key=lambda row: (row[2], row[3], row[4], row[6]))  # model, method, ratio, query_aware
    table = pd.DataFrame(rows, columns=[*LEADERBOARD_COLUMNS, *ISO_COLUMNS]).astype(
        {"iso_cr_absolute": float, "iso_cr_relative": float}
    )
    rundir.write_atomic(out / LEADERBOARD_CSV, table.to_csv(index=False, lineterminator="\n"))
    return len(rows), left_out


def _earlier_iso_columns(path: Path) -> dict[tuple[str, ...], list]:
    """The ISO_COLUMNS leaderboard.csv holds, by its row's other columns as text: what an earlier export computed
    for runs this export does not hold, which a rebuild keeps."""
    if not path.exists():
        return {}
    table = pd.read_csv(path, dtype=str, keep_default_na=False)
    if not set(ISO_COLUMNS) <= set(table.columns):
        return {}
    earlier = {}
    for row in table.to_dict("records"):
        figures = [row[column] for column in ISO_COLUMNS]
        for position in (0, 2):  # the ratios are numbers, empty where none
            figures[position] = float(figures[position]) if figures[position] else None
        earlier[tuple(row[column] for column in LEADERBOARD_COLUMNS)] = figures
    return earlier


def check_out(out: Path) -> None:
    """Refuse an --out that is, or lies under, something other than a folder, before anything is written."""
    top = rundir.first_missing(out)
    existing = out if top is None else top.parent
    if not existing.is_dir():
        where = "" if existing == out else f" lies under {existing}, which"
        raise ConfigError(f"--out {out}{where} is not a folder; pass a folder for the submissions")


def export(
    runs_dir: Path, out: Path, allow_partial: bool = False, replace: bool = False
) -> tuple[list[tuple[Submission, str]], list[tuple[Path, str]], int]:
    """Write every exportable run and rebuild leaderboard.csv; return each submission with what became of it
    (:func:`write_submission`), what was refused or skipped, with why, and how many rows leaderboard.csv lists."""
    check_out(out)
    runs, skipped = collect_runs(runs_dir)
    refused = list(skipped)
    written: list[tuple[Submission, str]] = []
    names: dict[str, Path] = {}
    for run in runs:
        if not is_ruler_4096(run):
            refused.append((run.path, f"not a ruler {DATA_DIR} run (benchmark {run.benchmark})"))
            continue
        try:
            submission = prepare(run, allow_partial)
        except Unmappable as reason:
            refused.append((run.path, f"no leaderboard name: {reason}"))
            continue
        except Partial as reason:
            refused.append((run.path, f"partial: {reason}; pass --allow-partial to export it anyway"))
            continue
        except Refused as reason:
            refused.append((run.path, f"not exportable: {reason}"))
            continue
        except (KeyError, TypeError) as error:  # a task without its score, a row without its answers
            refused.append((run.path, f"{run.path / rundir.METRICS} lacks a field the submission needs ({error!r})"))
            continue
        if submission.name in names:
            refused.append((run.path, f"{submission.name} is already exported from {names[submission.name]}"))
            continue
        try:
            outcome = write_submission(submission, out, replace)
        except KeyError as error:
            refused.append((run.path, f"{run.path / rundir.PREDICTIONS}: rows without the column {error}"))
            continue
        except Taken as reason:
            refused.append((run.path, str(reason)))
            continue
        names[submission.name] = run.path
        written.append((submission, outcome))
    listed = 0
    if out.is_dir() and any(out.iterdir()):  # a folder this export created and left empty stays so
        listed, left_out = write_leaderboard_csv(out, iso_columns([submission for submission, _ in written], runs))
        refused += left_out
    return written, refused, listed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evaluate.report.leaderboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", nargs="?", type=Path, default=DEFAULT_RUNS, help="default: %(default)s")
    parser.add_argument("--out", type=Path, required=True, help="submission folder (one subdirectory per run)")
    parser.add_argument(
        "--allow-partial",
        action="store_true",
        help=(
            "export runs that are not full leaderboard runs too: a limit, fraction < 1, missing tasks, local data, "
            "failed samples, or a model without a hub id (refused, with the reason, without this flag)"
        ),
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="replace a submission already in --out whose files would change (refused, naming it, without this flag)",
    )
    args = parser.parse_args(argv)
    try:
        written, refused, listed = export(args.runs_dir, args.out, args.allow_partial, args.replace)
    except ConfigError as error:
        refuse(error)
    except ReportError as error:
        raise SystemExit(f"error: {error}") from None
    for path, reason in refused:
        print(f"refused {path}: {reason}", file=sys.stderr)
    for submission, outcome in written:
        print(
            f"{args.out / submission.name}  score {submission.score:.2f}"
            + ("" if outcome == "written" else f" ({outcome})")
        )
    if not written:
        raise SystemExit(f"error: nothing exported from {args.runs_dir}")
    earlier = f" (of {listed}: {args.out} holds earlier exports too)" if listed > len(written) else ""
    print(f"{len(written)} submissions and {args.out / LEADERBOARD_CSV}{earlier}")


if __name__ == "__main__":
    main()
