"""Weights & Biases logging, selected by the ``wandb`` config group: ``wandb=disabled|offline|online``.

The default, ``wandb=env``, tracks in the mode ``$WANDB_MODE`` names (offline or online), else not at all.
``disabled`` never imports wandb, whatever ``$WANDB_MODE`` says; ``offline`` writes runs under ``wandb.dir`` (or
``$WANDB_DIR``, or ``./wandb``) for a later ``wandb sync DIR``. A run logs its config and progress, then its
metrics (its score by turn too, where its samples are turns of conversations), timings and sampled predictions; the
runs of one Hydra multirun share a ``group`` (a report's summary run is evaluate/report/tracking.py's).
A wandb failure turns the tracker off with a warning, never stopping an evaluation; a missing wandb package, or an
unknown mode, is refused before the model loads.
"""

import copy
import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evaluate.cost_schema import COST_KEYS
from evaluate.errors import ConfigError
from evaluate.points.point import PointSpec
from evaluate.report.tracking import MODE_VARIABLE, MODES, import_wandb, mode_from_env
from evaluate.score.bootstrap import sample_scores
from evaluate.score.diagnostics import FIELDS as DIAGNOSTIC_FIELDS
from evaluate.score.likelihood import FIELDS as LIKELIHOOD_FIELDS
from evaluate.score.turns import SAMPLES_BY_TURN, SCORE_BY_TURN

logger = logging.getLogger(__name__)


def answer_length_summary(answer_length: dict) -> dict[str, float]:
    """metrics.json's ``answer_length`` as summary keys: ``answer_length/answer_tokens``, ..., and the fields against
    the uncompressed baseline under ``answer_length/against_uncompressed/`` (evaluate/score/answer_length.py)."""
    against = answer_length.get("against_uncompressed") or {}
    return {
        **{f"answer_length/{key}": value for key, value in answer_length.items() if isinstance(value, int | float)},
        **{
            f"answer_length/against_uncompressed/{key}": value
            for key, value in against.items()
            if isinstance(value, int | float)
        },
    }


def diagnostics_summary(diagnostics: dict) -> dict[str, float | int]:
    """metrics.json's ``diagnostics`` as wandb summary keys: each field's headline and count, its mean per layer and
    per task (``diagnostics/answer_retention``, ``diagnostics/answer_retention/layers/0``, ...)."""
    summary = {}
    for name, values in diagnostics.items():
        summary |= {f"diagnostics/{name}": values["mean"], f"diagnostics/{name}/n": values["n"]}
        summary |= {f"diagnostics/{name}/layers/{layer}": mean for layer, mean in enumerate(values["by_layer"])}
        summary |= {
            f"diagnostics/{name}/tasks/{task}": task_values["mean"] for task, task_values in values["tasks"].items()
        }
    return summary


def turn_summary(metrics: dict) -> dict[str, float | int | None]:
    """metrics.json's score and samples by turn (evaluate/score/turns.py) as summary keys: ``score_by_turn/0``, ...,
    ``samples_by_turn/0``, ...; none for a run whose samples are no conversations."""
    return {
        f"{key}/{turn}": value
        for key in (SCORE_BY_TURN, SAMPLES_BY_TURN)
        for turn, value in (metrics.get(key) or {}).items()
    }


def tracking_mode(settings) -> tuple[str, str]:
    """The mode a run is tracked in and the setting that chose it: ``wandb.mode``, or, where it is null (the
    default, ``wandb=env``), ``$WANDB_MODE``; ConfigError for a mode that is none of MODES."""
    mode = settings.get("mode", "disabled")
    if mode is None:
        return mode_from_env(), MODE_VARIABLE
    if str(mode) not in MODES:
        raise ConfigError(f"wandb.mode={mode!r}; choose one of {', '.join(MODES)}")
    return str(mode), "wandb.mode"


