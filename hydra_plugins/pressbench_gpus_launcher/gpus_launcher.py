"""``hydra/launcher=gpus``: a multirun's jobs in parallel on one node, one worker process per visible GPU.

A thin wrapper over sharding (evaluate/points/shard.py), as ``torchrun --nproc-per-node N -m evaluate -m ...`` is: with
N visible GPUs, worker i runs every point of the sweep on shard i/N of the contexts, so each context is prefilled
once on the node and the last shard to finish a point scores it. Each worker is a fresh Python process started with
``CUDA_VISIBLE_DEVICES=<its GPU>``, so it sees exactly one device, as ``cuda:0``, before anything imports torch.
Without a GPU there is a single worker on the CPU, running the whole sweep.

The parent composes every job (as Hydra's own launchers do) and hands each worker the resolved job configs; a
worker's output goes to ``<sweep dir>/gpus/<device>.log``. Hydra job callbacks are not called for these jobs.
"""

import copy
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from hydra_plugins.pressbench_sweep_launcher.sweep_launcher import group_by_sweep

log = logging.getLogger(__name__)

WORKER_MODULE = "hydra_plugins.pressbench_gpus_launcher._worker"
# After an interrupt, how long workers get to record their state before they are killed.
STOP_GRACE_SECONDS = 30
LOG_TAIL_LINES = 20


def visible_gpus(requested: str | int | Sequence[Any] | None = None) -> list[str]:
    """The devices to spread jobs over: ``requested``, else CUDA_VISIBLE_DEVICES, else every device torch counts.

    Entries are kept verbatim (indices, GPU-/MIG- UUIDs): each becomes one worker's CUDA_VISIBLE_DEVICES. CUDA
    ignores the list from its first invalid entry on, so an empty entry or a negative index (``-1`` is a common
    way to hide every GPU) ends it here too.
    """
    if requested is not None:
        single = isinstance(requested, (str, int))
        entries = str(requested).split(",") if single else [str(entry) for entry in requested]
    elif "CUDA_VISIBLE_DEVICES" in os.environ:
        entries = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
    else:
        import torch

        return [str(index) for index in range(torch.cuda.device_count())]
    devices = []
    for entry in (entry.strip() for entry in entries):
        if not entry or entry.startswith("-"):
            break
        devices.append(entry)
    return devices


@dataclass
class _Job:
    index: int
    sweep_config: DictConfig
    task_config: DictConfig
    hydra_config: DictConfig
    resolved: dict


@dataclass
class _Worker:
    device: str | None
    jobs: list[_Job]
    process: subprocess.Popen
    result_path: Path
    log_path: Path
    log_handle: IO[str]


