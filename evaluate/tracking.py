"""Weights & Biases logging, selected by the ``wandb`` config group: ``wandb=disabled|offline|online``.

``disabled`` (the default) never imports wandb. ``offline`` writes runs under ``wandb.dir`` (or ``$WANDB_DIR``, or
``./wandb``) with no account and no network; ``wandb sync DIR`` uploads them later. ``online`` logs live.

A run's tracker logs its resolved config, progress (samples, timings, kept ratio) while it runs, then the
per-task metrics, the headline, the mean kept ratio, timings, peak memory and a ``wandb.Table`` of sampled
predictions. Runs of one Hydra multirun share a ``group`` (the sweep's folder name unless ``wandb.group`` is
set); ``job_type`` is the benchmark. ``python -m evaluate.report --wandb`` logs the report's tables and plots to
one summary run, with a score-against-cr chart per benchmark.

Tracking never stops an evaluation: once started, a wandb failure is logged as a warning and the tracker turns
itself off. A missing wandb package, or an unknown mode, is refused before the model loads.
"""

import csv
import io
import logging
import random
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from evaluate.config import ConfigError

if TYPE_CHECKING:
    from evaluate.report import Report

logger = logging.getLogger(__name__)

MODES = ("disabled", "offline", "online")


def _import_wandb(mode: str):
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            f"wandb.mode={mode} needs the wandb package: pip install 'pressbench[wandb]' (or wandb.mode=disabled)"
        ) from None
    return wandb


def sweep_group() -> str | None:
    """The folder name of the current Hydra multirun, shared by all its jobs; None outside a multirun."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return None
        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode != RunMode.MULTIRUN:
            return None
        return f"sweep-{Path(hydra_cfg.sweep.dir).name}"
    except Exception:  # Hydra internals differ across launchers; no group is better than a crash
        return None


class Tracker:
    """wandb logging for one run. Every method is a no-op when tracking is disabled or has failed."""

    def __init__(self, run=None, wandb_module=None, table_rows: int = 200, seed: int = 0):
        self._run = run
        self._wandb = wandb_module
        self.table_rows = table_rows
        self.seed = seed

    @property
    def enabled(self) -> bool:
        return self._run is not None

    @property
    def run_dir(self) -> Path | None:
        """Where wandb writes this run (offline: the folder ``wandb sync`` takes)."""
        return Path(self._run.dir).parent if self._run is not None else None

    @classmethod
    def from_config(cls, cfg: DictConfig, run_name: str) -> "Tracker":
        """Start a wandb run for ``cfg`` as the ``wandb`` group configures it; disabled when the group is absent."""
        settings = cfg.get("wandb")
        mode = "disabled" if settings is None else str(settings.get("mode", "disabled"))
        if mode not in MODES:
            raise ConfigError(f"wandb.mode={mode!r}; choose one of {', '.join(MODES)}")
        if mode == "disabled":
            return cls()
        wandb = _import_wandb(mode)
        config = OmegaConf.to_container(cfg, resolve=True)
        run = wandb.init(
            mode=mode,
            project=settings.get("project") or "pressbench",
            entity=settings.get("entity"),
            group=settings.get("group") or sweep_group(),
            job_type=cfg.benchmark.name,
            name=run_name,
            tags=list(settings.get("tags") or []),
            dir=settings.get("dir"),
            config=config,
            reinit="create_new",  # a sequential multirun logs each job to its own run
        )
        return cls(run, wandb, table_rows=int(settings.get("table_rows", 200)), seed=int(cfg.seed))

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
        summary: dict[str, Any] = {"score": metrics.get("score"), "samples": len(rows)}
        for task, values in metrics.get("tasks", {}).items():
            for key, value in values.items():
                if isinstance(value, int | float):
                    summary[f"tasks/{task}/{key}"] = value
        kept = [row["kept_ratio"] for row in rows if row.get("kept_ratio") is not None]
        if kept:
            summary["kept_ratio"] = sum(kept) / len(kept)
        for key in ("wall_seconds", "prefill_seconds", "decode_seconds", "peak_memory_mb", "errors"):
            if run_record.get(key) is not None:
                summary[key] = run_record[key]
        for key, value in metrics.items():
            if key not in ("tasks", "score", "benchmark") and isinstance(value, int | float):
                summary[key] = value
        self._run.summary.update(summary)
        task_table = self._wandb.Table(columns=["task", "score", "n"])
        for task, values in metrics.get("tasks", {}).items():
            task_table.add_data(task, values.get("score"), values.get("n"))
        self._run.log({"tasks": task_table, "predictions": self._predictions_table(rows, benchmark)})

    def _predictions_table(self, rows: Sequence[dict], benchmark):
        """Up to ``table_rows`` predictions drawn with the run's seed; ``correct`` is the sample's score / 100."""
        from evaluate.bootstrap import sample_scores

        picked = list(rows)
        if len(picked) > self.table_rows:
            picked = random.Random(self.seed).sample(picked, self.table_rows)
        scores = sample_scores(benchmark, picked)
        table = self._wandb.Table(columns=["id", "task", "question", "answers", "prediction", "correct"])
        for row, score in zip(picked, scores, strict=True):
            answers = row.get("answers")
            answers = " | ".join(map(str, answers)) if isinstance(answers, list) else str(answers)
            table.add_data(row.get("id"), row["task"], row.get("question"), answers, row["prediction"], score / 100)
        return table

    def finish(self, exit_code: int = 0) -> None:
        """Close the wandb run; a non-zero exit code marks it failed (an interrupted run)."""
        self._safely(lambda: self._run.finish(exit_code=exit_code))
        self._run = None


def _csv_rows(text: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(io.StringIO(text)))
    return rows[0], rows[1:]


def log_report(report: "Report", plots: Sequence[Path], mode: str, project: str = "pressbench", dir=None) -> str:
    """Log every table, every plot and a score-against-cr chart per benchmark to one summary run.

    Returns the run's URL (online) or its local folder (offline).
    """
    wandb = _import_wandb(mode)
    run = wandb.init(
        mode=mode,
        project=project,
        job_type="report",
        name=f"report-{datetime.now().strftime('%Y-%m-%d_%H-%M-%S')}",
        dir=dir,
        config={"runs": len(report.runs), "benchmarks": sorted({r.benchmark for r in report.runs})},
        reinit="create_new",
    )
    try:
        record: dict[str, Any] = {}
        for table in report.tables():
            header, rows = _csv_rows(table.csv)
            record[f"tables/{table.name}"] = wandb.Table(columns=header, data=rows, allow_mixed_types=True)
        for benchmark in sorted({r.benchmark for r in report.runs}):
            data = [
                [f"{r.label} · {r.model}", r.compression_ratio, r.score]
                for r in report.runs
                if r.benchmark == benchmark and r.score is not None
            ]
            chart_table = wandb.Table(columns=["method", "compression_ratio", "score"], data=data)
            record[f"charts/{benchmark}"] = wandb.plot.line(
                chart_table, "compression_ratio", "score", stroke="method", title=f"{benchmark}: score vs cr"
            )
        for path in plots:
            record[f"plots/{Path(path).stem}"] = wandb.Image(str(path))
        run.log(record)
        location = run.url if mode == "online" else str(Path(run.dir).parent)
    finally:
        run.finish()
    return location
