"""The settings of conf/config.yaml, each declared once: its type, the values it allows, whether it changes a
prediction, and a line on what it means. conf/config.yaml holds the defaults, which Hydra composes; this schema says
everything else.

Derived from it:

- the keys that never change a prediction (``NON_RESULT_KEYS``): the fingerprint leaves them out
  (evaluate/points/config.py), the readers of a results tree never tell two runs apart by them
  (evaluate/report/runs.py);
- the keys that choose the press (``PRESS_KEYS``), in which alone a run differs from its uncompressed baseline
  (evaluate/score/baseline.py), and the knobs kvpress's runner sets (``RUNNER_KNOBS``, evaluate/registry.py);
- each run's typed conversion and range checks (evaluate/points/resolve.py);
- the settings a point's spec carries (evaluate/points/point.py's ``PointSpec`` derives from :class:`Settings`).

tests/test_settings.py holds it to conf/config.yaml and to docs/configuration.md's table. Adding a setting means its
default in the YAML, its line here, and the code that reads it. It imports only the standard library, so the
torch-free readers may import it.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

# OmegaConf's mark of a value still to be given: the schema gives none, since conf/config.yaml gives every default.
MISSING = "???"


def setting(
    doc: str,
    *,
    result: bool = True,
    press: bool = False,
    runner: bool = False,
    allowed: Callable[[Any], bool] | None = None,
    refusal: str = "",
    choices: tuple[str, ...] = (),
) -> Any:
    """A setting's declaration (a dataclass field):

    - ``doc``: what it means, in a line;
    - ``result``: whether it can change a prediction (false: where results go, how many samples, which device);
    - ``press``: whether it chooses the press or how much it removes (a run and its baseline differ in these alone);
    - ``runner``: a knob kvpress's runner sets on a registry entry (null unless the entry needs it);
    - ``allowed`` and ``refusal``: the values it allows beside null, and the rest of the one-line refusal of any
      other (``cr=1.5 is outside [0, 1): ...``); ``choices``: the words it allows, where it names a mode.
    """
    metadata = {"doc": doc, "result": result, "press": press or runner, "runner": runner}
    return field(default=MISSING, metadata={**metadata, "allowed": allowed, "refusal": refusal, "choices": choices})


@dataclass(frozen=True)
class Settings:
    """conf/config.yaml's top-level settings (its config groups, ``model``, ``press``, ... are chosen by Hydra)."""

    cr: float = setting(
        "fraction of KV pairs removed by the press; ignored by press=none",
        press=True,
        allowed=lambda cr: 0 <= cr < 1,
        refusal="is outside [0, 1): cr is the fraction of KV pairs removed, e.g. cr=0.5",
    )
    budget: int | None = setting(
        "instead of cr: the KV pairs kept of each context's cache",
        press=True,
        allowed=lambda budget: budget > 0,
        refusal="must be a positive number of tokens kept per context, e.g. budget=256",
    )
    query_aware: bool = setting("append the question to the context before compression")
    # The knobs kvpress's runner sets on a registry entry (method=<name>): kvpress passes them on unchecked, and a
    # value out of range would fail every sample instead of refusing the run.
    key_channel_compression_ratio: float | None = setting(
        "ThinK's ratio of key channels removed",
        runner=True,
        allowed=lambda ratio: 0 <= ratio < 1,
        refusal="is not the fraction of key channels removed, in [0, 1)",
    )
    threshold: float | None = setting("DMSPress's score threshold", runner=True)
    head_compression_ratio: float | None = setting(
        "DuoAttention's ratio of streaming heads",
        runner=True,
        allowed=lambda ratio: 0 <= ratio < 1,
        refusal="is not the fraction of heads compressed, in [0, 1)",
    )
    compression_interval: int | None = setting(
        "a DecodingPress's steps between compressions",
        runner=True,
        allowed=lambda steps: steps >= 1,
        refusal="is not a whole number of decoding steps, at least 1",
    )
    target_size: int | None = setting(
        "the KV pairs a DecodingPress keeps of each row",
        runner=True,
        allowed=lambda pairs: pairs >= 1,
        refusal="is not a whole number of KV pairs, at least 1",
    )
    hidden_states_buffer_size: int | None = setting(
        "a DecodingPress's buffered hidden states",
        runner=True,
        allowed=lambda states: states >= 0,
        refusal="is not a whole number of hidden states, at least 0",
    )
    limit: int | None = setting(
        "samples per task (null: all)",
        result=False,
        allowed=lambda limit: limit > 0,
        refusal="must be a positive number of samples per task, or null for all",
    )
    fraction: float = setting(
        "share of the samples run, drawn with seed (kvpress's fraction)",
        result=False,
        allowed=lambda fraction: 0 < fraction <= 1,
        refusal="is outside (0, 1]: the share of samples to run, e.g. 0.1",
    )
    seed: int = setting("the seed of the sample draw and of each point's random streams")
    output_dir: str = setting("where the run directories go", result=False)
    device: str = setting("where the model runs: auto, cpu, cuda, cuda:N", result=False)
    # null, "auto" or a map of module names to devices: OmegaConf types no union of a string and a dict, so the
    # shape is checked by evaluate/points/config.py.
    device_map: Any = setting("the model's layers spread over devices by accelerate", result=False)
    dtype: str = setting("the model's dtype: auto, float32, float16, bfloat16")
    attn_implementation: str | None = setting("the model's attention (null: kvpress's rule)")
    max_context_length: int | None = setting(
        "tokens a context is cut at (null: the tokenizer's or the model's limit)",
        allowed=lambda length: length > 0,
        refusal="must be a positive number of tokens, or null",
    )
    truncation: str = setting(
        "who cuts a long context: kvpress's pipeline, or the harness keeping its head or both ends",
        choices=("pipeline", "head", "middle"),
    )
    turns: str = setting(
        "a conversation's turns asked each on its own, or in order on one cache", choices=("independent", "multi")
    )
    history: str = setting("under turns=multi, the earlier answers the cache holds", choices=("reference", "model"))
    max_new_tokens: int | None = setting(
        "tokens generated per answer in every row (null: each row's own)",
        allowed=lambda tokens: tokens > 0,
        refusal="must be a positive number of tokens, or null to keep each row's own",
    )
    overwrite: bool = setting("rerun a finished run, or one whose configuration changed, from scratch", result=False)
    decode_batch_size: int = setting(
        "questions decoded together in the decoding pool (1: kvpress's pipeline path)",
        result=False,
        allowed=lambda size: size >= 1,
        refusal="must be at least 1 (1 decodes one by one)",
    )
    decode_memory: float | None = setting(
        "GiB of compressed caches the pool may hold (null: a share of the free memory)",
        result=False,
        allowed=lambda gib: gib > 0,
        refusal="must be a positive number of GiB, or null for the default",
    )
    likelihood: bool = setting("record the likelihood fields beside each prediction", result=False)
    generate: bool = setting("decode the answers greedily (false: the likelihood fields alone)")
    diagnostics: str = setting(
        "why a press fails, beside each prediction: answer retention, and under attention attention recall too",
        result=False,
        choices=("retention", "attention", "none"),
    )
    save_kept: bool = setting("store each row's kept set (a bitmask per layer and KV head) in the run", result=False)
    fail_fast: bool = setting("stop at the first failing sample instead of recording it", result=False)
    retry_errors: bool = setting("answer again the samples an earlier session recorded as failed", result=False)
    wait_for_locks: bool = setting("wait for the points another process holds", result=False)
    shard: str | None = setting("this process's share of the contexts, INDEX/COUNT", result=False)


