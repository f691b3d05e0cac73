"""The types of the top-level settings of conf/config.yaml, checked by OmegaConf before anything runs.

The values (and their defaults) live in the YAML; this schema says only what each may be. ``typed`` gives every
setting its type the way OmegaConf's structured configs convert it (``overwrite=no`` is false, ``cr=0.5`` from a
string is the number), and refuses a value that has none in one line naming the key, the value and what is allowed
(``query_aware=maybe``, ``cr=abc``, ``limit=2.5``). It runs in ``run_sweep`` (evaluate/run/entry.py) rather than as the
config's Hydra schema, so that single runs, every launcher and the tests' composed configs are checked alike, and
so that a mistake is one line and exit code 2 rather than Hydra's multi-line composition error.
"""

from dataclasses import dataclass, fields
from typing import Any, get_args

from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import ValidationError

from evaluate.errors import ConfigError


@dataclass
class Settings:
    cr: float = MISSING
    budget: int | None = MISSING
    query_aware: bool = MISSING
    key_channel_compression_ratio: float | None = MISSING
    threshold: float | None = MISSING
    head_compression_ratio: float | None = MISSING
    compression_interval: int | None = MISSING
    target_size: int | None = MISSING
    hidden_states_buffer_size: int | None = MISSING
    limit: int | None = MISSING
    fraction: float = MISSING
    seed: int = MISSING
    output_dir: str = MISSING
    device: str = MISSING
    # null, "auto" or a map of module names to devices: OmegaConf types no union of a string and a dict, so the
    # shape is checked by config.validate.
    device_map: Any = MISSING
    dtype: str = MISSING
    attn_implementation: str | None = MISSING
    max_context_length: int | None = MISSING
    truncation: str = MISSING
    max_new_tokens: int | None = MISSING
    turns: str = MISSING
    history: str = MISSING
    overwrite: bool = MISSING
    decode_batch_size: int = MISSING
    decode_memory: float | None = MISSING
    likelihood: bool = MISSING
    generate: bool = MISSING
    fail_fast: bool = MISSING
    retry_errors: bool = MISSING
    wait_for_locks: bool = MISSING
    shard: str | None = MISSING


_MEANINGS = {float: "a number", int: "a whole number", bool: "true or false", str: "a string"}


def _allowed(annotation: type) -> str:
    kinds = [kind for kind in get_args(annotation) or (annotation,) if kind is not type(None)]
    return _MEANINGS[kinds[0]] + (" or null" if type(None) in get_args(annotation) else "")


def typed(cfg: DictConfig) -> DictConfig:
    """``cfg`` with each top-level setting converted to its type; a ConfigError for a value that cannot be."""
    schema = OmegaConf.structured(Settings)
    converted = {}
    for field in fields(Settings):
        if field.name not in cfg:
            continue
        value = cfg[field.name]
        try:
            schema[field.name] = value
        except ValidationError:
            raise ConfigError(f"{field.name}={value} is not {_allowed(field.type)}") from None
        # Only values the conversion changes are replaced: an int 0 stays 0, so no run's fingerprint moves.
        if schema[field.name] != value:
            converted[field.name] = schema[field.name]
    if not converted:
        return cfg
    result = cfg.copy()
    with open_dict(result):
        for name, value in converted.items():
            result[name] = value
    return result
