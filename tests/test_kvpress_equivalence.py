"""PressBench computes what kvpress's ``evaluation/evaluate.py`` computes, prediction by prediction.

The reference below drives kvpress's pipeline the way kvpress's runner does: a pandas frame of a local RULER-format
file; for query-aware runs the question appended to the context and the question emptied; rows grouped by context
(``groupby("context")``); one pipeline call per group with ``questions=``, the group's answer prefix and
``max_new_tokens``, and ``max_context_length=None``; the registry's press object with its ``compression_ratio`` set
(kvpress's own classes for the PR's presses that are not registry entries); the model as ``from_pretrained`` gives
it, with no PressBench hook. PressBench answers the same file as single runs (kvpress's pipeline path) and as one
sweep (shared prefill and batched decoding); every prediction must be identical.
"""

import json
from pathlib import Path

import pandas as pd
import pytest
from hydra.utils import instantiate
from kvpress import (
    ChunkKVPress,
    EntropyGatedChunkKVPress,
    ExpectedAttentionPress,
    SnapKVPress,
    TOVAPress,
)

from evaluate import rundir
from evaluate.points.config import method_name, run_dir
from evaluate.registry import PRESS_REGISTRY
from evaluate.run.entry import run, run_sweep
from tests.kvpress_reference import kvpress_predictions, ruler_rows, sample_ids, set_runner_knobs
from tests.support import compose_config

CR = 0.5
LIVELY = "+model.source.weight_scale=3.0"  # a random model whose answers depend on what the press kept


def eg_chunkkv(scorer):
    return lambda: EntropyGatedChunkKVPress(scorer, chunk_length=10, low_entropy_chunk_length=4)


# Every method of the eg_chunkkv_pr and dropkv_leaderboard presets: PressBench overrides, kvpress's press object.
METHODS = {
    "no_press": (("press=none",), PRESS_REGISTRY["no_press"]),
    "snapkv": (("press=topk", "scorer=snapkv"), PRESS_REGISTRY["snapkv"]),
    "adakv_snapkv": (("press=adakv", "scorer=snapkv"), PRESS_REGISTRY["adakv_snapkv"]),
    # The PR's ChunkKV (chunk_length 10) and the leaderboard's (the registry entry, chunk_length 20).
    "chunkkv_snapkv": (("press=chunkkv", "scorer=snapkv"), lambda: ChunkKVPress(SnapKVPress(), chunk_length=10)),
    "chunkkv": (("press=chunkkv", "scorer=snapkv", "press.press.chunk_length=20"), PRESS_REGISTRY["chunkkv"]),
    "eg_chunkkv_snapkv": (("press=eg_chunkkv", "scorer=snapkv"), eg_chunkkv(SnapKVPress())),
    "eg_chunkkv_expected_attention": (
        ("press=eg_chunkkv", "scorer=expected_attention"),
        eg_chunkkv(ExpectedAttentionPress()),
    ),
    "eg_chunkkv_tova": (("press=eg_chunkkv", "scorer=tova"), eg_chunkkv(TOVAPress())),
    "expected_attention": (
        ("press=adakv", "scorer=expected_attention", "scorer.press.epsilon=0.01"),
        PRESS_REGISTRY["expected_attention"],
    ),
}


@pytest.fixture(scope="module")
def ruler_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ruler") / "test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ruler_rows()))
    return path


def pressbench_config(tmp_path: Path, path: Path, method: str, query_aware: bool):
    overrides, _ = METHODS[method]
    return compose_config(
        tmp_path,
        "benchmark=ruler",
        f"benchmark.path={path}",
        "limit=null",
        LIVELY,
        f"cr={CR}",
        f"query_aware={query_aware}",
        *overrides,
    )


def predictions(cfg) -> dict[str, str]:
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert not [row for row in rows if row.get("error")]
    return {row["id"]: row["prediction"] for row in rows}


@pytest.fixture(scope="module")
def reference(ruler_file):
    return {
        (method, query_aware): kvpress_predictions(ruler_file, set_runner_knobs(factory(), CR), query_aware)
        for method, (_, factory) in METHODS.items()
        for query_aware in (False, True)
    }


def test_the_reference_answers_differ_between_methods(reference):
    # Equality below would prove little if every press gave the same answers.
    for query_aware in (False, True):
        assert len({tuple(answers.values()) for (_, aware), answers in reference.items() if aware == query_aware}) >= 4


@pytest.mark.parametrize("decode_batch_size", [1, 32])  # kvpress's pipeline path, and the decoding pool
@pytest.mark.parametrize("query_aware", [False, True])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_single_runs_equal_kvpress_evaluate(tmp_path, ruler_file, reference, method, query_aware, decode_batch_size):
    cfg = pressbench_config(tmp_path, ruler_file, method, query_aware)
    cfg.decode_batch_size = decode_batch_size
    assert method_name(cfg) == method
    run(cfg)
    assert predictions(cfg) == reference[method, query_aware]


@pytest.mark.parametrize("query_aware", [False, True])
def test_one_sweep_over_every_method_equals_kvpress_evaluate(tmp_path, ruler_file, reference, query_aware):
    cfgs = [pressbench_config(tmp_path, ruler_file, method, query_aware) for method in METHODS]
    run_sweep(cfgs)
    for method, cfg in zip(METHODS, cfgs, strict=True):
        assert predictions(cfg) == reference[method, query_aware], method


def test_fraction_draws_the_rows_kvpress_draws(tmp_path, ruler_file):
    cfg = compose_config(tmp_path, "benchmark=ruler", f"benchmark.path={ruler_file}", "limit=null", "press=none")
    cfg.fraction = 0.5
    run(cfg)
    frame = pd.read_json(ruler_file, lines=True)
    frame["id"] = sample_ids(frame)
    # kvpress: df.sample(frac=fraction, random_state=seed) on the data_dir's frame.
    assert set(predictions(cfg)) == set(frame.sample(frac=0.5, random_state=42)["id"])


@pytest.mark.slow  # the embedded SmolLM2-135M on 1k-token contexts: about a minute on two cores per case
@pytest.mark.parametrize(("method", "query_aware"), [("chunkkv", True), ("adakv_snapkv", False)])
def test_smollm2_single_run_in_the_pool_equals_kvpress_evaluate(tmp_path, method, query_aware):
    rows = ruler_rows()
    for row in rows:
        row["context"] = row["context"] * 3  # about 1,000 tokens for SmolLM2's tokenizer
    path = tmp_path / "smollm2.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = compose_config(
        tmp_path,
        "model=smollm2_135m",
        "benchmark=ruler",
        f"benchmark.path={path}",
        "limit=null",
        "cr=0.5",
        f"query_aware={query_aware}",
        *METHODS[method][0],
    )
    run(cfg)
    press = set_runner_knobs(METHODS[method][1](), CR)
    expected = kvpress_predictions(path, press, query_aware, source=instantiate(cfg.model.source))
    assert predictions(cfg) == expected
    assert any(answer.strip() for answer in expected.values())
