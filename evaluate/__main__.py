"""``python -m evaluate [overrides]``: the Hydra application that runs one configuration (or a sweep with -m)."""

import hydra
from omegaconf import DictConfig

from evaluate.errors import ConfigError, refuse
from evaluate.summary import run_summary
from evaluate.sweep import run


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = run(cfg)
    except ConfigError as error:
        refuse(error)
    print(run_summary(cfg, metrics))
    return metrics["score"]


if __name__ == "__main__":
    main()
