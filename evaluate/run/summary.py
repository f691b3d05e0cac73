"""The lines a run or a sweep ends with: headlines next to the uncompressed score, failures, files, what to run next."""

import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.points.point import PointSpec
from evaluate.report.runs import flatten
from evaluate.score.answer_length import drift_metrics
from evaluate.score.baseline import find_baseline
from evaluate.score.turns import SCORE_BY_TURN
from evaluate.settings import NON_RESULT_KEYS, RUNNER_KNOBS

# Overrides that choose the press (its runner knobs included); the uncompressed run of the same samples drops them.
PRESS_OVERRIDES = (
    "press=",
    "press.",
    "scorer=",
    "scorer.",
    "cr=",
    "budget=",
    "+press.",
    "+scorer.",
    "method=",
    *(f"{knob}=" for knob in sorted(RUNNER_KNOBS)),
)


def _last_of_each_key(overrides: Sequence[str]) -> list[str]:
    """The run's overrides, the last one of each key only (as Hydra applies them: `make run ARGS=press=none`)."""
    last = {override.split("=", 1)[0]: override for override in overrides}
    return list(last.values())


def uncompressed_score(spec: PointSpec, sample_ids: set[str]) -> tuple[float, Path, list[dict]] | None:
    """The headline this run's uncompressed baseline (evaluate/score/baseline.py) under ``output_dir`` gives on
    exactly these samples, its directory and its rows; None when no run there is its baseline."""
    config = (rundir.read_yaml(spec.out / rundir.CONFIG) or {}).get("config", {})
    found = find_baseline(Path(spec.output_dir), config, sample_ids)
    if found is None:
        return None
    same = [row for row in found[1] if row["id"] in sample_ids]
    return instantiate(spec.benchmark).score(same)["score"], found[0], same


def answer_length_line(rows: list[dict], baseline_rows: list[dict]) -> list[str]:
    """The line on the answers' length against the uncompressed answers (evaluate/score/answer_length.py), where
    both runs recorded token ids."""
    drift = drift_metrics(rows, baseline_rows)
    if drift is None:
        return []
    return [
        f"answers, same samples: {drift['answer_tokens']:.2f} tokens on average (uncompressed "
        f"{drift['answer_tokens_uncompressed']:.2f}), {100 * drift['hit_cap']:.1f} % hit max_new_tokens (uncompressed "
        f"{100 * drift['hit_cap_uncompressed']:.1f} %), {100 * drift['stopped_earlier']:.1f} % stopped earlier, "
        f"{drift['common_prefix']:.2f} tokens in common before the first difference"
    ]


def turn_line(metrics: dict) -> list[str]:
    """The line on the score on each turn's samples (evaluate/score/turns.py), where the samples are turns of
    conversations and were answered."""
    scores = metrics.get(SCORE_BY_TURN) or {}
    if all(score is None for score in scores.values()):  # no turns, or generate=false
        return []
    return ["score by turn: " + ", ".join(f"{turn} → {score:.2f}" for turn, score in scores.items())]


def decoding_line(spec: PointSpec, record: dict) -> list[str]:
    """The line on whether a decoding-time press compressed (run.json's ``decoding``, evaluate/score/decoding.py)."""
    counted = record.get("decoding")
    if not counted:
        return []
    target_size, interval = spec.decoding_target
    if counted["rows_compressed"] == 0:
        return [
            f"{spec.method} never compressed: no answer's cache outgrew target_size={target_size} at a "
            f"compression (every {interval} steps), so its answers ({counted['rows']}) are the uncompressed model's; "
            "lower target_size or compression_interval"
        ]
    return [f"{spec.method} compressed {counted['rows_compressed']} of {counted['rows']} answers"]


def likelihood_summary(likelihood: dict) -> str:
    return (
        f"answer KL {likelihood['answer_kl']:.4g} from the uncompressed model, top-1 kept at "
        f"{100 * likelihood['answer_top1']:.1f} %, answer NLL {likelihood['answer_nll']:.3f} "
        f"(uncompressed {likelihood['answer_nll_uncompressed']:.3f})"
    )


def diagnostics_summary(diagnostics: dict) -> list[str]:
    """The diagnostics' headlines (evaluate/score/diagnostics.py), where the run has them."""
    names = {"answer_retention": "answer retention", "attention_recall": "attention recall"}
    return [f"{names[name]} {100 * diagnostics[name]['mean']:.1f} %" for name in names if name in diagnostics]


