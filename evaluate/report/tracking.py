"""A report logged to Weights & Biases (``python -m evaluate.report --wandb``), and wandb's import, which a run's
tracking (evaluate/run/tracking.py) shares: every table, every plot and a score-against-cr chart per benchmark in one
summary run."""

import logging
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from evaluate.errors import ConfigError

if TYPE_CHECKING:
    from evaluate.report.build import Report

logger = logging.getLogger(__name__)

MODES = ("disabled", "offline", "online")
# wandb's own switch, which a user sets for every wandb program: honoured where no setting of ours chose a mode.
MODE_VARIABLE = "WANDB_MODE"
# The charts against cr logged per benchmark: a runs-frame column, the chart's key suffix and its title.
_CHARTS = (
    ("score", "", "score"),
    ("answer_kl", "_kl", "answer KL"),
    ("answer_tokens", "_answer_tokens", "mean answer tokens"),
    ("common_prefix", "_common_prefix", "tokens shared with the uncompressed answer"),
)


def mode_from_env() -> str:
    """The mode $WANDB_MODE asks for where neither the command line nor the config chose one: offline or online,
    else disabled. Another value is named in a warning line as ignored: a run meant to be tracked never goes
    untracked in silence."""
    value = os.environ.get(MODE_VARIABLE, "").strip()
    if value in ("offline", "online"):
        return value
    if value not in ("", "disabled"):
        logger.warning("%s=%s is ignored: set it to offline or online to track (or disabled)", MODE_VARIABLE, value)
    return "disabled"


def import_wandb(mode: str, chosen_by: str = "wandb.mode", instead: str = "wandb.mode=disabled"):
    """wandb, or ConfigError naming the setting ``chosen_by`` that asked for ``mode`` and the way out, ``instead``."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            f"{chosen_by}={mode} needs the wandb package: pip install 'pressbench[wandb]' (or {instead})"
        ) from None
    return wandb


def _table(wandb, frame, **options):
    """A DataFrame as a ``wandb.Table``."""
    return wandb.Table(columns=list(frame.columns), data=frame.astype(object).to_numpy().tolist(), **options)


def log_report(report: "Report", plots: Sequence[Path], mode: str, project: str = "pressbench", dir=None) -> str:
    """Log every table (as its CSV file holds it), every plot, and a score-against-cr chart per benchmark (and an
    answer-KL one where runs have the likelihood fields, answer-length ones where they recorded answer token ids)
    to one summary run; returns the run's URL (online) or its
    local folder (offline)."""
    wandb = import_wandb(mode)
    runs = report.frame.drop_duplicates("run")
    benchmarks = sorted(runs.benchmark.unique())
    name, config = f"report-{datetime.now():%Y-%m-%d_%H-%M-%S}", {"runs": len(runs), "benchmarks": benchmarks}
    run = wandb.init(
        mode=mode, project=project, job_type="report", name=name, dir=dir, config=config, reinit="create_new"
    )
    try:
        record = {f"tables/{t.name}": _table(wandb, t.cells(), allow_mixed_types=True) for t in report.tables()}
        for benchmark in benchmarks:
            for value, suffix, title in _CHARTS:
                # Charts against cr: token-budget runs have none (their figure is among the plots).
                measured = runs[(runs.benchmark == benchmark) & runs[value].notna() & runs.budget.isna()]
                if measured.empty:
                    continue  # generate=false runs have no score; runs made with likelihood=false no KL
                points = measured.assign(method=measured.label + " · " + measured.model, compression_ratio=measured.cr)
                chart = _table(wandb, points[["method", "compression_ratio", value]])
                line = {"stroke": "method", "title": f"{benchmark}: {title} vs cr"}
                record[f"charts/{benchmark}{suffix}"] = wandb.plot.line(chart, "compression_ratio", value, **line)
        record |= {f"plots/{Path(path).stem}": wandb.Image(str(path)) for path in plots}
        run.log(record)
        return run.url if mode == "online" else str(Path(run.dir).parent)
    finally:
        run.finish()
