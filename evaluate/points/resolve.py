"""The resolver: each composed configuration of a run or sweep typed, checked and resolved into its point, once.

``typed`` gives every setting its type the way OmegaConf's structured configs convert it (``overwrite=no`` is false,
``cr=0.5`` from a string is the number), and refuses a value that has none in one line naming the key, the value and
what is allowed (``query_aware=maybe``, ``cr=abc``, ``limit=2.5``); the types are evaluate/settings.py's. It runs in
:func:`checked` rather than as the config's Hydra schema, so that single runs, every launcher and the tests'
composed configs are checked alike, and so that a mistake is one line and exit code 2 rather than Hydra's
multi-line composition error. :func:`checked` then runs every check that needs no model (evaluate/points/config.py)
and :func:`resolve` derives each point's spec (evaluate/points/point.py). Nothing is written before every point
passed.
"""

import logging
from collections.abc import Sequence
from dataclasses import fields
from typing import get_args

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ValidationError

from evaluate.errors import ConfigError
from evaluate.points.config import (
    attention_implementation,
    compresses,
    decoding_target,
    effective_budget,
    effective_cr,
    fingerprint,
    kept_text,
    kv_cache,
    method_name,
    model_key,
    press_config,
    press_sources,
    recorded_config,
    refuse_knobs_no_point_reads,
    refuse_unread_cr,
    refuse_unread_knobs,
    resolve_device,
    resolve_device_map,
    run_dir,
    unread_settings,
    uses_scorer,
    validate,
)
from evaluate.points.point import PointSpec
from evaluate.points.shard import resolve_shard
from evaluate.settings import Settings

logger = logging.getLogger(__name__)

_MEANINGS = {float: "a number", int: "a whole number", bool: "true or false", str: "a string"}


def _allowed(annotation: type) -> str:
    kinds = [kind for kind in get_args(annotation) or (annotation,) if kind is not type(None)]
    return _MEANINGS[kinds[0]] + (" or null" if type(None) in get_args(annotation) else "")


def typed(cfg: DictConfig) -> DictConfig:
    """``cfg`` with each top-level setting converted to its type; a ConfigError for a value that cannot be."""
    schema = OmegaConf.structured(Settings)
    OmegaConf.set_readonly(schema, False)  # the schema is frozen; this copy of it converts the values
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


def checked(cfgs: Sequence[DictConfig], single: bool = False) -> list[PointSpec]:
    """Each configuration typed, checked (every check that needs no model) and resolved, once: a ConfigError for the
    first that fails, or for two points that are one run (a sweep would run it twice, or race itself). Every
    launcher calls it for every point before any runs; ``single`` also refuses a knob the run's entry does not read."""
    cfgs = [typed(cfg) for cfg in cfgs]  # overwrite=no is false, query_aware=maybe is refused
    for cfg in cfgs:
        validate(cfg)
        if single:
            refuse_unread_knobs(cfg)
    refuse_knobs_no_point_reads(cfgs)
    targets = [cfg for cfg in cfgs if decoding_target(cfg) is not None]
    if targets and not any(compresses(cfg) and effective_cr(cfg) is not None for cfg in cfgs):
        refuse_unread_cr(targets[0])  # no point of the sweep reads its cr
    specs = [resolve(cfg) for cfg in cfgs]
    _warn_ignored_cr(cfgs)
    _warn_unread_knobs(cfgs)
    _refuse_one_run_twice(cfgs, specs)
    return specs


def _refuse_one_run_twice(cfgs: Sequence[DictConfig], specs: Sequence[PointSpec]) -> None:
    """press=none, and a decoding-time press, is one run at any cr, a registry entry at any value of a knob it
    does not read, and a point on the dynamic cache at any value of the quantized cache's knobs: a sweep over them
    runs it once (run_points). Any other two points in one directory are refused."""
    directories = [spec.out for spec in specs]
    duplicates = {
        str(spec.out)
        for cfg, spec in zip(cfgs, specs, strict=True)
        if directories.count(spec.out) > 1
        and compresses(cfg)
        and spec.decoding_target is None
        and not unread_settings(cfg)
        and not kv_cache(cfg).unread_knobs()
    }
    if duplicates:
        raise ConfigError(
            f"the sweep runs the same configuration twice: {', '.join(sorted(duplicates))}; "
            "drop the repeats (limit, device and the like make no other run)"
        )


