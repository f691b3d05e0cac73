"""``hydra/sweeper=grids``: a sweep that is a union of cartesian grids, for experiments that are not one product.

    hydra:
      sweeper:
        params: {scorer: snapkv}                  # shared by every grid, as the basic sweeper's params
        grids:
          - {benchmark: "longbench,loogle", press: "chunkkv,eg_chunkkv", cr: "0.7,0.8,0.9"}
          - {benchmark: ruler, press: "chunkkv,eg_chunkkv", cr: "0.85,0.9,0.95"}

Each grid is expanded exactly as the basic sweeper expands its params (cartesian product, keys in order of first
appearance), from ``params``, then the grid, then the command line: a later value of a key replaces an earlier
one, so the command line narrows every grid (``cr=0.9``) or adds settings to all of them (``limit=2``). The
grids' jobs are concatenated in order and a job already listed by an earlier grid is dropped. No grids is one
empty grid: the basic sweeper. ``dry_run=true`` composes every job, prints them numbered as a launch would, and
runs nothing.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


@dataclass
class GridsSweeperConf:
    _target_: str = "hydra_plugins.pressbench_gpus_launcher.grids_sweeper.GridsSweeper"
    max_batch_size: int | None = None
    params: dict[str, Any] | None = None
    grids: list[dict[str, Any]] = field(default_factory=list)
    dry_run: bool = False


ConfigStore.instance().store(group="hydra/sweeper", name="grids", node=GridsSweeperConf, provider="pressbench")


def override_value(value: Any) -> str:
    """A YAML scalar as the override grammar spells it (YAML gives booleans and nulls, the grammar wants words)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def expand(
    parser: OverridesParser, params: dict[str, Any], grids: list[dict[str, Any]], arguments: list[str]
) -> list[list[str]]:
    """The jobs of a union of grids: each job is the list of its overrides."""
    jobs: list[list[str]] = []
    seen: set[tuple[str, ...]] = set()
    for grid in grids or [{}]:
        lines = [f"{key}={override_value(value)}" for key, value in {**params, **grid}.items()]
        for job in BasicSweeper.split_arguments(parser.parse_overrides(lines + list(arguments)), None)[0]:
            # Overrides of distinct keys commute, so their order does not make two jobs different.
            identity = tuple(sorted(job))
            if identity not in seen:
                seen.add(identity)
                jobs.append(job)
    return jobs


class GridsSweeper(BasicSweeper):
    def __init__(
        self,
        max_batch_size: int | None = None,
        params: dict[str, Any] | None = None,
        grids: list[dict[str, Any]] | None = None,
        dry_run: bool = False,
    ) -> None:
        super().__init__(max_batch_size=max_batch_size, params=params)
        self.grids = [dict(grid) for grid in grids or []]
        self.dry_run = dry_run

    def sweep(self, arguments: list[str]) -> list[list[JobReturn]]:
        assert self.config is not None and self.launcher is not None and self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        jobs = expand(parser, dict(self.params), self.grids, arguments)
        if self.dry_run:
            self.validate_batch_is_legal(jobs)
            for index, job in enumerate(jobs):
                print(f"#{index} : {' '.join(job)}")
            print(f"{len(jobs)} jobs (dry run: nothing launched)")
            return []
        self.overrides = list(self.split_overrides_to_chunks(jobs, self.max_batch_size))
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns = []
        initial_job_idx = 0
        while not self.is_done():
            batch = self.get_job_batch()
            # Composing every job first turns a typo in the last grid into an error before anything runs.
            self.validate_batch_is_legal(batch)
            results = self.launcher.launch(batch, initial_job_idx=initial_job_idx)
            for result in results:
                # Reading the value raises the job's exception if it failed.
                _ = result.return_value
            initial_job_idx += len(batch)
            returns.append(results)
        return returns
