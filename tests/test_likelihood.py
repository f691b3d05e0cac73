"""The likelihood fields (evaluate/engine/teacher_forcing.py): each proven against a computation made here,
independently."""

import logging
import time

import pytest
import torch
from omegaconf import open_dict

from evaluate import rundir
from evaluate.engine.context_budget import make_pipeline
from evaluate.engine.teacher_forcing import answer_text, teacher_forced
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import ConfigError, fingerprint, run_dir
from evaluate.run.entry import run, run_sweep
from evaluate.score.answer_length import STOP, TOKENS
from evaluate.score.likelihood import FIELDS, likelihood_metrics
from evaluate.score.rescore import rescore_run
from tests.support import SharedContextBenchmark, compose_config, with_shared_context

# A random model whose distributions depend on what the press kept (see TinyRandomModel).
LIVELY = "+model.source.weight_scale=3.0"


def config(output_dir, *overrides):
    return with_shared_context(compose_config(output_dir, *overrides, "limit=null", LIVELY))


def rows_of(cfg) -> list[dict]:
    return rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)


def plain_answer_nll(sample, model, tokenizer) -> float:
    """The mean loss of the reference answer's tokens in one forward pass over context + question + prefix + answer,
    tokenized as kvpress's pipeline tokenizes the context and the question."""
    pipe = make_pipeline(model, tokenizer, "cpu")
    inputs = pipe.preprocess(sample.context, [sample.question], sample.answer_prefix, 10_000)
    answer = tokenizer.encode(answer_text(sample.answers[0], sample.answer_prefix), add_special_tokens=False)
    ids = torch.cat([inputs["context_ids"], inputs["questions_ids"][0], torch.tensor([answer])], dim=-1)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    predicted = logits[-len(answer) - 1 : -1]
    return torch.nn.functional.cross_entropy(predicted, torch.tensor(answer)).item()


@pytest.mark.parametrize("decode_batch_size", [32, 1])  # the decoding pool, and kvpress's pipeline path
def test_uncompressed_answer_nll_is_the_loss_of_one_plain_forward_pass(tmp_path, tiny_tokenizer, decode_batch_size):
    cfg = config(tmp_path, "press=none", f"decode_batch_size={decode_batch_size}")
    run(cfg)
    model = TinyRandomModel(weight_scale=3.0).load_model("cpu", "float32", "sdpa")
    samples = {sample.id: sample for sample in SharedContextBenchmark().load(tiny_tokenizer)}
    rows = rows_of(cfg)
    assert len(rows) == 9
    for row in rows:
        expected = plain_answer_nll(samples[row["id"]], model, tiny_tokenizer)
        assert abs(row["answer_nll"] - expected) < 1e-5, row["id"]
        assert abs(row["answer_nll_uncompressed"] - expected) < 1e-5, row["id"]


@pytest.mark.parametrize("point", [("press=none",), ("press=topk", "scorer=snapkv", "cr=0"), ("press=adakv", "cr=0")])
def test_without_compression_the_distributions_do_not_move(tmp_path, point):
    cfg = config(tmp_path, *point)
    run(cfg)
    for row in rows_of(cfg):
        # The same keys teacher-forced the same way: not close, equal.
        assert row["answer_kl"] == 0.0, row["id"]
        assert row["answer_top1"] == 1.0, row["id"]
        assert row["answer_nll"] == row["answer_nll_uncompressed"], row["id"]


def test_compression_moves_the_distributions(tmp_path):
    cfg = config(tmp_path, "press=topk", "scorer=knorm", "cr=0.9")
    run(cfg)
    assert all(row["answer_kl"] > 1e-4 for row in rows_of(cfg))


POINTS = [
    ("press=none", "cr=0"),
    ("press=topk", "scorer=snapkv", "cr=0.6"),
    ("press=chunkkv", "scorer=snapkv", "cr=0.6"),
    ("press=adakv", "scorer=snapkv", "cr=0.6"),
    ("press=topk", "scorer=knorm", "cr=0.3"),
]


