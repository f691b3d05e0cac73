"""Checks and derived names for a composed run configuration.

Everything here runs before the model loads, so a bad run fails in the first second.
"""

import hashlib
import importlib.util
import json
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields
from functools import lru_cache
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from kvpress import BasePress
from omegaconf import DictConfig, OmegaConf

from evaluate import registry, rundir
from evaluate.benchmarks.sources import no_connection
from evaluate.errors import ConfigError
from evaluate.kv_cache import DynamicKVCache, QuantizedKVCache
from evaluate.points.overrides import default_setting
from evaluate.points.point import PointSpec
from evaluate.press_profile import (
    changes_the_model,
    decoding_part,
    downloads,
    kvpress_chunk_lengths,
    kvpress_defect,
    members,
    needs_eager,
    needs_non_eager,
    needs_query_aware,
    prefill_part,
    why_not_budget,
    why_not_decoding_window,
    why_not_multi_turn,
    why_not_teacher_forced,
)
from evaluate.settings import NON_RESULT_KEYS, Settings, without_old_defaults

logger = logging.getLogger(__name__)


def _path_name(name_or_path: str) -> str:
    return Path(str(name_or_path).rstrip("/")).name


OmegaConf.register_new_resolver("path_name", _path_name, replace=True)


def compresses(cfg: DictConfig) -> bool:
    """Whether the configuration compresses at all (press=none and method=no_press do not)."""
    return cfg.press.press is not None and described_press(cfg) is not None


def press_config(cfg: DictConfig) -> dict | None:
    """The press's ``_target_`` tree, resolved (None for press=none): what the point's spec carries."""
    return None if cfg.press.press is None else OmegaConf.to_container(cfg.press.press, resolve=True)


def build_press(spec: PointSpec) -> BasePress | None:
    """A new press object for the run (None for press=none); a registry entry's missing knob is a ConfigError."""
    return None if spec.press is None else _instantiate(spec.press)


def described_press(cfg: DictConfig) -> BasePress | None:
    """The press the configuration describes, to read its classes and arguments, never to run: built once per
    distinct press configuration, since the checks ask for it many times and some constructors log (KVzip's cost)."""
    return described(press_config(cfg))


def described(press: dict | None) -> BasePress | None:
    """:func:`described_press` of a press's resolved ``_target_`` tree (a spec's ``press``)."""
    return None if press is None else _described(json.dumps(press, sort_keys=True))


@lru_cache(maxsize=256)
def _described(press_config: str) -> BasePress | None:
    return _instantiate(json.loads(press_config))


def _instantiate(press_config: dict | None) -> BasePress | None:
    try:
        return instantiate(press_config)
    except InstantiationException as error:
        if isinstance(error.__cause__, ConfigError):
            raise error.__cause__ from None
        raise


# Packages whose code a run's versions already identify (config.yaml records kvpress's and PressBench's versions).
_VERSIONED_PACKAGES = ("kvpress", "evaluate", "presses", "scorers")


def press_sources(cfg: DictConfig) -> dict[str, str]:
    """The source of each module that defines the run's press or a press it holds (its scorer), or a class they
    derive from, outside kvpress and PressBench: ``{module: sha256 of its file}``. Your own press's code is part of
    what a run answered with, though no setting names it: a resume on edited code is refused (plan.previous_rows)."""
    press = described_press(cfg) if compresses(cfg) else None
    modules = {
        cls.__module__
        for member in members(press)
        for cls in type(member).__mro__
        if cls.__module__.partition(".")[0] not in (*_VERSIONED_PACKAGES, "builtins", "abc")
    }
    sources = {}
    for name in sorted(modules):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file is not None:
            sources[name] = hashlib.sha256(Path(file).read_bytes()).hexdigest()[:16]
    return sources


def uses_registry_entry(cfg: DictConfig) -> bool:
    """Whether the press is a kvpress registry entry (method=<name>, press=registry)."""
    return cfg.press.press is not None and cfg.press.press.get("_target_") == registry.BUILD_TARGET