def _warn_ignored_cr(cfgs: Sequence[DictConfig]) -> None:
    """Say which points of a sweep ignore the ratios it gives: press=none (run once, at cr=0, the baseline) and the
    decoding-time presses (run once, at their target)."""
    uncompressed = [cfg for cfg in cfgs if not compresses(cfg)]
    given = {
        "cr": sorted({float(cfg.cr) for cfg in uncompressed if cfg.cr > 0}),
        "budget": sorted({cfg.budget for cfg in uncompressed if cfg.get("budget") is not None}),
    }
    ignored = [f"{key}={','.join(f'{value:g}' for value in values)}" for key, values in given.items() if values]
    if ignored:
        logger.warning(
            "press=none compresses nothing: %s %s ignored and %s",
            " and ".join(ignored),
            "is" if len(ignored) == 1 else "are",
            "the sweep runs it once, at cr=0, as the baseline of its points"
            if len(cfgs) > 1
            else "the run is recorded at cr=0",
        )
    targets = {method_name(cfg): cfg for cfg in cfgs if decoding_target(cfg) is not None}
    ratios = sorted({float(cfg.cr) for cfg in cfgs if decoding_target(cfg) is not None})
    if len(ratios) > 1:
        logger.warning(
            "%s keep%s target_size pairs while decoding and read no cr: cr=%s is ignored and the sweep runs each "
            "once (their axes are target_size= and compression_interval=)",
            ", ".join(targets),
            "s" if len(targets) == 1 else "",
            ",".join(f"{ratio:g}" for ratio in ratios),
        )


def _warn_unread_knobs(cfgs: Sequence[DictConfig]) -> None:
    """Say which registry entries of a sweep read none of the values it gives a knob (knorm in a sweep over
    target_size=256,512): each runs once."""
    values: dict[tuple[str, str], set] = {}
    for cfg in cfgs:
        for knob in unread_settings(cfg):
            values.setdefault((method_name(cfg), knob), set()).add(cfg.get(knob))
    unread_cache = sorted({knob.split("=")[0] for cfg in cfgs for knob in kv_cache(cfg).unread_knobs()})
    if unread_cache:
        logger.warning(
            "cache=dynamic reads no %s: the sweep runs each of its dynamic points once", ", ".join(unread_cache)
        )
    for (method, knob), given in sorted(values.items()):
        if len(given) > 1:
            logger.warning(
                "%s reads no %s: %s=%s is ignored and the sweep runs it once",
                method,
                knob,
                knob,
                ",".join(f"{value:g}" for value in sorted(given)),
            )


def resolve(cfg: DictConfig) -> PointSpec:
    """``cfg``'s spec; ``cfg`` has been typed and validated (:func:`checked` does both, once)."""
    shard = resolve_shard(cfg.get("shard"))
    if not shard.whole and (cfg.overwrite or cfg.retry_errors):
        raise ConfigError(
            f"overwrite and retry_errors rewrite every shard's rows, which shard {shard} cannot do beside the others: "
            "run them once without shards (one process), then shard the rest"
        )
    scorer = cfg.scorer if uses_scorer(cfg) else {}
    window = scorer.get("press", {}).get("window_size") if scorer else None
    settings = {field.name: cfg[field.name] for field in fields(Settings)}
    resolved = {
        "device": resolve_device(cfg.device),
        "device_map": resolve_device_map(cfg),
        "max_new_tokens": cfg.max_new_tokens if cfg.generate else None,
        "budget": effective_budget(cfg),
        "shard": shard,
    }
    return PointSpec(
        **{**settings, **resolved},
        out=run_dir(cfg),
        fingerprint=fingerprint(cfg),
        method=method_name(cfg),
        effective_cr=effective_cr(cfg),
        decoding_target=decoding_target(cfg),
        kept_text=kept_text(cfg),
        attention=attention_implementation(cfg),
        model_key=model_key(cfg),
        benchmark_name=cfg.benchmark.name,
        model_name=cfg.model.name,
        benchmark=OmegaConf.to_container(cfg.benchmark, resolve=True),
        model_source=OmegaConf.to_container(cfg.model.source, resolve=True),
        press=press_config(cfg),
        scorer_name=scorer.get("name"),
        scorer_window=window if isinstance(window, int) else None,
        scorer_min_context=scorer.get("min_context", 0),
        kv_cache=kv_cache(cfg),
        press_sources=press_sources(cfg),
        recorded=recorded_config(cfg),
        tracking=OmegaConf.to_container(cfg.wandb, resolve=True) if cfg.get("wandb") else {},
    )
