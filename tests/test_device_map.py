"""A model spread by a device map (accelerate's hooks, a layer offloaded to disk) answers as the model on one device,
on both engines; ``device=auto`` resolves by one rule; the device map is not part of a run's identity."""

import pytest

from evaluate import rundir
from evaluate.models import loading
from evaluate.points.config import fingerprint, resolve_device, resolve_device_map, run_dir
from evaluate.run.entry import run
from evaluate.score.answer_length import TOKENS
from tests.support import compose_config, with_shared_context

# Every module of the tiny Llama with parameters or buffers, each on the CPU: accelerate installs its hooks all the
# same (sources.placed dispatches with force_hooks), so inputs and outputs go through them as on several GPUs.
MODULES = ("model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
ON_THE_CPU = "device_map={" + ",".join(f"{module}:cpu" for module in MODULES) + "}"
# The second layer's weights offloaded to disk: on the meta device, brought to the CPU only while it runs (and while
# a press compresses its cache: SnapKV, the default scorer, reads its query projection).
LAYER_ON_DISK = ON_THE_CPU.replace("model.layers.1:cpu", "model.layers.1:disk")
FIELDS = ("id", "prediction", "answer_nll", "answer_nll_uncompressed", "answer_kl", "answer_top1", "kept_ratio", TOKENS)


def answered(tmp_path, name: str, *overrides: str, monkeypatch) -> tuple[list[dict], object]:
    """The rows a run of the shared-context benchmark at cr=0.5 writes, and the model it ran on."""
    loaded = []

    def fit_and_record(model):
        loaded.append(model)
        fit_masks_to_layers(model)

    fit_masks_to_layers = loading.fit_masks_to_layers
    monkeypatch.setattr(loading, "fit_masks_to_layers", fit_and_record)
    cfg = with_shared_context(compose_config(tmp_path / name, "cr=0.5", *overrides))
    run(cfg)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert len(rows) == 6 and all(row.get("error") is None for row in rows)
    return [{field: row.get(field) for field in FIELDS} for row in rows], loaded[0]


@pytest.mark.parametrize("decode_batch_size", [32, 1], ids=["pooled", "pipeline"])
def test_a_model_spread_by_a_device_map_answers_as_on_one_device(tmp_path, monkeypatch, decode_batch_size):
    settings = ("press=topk", f"decode_batch_size={decode_batch_size}")
    expected, single = answered(tmp_path, "single", *settings, monkeypatch=monkeypatch)
    assert not hasattr(single, "hf_device_map")
    assert expected[0]["answer_nll"] is not None and any(row["prediction"] for row in expected)
    assert all(len(row[TOKENS]) == 6 for row in expected)  # the answer tokens, recorded through the device map too

    rows, spread = answered(tmp_path, "spread", *settings, ON_THE_CPU, monkeypatch=monkeypatch)
    assert set(spread.hf_device_map) == set(MODULES)
    assert all(hasattr(spread.get_submodule(module), "_hf_hook") for module in MODULES)
    assert rows == expected

    rows, offloaded = answered(tmp_path, "offloaded", *settings, LAYER_ON_DISK, monkeypatch=monkeypatch)
    assert offloaded.hf_device_map["model.layers.1"] == "disk"
    assert offloaded.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    assert rows == expected


def test_device_auto_resolves_by_one_rule(tmp_path, monkeypatch):
    monkeypatch.setattr("evaluate.points.config._cuda_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert resolve_device("auto") == "cuda:3"  # a process torchrun started keeps to its own GPU
    assert resolve_device_map(compose_config(tmp_path, "device=auto")) is None
    monkeypatch.delenv("LOCAL_RANK")
    assert resolve_device("auto") == "auto"  # every visible GPU, as kvpress loads models
    assert resolve_device_map(compose_config(tmp_path, "device=auto")) == "auto"
    assert resolve_device("cuda:1") == "cuda:1" and resolve_device("cpu") == "cpu"
    assert resolve_device_map(compose_config(tmp_path, "device=cuda:1")) is None
    monkeypatch.setattr("evaluate.points.config._cuda_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device_map(compose_config(tmp_path, "device=auto")) is None


def test_the_device_map_is_not_part_of_a_runs_identity(tmp_path):
    plain = compose_config(tmp_path, "press=topk")
    for device_map in (ON_THE_CPU, LAYER_ON_DISK, "device_map=auto"):
        spread = compose_config(tmp_path, "press=topk", device_map)
        assert run_dir(spread) == run_dir(plain) and fingerprint(spread) == fingerprint(plain)


def test_a_press_reading_an_offloaded_layers_weights_compresses_as_on_one_device(tmp_path, monkeypatch):
    # CriticalKV reads the output projection's weight itself, outside any forward pass that would bring it from disk:
    # the pooled path brings the layer's weights for its compression (devices.onloaded).
    method = "method=critical_snapkv"
    expected, _ = answered(tmp_path, "single", method, "likelihood=false", monkeypatch=monkeypatch)
    rows, _ = answered(tmp_path, "offloaded", method, "likelihood=false", LAYER_ON_DISK, monkeypatch=monkeypatch)
    assert rows == expected