def refuse_unread_knobs(cfg: DictConfig) -> None:
    """Refuse a single run's knob that its registry entry does not read, a ``cr`` its decoding-time press does not
    read, or a ``max_new_tokens`` with ``generate=false``: it would only duplicate the run without it. (A sweep may
    give one knob to several entries, or max_new_tokens to generate=true,false; the points that do not read it run
    without it.)"""
    if not cfg.generate and cfg.max_new_tokens is not None:
        raise ConfigError(
            f"generate=false decodes nothing, so max_new_tokens={cfg.max_new_tokens} is never read; drop it "
            "(it would only duplicate the run without it)"
        )
    if unread := kv_cache(cfg).unread_knobs():
        raise ConfigError(
            f"cache=dynamic reads no {' '.join(unread)}; drop it or use cache=quantized (it would only duplicate the "
            "run without it)"
        )
    refuse_unread_cr(cfg)
    if not compresses(cfg):
        given = [f"{knob}={cfg.get(knob)}" for knob in sorted(registry.RUNNER_KNOBS) if cfg.get(knob) is not None]
        if given:
            raise ConfigError(
                f"the uncompressed run reads no press knob: drop {' '.join(given)} (it would only duplicate the run "
                "without it)"
            )
    if not uses_registry_entry(cfg):
        return
    unread = unread_settings(cfg)
    if unread:
        settings = " ".join(f"{knob}={cfg.get(knob)}" for knob in unread)
        raise ConfigError(
            f"method={cfg.press.method} does not read {settings}; drop it (it would only duplicate the run without it)"
        )


def unread_settings(cfg: DictConfig) -> list[str]:
    """The runner knobs a point's registry entry does not read, among those its config sets (a sweep's
    ``target_size`` on its knorm point): the point is one run whatever they say."""
    if not compresses(cfg) or not uses_registry_entry(cfg):
        return []
    return registry.unread_knobs(cfg.press.method, {knob: cfg.get(knob) for knob in registry.RUNNER_KNOBS})


def recorded_config(cfg: DictConfig) -> dict:
    """The configuration as config.yaml records it: resolved, with a knob the point's registry entry does not read
    as null (the run is the run without it: knorm in a sweep over target_size), so that no report tells two of its
    runs apart by a knob neither read."""
    recorded = OmegaConf.to_container(cfg, resolve=True)
    for knob in unread_settings(cfg):
        recorded[knob] = None
        recorded["press"]["press"][knob] = None
    return recorded


def refuse_knobs_no_point_reads(cfgs: Sequence[DictConfig]) -> None:
    """Refuse a sweep that sets a runner knob none of its points reads (``method=knorm target_size=256,512``), as a
    single run is refused: its points would run once each, whatever the knob says."""
    for knob in sorted(registry.RUNNER_KNOBS):
        setting = [cfg for cfg in cfgs if cfg.get(knob) is not None and uses_registry_entry(cfg) and compresses(cfg)]
        if setting and all(knob in unread_settings(cfg) for cfg in setting):
            refuse_unread_knobs(setting[0])


def uses_scorer(cfg: DictConfig) -> bool:
    """Whether the press is built from the scorer axis (press=topk, adakv, chunkkv...): every press but none and
    the registry entries of method=<name>. Read off the press's target, which survives resolving the config (a
    launcher's workers receive it resolved)."""
    return compresses(cfg) and cfg.press.press.get("_target_") != registry.BUILD_TARGET


def decoding_target(cfg: DictConfig) -> tuple[int, int] | None:
    """``(target_size, compression_interval)`` of a point whose press compresses only while decoding (kvpress's
    ``DecodingPress``, CAM's included): it keeps ``target_size`` pairs of each row, whatever ``cr`` says, so that
    target is its axis. None for every other point (a ``PrefillDecodingPress`` compresses its prefill by a ratio)."""
    press = described_press(cfg) if compresses(cfg) else None
    decoding = decoding_part(press)
    if decoding is None or prefill_part(press) is not None:
        return None
    return decoding.target_size, decoding.compression_interval


