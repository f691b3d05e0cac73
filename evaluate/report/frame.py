"""Finished runs as one tidy DataFrame: a row per run x task, the data every table, plot and summary reads."""

from collections.abc import Sequence

import pandas as pd

from evaluate.cost_schema import COST_KEYS
from evaluate.report.runs import NO_PRESS, ROW_KEY, RunResult, find_baselines, variant_names
from evaluate.score.answer_length import DRIFT_FIELDS, drift_metrics, own_metrics
from evaluate.score.diagnostics import FIELDS as DIAGNOSTIC_FIELDS
from evaluate.score.likelihood import FIELDS as LIKELIHOOD_FIELDS

_RUN_ATTRIBUTES = "benchmark model model_id method variant query_aware score interval_note partial_reasons".split()
_RUN_ATTRIBUTES += "turns history score_by_turn samples_by_turn generate variant_settings cache".split()
_INTERVAL = {"ci_low": "low", "ci_high": "high", "contexts": "contexts"}  # frame column: Interval attribute
_TASK_COLUMNS = [
    "task",
    "task_score",
    "task_n",
    *(f"task_{name}" for name in LIKELIHOOD_FIELDS),
    "task_likelihood_n",
    *(f"task_{name}" for name in DIAGNOSTIC_FIELDS),
]
QUERY_AWARE = {True: " (query-aware)", False: ""}  # what labels add for query-aware runs


def mode_label(turns: str, history: str) -> str:
    """What labels add for a multi-turn run (conf/config.yaml's turns and history); nothing for independent turns,
    kvpress's way and that of every run recorded before the settings existed, so that their labels stay as they were."""
    if turns == "independent":
        return ""
    return " (multi-turn)" if history == "reference" else f" (multi-turn, {history} history)"


def cache_mark(cache: str) -> str:
    """What labels add for a run on a quantized cache (`` (quanto 4-bit)``); nothing for the model's own cache."""
    return f" ({cache})" if cache else ""


def bracketed(variant: str) -> str:
    """`` [variant]``, or nothing for a run that is no variant."""
    return f" [{variant}]" if variant else ""


def answer_length(runs: Sequence[RunResult], position: int, baseline: int | None) -> dict:
    """A run's answer-length fields (evaluate/score/answer_length.py), recomputed from the prediction files: against
    its baseline's answers where both recorded token ids, else its own (length and cap share) where it did; NaN for
    the rest. ``answer_length_n`` counts the rows they are over."""
    rows = runs[position].rows
    found = (drift_metrics(rows, runs[baseline].rows) if baseline is not None else None) or own_metrics(rows) or {}
    return {**{name: found.get(name) for name in DRIFT_FIELDS}, "answer_length_n": found.get("n")}


def decoding_fields(run: RunResult, kept: Sequence[float]) -> dict:
    """A decoding-time run's fields (config.yaml's ``decoding``; NaN and False for other runs): ``decoding``, its
    ``target_size`` and ``compression_interval``, run.json's ``rows_compressed``, and ``never_compressed``: no row was
    ever compressed, as run.json's ``decoding.rows_compressed`` counts them, or, where run.json lacks the count, every
    row's measured ``kept`` ratio is 1."""
    decoding = run.decoding or {}
    compressed = (run.run.get("decoding") or {}).get("rows_compressed")
    never = compressed == 0 if compressed is not None else bool(kept) and all(ratio == 1.0 for ratio in kept)
    return {
        "decoding": run.decoding is not None,
        "target_size": decoding.get("target_size"),
        "compression_interval": decoding.get("compression_interval"),
        "rows_compressed": compressed,
        "never_compressed": run.decoding is not None and never,
    }


def runs_frame(runs: Sequence[RunResult]) -> pd.DataFrame:
    """One row per run x task, in the order of ``runs`` and of task names (a run without tasks keeps a row, task
    None). Besides the run's figures: ``run``, its position in ``runs``; ``cr`` as recorded and ``ratio`` rounded
    to match runs on, or ``budget``, the tokens kept of each context, for a token-budget run (NaN in the other);
    ``reference``, a no_press run; ``baseline``, the position of the run's uncompressed baseline
    (evaluate/score/baseline.py), NA for none; ``contexts``, the fewest any task's interval resampled; ``n``,
    samples; ``settings``, the benchmark's config; the answer-length fields (:func:`answer_length`); each
    likelihood field's headline (``answer_kl``, ...) with its interval (``answer_kl_low``, ``answer_kl_high``) and
    ``likelihood_n``, the rows that have them; ``answer_retention`` and ``attention_recall``, the diagnostics'
    headlines (evaluate/score/diagnostics.py); ``turns``, ``history`` and ``turn_mode`` (:func:`mode_label`),
    ``score_by_turn`` and ``samples_by_turn`` (metrics.json's, empty without turns); ``generate``; ``kept_ratio``,
    the mean of the rows' measured kept share, and a decoding-time run's fields (:func:`decoding_fields`);
    ``variant_settings``, what :func:`labelled` tells runs apart by; then task, task_score, task_n and the task's
    likelihood means (``task_answer_kl``, ..., ``task_likelihood_n``) and diagnostics' means (``task_answer_retention``,
    ``task_attention_recall``)."""
    records = []
    baselines = find_baselines(runs)
    for position, run in enumerate(runs):
        records += _task_records(run, _run_record(runs, position, baselines[position]))
    return labelled(pd.DataFrame.from_records(records).astype(_column_types()))


