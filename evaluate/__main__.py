"""``python -m evaluate [overrides]``: the Hydra application that runs one configuration (or a sweep with -m)."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from evaluate.errors import ConfigError, refuse
from evaluate.points.overrides import check_command_line
from evaluate.run.entry import command


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    hydra_config = HydraConfig.get()
    # Where your own configs are found is Hydra's setting, yet the commands the run suggests need it too.
    searchpath = [override for override in hydra_config.overrides.hydra if override.startswith("hydra.searchpath=")]
    overrides = [*searchpath, *hydra_config.overrides.task]
    metrics = command([cfg], [hydra_config.runtime.choices], single=True, overrides=overrides)[0]
    # None for a shard whose point waits for the other shards: it has no score yet (its closing lines say so).
    return None if metrics is None else metrics["score"]


def cli() -> None:
    """The command: its keys and config group options are checked before Hydra composes anything, so that a typo is
    one line and exit code 2, not Hydra's error over several lines (or a ``+key`` nothing reads), and a refused
    sweep leaves no folder."""
    try:
        check_command_line(sys.argv[1:])
    except ConfigError as error:
        refuse(error)
    main()


if __name__ == "__main__":
    cli()