def refuse_unread_cr(cfg: DictConfig) -> None:
    """Refuse a ``cr`` other than conf/config.yaml's default beside a decoding-time press, which never reads it: the
    run would be filed under a ratio it did not apply."""
    target = decoding_target(cfg)
    if target is not None and cfg.cr != default_setting("cr"):
        raise ConfigError(
            f"method={method_name(cfg)} keeps target_size={target[0]} pairs while decoding and never reads "
            f"cr={cfg.cr}; drop cr (its axes are target_size= and compression_interval=)"
        )


def effective_budget(cfg: DictConfig) -> int | None:
    """The token budget of each context (``budget=N``), or None: for ``cr`` runs and presses that do not compress."""
    budget = cfg.get("budget")
    return int(budget) if budget is not None and compresses(cfg) else None


def effective_cr(cfg: DictConfig) -> float | None:
    """The compression ratio actually applied: presses that do not compress apply 0; a token budget applies none
    (each context gets its own ratio, evaluate/points/budget.py), nor a decoding-time press (its target decides)."""
    if effective_budget(cfg) is not None or decoding_target(cfg) is not None:
        return None
    return float(cfg.cr) if compresses(cfg) else 0.0


def kept_text(cfg: DictConfig) -> str:
    """How much a point keeps, as its lines print it: ``budget=N``, a decoding-time press's target, or the ratio as
    run names write it."""
    budget, target = effective_budget(cfg), decoding_target(cfg)
    if budget is not None:
        return f"budget={budget}"
    if target is not None:
        return f"target_size={target[0]} (interval {target[1]})"
    return rundir.cr_text(effective_cr(cfg))


def attention_implementation(cfg: DictConfig) -> str:
    """The attention the model runs: as given, or kvpress's rule when null (eager for ObservedAttentionPress,
    flash_attention_2 on CUDA when ``flash_attn`` is installed, else the transformers default, sdpa)."""
    if cfg.attn_implementation is not None:
        return cfg.attn_implementation
    if compresses(cfg) and needs_eager(described_press(cfg)):
        return "eager"
    if runs_on_cuda(resolve_device(cfg.device)) and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def method_name(cfg: DictConfig) -> str:
    """The run's method: kvpress's registry name where the press is that entry (evaluate/registry.py)."""
    return registry.method_name(cfg.press.method, described_press(cfg))


def validate_choices(choices: Mapping[str, str | None]) -> None:
    """Refuse config-group choices that contradict each other (Hydra's ``runtime.choices`` of a run or sweep point):
    ``method=`` selects ``press=registry``, and a ``press=`` given beside it would win silently."""
    method, press = choices.get("method"), choices.get("press")
    if method is not None and press != "registry":
        raise ConfigError(
            f"press={press} and method={method} both choose the press; give one: method={method} runs kvpress's "
            f"registry entry, press={press} the press of conf/press/{press}.yaml"
        )


def check_ranges(cfg: DictConfig) -> None:
    """Refuse a setting outside the values evaluate/settings.py allows it (null aside), in its one line."""
    for each in fields(Settings):
        value, declaration = cfg.get(each.name), each.metadata
        if value is None:
            continue
        if declaration["choices"] and value not in declaration["choices"]:
            raise ConfigError(f"{each.name}={value!r}; choose one of {', '.join(declaration['choices'])}")
        if declaration["allowed"] is not None and not declaration["allowed"](value):
            raise ConfigError(f"{each.name}={value} {declaration['refusal']}")