def run_summary(spec: PointSpec, metrics: dict, overrides: Sequence[str] = ()) -> str:
    """The lines a single run ends with; ``overrides`` are its command line's (the commands it suggests keep them)."""
    out = spec.out
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    kept = [row["kept_ratio"] for row in rows if row.get("kept_ratio") is not None]
    method = spec.method
    at = spec.kept_text if spec.effective_cr is None else f"cr {spec.kept_text}"  # budget=64, target_size=.., cr 0.50
    record = rundir.read_json(out / rundir.RUN) or {}
    lines = [
        f"{method} at {at} on {spec.benchmark_name} ({spec.model_name}, {len(rows)} samples): "
        + ", ".join(
            [
                *([f"score {metrics['score']}"] if metrics.get("score") is not None else []),
                *([likelihood_summary(metrics["likelihood"])] if metrics.get("likelihood") else []),
                *([f"{100 * sum(kept) / len(kept):.1f} % of the KV pairs kept on average"] if kept else []),
                *diagnostics_summary(metrics.get("diagnostics") or {}),
            ]
        )
    ]
    lines += turn_line(metrics)
    lines += decoding_line(spec, record)
    if note := (record.get("answered_by") or {}).get("note"):
        lines.append(f"answered from the pool: {note}")
    failed = [row["error"] for row in rows if row.get("error")]
    if failed:
        lines.append(
            f"{len(failed)} of {len(rows)} samples failed and count as wrong answers; the first: {failed[0]} "
            "(rerun with retry_errors=true to answer them again)"
        )
    overrides = _last_of_each_key(overrides)
    # A shard's share is no run of its own: the commands it suggests are for the whole point.
    others = [override for override in overrides if not override.startswith((*PRESS_OVERRIDES, "shard="))]
    if method != "no_press":
        found = uncompressed_score(spec, {row["id"] for row in rows})
        if found is not None:
            lines.append(f"uncompressed, same samples: score {found[0]} ({found[1]})")
            lines += answer_length_line(rows, found[2])
        else:
            uncompressed = shlex.join(["press=none", *others])
            lines.append(f"no uncompressed run of these samples and settings yet: python -m evaluate {uncompressed}")
    lines.append(f"files: {out}/ (predictions.jsonl, metrics.json, run.json, config.yaml)")
    # The sweep suggested is the run's own press, its knobs included, at more ratios (or budgets, or targets); an
    # uncompressed run's sweeps two presses that compress.
    axis = _sweep_axis(spec)
    press = [o for o in overrides if o.startswith(PRESS_OVERRIDES) and not o.startswith(f"{axis.partition('=')[0]}=")]
    if method == "no_press":
        press = ["press=chunkkv,eg_chunkkv"]
    report = shlex.quote(str(spec.output_dir))
    lines.append(f"next: python -m evaluate.report {report}   (tables and plots of every run)")
    sweep = shlex.join(["-m", *press, *others, axis])
    lines.append(f"      python -m evaluate {sweep}   (a sweep: one model load, one prefill per context)")
    return "\n".join(lines)


def _sweep_axis(spec: PointSpec) -> str:
    """The axis the suggested sweep runs along: a budget run's budgets (cr beside a budget is refused), a
    decoding-time press's targets (it reads no cr), else ratios."""
    if spec.budget is not None:
        return "budget=64,256,1024"
    target = spec.decoding_target
    if target is not None:
        return f"target_size={','.join(str(max(1, target[0] // 4**step)) for step in (2, 1, 0))}"
    return "cr=0.5,0.7,0.9"


def failed_samples(metrics: dict) -> tuple[int, int]:
    """How many of a run's samples failed, and how many it has."""
    return int(metrics.get("n_errors", 0)), sum(int(task.get("n", 0)) for task in metrics["tasks"].values())


def _settings(spec: PointSpec) -> dict[str, str]:
    """A point's result settings but the press and ratio (its method names those), flattened to dotted keys, and its
    cache as its label names it."""
    data = spec.recorded
    left_out = {*NON_RESULT_KEYS, "cr", "budget", "press", "scorer", "cache"}
    kept = {key: value for key, value in data.items() if key not in left_out}
    # The cache as labels name it (its knobs are read only by the quantized one): "" for the model's own.
    return {key: str(value) for key, value in flatten(kept).items()} | {"cache": spec.kv_cache.label}


def _headline(metrics: dict | None) -> str:
    """A point's cell: its score ('-' without one: left to another process, or generate=false), and its answer
    KL when it has the likelihood fields."""
    if metrics is None:
        return "-"
    kl = f"{metrics['likelihood']['answer_kl']:.3g}" if metrics.get("likelihood") else None
    if metrics.get("score") is None:
        return kl or "-"
    return f"{metrics['score']} ({kl})" if kl else str(metrics["score"])


def _kept_order(kept: str) -> tuple[int, float]:
    """Ratios, then budgets, then decoding-time targets, each by its size (budget=1024 after budget=256)."""
    kinds = ("budget=", "target_size=")
    kind = next((index for index, prefix in enumerate(kinds, 1) if kept.startswith(prefix)), 0)
    return kind, float(re.search(r"[\d.]+", kept).group())


def _axis_name(spec: PointSpec) -> str:
    if spec.budget is not None:
        return "budget"
    return "cr" if spec.decoding_target is None else "target_size"