def declared(name: str) -> dict:
    """The declaration of the setting ``name`` (:func:`setting`'s metadata)."""
    return next(each.metadata for each in fields(Settings) if each.name == name)


# Config groups whose choice never changes a prediction: wandb's tracking, and an experiment preset's report tables.
NON_RESULT_GROUPS = ("wandb", "report")
# Keys that never change a prediction: where results go, how many samples, which device runs them.
NON_RESULT_KEYS = (*(each.name for each in fields(Settings) if not each.metadata["result"]), *NON_RESULT_GROUPS)

# Set by kvpress's runner from its command line (compression_ratio, ThinK's key_channel_compression_ratio, DMS's
# threshold, DuoAttention's head_compression_ratio, DecodingPress's interval and target size): they are the
# sweep axes, not part of what a name means.
RUNNER_KNOBS = frozenset({"compression_ratio", *(each.name for each in fields(Settings) if each.metadata["runner"])})
# What chooses the press and how much it removes (a ratio, or a token budget): a run and its uncompressed baseline
# differ in these alone.
PRESS_KEYS = frozenset(
    {"press", "scorer", *RUNNER_KNOBS, *(each.name for each in fields(Settings) if each.metadata["press"])}
)

# conf/config.yaml's conversation settings as every run recorded before they existed ran: each question on its own.
TURN_DEFAULTS = {"turns": "independent", "history": "reference"}
# Settings, by dotted key, at the value every run recorded before they existed ran with: each generated its answers,
# and asked one question per context (ruler_synth's benchmark.turns). A reader compares a missing one as this value.
RECORDED_DEFAULTS = {"generate": True, "benchmark.turns": 1}
# Config groups, by their choice's ``_target_``, at the choice every run recorded before the group existed ran with:
# the model's own cache (conf/cache/dynamic.yaml).
RECORDED_DEFAULT_GROUPS = {"cache": "evaluate.kv_cache.DynamicKVCache"}


def without_old_defaults(config: dict) -> dict:
    """A resolved config without the settings every run recorded before conversations and the cache axis existed
    ran with: ``benchmark.turns: 1`` (ruler_synth's one question per context), ``turns: independent`` (with
    ``history``, which only ``turns=multi`` reads) and ``cache: dynamic`` (:data:`RECORDED_DEFAULT_GROUPS`). Those runs
    and today's runs at those values are one configuration to the fingerprint, the baseline and the report alike."""
    config = dict(config)
    if isinstance(config.get("benchmark"), dict):
        single = RECORDED_DEFAULTS["benchmark.turns"]
        config["benchmark"] = {
            key: value for key, value in config["benchmark"].items() if (key, value) != ("turns", single)
        }
    if config.get("turns", TURN_DEFAULTS["turns"]) == TURN_DEFAULTS["turns"]:
        config.pop("turns", None)
        config.pop("history", None)
    for group, target in RECORDED_DEFAULT_GROUPS.items():
        if isinstance(config.get(group), dict) and config[group].get("_target_") == target:
            config.pop(group)
    return config