@pytest.mark.parametrize("query_aware", ["false", "true"])
def test_a_sweep_gives_the_fields_of_separate_runs(tmp_path, query_aware):
    swept = [config(tmp_path / "sweep", *point, f"query_aware={query_aware}") for point in POINTS]
    run_sweep(swept)
    for point, cfg in zip(POINTS, swept, strict=True):
        separate = config(tmp_path / "separate", *point, f"query_aware={query_aware}")
        run(separate)
        # A cache's rows are teacher-forced on their own, whatever shares the pool: byte-identical files.
        shared = (run_dir(cfg) / rundir.PREDICTIONS).read_bytes()
        assert shared == (run_dir(separate) / rundir.PREDICTIONS).read_bytes(), run_dir(cfg).name
        assert all(row.get(name) is not None for row in rows_of(cfg) for name in FIELDS)


def test_the_pipeline_path_gives_the_fields_of_the_pool(tmp_path):
    for point in POINTS[1:4]:
        pooled = config(tmp_path / "pool", *point)
        pipeline = config(tmp_path / "pipeline", *point, "decode_batch_size=1")
        run(pooled), run(pipeline)
        fields = [[row.get(name) for name in FIELDS] for row in rows_of(pooled)]
        assert fields == [[row.get(name) for name in FIELDS] for row in rows_of(pipeline)], point


def test_generate_false_measures_the_same_fields_without_answers(tmp_path):
    point = ("press=topk", "scorer=snapkv", "cr=0.6")
    generated, measured = config(tmp_path, *point), config(tmp_path, *point, "generate=false")
    assert run_dir(generated) != run_dir(measured)  # two runs: one holds answers, the other none
    run(generated)
    metrics = run(measured)
    rows = rows_of(measured)
    assert all(row["prediction"] is None for row in rows)
    # The same fields, bit for bit; only the generating run has answers, and their tokens.
    with_answers = [
        {**{k: v for k, v in row.items() if k not in (TOKENS, STOP)}, "prediction": None} for row in rows_of(generated)
    ]
    assert all(isinstance(row[TOKENS], list) for row in rows_of(generated))
    assert with_answers == rows
    assert metrics["score"] is None and all(task["score"] is None for task in metrics["tasks"].values())
    assert metrics["likelihood"] == likelihood_metrics(rows)
    # The generating run's fingerprint is the one it had before generate existed.
    before = generated.copy()
    with open_dict(before):
        del before["generate"]
    assert fingerprint(generated) == fingerprint(before) != fingerprint(measured)


def test_likelihood_false_leaves_the_fields_out_and_keeps_the_run(tmp_path):
    with_fields, without = (
        config(tmp_path, "press=topk", "cr=0.5"),
        config(tmp_path, "press=topk", "cr=0.5", "likelihood=false"),
    )
    assert run_dir(with_fields) == run_dir(without)  # the predictions are the same either way
    run(without)
    rows = rows_of(without)
    assert all(name not in row for row in rows for name in FIELDS)
    assert "likelihood" not in rundir.read_json(run_dir(without) / rundir.METRICS)


def test_metrics_are_task_means_and_their_unweighted_mean():
    rows = [
        {"task": "a", "answer_nll": 1.0, "answer_nll_uncompressed": 0.5, "answer_kl": 0.2, "answer_top1": 1.0},
        {"task": "a", "answer_nll": 3.0, "answer_nll_uncompressed": 1.5, "answer_kl": 0.4, "answer_top1": 0.5},
        {"task": "b", "answer_nll": 5.0, "answer_nll_uncompressed": 2.0, "answer_kl": 0.9, "answer_top1": 0.0},
        {"task": "b", "error": "RuntimeError: boom", "prediction": ""},  # a failed sample has no fields
    ]
    metrics = likelihood_metrics(rows)
    assert metrics["tasks"]["a"] == pytest.approx(
        {"answer_nll": 2.0, "answer_nll_uncompressed": 1.0, "answer_kl": 0.3, "answer_top1": 0.75, "n": 2}
    )
    assert metrics["tasks"]["b"]["n"] == 1
    assert metrics["answer_kl"] == pytest.approx((0.3 + 0.9) / 2)
    assert metrics["n"] == 3
    assert likelihood_metrics([{"task": "a", "prediction": "x"}]) is None


