"""Configuration: names, derived run names, and refusals that happen before the model loads."""

import importlib.util
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra.errors import MissingConfigException

from evaluate import rundir
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import ConfigError, attention_implementation, fingerprint, method_name, run_dir, run_name
from evaluate.run.entry import run
from tests.support import SharedContextBenchmark, compose_config, with_shared_context

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def model_must_not_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded before the configuration was refused")

    monkeypatch.setattr(TinyRandomModel, "load_model", refuse)


@pytest.mark.parametrize(
    ("press", "scorer", "method"),
    [
        ("none", "snapkv", "no_press"),
        ("topk", "snapkv", "snapkv"),
        ("topk", "tova", "tova"),
        ("adakv", "snapkv", "adakv_snapkv"),
        ("chunkkv", "knorm", "chunkkv_knorm"),
        ("eg_chunkkv", "snapkv", "eg_chunkkv_snapkv"),
        ("chunkkv_exact", "snapkv", "chunkkv_exact_snapkv"),
    ],
)
def test_method_names(tmp_path, press, scorer, method):
    assert method_name(compose_config(tmp_path, f"press={press}", f"scorer={scorer}")) == method


def test_default_configuration_is_smollm2_ruler_synth_snapkv(tmp_path):
    with_defaults = compose_config(tmp_path, "model=smollm2_135m")
    assert (with_defaults.model.name, with_defaults.benchmark.name, with_defaults.scorer.name) == (
        "smollm2-135m",
        "ruler_synth",
        "snapkv",
    )
    # kvpress's rule, resolved where the run is fingerprinted: sdpa without CUDA and flash_attn.
    assert with_defaults.attn_implementation is None and attention_implementation(with_defaults) == "sdpa"
    assert with_defaults.benchmark.max_seq_length == 4096


def test_run_name_is_readable_and_hashes_only_result_changing_keys(tmp_path):
    base = compose_config(tmp_path, "press=eg_chunkkv", "cr=0.9")
    name = run_name(base)
    prefix, suffix = name.rsplit("__", 1)
    assert prefix == "ruler_synth__tiny-random__eg_chunkkv_snapkv__cr0.90"
    assert len(suffix) == 6

    assert run_name(compose_config(tmp_path / "x", "press=eg_chunkkv", "cr=0.9", "limit=7", "device=cuda")) == name
    assert run_name(compose_config(tmp_path, "press=eg_chunkkv", "cr=0.9", "scorer.press.window_size=32")) != name
    assert run_name(compose_config(tmp_path, "press=eg_chunkkv", "cr=0.9", "seed=1")) != name


def test_scorer_choice_does_not_split_uncompressed_runs(tmp_path):
    assert fingerprint(compose_config(tmp_path, "press=none", "scorer=snapkv")) == fingerprint(
        compose_config(tmp_path, "press=none", "scorer=knorm", "cr=0.3")
    )


def test_unknown_names_list_the_valid_choices(tmp_path):
    with pytest.raises(MissingConfigException, match="eg_chunkkv"):
        compose_config(tmp_path, "press=eg_chunk")
    with pytest.raises(MissingConfigException, match="expected_attention"):
        compose_config(tmp_path, "scorer=snap")
    with pytest.raises(MissingConfigException, match="smollm2_135m"):
        compose_config(tmp_path, "model=smollm3")
    with pytest.raises(MissingConfigException, match="ruler_synth"):
        compose_config(tmp_path, "benchmark=rulr")


@pytest.mark.parametrize("cr", ["1.0", "-0.1", "1.5"])
def test_cr_outside_unit_interval_is_refused(tmp_path, model_must_not_load, cr):
    with pytest.raises(ConfigError, match=r"outside \[0, 1\)"):
        run(compose_config(tmp_path, f"cr={cr}"))


def test_non_positive_limit_is_refused(tmp_path, model_must_not_load):
    with pytest.raises(ConfigError, match="limit=0"):
        run(compose_config(tmp_path, "limit=0"))


def test_decode_batch_size_below_one_is_refused_and_does_not_split_runs(tmp_path, model_must_not_load):
    with pytest.raises(ConfigError, match="decode_batch_size=0 must be at least 1"):
        run(compose_config(tmp_path, "decode_batch_size=0"))
    assert run_name(compose_config(tmp_path, "decode_batch_size=1")) == run_name(compose_config(tmp_path))


@pytest.mark.parametrize("press", ["adakv", "chunkkv", "eg_chunkkv", "chunkkv_exact"])
def test_presses_that_need_sdpa_are_refused_under_eager(tmp_path, model_must_not_load, press):
    with pytest.raises(ConfigError, match="attn_implementation=eager"):
        run(compose_config(tmp_path, f"press={press}", "attn_implementation=eager"))


def test_scorer_window_longer_than_context_is_refused_before_the_model_loads(tmp_path, model_must_not_load):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "scorer.press.window_size=5000"))
    with pytest.raises(ConfigError, match="longer than 5000 tokens"):
        run(cfg)


