"""evaluate/settings.py declares each setting once: conf/config.yaml, the spec, the fingerprint's non-result keys and
docs/configuration.md's table agree with it, and its ranges refuse what the one-line refusals name."""

import re
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from evaluate.errors import ConfigError
from evaluate.points.point import PointSpec
from evaluate.points.resolve import checked, resolve, typed
from evaluate.settings import NON_RESULT_GROUPS, NON_RESULT_KEYS, PRESS_KEYS, RUNNER_KNOBS, Settings
from tests.support import compose_config

REPO = Path(__file__).resolve().parent.parent


def yaml_settings() -> dict:
    config = yaml.safe_load((REPO / "conf" / "config.yaml").read_text(encoding="utf-8"))
    return {key: value for key, value in config.items() if key not in ("defaults", "hydra")}


def test_every_setting_of_config_yaml_is_declared_once_and_every_declaration_is_a_setting():
    assert [each.name for each in fields(Settings)] == list(yaml_settings())
    assert all(each.metadata["doc"] for each in fields(Settings))


def test_the_defaults_of_config_yaml_are_of_their_declared_type_and_in_their_declared_range(tmp_path):
    cfg = compose_config(tmp_path)
    assert typed(cfg) is cfg  # nothing to convert: every default already has its type
    (spec,) = checked([cfg], single=True)
    assert {each.name for each in fields(Settings)} <= {each.name for each in fields(PointSpec)}
    assert spec.cr == 0.5 and spec.turns == "independent" and spec.output_dir == str(tmp_path)


def test_the_keys_derived_from_the_declarations():
    """The declarations give the lists evaluate/keys.py held before them (a later non-result setting joins them)."""
    declared = {each.name: each.metadata for each in fields(Settings)}
    before = {"limit", "fraction", "output_dir", "overwrite", "device", "device_map", "fail_fast", "retry_errors"}
    before |= {"wandb", "decode_batch_size", "decode_memory", "wait_for_locks", "shard", "likelihood", "report"}
    assert (
        before
        <= set(NON_RESULT_KEYS)
        == {name for name, meta in declared.items() if not meta["result"]} | set(NON_RESULT_GROUPS)
    )
    knobs = {"key_channel_compression_ratio", "threshold", "head_compression_ratio", "compression_interval"}
    knobs |= {"target_size", "hidden_states_buffer_size"}
    assert (
        RUNNER_KNOBS
        == {"compression_ratio", *knobs}
        == {"compression_ratio"} | {name for name, meta in declared.items() if meta["runner"]}
    )
    assert PRESS_KEYS == {"press", "scorer", "cr", "budget", *RUNNER_KNOBS}


def test_docs_configuration_table_names_every_setting_and_no_other():
    docs = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    table = docs[docs.index("| key | meaning |") :].split("\n\n")[0].splitlines()[2:]
    keys = {name for row in table for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    named = {name for row in table for name in re.findall(r"`(\w+)`", row)}
    groups = {"model", "method", "press", "scorer", "cache", "benchmark"}
    declared = {each.name for each in fields(Settings)}
    assert keys - groups <= declared
    assert declared - RUNNER_KNOBS <= keys  # the runner's knobs are listed in method's row
    assert RUNNER_KNOBS - {"compression_ratio"} <= named


@pytest.mark.parametrize(
    ("override", "refusal"),
    [
        ("cr=1.0", "cr=1.0 is outside [0, 1): cr is the fraction of KV pairs removed, e.g. cr=0.5"),
        ("budget=0", "budget=0 must be a positive number of tokens kept per context, e.g. budget=256"),
        ("limit=0", "limit=0 must be a positive number of samples per task, or null for all"),
        ("fraction=0", "fraction=0 is outside (0, 1]: the share of samples to run, e.g. 0.1"),
        ("decode_batch_size=0", "decode_batch_size=0 must be at least 1 (1 decodes one by one)"),
        ("decode_memory=0", "decode_memory=0 must be a positive number of GiB, or null for the default"),
        ("max_context_length=0", "max_context_length=0 must be a positive number of tokens, or null"),
        ("max_new_tokens=-1", "max_new_tokens=-1 must be a positive number of tokens, or null to keep each row's own"),
        ("truncation=tail", "truncation='tail'; choose one of pipeline, head, middle"),
        ("turns=all", "turns='all'; choose one of independent, multi"),
        ("history=none", "history='none'; choose one of reference, model"),
    ],
)
def test_a_setting_outside_its_declared_values_is_refused_in_its_one_line(tmp_path, override, refusal):
    with pytest.raises(ConfigError) as refused:
        checked([compose_config(tmp_path, override)])
    assert str(refused.value) == refusal


def test_the_spec_carries_what_the_run_reads_so_the_run_never_reads_the_config(tmp_path):
    cfg = compose_config(tmp_path, "press=eg_chunkkv", "cr=0.9", "wandb=disabled")
    spec = resolve(typed(cfg))
    assert (spec.benchmark_name, spec.model_name, spec.kept_text) == ("ruler_synth", "tiny-random", "0.90")
    assert spec.benchmark["_target_"] == cfg.benchmark._target_ and spec.model_source == dict(cfg.model.source)
    assert spec.press["_target_"] == cfg.press.press._target_ and spec.scorer_name == "snapkv"
    assert spec.recorded["press"]["method"] == cfg.press.method and spec.tracking["mode"] == "disabled"
