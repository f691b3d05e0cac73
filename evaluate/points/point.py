"""One point of a run or sweep, resolved once: everything derived from its configuration that the later stages read.

The run directory, the fingerprint, the method's name, the compression ratio applied, the attention, the device and
the device map are each computed here, once per point, and every later stage (the plan, the engine, the recorder,
the summary) reads them from the spec instead of deriving them again.
"""

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from evaluate.errors import ConfigError
from evaluate.points.config import (
    attention_implementation,
    effective_cr,
    fingerprint,
    method_name,
    model_key,
    resolve_device,
    resolve_device_map,
    run_dir,
)
from evaluate.points.shard import Shard, resolve_shard


@dataclass(frozen=True)
class PointSpec:
    """A typed and validated configuration with what is derived from it (see the module docstring)."""

    cfg: DictConfig
    out: Path
    fingerprint: str
    method: str
    effective_cr: float
    attention: str
    device: str
    device_map: dict[str, int | str] | str | None
    model_key: str
    shard: Shard = Shard()


def resolve(cfg: DictConfig) -> PointSpec:
    """``cfg``'s spec; ``cfg`` has been typed and validated (evaluate/run/entry.py does both, once)."""
    shard = resolve_shard(cfg.get("shard"))
    if not shard.whole and (cfg.overwrite or cfg.retry_errors):
        raise ConfigError(
            f"overwrite and retry_errors rewrite every shard's rows, which shard {shard} cannot do beside the others: "
            "run them once without shards (one process), then shard the rest"
        )
    return PointSpec(
        cfg=cfg,
        out=run_dir(cfg),
        fingerprint=fingerprint(cfg),
        method=method_name(cfg),
        effective_cr=effective_cr(cfg),
        attention=attention_implementation(cfg),
        device=resolve_device(cfg.device),
        device_map=resolve_device_map(cfg),
        model_key=model_key(cfg),
        shard=shard,
    )
