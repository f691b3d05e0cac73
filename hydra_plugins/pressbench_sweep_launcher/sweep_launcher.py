"""``hydra/launcher=shared_prefill`` (the default): a sequential multirun as one sweep in this process.

Hydra's basic launcher runs the jobs one after another, each on its own; this launcher composes every job's
configuration first and hands them all to ``evaluate.run.entry.run_sweep``, which loads each model once and
prefills each context once for all the points that can share it.
"""

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class SharedPrefillLauncherConf:
    _target_: str = "hydra_plugins.pressbench_sweep_launcher.sweep_launcher.SharedPrefillLauncher"


ConfigStore.instance().store(
    group="hydra/launcher", name="shared_prefill", node=SharedPrefillLauncherConf, provider="pressbench"
)


def group_by_sweep(task_config: DictConfig, sweep_dir: str) -> None:
    """The runs of one multirun share a wandb group named after its folder, unless ``wandb.group`` names one: set
    in each job's config (``wandb`` is not a result key), so that no run reads Hydra's global state for it."""
    if task_config.get("wandb") is not None and task_config.wandb.get("group") is None:
        task_config.wandb.group = f"sweep-{Path(str(sweep_dir)).name}"


def compose_jobs(
    hydra_context: HydraContext, config: DictConfig, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
) -> tuple[list[DictConfig], list[DictConfig]]:
    """Each job's sweep config (with Hydra's part) and task config (without it), as Hydra's launchers compose
    them, for a launcher that runs every job as one sweep."""
    sweep_configs, task_configs = [], []
    for index, overrides in enumerate(job_overrides):
        log.info(f"\t#{initial_job_idx + index} : {' '.join(filter_overrides(overrides))}")
        sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = sweep_config.hydra.job.num = initial_job_idx + index
        task_config = sweep_config.copy()
        with open_dict(task_config):
            del task_config["hydra"]
            group_by_sweep(task_config, sweep_config.hydra.sweep.dir)
        sweep_configs.append(sweep_config)
        task_configs.append(task_config)
    return sweep_configs, task_configs


class SharedPrefillLauncher(Launcher):
    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from evaluate.rundir import first_missing

        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        # Set up before the sweeper creates the sweep folder: a refused sweep removes what it created.
        self.created = first_missing(Path(str(config.hydra.sweep.dir)))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # The harness, imported only when a sweep actually runs.
        from evaluate.run.entry import command
        from evaluate.rundir import remove_created

        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs as one sweep (shared model loads and prefills)")
        sweep_configs, task_configs = compose_jobs(self.hydra_context, self.config, job_overrides, initial_job_idx)
        # Every point is checked before any runs: one bad point refuses the sweep in one line, as a single run,
        # and leaves no sweep folder behind.
        choices = [sweep_config.hydra.runtime.choices for sweep_config in sweep_configs]
        metrics = command(task_configs, choices, single=False, refused=lambda: remove_created(self.created))
        return [
            JobReturn(
                overrides=list(overrides),
                cfg=task_config,
                hydra_cfg=sweep_config,
                working_dir=os.getcwd(),
                task_name=sweep_config.hydra.job.name,
                status=JobStatus.COMPLETED,
                _return_value=result and result["score"],
            )
            for overrides, task_config, sweep_config, result in zip(
                job_overrides, task_configs, sweep_configs, metrics, strict=True
            )
        ]