def _run_record(runs: Sequence[RunResult], position: int, baseline: int | None) -> dict:
    """The columns of run ``position`` that each of its task rows repeats (see :func:`runs_frame`), in their order."""
    run = runs[position]
    kept = [row["kept_ratio"] for row in run.rows if row.get("kept_ratio") is not None]
    return {
        **{name: getattr(run, name) for name in _RUN_ATTRIBUTES},
        "turn_mode": mode_label(run.turns, run.history),
        "run": position,
        "cr": run.compression_ratio,
        "ratio": round(run.compression_ratio, 6),
        "budget": run.budget,
        "reference": run.method == NO_PRESS,
        "baseline": baseline,
        **{column: getattr(run.interval, name, None) for column, name in _INTERVAL.items()},
        "n": run.samples,
        "partial": bool(run.partial_reasons),
        "settings": run.config.get("benchmark", {}),
        "status": run.run.get("status", ""),
        "kept_ratio": sum(kept) / len(kept) if kept else None,
        **decoding_fields(run, kept),
        **{key: run.run.get(key) for key in COST_KEYS},
        "run_dir": str(run.path),
        **_likelihood_fields(run),
        **{name: (run.diagnostics.get(name) or {}).get("mean") for name in DIAGNOSTIC_FIELDS},
        **answer_length(runs, position, baseline),
    }


def _likelihood_fields(run: RunResult) -> dict:
    """A run's likelihood headlines (``answer_kl``, ...), their intervals' ends (``answer_kl_low``, ...) and
    ``likelihood_n``; None where the run has none."""
    return {
        **{name: run.likelihood.get(name) for name in LIKELIHOOD_FIELDS},
        **{
            f"{name}_{end}": getattr(run.likelihood_intervals.get(name), end, None)
            for name in LIKELIHOOD_FIELDS
            for end in ("low", "high")
        },
        "likelihood_n": run.likelihood.get("n"),
    }


def _task_records(run: RunResult, common: dict) -> list[dict]:
    """A record per task of ``run``, by task name: ``common`` and the task's figures; a run without tasks still
    gets one, task None, so that it keeps its row."""
    likelihood = run.likelihood.get("tasks", {})
    records = []
    for task, values in sorted(run.tasks.items()) or [(None, {})]:
        means = likelihood.get(task, {})
        task_likelihood = {f"task_{name}": means.get(name) for name in LIKELIHOOD_FIELDS}
        task_figures = {"task_score": values.get("score"), "task_n": values.get("n", 0), **task_likelihood}
        diagnostics = {
            f"task_{name}": ((run.diagnostics.get(name) or {}).get("tasks", {}).get(task) or {}).get("mean")
            for name in DIAGNOSTIC_FIELDS
        }
        records.append({**common, "task": task, **task_figures, "task_likelihood_n": means.get("n"), **diagnostics})
    return records


def _column_types() -> dict:
    """The dtype of each numeric column of :func:`runs_frame`: nullable Int64 for counts and positions, float for
    figures, so that a missing value is NA or NaN rather than None in an object column."""
    # Scores are floats, NaN where a benchmark gives none (ZeroSCROLLS): tables show "-", plots draw nothing.
    numbers = {"baseline": "Int64", "contexts": "Int64", "task_n": "Int64", "score": float, "task_score": float}
    numbers |= {"cr": float, "ratio": float, "budget": float}  # NaN where the other decides what is kept
    numbers |= {"target_size": "Int64", "compression_interval": "Int64", "rows_compressed": "Int64"}
    likelihood_columns = [
        *LIKELIHOOD_FIELDS,
        *(f"{name}_{end}" for name in LIKELIHOOD_FIELDS for end in ("low", "high")),
    ]
    numbers |= {column: float for column in [*likelihood_columns, *(f"task_{name}" for name in LIKELIHOOD_FIELDS)]}
    numbers |= {"likelihood_n": "Int64", "task_likelihood_n": "Int64", "answer_length_n": "Int64"}
    numbers |= dict.fromkeys(DRIFT_FIELDS, float)
    numbers |= dict.fromkeys([*DIAGNOSTIC_FIELDS, *(f"task_{name}" for name in DIAGNOSTIC_FIELDS)], float)
    return numbers


def labelled(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each run's ``variant`` and ``label`` (what tells a row's runs apart) as the runs in ``frame``
    alone tell them apart: a table or figure labels its own runs, so that a setting is named only where it separates
    two of them, never for a run it drops (a generate=false run in a plot of scores)."""
    level = frame.drop_duplicates("run")
    keys = list(level[list(ROW_KEY)].itertuples(index=False, name=None))
    variant = frame.run.map(dict(zip(level.run, variant_names(level.variant_settings.tolist(), keys), strict=True)))
    label = frame.method.mask(frame.reference, "no compression") + variant.astype(str).map(bracketed)
    label += frame.cache.map(cache_mark) + frame.query_aware.map(QUERY_AWARE) + frame.turn_mode
    return frame.assign(variant=variant.astype(str), label=label)


def run_level(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per run, without the task columns."""
    return frame.drop_duplicates("run").drop(columns=_TASK_COLUMNS).reset_index(drop=True)


def with_baselines(frame: pd.DataFrame, chosen: pd.Series) -> pd.DataFrame:
    """The runs of ``frame`` that ``chosen`` marks, with the ``no_press`` runs that are their baselines."""
    return frame[chosen | (frame.reference & frame.run.isin(frame.baseline[chosen].dropna()))]


def split_by_axis(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``frame``'s runs at a compression ratio (every ``no_press`` run among them); its token-budget runs
    (``budget=N``), and its decoding-time runs (config.yaml's ``decoding``), each with the ``no_press`` runs that are
    their baselines: the tables and plots by cr read the first, those by budget the second, the decoding table the
    third, so that none mistakes another's runs for its own (nor credits a decoding-time run with the cr it ignored)."""
    budget = frame.budget.notna()
    return frame[~budget & ~frame.decoding], with_baselines(frame, budget), with_baselines(frame, frame.decoding)