def validate(cfg: DictConfig) -> None:
    """Refuse configurations kvpress cannot run, each with a one-line reason."""
    check_ranges(cfg)
    _check_budget(cfg)
    _check_device(cfg.device)
    resolve_dtype(cfg.dtype)
    _check_attention(cfg.attn_implementation, resolve_device(cfg.device))
    _check_device_map(cfg.get("device_map"))
    _check_writable(Path(cfg.output_dir))
    knobs = {knob: cfg.get(knob) for knob in sorted(registry.RUNNER_KNOBS - {"compression_ratio"})}
    if not uses_registry_entry(cfg) and cfg.press.press is not None and any(v is not None for v in knobs.values()):
        stray = ", ".join(knob for knob, value in knobs.items() if value is not None)
        raise ConfigError(f"{stray} set the knobs of kvpress's registry entries; use method=<entry>")
    if not cfg.generate and not cfg.likelihood:
        raise ConfigError("generate=false with likelihood=false measures nothing; drop one of them")
    if cfg.save_kept and cfg.diagnostics == "none":
        raise ConfigError("save_kept=true stores the kept sets the diagnostics find, and diagnostics=none finds none")
    _check_turns(cfg)
    why_not = kv_cache(cfg).why_not_multi_turn  # its instantiation refuses a backend or bits it cannot take
    if why_not and cfg.turns == "multi":
        raise ConfigError(f"turns=multi {why_not}; use cache=dynamic")
    if not compresses(cfg):
        return
    press = described_press(cfg)
    why_not = why_not_teacher_forced(press)
    if why_not and not cfg.generate:
        raise ConfigError(f"generate=false needs the likelihood fields, and {method_name(cfg)} has none: {why_not}")
    if why_not and cfg.likelihood:
        logger.warning("%s gets no likelihood fields: %s", method_name(cfg), why_not)
    validate_press(cfg, press, method_name(cfg))
    why_not = why_not_multi_turn(press, cfg.history) if cfg.turns == "multi" else None
    if why_not:
        raise ConfigError(f"turns=multi cannot run {method_name(cfg)}: {why_not}")
    if needs_non_eager(press) and attention_implementation(cfg) == "eager":
        raise ConfigError(
            f"press {method_name(cfg)} cannot run with attn_implementation=eager "
            "(kvpress's ChunkKV/AdaKV need sdpa or flash attention); use attn_implementation=sdpa"
        )
    if uses_scorer(cfg) and cfg.scorer.get("needs_eager", False) and attention_implementation(cfg) != "eager":
        raise ConfigError(
            f"scorer {cfg.scorer.name} reads the attention weights, which only eager attention returns; "
            "use attn_implementation=eager"
        )


def _check_turns(cfg: DictConfig) -> None:
    """Refuse a history that nothing reads, and conversations asked without answers."""
    if cfg.turns == "independent" and cfg.history != "reference":
        raise ConfigError(
            f"history={cfg.history} is read only by turns=multi (independent turns keep no earlier answer); "
            "add turns=multi, or drop history"
        )
    if cfg.turns == "multi" and not cfg.generate:
        raise ConfigError("turns=multi asks each turn after the previous answer, and generate=false answers none")


def _check_budget(cfg: DictConfig) -> None:
    """Refuse a token budget a press cannot keep, or one that every context fits in (check_ranges refuses one that
    is not a positive count): with ``truncation=pipeline`` no context is longer than ``max_context_length``, so a
    budget at least that keeps them all whole, the uncompressed run (the lengths themselves are checked once
    tokenized)."""
    budget = cfg.get("budget")
    if budget is None or not compresses(cfg):
        return
    why_not = why_not_budget(described_press(cfg))
    if why_not:
        raise ConfigError(f"method {method_name(cfg)} cannot keep a token budget: {why_not}")
    if cfg.truncation == "pipeline" and cfg.max_context_length is not None and budget >= cfg.max_context_length:
        raise ConfigError(
            f"budget={budget} keeps every context whole: none is longer than max_context_length="
            f"{cfg.max_context_length}; give a smaller budget (or press=none for the uncompressed run)"
        )


