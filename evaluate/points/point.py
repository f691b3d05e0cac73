"""One point of a run or sweep, resolved once: everything of its configuration that the later stages read, typed.

The run directory, the fingerprint, the method's name, the compression ratio applied, the attention, the device and
the device map are each computed here, once per point, and the settings the engine and the recorder act on are
copied out with their types; every later stage (the engine, the model loader, the recorder) reads the spec instead
of the raw configuration. Only the run (evaluate/run/) keeps the composed config beside it (:class:`Point`): it
builds the press, the benchmark and the model source from it and records it in config.yaml.
"""

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from evaluate.errors import ConfigError
from evaluate.points.config import (
    attention_implementation,
    effective_budget,
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
    """A typed and validated configuration with what is derived from it (see the module docstring); the settings
    keep conf/config.yaml's names and meanings."""

    out: Path
    fingerprint: str
    method: str
    # None under a token budget, which gives each context its own ratio (evaluate/points/budget.py).
    effective_cr: float | None
    attention: str
    device: str
    device_map: dict[str, int | str] | str | None
    model_key: str
    # How its samples are answered (the engine reads these).
    query_aware: bool
    generate: bool
    likelihood: bool
    seed: int
    dtype: str
    truncation: str
    max_context_length: int | None
    # Each sample's tokens to generate when set (null: each row's own, as does generate=false, which decodes
    # nothing); make_plan applies it to the samples.
    max_new_tokens: int | None
    decode_batch_size: int
    decode_memory: float | None
    # A conversation's turns asked on their own (independent) or in order on one cache (multi), and under multi the
    # earlier answers the cache holds (reference or model).
    turns: str
    history: str
    # What the run does with earlier sessions' rows and with failures (the recorder reads these).
    overwrite: bool
    retry_errors: bool
    fail_fast: bool
    wait_for_locks: bool
    shard: Shard = Shard()
    # KV pairs kept of each context (budget=N), or None: the engines set each context's ratio from it.
    budget: int | None = None


@dataclass(frozen=True)
class Point:
    """A point as the run holds it: the composed config (its press, benchmark and model source are built from it,
    and config.yaml records it) beside its spec, which everything below the run reads."""

    cfg: DictConfig
    spec: PointSpec


# The spec's fields copied from conf/config.yaml's keys of the same name as they are (settings.typed typed them).
COPIED_SETTINGS = (
    "query_aware",
    "generate",
    "likelihood",
    "seed",
    "dtype",
    "truncation",
    "max_context_length",
    "decode_batch_size",
    "decode_memory",
    "turns",
    "history",
    "overwrite",
    "retry_errors",
    "fail_fast",
    "wait_for_locks",
)


def resolve(cfg: DictConfig) -> PointSpec:
    """``cfg``'s spec; ``cfg`` has been typed and validated (evaluate/run/entry.py does both, once)."""
    shard = resolve_shard(cfg.get("shard"))
    if not shard.whole and (cfg.overwrite or cfg.retry_errors):
        raise ConfigError(
            f"overwrite and retry_errors rewrite every shard's rows, which shard {shard} cannot do beside the others: "
            "run them once without shards (one process), then shard the rest"
        )
    return PointSpec(
        out=run_dir(cfg),
        fingerprint=fingerprint(cfg),
        method=method_name(cfg),
        effective_cr=effective_cr(cfg),
        budget=effective_budget(cfg),
        attention=attention_implementation(cfg),
        device=resolve_device(cfg.device),
        device_map=resolve_device_map(cfg),
        model_key=model_key(cfg),
        max_new_tokens=cfg.max_new_tokens if cfg.generate else None,
        **{name: cfg[name] for name in COPIED_SETTINGS},
        shard=shard,
    )
