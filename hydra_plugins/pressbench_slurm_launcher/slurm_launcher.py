"""``hydra/launcher=slurm`` (and ``slurm_local``): hydra-submitit-launcher, with the sweep sharded by context.

With ``shards: null`` this is hydra-submitit-launcher as it is: one array task per job (point). With ``shards: N``
the sweep is submitted as N array tasks, and task i runs every point of the sweep on its shard of the contexts
(evaluate/points/shard.py), so each context is prefilled once on the cluster; with ``tasks_per_node: T`` each task's
``srun`` ranks split its share again, for N x T shards in all, each rank on its own GPU (``LOCAL_RANK``). The last
shard to finish a point scores it. Near its time limit, or when preempted, a task is requeued with the same
arguments and resumes its shard from its own predictions (submitit's checkpoint, as for one point per task).
"""

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra.types import HydraContext
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher
from omegaconf import DictConfig, open_dict

from hydra_plugins.pressbench_sweep_launcher.sweep_launcher import compose_jobs

log = logging.getLogger(__name__)


@dataclass
class ShardedSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.pressbench_slurm_launcher.slurm_launcher.ShardedSlurmLauncher"
    # Array tasks that shard the sweep by context; null: one array task per job (point).
    shards: int | None = None


@dataclass
class ShardedLocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.pressbench_slurm_launcher.slurm_launcher.ShardedLocalLauncher"
    shards: int | None = None


ConfigStore.instance().store(
    group="hydra/launcher", name="pressbench_slurm", node=ShardedSlurmConf, provider="pressbench"
)
ConfigStore.instance().store(
    group="hydra/launcher", name="pressbench_local", node=ShardedLocalConf, provider="pressbench"
)


class ShardJob:
    """One array task: every job of the sweep on shard ``task * ranks + rank`` of ``shards * ranks``, where the
    ranks are the task's srun tasks. Submitit calls :meth:`checkpoint` before a requeue."""

    def __init__(self, hydra_context: HydraContext, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config

    def __call__(
        self, job_overrides: list[list[str]], initial_job_idx: int, task: int, shards: int, singleton_state: dict
    ) -> list[dict | None]:
        import submitit

        from evaluate.run.entry import command

        environment = submitit.JobEnvironment()
        Singleton.set_state(singleton_state)
        setup_globals()
        # Each srun rank on its own GPU (evaluate/points/config.py:resolve_device reads LOCAL_RANK).
        os.environ["LOCAL_RANK"] = str(environment.local_rank)
        shard = f"{task * environment.num_tasks + environment.global_rank}/{shards * environment.num_tasks}"
        sweep_configs, task_configs = compose_jobs(self.hydra_context, self.config, job_overrides, initial_job_idx)
        for task_config in task_configs:
            with open_dict(task_config):
                task_config.shard = shard
        log.info("shard %s of %d jobs", shard, len(task_configs))
        choices = [sweep_config.hydra.runtime.choices for sweep_config in sweep_configs]
        return command(task_configs, choices, single=False)

    def checkpoint(self, *args: Any) -> Any:
        """Requeue the task with the same arguments: its shard resumes from what it wrote."""
        import submitit

        return submitit.helpers.DelayedSubmission(self, *args)


class _Sharded:
    """What the two launchers below add to hydra-submitit-launcher's: ``shards``."""

    def __init__(self, shards: int | None = None, **params: Any) -> None:
        super().__init__(**params)
        self.shards = shards

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        if self.shards is None:
            return super().launch(job_overrides, initial_job_idx)
        from evaluate.errors import ConfigError, refuse
        from evaluate.points.resolve import checked

        _, task_configs = compose_jobs(self.hydra_context, self.config, job_overrides, initial_job_idx)
        try:  # refused here, in one line, rather than in every array task
            if self.shards < 1:
                raise ConfigError(f"hydra.launcher.shards={self.shards}: give 1 or more array tasks, or null")
            checked(task_configs)
        except ConfigError as error:
            refuse(error)
        executor = self._executor()
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info("%d jobs as %d array tasks, each on its shard of the contexts", len(job_overrides), self.shards)
        overrides = [list(each) for each in job_overrides]
        state = Singleton.get_state()
        count = range(self.shards)
        tasks = executor.map_array(
            ShardJob(self.hydra_context, self.config),
            [overrides for _ in count],
            [initial_job_idx for _ in count],
            list(count),
            [self.shards for _ in count],
            [state for _ in count],
        )
        # Each task gives a list per srun rank, each a list of metrics per job: a job takes the one that scored it.
        per_rank = [metrics for task in tasks for metrics in task.results()]
        returns = []
        for position, (overrides_of_job, task_config) in enumerate(zip(overrides, task_configs, strict=True)):
            scored = next((metrics[position] for metrics in per_rank if metrics[position] is not None), None)
            job_return = JobReturn(overrides=overrides_of_job, cfg=task_config, status=JobStatus.COMPLETED)
            job_return.return_value = scored and scored["score"]
            returns.append(job_return)
        return returns

    def _executor(self):
        """hydra-submitit-launcher's executor and parameters, as its own launch builds them."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
        from omegaconf import OmegaConf

        params = dict(self.params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{key if key in base else f"{self._EXECUTOR}_{key}": value for key, value in params.items()}
        )
        return executor


class ShardedSlurmLauncher(_Sharded, SlurmLauncher):
    pass


class ShardedLocalLauncher(_Sharded, LocalLauncher):
    pass