def test_rescoring_keeps_the_fields(tmp_path):
    cfg = config(tmp_path, "press=topk", "cr=0.5")
    written = run(cfg)
    predictions = (run_dir(cfg) / rundir.PREDICTIONS).read_bytes()
    assert rescore_run(run_dir(cfg)) == written
    assert written["likelihood"]["n"] == 9
    assert (run_dir(cfg) / rundir.PREDICTIONS).read_bytes() == predictions


def test_generate_false_with_likelihood_false_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="generate=false with likelihood=false measures nothing"):
        run(config(tmp_path, "generate=false", "likelihood=false"))
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_a_press_that_compresses_while_decoding_gets_no_fields_and_says_so(tmp_path, caplog):
    cfg = config(tmp_path, "method=decoding_knorm", "cr=0.5", "target_size=64")
    with pytest.raises(ConfigError, match="generate=false needs the likelihood fields, and decoding_knorm has none"):
        run(config(tmp_path, "method=decoding_knorm", "cr=0.5", "target_size=64", "generate=false"))
    with caplog.at_level(logging.WARNING):
        run(cfg)
    assert "decoding_knorm gets no likelihood fields: it compresses while decoding" in caplog.text
    assert all(name not in row for row in rows_of(cfg) for name in FIELDS)


@pytest.mark.parametrize("path", ["pool", "pipeline"])
def test_a_likelihood_failure_fails_its_samples_by_name_and_the_run_goes_on(tmp_path, monkeypatch, path):
    def broken(*args, **kwargs):
        raise RuntimeError("teacher forcing is broken")

    monkeypatch.setattr(
        f"evaluate.engine.{'pool_engine' if path == 'pool' else 'pipeline_engine'}.teacher_forced", broken
    )
    cfg = config(
        tmp_path, "press=topk", "scorer=snapkv", "cr=0.5", *(["decode_batch_size=1"] if path == "pipeline" else [])
    )
    metrics = run(cfg)
    rows = rows_of(cfg)
    assert rows and all(row["error"] == "RuntimeError: teacher forcing is broken" for row in rows)
    assert metrics["n_errors"] == len(rows)
    assert rundir.read_json(run_dir(cfg) / rundir.RUN)["status"] == "complete_with_errors"


def test_each_second_of_the_likelihood_is_counted_in_one_stage(tmp_path, monkeypatch):
    """The uncompressed references are teacher-forced right after the shared prefill: their time is the
    likelihood's, not the prefill's too; and the run's wall time is the time it was answered, not a sum of stages."""

    def slow_references(pool, cache, hidden, *args):
        if hidden == ():  # the uncompressed cache's rows (a compressed cache's carry one entry per layer)
            time.sleep(2.0)
        return teacher_forced(pool, cache, hidden, *args)

    monkeypatch.setattr("evaluate.engine.pool_engine.teacher_forced", slow_references)
    cfg = config(tmp_path, "press=topk", "scorer=snapkv", "cr=0.5")
    started = time.perf_counter()
    run(cfg)
    elapsed = time.perf_counter() - started
    record = rundir.read_json(run_dir(cfg) / rundir.RUN)
    # 3 contexts: 6 s slept in the references, all of it likelihood (the three prefills take well under that).
    assert record["likelihood_seconds"] >= 6.0
    assert record["prefill_seconds"] < 6.0
    stages = sum(record[f"{stage}_seconds"] for stage in ("prefill", "compress", "decode", "likelihood"))
    assert stages <= record["wall_seconds"] + 0.01  # run.json rounds each to the millisecond
    assert record["wall_seconds"] <= elapsed