def validate_press(cfg: DictConfig, press, method: str) -> None:
    """Refuse, in one line, a press that cannot run here: kvpress fails with it, it needs downloads this machine
    cannot make, or the run lacks what kvpress's runner requires for it."""
    defect = kvpress_defect(press)
    if defect:
        raise ConfigError(f"method {method} cannot run: {defect}")
    needed = downloads(press)
    if needed and hub_unreachable():
        raise ConfigError(
            f"method {method} needs {needed}, which this machine cannot download ({hub_unreachable()}); "
            "run it where the Hugging Face hub is reachable"
        )
    why_not = why_not_decoding_window(press)
    if why_not:
        raise ConfigError(f"method {method} cannot compress while decoding: {why_not}")
    if needs_query_aware(press) and not cfg.query_aware:
        raise ConfigError(f"method {method} needs query-aware runs, as kvpress's runner requires; add query_aware=true")
    if needs_eager(press) and attention_implementation(cfg) != "eager":
        raise ConfigError(
            f"method {method} reads the attention weights, which only eager attention returns; "
            "use attn_implementation=eager (or null, kvpress's choice)"
        )


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached, if it cannot: offline mode, or no connection within 3 s."""
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else no_connection()


def validate_context_lengths(spec: PointSpec, shortest_context: int) -> None:
    """Refuse a scorer whose observation window does not fit in the shortest context."""
    if spec.scorer_name is None:
        return
    # A scorer's YAML may leave min_context out: a scorer without an observation window needs no minimum.
    min_context = spec.scorer_min_context
    if shortest_context <= min_context:
        raise ConfigError(
            f"scorer {spec.scorer_name} needs contexts longer than {min_context} tokens but the shortest "
            f"context has {shortest_context}; lower its window (e.g. scorer.press.window_size=) or use longer contexts"
        )


def validate_budget(spec: PointSpec, shortest_context: int) -> None:
    """Refuse a ratio at which the press would keep more than its budget of the shortest context: a budget of 0
    pairs, which kvpress's ``compute_n_kept`` and presses/exact_budget.py raise to 1, and 0 chunks, which kvpress's
    ChunkKVPress raises to one whole chunk; warn when a scorer's window outnumbers the budget, so that tie-breaking
    picks the pairs kept (docs/configuration.md, "Extreme ratios")."""
    cr = spec.effective_cr
    if cr == 0 or spec.decoding_target is not None:
        return
    if cr is None:  # a token budget keeps at least 1 pair of every context, and exactly its budget
        _warn_window(spec, min(spec.budget, shortest_context), shortest_context, f"budget={spec.budget}")
        return
    if spec.scorer_name is not None:
        n_kept = int(shortest_context * (1 - cr))
        if n_kept == 0:
            raise ConfigError(
                f"cr={cr} keeps int({shortest_context} * (1 - cr)) = 0 pairs of the shortest context "
                f"({shortest_context} tokens), and the press would keep 1 anyway; use contexts of at least "
                f"{shortest_keeping(1, cr)} tokens or a lower cr"
            )
        _warn_window(spec, n_kept, shortest_context, f"cr={cr}", shortest_keeping)
    for chunk_length in kvpress_chunk_lengths(described(spec.press)):
        n_chunks = -(-shortest_context // chunk_length)
        if int(n_chunks * (1 - cr)) == 0:
            raise ConfigError(
                f"kvpress's ChunkKVPress at cr={cr} keeps int({n_chunks} chunks * (1 - cr)) = 0 chunks of "
                f"{chunk_length} tokens of the shortest context ({shortest_context} tokens), and keeps one "
                f"whole chunk anyway, more than the budget; use contexts of at least "
                f"{(shortest_keeping(1, cr) - 1) * chunk_length + 1} tokens, a chunk_length of at most "
                f"{largest_chunk_keeping(shortest_context, cr)}, or press=chunkkv_exact (an exact budget)"
            )


def warn_uncompressed_decoding(spec: PointSpec, longest_row: int, longest_question: int, longest_answer: int) -> None:
    """Warn, before the model loads, when a decoding-time press will compress no row: it removes pairs only once a
    layer holds more than ``target_size`` at a compression, which comes every ``compression_interval`` passes (the
    question's pass the first) or on a pass of at least ``target_size`` tokens. Its run is then the uncompressed
    model's; its closing lines and run.json say how many rows it compressed (evaluate/score/decoding.py). The
    lengths are the samples' tokens before the chat template: the longest context, question and answer together,
    the longest question, and the largest ``max_new_tokens``."""
    if spec.decoding_target is None:
        return
    target_size, interval = spec.decoding_target
    if longest_row <= target_size:
        why = (
            f"target_size={target_size} holds every row whole (the longest context, question and answer hold "
            f"{longest_row} tokens); give a target_size below {longest_row}"
        )
    elif longest_answer < interval and longest_question < target_size:
        why = (
            f"compression_interval={interval} is more than every answer's max_new_tokens (at most {longest_answer}), "
            f"so no row reaches its first compression; give compression_interval={longest_answer} or less"
        )
    else:
        return
    logger.warning("%s will never compress here, and answers as the uncompressed model: %s", spec.method, why)


def _warn_window(spec: PointSpec, n_kept: int, shortest_context: int, at: str, shortest=None) -> None:
    """Warn when the pairs kept of the shortest context are fewer than the scorer's window. Not refused: the press
    keeps its budget, as kvpress computes it; but which pairs is tie-breaking. ``shortest(window, cr)``, for a
    ratio, is the context length whose budget holds the window; a token budget holds it at ``budget=window``."""
    window = spec.scorer_window
    if window is None or n_kept >= window:
        return
    fix = (
        f"use contexts of at least {shortest(window, spec.effective_cr)} tokens"
        if shortest
        else f"use budget={window} or more"
    )
    logger.warning(
        "scorer %s keeps %d pairs per head of the shortest context (%d tokens) at %s, fewer than its window of %d, "
        "which it scores above every other position: the pairs kept are window positions picked among equal scores "
        "by torch.topk; %s or a smaller scorer.press.window_size for a selection the scores decide",
        spec.scorer_name,
        n_kept,
        shortest_context,
        at,
        window,
        fix,
    )


def shortest_keeping(n_kept: int, cr: float) -> int:
    """The fewest items ``n`` with ``int(n * (1 - cr)) >= n_kept``, the rounding of kvpress's budgets."""
    n = max(1, math.floor(n_kept / (1 - cr)) - 2)
    while int(n * (1 - cr)) < n_kept:
        n += 1
    return n


def largest_chunk_keeping(context: int, cr: float) -> int:
    """The largest chunk length at which kvpress's ChunkKV budget ``int(n_chunks * (1 - cr))`` keeps a chunk of a
    ``context``-token context (1 when none does: chunks of one token are the bare scorer's budget)."""
    return next(
        (length for length in range(context, 0, -1) if int(-(-context // length) * (1 - cr)) >= 1),
        1,
    )


def result_config(cfg: DictConfig) -> dict:
    """The resolved configuration minus the keys that cannot change a prediction."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    for key in NON_RESULT_KEYS:
        resolved.pop(key, None)
    resolved["cr"] = effective_cr(cfg)
    if effective_budget(cfg) is None:
        resolved.pop("budget", None)  # cr runs keep the fingerprints they had before budget= existed
    else:
        resolved["budget"] = effective_budget(cfg)
    if resolved["cr"] is None:
        resolved.pop("cr")  # each context gets its own ratio, or a decoding-time press its target: cr says nothing
    if decoding_target(cfg) is not None:
        resolved["press"]["press"].pop("compression_ratio", None)  # the registry entry's copy of the cr it ignores
    for knob in registry.RUNNER_KNOBS:
        if resolved.get(knob) is None:
            resolved.pop(knob, None)  # unset knobs do not split runs, nor move the runs recorded before they existed
    if resolved.get("generate", True):
        resolved.pop("generate", None)  # generating runs keep the fingerprints they had before generate=false existed
    resolved = without_old_defaults(resolved)
    if resolved.get("max_new_tokens") is None or not resolved.get("generate", True):
        # null: each row's own, as every run recorded before the key existed; generate=false decodes nothing.
        resolved.pop("max_new_tokens", None)
    if uses_registry_entry(cfg):
        # A knob the entry does not read (a sweep's key_channel_compression_ratio or target_size on its knorm point)
        # changes nothing: the point is the run without it, the registry entry's copy of the knob included.
        for knob in registry.unread_knobs(cfg.press.method, resolved):
            resolved.pop(knob)
            if knob in resolved["press"]["press"]:
                resolved["press"]["press"][knob] = None
    # What actually runs, so that a run on flash attention never resumes one on sdpa.
    resolved["attn_implementation"] = attention_implementation(cfg)
    if not compresses(cfg):
        # method=no_press is press=none: one run, whichever way it was asked for.
        resolved["press"] = {"method": "no_press", "press": None}
        for knob in registry.RUNNER_KNOBS:
            resolved.pop(knob, None)
    if not uses_scorer(cfg):
        # A press that is not built from the scorer (none, or a registry entry) must not split runs by its choice.
        resolved.pop("scorer", None)
    return resolved


def fingerprint(cfg: DictConfig) -> str:
    """A stable hash of everything that can change a prediction."""
    canonical = json.dumps(result_config(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def run_name(cfg: DictConfig) -> str:
    """Readable run directory name; the suffix hashes every result-changing key the name leaves out."""
    budget, target = effective_budget(cfg), decoding_target(cfg)
    if budget is not None:
        kept = f"budget{budget}"
    elif target is not None:
        kept = f"target{target[0]}_interval{target[1]}"
    else:
        kept = f"cr{rundir.cr_text(effective_cr(cfg))}"
    parts = [cfg.benchmark.name, cfg.model.name, method_name(cfg), kept]
    if cfg.query_aware:
        parts.append("query_aware")
    if cfg.get("turns", "independent") == "multi":
        parts.append("multi" if cfg.history == "reference" else f"multi_{cfg.history}")
    if (cache := kv_cache(cfg).run_name_part) is not None:
        parts.append(cache)
    parts.append(fingerprint(cfg)[:6])
    return "__".join(parts)


def kv_cache(cfg: DictConfig) -> DynamicKVCache | QuantizedKVCache:
    """The cache the point holds its keys and values in (the ``cache`` group; a configuration from before the group
    existed: the model's own)."""
    return DynamicKVCache() if cfg.get("cache") is None else _instantiate(cfg.cache)


def run_dir(cfg: DictConfig) -> Path:
    return Path(cfg.output_dir) / run_name(cfg)


def model_key(cfg: DictConfig) -> str:
    """Configurations with equal keys run on one loaded model: in one sweep, and on one worker of the gpus launcher."""
    model = OmegaConf.to_container(cfg.model.source, resolve=True)
    key = [model, cfg.device, resolve_device_map(cfg), cfg.dtype, attention_implementation(cfg), cfg.seed]
    if compresses(cfg) and changes_the_model(described_press(cfg)):
        key.append(run_name(cfg))  # a model this press changes serves no other configuration
    return json.dumps(key, sort_keys=True)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(device: str) -> str:
    """Where ``device`` runs the model: the one rule for ``device=auto``, which sharding relies on.

    - an explicit device (``cpu``, ``cuda``, ``cuda:1``) is returned as given;
    - ``auto`` without CUDA is ``cpu``;
    - ``auto`` in a process a launcher started with ``LOCAL_RANK`` (torchrun) is ``cuda:<LOCAL_RANK>``: one shard of the
      work per GPU, so the process keeps to its own device;
    - ``auto`` otherwise stays ``auto``: the model is spread over every visible GPU with ``device_map="auto"``, as
      kvpress's evaluate.py loads it when CUDA is present (a 70B model, or an 8B one at 128k tokens, needs several).
    """
    if device != "auto":
        return device
    if not _cuda_available():
        return "cpu"
    local_rank = os.environ.get("LOCAL_RANK")
    return f"cuda:{int(local_rank)}" if local_rank is not None else "auto"


def runs_on_cuda(device: str) -> bool:
    """Whether a resolved device (:func:`resolve_device`) puts the model on CUDA (``auto`` does so only with CUDA)."""
    return device == "auto" or device.startswith("cuda")


def resolve_device_map(cfg: DictConfig) -> dict[str, int | str] | str | None:
    """The device map the model is loaded with: ``device_map`` as given, else ``auto`` where ``device`` resolves to
    it, else None (the model is moved whole to the device)."""
    if cfg.get("device_map") is not None:
        device_map = cfg.device_map
        return device_map if isinstance(device_map, str) else OmegaConf.to_container(device_map, resolve=True)
    return "auto" if resolve_device(cfg.device) == "auto" else None


def resolve_dtype(dtype: str) -> torch.dtype | str:
    """Map a config string ("auto", "float32", "bfloat16", ...) to what ``from_pretrained`` accepts."""
    if dtype == "auto":
        return "auto"
    resolved = getattr(torch, str(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ConfigError(f"dtype={dtype} is not a torch dtype; use auto, float32, float16 or bfloat16")
    return resolved


def _check_device(device: str) -> None:
    """Refuse a device torch cannot parse, or one this machine does not have, before any run directory exists."""
    resolved = resolve_device(device)
    if resolved == "auto":
        return
    try:
        parsed = torch.device(resolved)
    except (RuntimeError, ValueError):
        raise ConfigError(f"device={device} is not a device; use auto, cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        if not _cuda_available():
            raise ConfigError(
                f"device={device}, but torch sees no CUDA GPU on this machine; use device=cpu or device=auto"
            )
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device={device}, but torch sees {torch.cuda.device_count()} CUDA GPUs (cuda:0 to "
                f"cuda:{torch.cuda.device_count() - 1}); use one of them or device=auto"
            )
    elif parsed.type != "cpu":
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None or accelerator.type != parsed.type:
            raise ConfigError(f"device={device}, but this machine has no {parsed.type} device; use device=auto")


def _check_attention(attn_implementation: str | None, device: str) -> None:
    """Refuse an attention transformers does not know, or flash attention where it cannot run. PressBench refuses an
    explicit ``flash_attention_2`` without ``flash_attn`` rather than fall back: only ``null`` is kvpress's rule,
    which falls back to sdpa when it cannot import flash_attn."""
    if attn_implementation is None:
        return
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if attn_implementation not in known and not is_kernel(attn_implementation):
        raise ConfigError(
            f"attn_implementation={attn_implementation} is not an attention transformers knows; use null "
            "(kvpress's rule), eager, sdpa, flash_attention_2, flash_attention_3 or flex_attention"
        )
    flash = attn_implementation.removeprefix("paged|")
    available = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}
    if flash in available and not (runs_on_cuda(device) and available[flash]()):
        package = "flash_attn" if flash == "flash_attention_2" else "flash_attn_3"
        raise ConfigError(
            f"attn_implementation={attn_implementation} needs a CUDA GPU and the {package} package, which this "
            f"machine lacks (device={device}); install it on a GPU machine, or use attn_implementation=null: "
            "kvpress's rule, flash_attention_2 where flash_attn imports, else sdpa"
        )


def _check_device_map(device_map) -> None:
    if device_map is None or device_map == "auto":
        return
    if not isinstance(device_map, Mapping) or not device_map:
        raise ConfigError(
            f"device_map={device_map} is neither auto nor a map of module names to devices, "
            "e.g. {model.embed_tokens:0,model.layers.0:0,...}"
        )
    for module, where in device_map.items():
        if not isinstance(where, int | str) or isinstance(where, bool):
            raise ConfigError(f"device_map names {where!r} for {module}; give a GPU index, cuda:N, cpu, disk or meta")


def _check_writable(output_dir: Path) -> None:
    """Refuse an ``output_dir`` that is a file or sits in a folder this process cannot write, before any run starts."""
    existing = next(path for path in (output_dir, *output_dir.absolute().parents) if path.exists())
    if not existing.is_dir():
        raise ConfigError(f"output_dir={output_dir} is not a folder ({existing} is a file); pass another output_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"output_dir={output_dir} cannot be written ({existing} is read-only); pass another output_dir"
        )
