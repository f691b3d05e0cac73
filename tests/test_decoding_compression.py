"""Decoding-time presses in the decoding pool equal kvpress's evaluate.py (tests/kvpress_reference.py), row by row.

Every ``decoding_*`` registry entry the pool accepts answers a RULER-format file of contexts of a few hundred tokens,
with a small ``target_size`` and ``compression_interval`` so that every answer is compressed several times, and
several rows decode together in the pool (each compressing on its own steps): its predictions must equal kvpress's
pipeline's, and the harness's own pipeline path's (``decode_batch_size=1``). The entries the pool refuses say why.

Ties: the tiny model's tokenizer is byte-level, so a context repeats each byte many times, and in the first layer a
repeated token has the same pre-RoPE key, whose norm RoPE (a rotation) keeps: KnormPress's and KeyDiffPress's scores
tie to within the last bit. In float32 the batched pool's last-bit rounding (which the pipeline's batch-1 passes do
not share) then breaks those ties otherwise than kvpress does, and answers part from the first differing selection
(measured: KnormPress, 2 of 8 rows, after 13 tokens). In float64 no tie is that close, so the scorers that tie compare
in float64 (``dtype=float64``, and kvpress's reference model in float64 too); StreamingLLM, whose selection depends on
positions only, compares in float32 as well.

AdaKV as the base press prunes nothing: kvpress's attention patch overwrites the keys it masks with fake keys that
stay in the cache, and the pool writes them into each row's slot the same way. SnapKV scores a compression's buffered
hidden states only when they hold more than its 64-token window, so its entry compresses every 70 steps, with a
longer buffer and longer answers.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kvpress import AdaKVPress, CAMPress, DecodingPress, KnormPress, PrefillDecodingPress, RandomPress, SnapKVPress
from omegaconf import OmegaConf
from transformers import DynamicCache

from evaluate import rundir
from evaluate.engine.context_budget import make_pipeline
from evaluate.engine.decoding_compression import DecodingCompression
from evaluate.engine.decoding_pool import DecodingPool
from evaluate.engine.requests import DecodeRequest
from evaluate.engine.slot_cache import SlotCache
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import run_dir
from evaluate.press_profile import why_not_shared_prefill
from evaluate.registry import PRESS_REGISTRY
from evaluate.run.entry import run
from tests.kvpress_reference import LIVELY_MODEL, kvpress_predictions, ruler_rows, set_runner_knobs
from tests.support import compose_config

KNOBS = {"target_size": 48, "compression_interval": 5, "hidden_states_buffer_size": 8}
MAX_NEW_TOKENS = 32
# SnapKV's window: a compression's buffer must hold more than 64 hidden states.
SNAPKV_KNOBS = {"target_size": 96, "compression_interval": 70, "hidden_states_buffer_size": 80}
SNAPKV_MAX_NEW_TOKENS = 220
LIVELY = "+model.source.weight_scale=3.0"
POOLED = (
    "decoding_knorm",
    "decoding_streaming_llm",
    "decoding_tova",
    "decoding_keydiff",
    "decoding_adakv_expected_attention_e2",
    "decoding_adakv_snapkv",
)
# Decoding presses the pool refuses (kvpress's pipeline answers them), and the words of the reason.
REFUSED = {
    "random base press": (lambda: DecodingPress(base_press=RandomPress()), "random numbers"),
    "CAM": (lambda: CAMPress(base_press=KnormPress()), "CAMPress overrides"),
}


class Float64Model(TinyRandomModel):
    """kvpress's reference model in float64, as ``dtype=float64`` loads PressBench's."""

    def load_model(self, device, dtype, attn_implementation, device_map=None):
        return super().load_model(device, "float64", attn_implementation, device_map)


def write_ruler_file(directory: Path, max_new_tokens: int) -> Path:
    rows = ruler_rows()
    for row in rows:
        row["max_new_tokens"] = max_new_tokens
    path = directory / "test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def ruler_file(tmp_path_factory) -> Path:
    return write_ruler_file(tmp_path_factory.mktemp("ruler"), MAX_NEW_TOKENS)


def knobs_and_file(method: str, tmp_path: Path, ruler_file: Path) -> tuple[dict, Path]:
    if method == "decoding_adakv_snapkv":
        return SNAPKV_KNOBS, write_ruler_file(tmp_path, SNAPKV_MAX_NEW_TOKENS)
    return KNOBS, ruler_file


def predictions(cfg) -> dict[str, str]:
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert not [row for row in rows if row.get("error")]
    return {row["id"]: row["prediction"] for row in rows}


def kept_ratios(cfg) -> dict[str, float]:
    return {row["id"]: row["kept_ratio"] for row in rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)}


def config(tmp_path: Path, path: Path, method: str, decode_batch_size: int, dtype: str, knobs: dict = KNOBS):
    return compose_config(
        tmp_path,
        "benchmark=ruler",
        f"benchmark.path={path}",
        "limit=null",
        LIVELY,
        f"method={method}",
        *(f"{knob}={value}" for knob, value in knobs.items()),
        f"decode_batch_size={decode_batch_size}",
        f"dtype={dtype}",
    )


def expected_predictions(method: str, knobs: dict, path: Path, dtype: str) -> dict[str, str]:
    press = set_runner_knobs(PRESS_REGISTRY[method](), 0.0, **knobs)
    source = LIVELY_MODEL if dtype == "float32" else Float64Model(weight_scale=3.0)
    return kvpress_predictions(path, press, False, source=source)


@pytest.mark.slow  # kvpress's reference and two whole runs of eight 32-token answers: 20 to 40 s a case
@pytest.mark.parametrize(
    ("method", "dtype"),
    [
        *((method, "float64") for method in POOLED),
        ("decoding_streaming_llm", "float32"),
        ("decoding_adakv_expected_attention_e2", "float32"),
    ],
)
def test_decoding_presses_in_the_pool_equal_kvpress_evaluate(tmp_path, ruler_file, method, dtype):
    knobs, path = knobs_and_file(method, tmp_path, ruler_file)
    expected = expected_predictions(method, knobs, path, dtype)
    pooled = config(tmp_path / "pool", path, method, 4, dtype, knobs)
    run(pooled)
    assert rundir.read_json(run_dir(pooled) / rundir.RUN)["answered_by"]["path"] == "pool"
    assert predictions(pooled) == expected
    alone = config(tmp_path / "pipeline", path, method, 1, dtype, knobs)
    run(alone)
    assert predictions(alone) == expected
    # Both paths measure the cache each row's answer left, cut back to its length before the question, less the
    # keys AdaKV's last compression masked there.
    assert kept_ratios(pooled) == kept_ratios(alone)
    assert min(kept_ratios(pooled).values()) < 0.2


@pytest.mark.slow  # kvpress's reference and one whole run: about 10 s a case
@pytest.mark.parametrize("method", ["decoding_adakv_expected_attention_e2", "decoding_adakv_snapkv"])
def test_adakv_rows_answer_otherwise_without_kvpress_fake_keys(tmp_path, ruler_file, method, monkeypatch):
    """The equivalence above depends on the fake keys: a pool that leaves AdaKV's masked keys as they are gives
    other answers, so the fake keys are written, and where kvpress writes them."""
    knobs, path = knobs_and_file(method, tmp_path, ruler_file)
    expected = expected_predictions(method, knobs, path, "float64")
    monkeypatch.setattr(SlotCache, "write_fake_keys", lambda self, layer_idx, query: None)
    pooled = config(tmp_path / "pool", path, method, 4, "float64", knobs)
    run(pooled)
    differing = [row for row, answer in predictions(pooled).items() if answer != expected[row]]
    assert len(differing) >= 3


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_pool_says_why_it_refuses_a_decoding_press(name):
    build, reason = REFUSED[name]
    assert reason in why_not_shared_prefill(build(), "sdpa")


def test_an_adakv_decoding_rows_slot_holds_its_whole_answer():
    """AdaKV under a DecodingPress masks keys and removes none, so the budget counts every token the row writes."""
    adakv = DecodingPress(AdaKVPress(SnapKVPress()), compression_interval=8, target_size=40)
    knorm = DecodingPress(KnormPress(), compression_interval=8, target_size=40)
    assert DecodingCompression(adakv).slot_length(300, 20, 100) == 300 + 20 + 100
    assert DecodingCompression(knorm).slot_length(300, 20, 100) == 300 + 20 + 8


def pool_requests(target_size: int, interval: int, max_new_tokens: int) -> tuple[object, list[DecodeRequest]]:
    """Rows of several contexts and questions, each with its own DecodingPress (Knorm), on the lively model."""
    model = LIVELY_MODEL.load_model("cpu", "float32", "sdpa")
    pipe = make_pipeline(model, LIVELY_MODEL.load_tokenizer(), "cpu")
    requests = []
    for row in ruler_rows()[3:]:
        tokens = pipe.preprocess(row["context"], [row["question"] + "Be brief." * len(requests)], " A:", 10**6)
        cache = DynamicCache()
        with torch.no_grad():
            model.model(input_ids=tokens["context_ids"], past_key_values=cache)
        press = DecodingCompression(DecodingPress(KnormPress(), compression_interval=interval, target_size=target_size))
        length = tokens["context_ids"].shape[1]
        requests.append(DecodeRequest(cache, tokens["questions_ids"][0], length, max_new_tokens, compression=press))
    return model, requests


def test_a_decoding_rows_slot_holds_at_most_its_target_and_interval_once_compressed():
    target_size, interval, max_new_tokens = 40, 6, 40
    model, requests = pool_requests(target_size, interval, max_new_tokens)
    pool = DecodingPool(model, batch_size=3, memory_bytes=2**40)
    for index, request in enumerate(requests):
        pool.submit(replace(request, tag=index))
        # The budget counts the row's longest moment, not its whole context, question and answer.
        context, question = request.cache.layers[0].keys.shape[2], request.question_ids.shape[1]
        assert request.slot_length() == context + question + interval
        assert request.slot_length() < context + question + max_new_tokens
    compressed_at: dict[int, list[int]] = {}
    step = 0
    while pool.busy():
        pool.step()
        step += 1
        for slot, row in enumerate(pool.rows):
            if row is None:
                continue
            longest = int(pool.cache.host_lengths[:, slot].max())
            assert longest < pool.cache.capacity  # the slot's last position stays padding's
            if row.compression.compressions:
                assert longest <= target_size + interval
                compressed_at.setdefault(row.request.tag, [])
                if row.compression.steps[0] == 0:
                    compressed_at[row.request.tag].append(step)
    # Every row compressed several times, and rows on different steps (rows joined as others left).
    assert len(compressed_at) == len(requests)
    assert all(len(steps) >= 3 for steps in compressed_at.values())
    assert len({tuple(steps) for steps in compressed_at.values()}) > 1


PREFILL_DECODING = {
    "_target_": "kvpress.PrefillDecodingPress",
    "prefilling_press": {"_target_": "kvpress.KnormPress", "compression_ratio": 0.5},
    "decoding_press": {
        "_target_": "kvpress.DecodingPress",
        "base_press": {"_target_": "kvpress.TOVAPress"},
        "compression_interval": 4,
        "target_size": 40,
        "hidden_states_buffer_size": 8,
    },
}


@pytest.mark.slow  # two whole runs: about 20 s
def test_a_prefill_decoding_press_compresses_at_prefill_and_in_the_pool_as_kvpress_pipeline(tmp_path, ruler_file):
    """kvpress's PrefillDecodingPress: its prefilling press on the shared prefill, its decoding press in the pool; the
    harness's pipeline path (kvpress's pipeline, each row asked alone) is the reference."""

    def config(output_dir: Path, decode_batch_size: int):
        cfg = compose_config(
            output_dir,
            "benchmark=ruler",
            f"benchmark.path={ruler_file}",
            "limit=null",
            LIVELY,
            "press=topk",
            "scorer=knorm",
            "cr=0.5",
            "dtype=float64",
            f"decode_batch_size={decode_batch_size}",
        )
        cfg.press.press = OmegaConf.create(PREFILL_DECODING)
        return cfg

    pooled, alone = config(tmp_path / "pool", 4), config(tmp_path / "pipeline", 1)
    run(pooled)
    run(alone)
    assert rundir.read_json(run_dir(pooled) / rundir.RUN)["answered_by"]["path"] == "pool"
    assert predictions(pooled) == predictions(alone)
    assert len(set(predictions(alone).values())) > 2
    assert kept_ratios(pooled) == kept_ratios(alone)


def test_a_prefill_decoding_press_with_adakv_at_prefill_is_refused_with_a_reason():
    press = PrefillDecodingPress(
        prefilling_press=AdaKVPress(SnapKVPress(compression_ratio=0.5)),
        decoding_press=DecodingPress(KnormPress(), compression_interval=4, target_size=40),
    )
    assert "AdaKV masks" in why_not_shared_prefill(press, "sdpa")
    press.decoding_press = None  # then it is a prefill press like any other
    assert why_not_shared_prefill(press, "sdpa") is None
