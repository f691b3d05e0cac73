"""Finished runs as one tidy DataFrame: a row per run x task, the data every table, plot and summary reads."""

from collections.abc import Sequence

import pandas as pd

from evaluate.cost_schema import COST_KEYS
from evaluate.report.runs import NO_PRESS, RunResult, find_baselines
from evaluate.score.answer_length import DRIFT_FIELDS, drift_metrics, own_metrics
from evaluate.score.likelihood import FIELDS as LIKELIHOOD_FIELDS

_RUN_ATTRIBUTES = "benchmark model model_id method variant query_aware score interval_note partial_reasons".split()
_RUN_ATTRIBUTES += "turns history score_by_turn samples_by_turn".split()
_INTERVAL = {"ci_low": "low", "ci_high": "high", "contexts": "contexts"}  # frame column: Interval attribute
_TASK_COLUMNS = ["task", "task_score", "task_n", *(f"task_{name}" for name in LIKELIHOOD_FIELDS), "task_likelihood_n"]
QUERY_AWARE = {True: " (query-aware)", False: ""}  # what labels add for query-aware runs


def mode_label(turns: str, history: str) -> str:
    """What labels add for a multi-turn run (conf/config.yaml's turns and history); nothing for independent turns,
    kvpress's way and that of every run recorded before the settings existed, so that their labels stay as they were."""
    if turns == "independent":
        return ""
    return " (multi-turn)" if history == "reference" else f" (multi-turn, {history} history)"


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


def runs_frame(runs: Sequence[RunResult]) -> pd.DataFrame:
    """One row per run x task, in the order of ``runs`` and of task names (a run without tasks keeps a row, task
    None). Besides the run's figures: ``run``, its position in ``runs``; ``cr`` as recorded and ``ratio`` rounded
    to match runs on, or ``budget``, the tokens kept of each context, for a token-budget run (NaN in the other);
    ``reference``, a no_press run; ``baseline``, the position of the run's uncompressed baseline
    (evaluate/score/baseline.py), NA for none; ``contexts``, the fewest any task's interval resampled; ``n``,
    samples; ``settings``, the benchmark's config; the answer-length fields (:func:`answer_length`); each
    likelihood field's headline (``answer_kl``, ...) with its interval (``answer_kl_low``, ``answer_kl_high``) and
    ``likelihood_n``, the rows that have them; ``turns``, ``history`` and ``turn_mode`` (:func:`mode_label`),
    ``score_by_turn`` and ``samples_by_turn`` (metrics.json's, empty without turns); then task, task_score, task_n
    and the task's likelihood means (``task_answer_kl``, ..., ``task_likelihood_n``)."""
    records = []
    baselines = find_baselines(runs)
    for position, run in enumerate(runs):
        kept = [row["kept_ratio"] for row in run.rows if row.get("kept_ratio") is not None]
        common = {
            **{name: getattr(run, name) for name in _RUN_ATTRIBUTES},
            "turn_mode": mode_label(run.turns, run.history),
            "run": position,
            "cr": run.compression_ratio,
            "ratio": round(run.compression_ratio, 6),
            "budget": run.budget,
            "reference": run.method == NO_PRESS,
            "baseline": baselines[position],
            **{column: getattr(run.interval, name, None) for column, name in _INTERVAL.items()},
            "n": run.samples,
            "partial": bool(run.partial_reasons),
            "settings": run.config.get("benchmark", {}),
            "status": run.run.get("status", ""),
            "kept_ratio": sum(kept) / len(kept) if kept else None,
            **{key: run.run.get(key) for key in COST_KEYS},
            "run_dir": str(run.path),
            **{name: run.likelihood.get(name) for name in LIKELIHOOD_FIELDS},
            **{
                f"{name}_{end}": getattr(run.likelihood_intervals.get(name), end, None)
                for name in LIKELIHOOD_FIELDS
                for end in ("low", "high")
            },
            "likelihood_n": run.likelihood.get("n"),
            **answer_length(runs, position, baselines[position]),
        }
        likelihood = run.likelihood.get("tasks", {})
        for task, values in sorted(run.tasks.items()) or [(None, {})]:
            means = likelihood.get(task, {})
            task_likelihood = {f"task_{name}": means.get(name) for name in LIKELIHOOD_FIELDS}
            task_figures = {"task_score": values.get("score"), "task_n": values.get("n", 0), **task_likelihood}
            records.append({**common, "task": task, **task_figures, "task_likelihood_n": means.get("n")})
    # Scores are floats, NaN where a benchmark gives none (ZeroSCROLLS): tables show "-", plots draw nothing.
    numbers = {"baseline": "Int64", "contexts": "Int64", "task_n": "Int64", "score": float, "task_score": float}
    numbers |= {"cr": float, "ratio": float, "budget": float}  # NaN where the other decides what is kept
    likelihood_columns = [
        *LIKELIHOOD_FIELDS,
        *(f"{name}_{end}" for name in LIKELIHOOD_FIELDS for end in ("low", "high")),
    ]
    numbers |= {column: float for column in [*likelihood_columns, *(f"task_{name}" for name in LIKELIHOOD_FIELDS)]}
    numbers |= {"likelihood_n": "Int64", "task_likelihood_n": "Int64", "answer_length_n": "Int64"}
    numbers |= dict.fromkeys(DRIFT_FIELDS, float)
    frame = pd.DataFrame.from_records(records).astype(numbers)
    label = frame.method.mask(frame.reference, "no compression") + frame.variant.map(bracketed)
    return frame.assign(label=label + frame.query_aware.map(QUERY_AWARE) + frame.turn_mode)  # tells a row's runs apart


def run_level(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per run, without the task columns."""
    return frame.drop_duplicates("run").drop(columns=_TASK_COLUMNS).reset_index(drop=True)


def split_by_axis(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``frame``'s runs at a compression ratio (every ``no_press`` run among them), and its token-budget runs
    (``budget=N``) with the ``no_press`` runs that are their baselines: the tables and plots by cr read the first,
    those by budget the second, so that neither mistakes the other's runs for its own."""
    budget = frame.budget.notna()
    baselines = frame.reference & frame.run.isin(frame.baseline[budget].dropna())
    return frame[~budget], frame[budget | baselines]