def test_cli_prints_a_one_line_error_and_exits_2():
    result = subprocess.run(
        [sys.executable, "-m", "evaluate", "cr=1.5", "model=tiny_random"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: cr=1.5 is outside [0, 1)")


def test_attention_follows_kvpress_rule_and_the_choice_splits_runs(tmp_path, monkeypatch):
    default = compose_config(tmp_path, "device=cuda")
    sdpa_name = run_name(compose_config(tmp_path, "attn_implementation=sdpa", "device=cuda"))
    monkeypatch.setattr("evaluate.points.config.resolve_device", lambda device: "cuda")
    assert attention_implementation(default) == "sdpa" and run_name(default) == sdpa_name
    # With flash_attn importable on CUDA, kvpress's evaluate.py loads the model with flash_attention_2.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec",
        lambda name, *args: object() if name == "flash_attn" else real_find_spec(name, *args),
    )
    assert attention_implementation(default) == "flash_attention_2"
    assert run_name(default) != sdpa_name
    # An explicit choice is passed through unchanged.
    assert attention_implementation(compose_config(tmp_path, "attn_implementation=eager")) == "eager"


def test_config_yaml_records_the_attention_that_ran(tmp_path):
    cfg = with_shared_context(compose_config(tmp_path, "press=none", "limit=1"))
    run(cfg)
    assert rundir.read_yaml(run_dir(cfg) / rundir.CONFIG)["config"]["attn_implementation"] == "sdpa"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cr=abc", "cr=abc is not a number"),
        ("limit=abc", "limit=abc is not a whole number or null"),
        ("limit=2.5", "limit=2.5 is not a whole number or null"),
        ("query_aware=maybe", "query_aware=maybe is not true or false"),
        ("overwrite=perhaps", "overwrite=perhaps is not true or false"),
        ("decode_memory=lots", "decode_memory=lots is not a number or null"),
        ("decode_memory=0", "decode_memory=0 must be a positive number of GiB, or null for the default"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_in_one_line_naming_key_value_and_what_is_allowed(
    tmp_path, model_must_not_load, override, message
):
    with pytest.raises(ConfigError) as error:
        run(compose_config(tmp_path / "runs", override))
    assert str(error.value) == message
    assert not (tmp_path / "runs").exists()


def test_overwrite_no_keeps_a_finished_run_as_it_is(tmp_path, capsys):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "limit=1"))
    run(cfg)
    files = {name: (run_dir(cfg) / name).read_bytes() for name in (rundir.PREDICTIONS, rundir.RUN, rundir.METRICS)}
    capsys.readouterr()
    run(with_shared_context(compose_config(tmp_path, "press=topk", "limit=1", "overwrite=no")))
    assert f"{run_dir(cfg)} is already complete (2 samples); pass overwrite=true to redo it" in capsys.readouterr().out
    assert {name: (run_dir(cfg) / name).read_bytes() for name in files} == files


def test_data_changed_under_the_same_configuration_is_refused_not_reported_complete(tmp_path, monkeypatch):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "limit=1"))
    run(cfg)
    predictions = (run_dir(cfg) / rundir.PREDICTIONS).read_bytes()
    load = SharedContextBenchmark.load

    def edited_in_place(self, tokenizer, limit=None):  # the data file behind the same configuration, edited
        samples = load(self, tokenizer, limit)
        return [replace(sample, answers=["9999"]) if sample.id == "doc-0-1" else sample for sample in samples]

    monkeypatch.setattr(SharedContextBenchmark, "load", edited_in_place)
    with pytest.raises(ConfigError) as error:
        run(with_shared_context(compose_config(tmp_path, "press=topk", "limit=1")))
    assert str(error.value) == (
        f"{run_dir(cfg)}: 1 of its 2 predictions answer samples that have changed since (the first, doc-0-1: its "
        "answers); the data changed under the same name: pass overwrite=true to redo the run or output_dir=... to "
        "keep both"
    )
    assert (run_dir(cfg) / rundir.PREDICTIONS).read_bytes() == predictions


def test_an_output_dir_that_is_a_file_or_read_only_is_refused_before_anything_runs(tmp_path, monkeypatch):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ConfigError) as error:
        run(compose_config(tmp_path / "taken" / "runs"))
    assert str(error.value) == (
        f"output_dir={tmp_path / 'taken' / 'runs'} is not a folder ({tmp_path / 'taken'} is a file); "
        "pass another output_dir"
    )
    # Root may write anywhere, as CI does; a read-only folder is what os.access reports for other users.
    monkeypatch.setattr(os, "access", lambda path, mode, **kwargs: Path(path) != tmp_path)
    with pytest.raises(ConfigError) as error:
        run(compose_config(tmp_path / "runs"))
    assert (
        str(error.value)
        == f"output_dir={tmp_path / 'runs'} cannot be written ({tmp_path} is read-only); pass another output_dir"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["taken"]


def test_device_cuda_without_a_gpu_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as error:
        run(compose_config(tmp_path, "device=cuda"))
    assert str(error.value) == (
        "device=cuda, but torch sees no CUDA GPU on this machine; use device=cpu or device=auto"
    )