class Tracker:
    """wandb logging for one run. Every method is a no-op when tracking is disabled or has failed."""

    def __init__(self, run=None, wandb_module=None, table_rows: int = 200, seed: int = 0):
        self._run, self._wandb, self.table_rows, self.seed = run, wandb_module, table_rows, seed

    @property
    def enabled(self) -> bool:
        return self._run is not None

    @property
    def run_dir(self) -> Path | None:
        """Where wandb writes this run (offline: the folder ``wandb sync`` takes)."""
        return Path(self._run.dir).parent if self._run is not None else None

    @classmethod
    def from_spec(cls, spec: PointSpec) -> "Tracker":
        """Start a wandb run for a point, named after its run directory, as its ``wandb`` group configures it;
        disabled when the group is absent."""
        settings = spec.tracking
        mode, chosen_by = tracking_mode(settings)
        if mode == "disabled":
            return cls()
        instead = "wandb.mode=disabled" if chosen_by != MODE_VARIABLE else f"unset {MODE_VARIABLE}, or wandb=disabled"
        wandb = import_wandb(mode, chosen_by, instead)
        config = copy.deepcopy(spec.recorded)
        config["wandb"]["mode"] = mode  # the mode the run is tracked in, where $WANDB_MODE chose it
        run = wandb.init(
            mode=mode,
            project=settings.get("project") or "pressbench",
            entity=settings.get("entity"),
            group=settings.get("group"),
            job_type=spec.benchmark_name,
            name=spec.out.name,
            tags=list(settings.get("tags") or []),
            dir=settings.get("dir"),
            config=config,
            reinit="create_new",  # a sequential multirun logs each job to its own run
        )
        return cls(run, wandb, table_rows=int(settings.get("table_rows", 200)), seed=spec.seed)

    def _safely(self, action, *args) -> None:
        if self._run is None:
            return
        try:
            action(*args)
        except Exception as error:  # tracking is an extra; the evaluation itself must go on
            logger.warning("wandb logging failed and is turned off for this run: %s", error)
            self._run = None

    def log_progress(self, samples_done: int, samples_expected: int, **values: float | None) -> None:
        """Progress after each context: samples done, and any timings or the context's kept ratio."""
        record = {"progress/samples": samples_done, "progress/fraction": samples_done / max(1, samples_expected)}
        record.update({f"progress/{key}": value for key, value in values.items() if value is not None})
        self._safely(lambda: self._run.log(record, step=samples_done))

    def log_metrics(self, metrics: dict, rows: Sequence[dict], benchmark, run_record: dict | None = None) -> None:
        """The finished run: headline, per-task metrics, kept ratio, timings, memory, sampled predictions."""
        self._safely(self._log_metrics, metrics, rows, benchmark, run_record or {})

    def _log_metrics(self, metrics: dict, rows: Sequence[dict], benchmark, run_record: dict) -> None:
        tasks: dict[str, dict] = metrics.get("tasks", {})
        summary: dict[str, Any] = {"score": metrics.get("score"), "samples": len(rows)}
        for task, values in tasks.items():
            summary |= {f"tasks/{task}/{key}": value for key, value in values.items() if isinstance(value, int | float)}
        if kept := [row["kept_ratio"] for row in rows if row.get("kept_ratio") is not None]:
            summary["kept_ratio"] = sum(kept) / len(kept)
        # Every cost key of run.json (evaluate/cost_schema.py), and the failed samples.
        summary |= {key: run_record[key] for key in (*COST_KEYS, "errors") if run_record.get(key) is not None}
        other = {key: value for key, value in metrics.items() if key not in ("tasks", "score", "benchmark")}
        summary |= {key: value for key, value in other.items() if isinstance(value, int | float)}
        likelihood = metrics.get("likelihood") or {}  # the likelihood fields' means: headline, then per task
        summary |= {f"likelihood/{key}": value for key, value in likelihood.items() if isinstance(value, int | float)}
        for task, values in likelihood.get("tasks", {}).items():
            summary |= {f"likelihood/tasks/{task}/{key}": value for key, value in values.items()}
        summary |= diagnostics_summary(metrics.get("diagnostics") or {})
        summary |= answer_length_summary(metrics.get("answer_length") or {})
        summary |= turn_summary(metrics)
        self._run.summary.update(summary)
        task_rows = [[task, values.get("score"), values.get("n")] for task, values in tasks.items()]
        task_table = self._wandb.Table(columns=["task", "score", "n"], data=task_rows)
        record = {"tasks": task_table, "predictions": self._predictions_table(rows, benchmark)}
        if scores := metrics.get(SCORE_BY_TURN):  # conversations: the score on each turn's samples, a row per turn
            data = [[int(turn), score, metrics[SAMPLES_BY_TURN].get(turn)] for turn, score in scores.items()]
            record["turns"] = self._wandb.Table(columns=["turn", "score", "n"], data=data)
        self._run.log(record)

    def _predictions_table(self, rows: Sequence[dict], benchmark):
        """Up to ``table_rows`` predictions drawn with the run's seed; ``correct`` is the sample's score / 100."""
        picked = list(rows)
        picked = random.Random(self.seed).sample(picked, self.table_rows) if len(picked) > self.table_rows else picked
        # generate=false rows hold no prediction to score.
        generated = all(row.get("prediction") is not None for row in picked)
        scores = sample_scores(benchmark, picked) if generated else [None] * len(picked)
        data = []
        for row, score in zip(picked, scores, strict=True):
            answers = " | ".join(map(str, a)) if isinstance(a := row.get("answers"), list) else str(a)
            correct = None if score is None else score / 100
            cells = [row.get("id"), row["task"], row.get("question"), answers, row["prediction"], correct]
            data.append(cells + [row.get(name) for name in (*LIKELIHOOD_FIELDS, *DIAGNOSTIC_FIELDS)])
        columns = ["id", "task", "question", "answers", "prediction", "correct", *LIKELIHOOD_FIELDS, *DIAGNOSTIC_FIELDS]
        return self._wandb.Table(columns=columns, data=data)

    def finish(self, exit_code: int = 0) -> None:
        """Close the wandb run; a non-zero exit code marks it failed (an interrupted run)."""
        self._safely(lambda: self._run.finish(exit_code=exit_code))
        self._run = None