def sweep_summary(specs: Sequence[PointSpec], metrics: Sequence[dict | None]) -> str:
    """The lines a sweep ends with: every point's headline in one method x cr table (rows also split by any other
    setting the points differ in; '-' for a point left to another process), then the points whose samples failed."""
    settings = pd.DataFrame([_settings(spec) for spec in specs])
    differing = [key for key in settings.columns if settings[key].nunique(dropna=False) > 1]
    # press=none at several ratios is one run, one cell.
    points = (
        settings[differing]
        .assign(
            method=[spec.method for spec in specs],
            cr=[spec.kept_text for spec in specs],
            score=[_headline(result) for result in metrics],
            run=[spec.out for spec in specs],
        )
        .drop_duplicates("run")
    )
    # Points that differ only in a setting this table leaves out (a press knob) share a cell, joined by " / ".
    table = points.pivot_table(index=["method", *differing], columns="cr", values="score", aggfunc=" / ".join)
    table = table[sorted(table.columns, key=_kept_order)]
    scored = any(result and result.get("score") is not None for result in metrics)
    with_kl = any(result and result.get("likelihood") for result in metrics)
    shown = {(True, True): "score (answer KL)", (True, False): "score", (False, True): "answer KL"}.get(
        (scored, with_kl), "score"
    )
    axes = {_axis_name(spec) for spec in specs}
    axis = table.columns.name = " or ".join(name for name in ("cr", "budget", "target_size") if name in axes)
    lines = [f"sweep of {len(specs)} points, {shown} by method and {axis}:", table.fillna("").to_string()]
    failed = []
    for index in points.index:
        spec, result = specs[index], metrics[index]
        errors, samples = failed_samples(result) if result is not None else (0, 0)
        if errors:
            rows = rundir.read_predictions(spec.out / rundir.PREDICTIONS)
            first = next(row["error"] for row in rows if row.get("error"))
            failed.append(f"  {spec.out}: {errors} of {samples} samples failed; the first: {first}")
    if failed:
        lines += [f"{len(failed)} points had failed samples (rerun with retry_errors=true to answer them again):"]
        lines += failed
    lines += _decoding_notes([specs[index] for index in points.index])
    waiting = waiting_summary(specs, metrics)
    return "\n".join([*lines, *([waiting] if waiting else [])])


def _decoding_notes(specs: Sequence[PointSpec]) -> list[str]:
    """A sweep's decoding-time points that never compressed, and those whose pooled answers may part from
    kvpress's batch of one (each point's run.json)."""
    records = {spec.out: rundir.read_json(spec.out / rundir.RUN) or {} for spec in specs}
    never = [str(out) for out, record in records.items() if (record.get("decoding") or {}).get("rows_compressed") == 0]
    noted = [out for out, record in records.items() if (record.get("answered_by") or {}).get("note")]
    lines = []
    if never:
        lines += [
            f"{len(never)} points never compressed (no answer outgrew target_size): their answers are the "
            "uncompressed model's; lower target_size or compression_interval:",
            *(f"  {out}" for out in never),
        ]
    if noted:
        lines.append(
            f"{len(noted)} points answered from the pool with a note (run.json's answered_by.note), the first:"
        )
        lines.append(f"  {noted[0].name}: {records[noted[0]]['answered_by']['note']}")
    return lines


def waiting_summary(specs: Sequence[PointSpec], metrics: Sequence[dict | None]) -> str:
    """The points that wait for other shards (evaluate/points/shard.py), each with the shards whose samples are
    missing and whether they still run, as its run.json says; empty when none waits."""
    lines = []
    for spec, result in zip(specs, metrics, strict=True):
        record = rundir.read_json(spec.out / rundir.RUN) or {}
        if result is None and "shards" in record:
            lines.append(f"  {spec.out}: {record['status']}, {record['unanswered']} samples: {record['error']}")
    if not lines:
        return ""
    return "\n".join([f"{len(lines)} points wait for other shards (the last shard to finish scores each):", *lines])


def session_record(spec: PointSpec) -> Path:
    """The file this process's sessions of a point are recorded in: run.json, or its shard's own record."""
    shard = spec.shard
    return spec.out / rundir.RUN if shard.whole else rundir.shard_path(spec.out, shard.name, ".json")


def interrupted_summary(specs: Sequence[PointSpec]) -> str:
    """The one line a run or sweep stopped by Ctrl-C or SIGTERM ends with: what this session answered and kept (the
    session_samples of each run.json; earlier sessions' rows are not its own), and the command that resumes it."""
    command = shlex.join(["python", "-m", "evaluate", *sys.argv[1:]])
    if not specs:  # stopped while its points were checked
        return f"interrupted before any run started; rerun: {command}"
    records = [rundir.read_json(session_record(spec)) or {} for spec in specs]
    kept = sum(record.get("session_samples", 0) for record in records)
    where = specs[0].out if len(specs) == 1 else specs[0].output_dir
    return f"interrupted: {kept} samples answered and kept in {where}; rerun to resume: {command}"