class GpusLauncher(Launcher):
    def __init__(self, gpus: str | int | Sequence[Any] | None = None) -> None:
        self.gpus = gpus
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from evaluate.rundir import first_missing

        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        # Set up before the sweeper creates the sweep folder: a refused sweep removes what it created.
        self.created = first_missing(Path(str(config.hydra.sweep.dir)))

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        # The harness (torch, kvpress) is imported only when a sweep runs: Hydra imports plugins for every command.
        from evaluate.errors import ConfigError, refuse
        from evaluate.points.config import validate_choices
        from evaluate.points.resolve import checked
        from evaluate.points.shard import Shard
        from evaluate.rundir import remove_created

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        log_dir = Path(str(self.config.hydra.sweep.dir)) / "gpus"

        devices = visible_gpus(self.gpus)
        log.info(
            "Launching %d jobs on %s",
            len(job_overrides),
            f"{len(devices)} GPUs ({', '.join(devices)}), one shard each" if devices else "the CPU (no GPU visible)",
        )
        jobs = [self._compose(initial_job_idx + offset, overrides) for offset, overrides in enumerate(job_overrides)]
        try:  # every point checked before any worker starts: one bad point refuses the sweep in one line
            for job in jobs:
                validate_choices(job.sweep_config.hydra.runtime.choices)
            points = checked([OmegaConf.create(job.resolved) for job in jobs])
            if len(devices) > 1 and any(not point.shard.whole for point in points):
                raise ConfigError("hydra/launcher=gpus shards the sweep over the GPUs itself: drop shard=")
        except ConfigError as error:
            remove_created(self.created)  # and leaves no sweep folder behind
            refuse(error)
        log_dir.mkdir(parents=True, exist_ok=True)
        # Every worker runs every point, on its shard of the contexts (evaluate/points/shard.py).
        count = max(1, len(devices))
        with tempfile.TemporaryDirectory(prefix="pressbench-gpus-") as scratch:
            workers = []
            try:
                for number in range(count):
                    device = devices[number] if devices else None
                    shard = [replace(point, shard=Shard(number, count)) for point in points] if count > 1 else points
                    workers.append(self._start(device, jobs, shard, Path(scratch), log_dir))
                _wait(workers)
            except BaseException:
                _stop(workers)
                raise
            finally:
                for worker in workers:
                    worker.log_handle.close()
            outcomes = [_outcomes(worker) for worker in workers]
        return [
            _job_return(job, *_combined([each[position] for each in outcomes])) for position, job in enumerate(jobs)
        ]

    def _compose(self, index: int, overrides: Sequence[str]) -> _Job:
        """One job's config, as Hydra's launchers build it, with the job part resolved for the worker."""
        assert self.config is not None and self.hydra_context is not None
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = index
            sweep_config.hydra.job.num = index
        output_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
        with read_write(sweep_config.hydra), open_dict(sweep_config.hydra):
            # Fixed now: a ${now:} in the sweep dir would otherwise resolve anew in the worker.
            sweep_config.hydra.sweep.dir = str(sweep_config.hydra.sweep.dir)
            sweep_config.hydra.runtime.output_dir = str(output_dir.absolute())
        previous = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(sweep_config)
        try:
            task_config = copy.deepcopy(sweep_config)
            with read_write(task_config), open_dict(task_config):
                del task_config["hydra"]
                group_by_sweep(task_config, sweep_config.hydra.sweep.dir)
            resolved = OmegaConf.to_container(task_config, resolve=True)
            hydra_config = copy.deepcopy(HydraConfig.instance().cfg)
        finally:
            HydraConfig.instance().cfg = previous
        log.info("\t#%d : %s", index, " ".join(filter_overrides(overrides)))
        return _Job(index, sweep_config, task_config, hydra_config, resolved)

    def _start(self, device: str | None, jobs: list[_Job], points: list, scratch: Path, log_dir: Path) -> _Worker:
        label = device or "cpu"
        task_path, result_path = scratch / f"{label}.task", scratch / f"{label}.result.json"
        with task_path.open("wb") as handle:
            pickle.dump({"points": points}, handle)  # checked here once: the worker runs them as they are
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if device is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        log_path = log_dir / f"{label}.log"
        log_handle = log_path.open("a", encoding="utf-8")
        process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, str(task_path), str(result_path)],
            env=env,
            stdout=log_handle,
            stderr=subprocess.STDOUT,
        )
        log.info(
            "%s: jobs %s (pid %d, log %s)",
            f"GPU {device}" if device else "CPU",
            " ".join(f"#{job.index}" for job in jobs),
            process.pid,
            log_path,
        )
        return _Worker(device, jobs, process, result_path, log_path, log_handle)


def _wait(workers: list[_Worker]) -> None:
    for worker in workers:
        code = worker.process.wait()
        log.info("%s finished (exit code %d)", f"GPU {worker.device}" if worker.device else "CPU", code)


def _stop(workers: list[_Worker]) -> None:
    """Interrupt the workers (they record their runs as interrupted) and kill those that do not stop."""
    running = [worker.process for worker in workers if worker.process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGINT)
    for process in running:
        try:
            process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _log_tail(path: Path) -> str:
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _outcomes(worker: _Worker) -> list[tuple[JobStatus, Any]]:
    """Each job's status and return value (its score, as ``python -m evaluate`` returns), or the failure."""
    where = f"GPU {worker.device}" if worker.device else "CPU"
    result = json.loads(worker.result_path.read_text()) if worker.result_path.exists() else None
    if result is not None and "metrics" in result:
        # A point left to another process (None) completed here without a score.
        return [(JobStatus.COMPLETED, metrics and metrics["score"]) for metrics in result["metrics"]]
    reason = (
        f"failed: {result['error']}"
        if result is not None
        else f"exited with code {worker.process.returncode} before finishing"
    )
    error = RuntimeError(f"worker on {where} {reason}; log {worker.log_path}:\n{_log_tail(worker.log_path)}")
    return [(JobStatus.FAILED, error)] * len(worker.jobs)


def _combined(outcomes: list[tuple[JobStatus, Any]]) -> tuple[JobStatus, Any]:
    """A job's outcome over the shards that ran it: the score of the shard that scored the point (its last), else
    the first failure, else completed without a score (a point left to another process)."""
    for status, value in outcomes:
        if status == JobStatus.COMPLETED and value is not None:
            return status, value
    return next(((s, v) for s, v in outcomes if s == JobStatus.FAILED), (JobStatus.COMPLETED, None))


def _job_return(job: _Job, status: JobStatus, value: Any) -> JobReturn:
    job_return = JobReturn(
        overrides=OmegaConf.to_container(job.sweep_config.hydra.overrides.task),
        cfg=job.task_config,
        hydra_cfg=job.hydra_config,
        working_dir=os.getcwd(),
        task_name=str(job.sweep_config.hydra.job.name),
        status=status,
    )
    job_return.return_value = value
    return job_return
