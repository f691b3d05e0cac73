"""In the dtypes the leaderboard runs: a pool of one row equals kvpress's pipeline token for token in bfloat16 and
float16, as in float32, on the tiny models (tests/test_decoding.py's rows: five presses' caches, uneven ChunkKV
layers, AdaKV masks, three question lengths) and on SmolLM2.

The pool's CPU attention in float32 is a grouped matrix product; in half precision it rounded the scores and the
weights to the half type before summing the values, where the pipeline's sdpa keeps them in float32, and a pool of
one parted from the pipeline (6 of 15 rows in bfloat16, 1 in float16, on the tiny Llama). It attends with sdpa in
half precision now (evaluate/engine/attention.py), and a decoding step's segment of one row over that row's own keys
on each layer, as the pipeline does (evaluate/engine/slot_cache.py): sdpa sums a longer row of keys, even masked, in
other blocks, and the tiny Qwen3's ChunkKV row, whose layers differ in length, parted at its 38th token. Without
both changes, 6 rows of 15 part on the tiny Llama in bfloat16, 1 in float16, 3 on the tiny Qwen3 in bfloat16, and 2
of SmolLM2's 7.
"""

import re

import pytest
import torch
from hydra.utils import instantiate
from kvpress import KnormPress, SnapKVPress, TOVAPress
from transformers import DynamicCache

from evaluate import rundir
from evaluate.engine.context_budget import make_pipeline
from evaluate.engine.decoding_pool import decode_all
from evaluate.engine.requests import DecodeRequest, hidden_keys
from evaluate.models.layer_masks import fit_masks_to_layers
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import run_dir
from evaluate.points.resolve import resolve
from evaluate.run.entry import HALF_PRECISION_MEASURED, run
from evaluate.run.summary import run_summary
from tests.support import REPO, compose_config
from tests.test_decoding import pipeline_tokens, requests_over_points


def differing_rows(model, pipe, requests: list[DecodeRequest], batch_size: int) -> list[int]:
    expected = [pipeline_tokens(model, pipe, request) for request in requests]
    got = decode_all(model, requests, batch_size)
    return [index for index, (want, have) in enumerate(zip(expected, got, strict=True)) if want != have]


@pytest.mark.slow  # the pipeline and the pool over 15 rows of up to 40 tokens, per model and dtype
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_a_pool_of_one_equals_kvpress_pipeline_in_half_precision(architecture, dtype):
    source = TinyRandomModel(architecture=architecture, weight_scale=3.0)
    model = source.load_model("cpu", dtype, "sdpa")
    fit_masks_to_layers(model)
    pipe = make_pipeline(model, source.load_tokenizer(), "cpu")
    requests = requests_over_points(model, pipe, [40, 17, 1])
    assert differing_rows(model, pipe, requests, batch_size=1) == []


@pytest.mark.slow  # SmolLM2 in bfloat16: seven caches of a 1,067-token context, 64 tokens each
def test_a_pool_of_one_equals_kvpress_pipeline_on_smollm2_in_bfloat16(tmp_path):
    source = instantiate(compose_config(tmp_path, "model=smollm2_135m").model.source)
    model = source.load_model("cpu", "bfloat16", "sdpa")
    pipe = make_pipeline(model, source.load_tokenizer(), "cpu")
    text = " ".join(f"Line {i}: the value of key {i} is {i * 7 % 1000}." for i in range(60))
    ids = pipe.preprocess(text, ["What is the value of key 42? "], "Answer:", 4096)
    requests = []
    presses = [
        None,
        *(press(compression_ratio=cr) for press in (SnapKVPress, KnormPress, TOVAPress) for cr in (0.5, 0.9)),
    ]
    for press in presses:
        cache = DynamicCache()
        with torch.no_grad(), press(model) if press is not None else torch.no_grad():
            model.model(input_ids=ids["context_ids"], past_key_values=cache)
        question = ids["questions_ids"][0]
        hidden = hidden_keys([layer.self_attn for layer in model.model.layers])
        requests.append(DecodeRequest(cache, question, ids["context_ids"].shape[1], 64, hidden))
    assert differing_rows(model, pipe, requests, batch_size=1) == []


@pytest.mark.parametrize(("dtype", "decode_batch_size", "noted"), [("bfloat16", 32, True), ("bfloat16", 1, False)])
def test_a_run_in_half_precision_on_the_pool_says_its_answers_may_part_from_kvpress(
    tmp_path, dtype, decode_batch_size, noted
):
    overrides = (
        "press=topk",
        "cr=0.5",
        "benchmark.tasks=[niah_single_1]",
        "limit=1",
        "likelihood=false",
        f"dtype={dtype}",
    )
    cfg = compose_config(tmp_path, *overrides, f"decode_batch_size={decode_batch_size}")
    metrics = run(cfg)
    answered_by = rundir.read_json(run_dir(cfg) / rundir.RUN)["answered_by"]
    assert answered_by["path"] == ("pool" if decode_batch_size > 1 else "pipeline")
    note = "in bfloat16 the pool's batched steps round otherwise than kvpress's batch of one"
    assert (note in answered_by.get("note", "")) == noted
    assert (f"answered from the pool: {note}" in run_summary(resolve(cfg), metrics)) == noted


def test_the_half_precision_note_gives_the_measured_table_s_figures():
    """The figure a half-precision run's note quotes is the bfloat16 agreement table's: its rows that part, its rows,
    and every paired interval holding 0."""
    table = (REPO / "results" / "bench" / "pool_agreement_bfloat16_cpu.md").read_text().splitlines()
    rows = [line.split(" | ") for line in table if line.startswith("| ") and line[2].isalpha() and "point" not in line]
    parted = sum(int(cells[2].split()[0]) for cells in rows)
    total = sum(int(cells[1]) for cells in rows)
    intervals = [re.search(r"\[([-+.\d]+), ([-+.\d]+)\]", cells[6]).groups() for cells in rows]
    assert f"{parted} of {total:,} rows parted" in HALF_PRECISION_MEASURED
    assert "every score difference's paired 95 % interval held 0" in HALF_PRECISION_MEASURED
    assert all(float(low) <= 0 <= float(high) for low, high in intervals)
