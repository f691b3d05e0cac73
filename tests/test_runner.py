"""End-to-end runs on the tiny random model: every press x scorer, resume, rescoring."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from evaluate import rundir
from evaluate.points.config import method_name, run_dir
from evaluate.points.resolve import resolve
from evaluate.run.entry import run
from evaluate.run.summary import run_summary
from evaluate.score.rescore import main as score_main
from tests.support import SharedContextBenchmark, assert_kept, compose_config, with_shared_context

PRESSES = ["topk", "chunkkv", "chunkkv_exact", "eg_chunkkv", "adakv"]
SCORERS = ["snapkv", "expected_attention", "tova", "knorm", "keydiff", "streaming_llm", "random"]


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("press", PRESSES)
def test_every_press_and_scorer_runs_end_to_end_at_cr_half(tmp_path, press, scorer):
    cfg = with_shared_context(compose_config(tmp_path, f"press={press}", f"scorer={scorer}", "cr=0.5"))
    metrics = run(cfg)

    out = run_dir(cfg)
    assert out.name.startswith(f"shared_context__tiny-random__{method_name(cfg)}__cr0.50__")
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert [row["id"] for row in rows] == [f"doc-{c}-{q}" for c in range(3) for q in range(3)][:6]
    assert sum(task["n"] for task in metrics["tasks"].values()) == 6
    for row in rows:
        assert row["compression_ratio"] == 0.5
        assert_kept(press, row, 0.5)
    assert json.loads((out / rundir.METRICS).read_text()) == metrics
    assert rundir.read_json(out / rundir.RUN)["status"] == "complete"


def test_no_press_keeps_everything_and_records_cr_zero(tmp_path, caplog):
    cfg = with_shared_context(compose_config(tmp_path, "press=none", "cr=0.5"))
    run(cfg)
    assert "cr=0.5 is ignored" in caplog.text
    out = run_dir(cfg)
    assert "__no_press__cr0.00__" in out.name
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert {(row["kept_ratio"], row["compression_ratio"]) for row in rows} == {(1.0, 0.0)}


def test_questions_sharing_a_context_are_answered_from_one_compression(tmp_path, monkeypatch):
    from kvpress import KVPressTextGenerationPipeline

    calls = []
    original = KVPressTextGenerationPipeline.__call__

    def counting_call(self, context, **kwargs):
        calls.append(len(kwargs["questions"]))
        return original(self, context, **kwargs)

    monkeypatch.setattr(KVPressTextGenerationPipeline, "__call__", counting_call)
    run(with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5", "decode_batch_size=1")))
    assert calls == [3, 3]


def test_the_pool_compresses_each_context_once_for_its_questions(tmp_path, monkeypatch):
    from evaluate.engine import pool_engine

    compressions = []
    original = pool_engine.compressed_cache

    def counting(*args):
        compressions.append(args[0])
        return original(*args)

    monkeypatch.setattr(pool_engine, "compressed_cache", counting)
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5"))
    run(cfg)
    assert len(compressions) == 2
    record = rundir.read_json(run_dir(cfg) / rundir.RUN)
    # Two prefills and two compressions for six questions, and fewer passes per question than one by one.
    assert record["contexts"] == 2 and record["questions"] == 6


def test_query_aware_compresses_context_and_question_together(tmp_path):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5", "query_aware=true"))
    run(cfg)
    out = run_dir(cfg)
    assert "__query_aware__" in out.name
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    plain = with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5"))
    run(plain)
    plain_rows = rundir.read_predictions(run_dir(plain) / rundir.PREDICTIONS)
    # The question now sits inside the compressed context, so each context is longer by its question.
    for aware, unaware in zip(rows, plain_rows, strict=True):
        assert aware["question"] == unaware["question"]
        assert aware["context_length"] > unaware["context_length"]


def test_interrupted_run_resumes_to_exactly_the_uninterrupted_result(tmp_path, monkeypatch):
    overrides = ("press=eg_chunkkv", "cr=0.5", "limit=null")
    reference = with_shared_context(compose_config(tmp_path / "reference", *overrides))
    run(reference)
    reference_dir = run_dir(reference)

    cfg = with_shared_context(compose_config(tmp_path / "resumed", *overrides))
    out = run_dir(cfg)
    original_append = rundir.append_predictions
    appended = []

    def crash_on_second_context(path, rows):
        if appended:
            # A crash in the middle of writing: part of a line reaches the file, then the process dies.
            with path.open("a") as handle:
                handle.write('{"id": "doc-1-0", "task": "niah')
            raise KeyboardInterrupt
        appended.append(path)
        original_append(path, rows)

    monkeypatch.setattr(rundir, "append_predictions", crash_on_second_context)
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    assert rundir.read_json(out / rundir.RUN)["status"] == "interrupted"
    assert len(rundir.read_predictions(out / rundir.PREDICTIONS)) == 3

    monkeypatch.setattr(rundir, "append_predictions", original_append)
    run(cfg)

    lines = (out / rundir.PREDICTIONS).read_text().splitlines()
    assert lines == (reference_dir / rundir.PREDICTIONS).read_text().splitlines()
    assert len({json.loads(line)["id"] for line in lines}) == len(lines) == 9
    assert (out / rundir.METRICS).read_text() == (reference_dir / rundir.METRICS).read_text()
    record = rundir.read_json(out / rundir.RUN)
    assert (record["status"], record["samples"], record["sessions"]) == ("complete", 9, 2)


def test_finished_run_is_not_redone_unless_overwrite(tmp_path, capsys, monkeypatch):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5"))
    run(cfg)
    predictions = run_dir(cfg) / rundir.PREDICTIONS
    before = predictions.read_text()

    from evaluate.models.random_models import TinyRandomModel

    def no_model(*args, **kwargs):
        raise AssertionError("a complete run must not load the model")

    monkeypatch.setattr(TinyRandomModel, "load_model", no_model)
    run(cfg)
    assert "already complete" in capsys.readouterr().out
    assert predictions.read_text() == before

    monkeypatch.undo()
    run(with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5", "overwrite=true")))
    assert predictions.read_text() == before
    assert rundir.read_json(run_dir(cfg) / rundir.RUN)["sessions"] == 1


def test_a_larger_limit_extends_a_finished_run(tmp_path):
    run(with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5", "limit=1")))
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5", "limit=null"))
    run(cfg)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert [row["id"] for row in rows] == [f"doc-{c}-{q}" for c in range(3) for q in range(3)]


def test_rescoring_from_predictions_alone_reproduces_metrics(tmp_path, capsys):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5"))
    metrics = run(cfg)
    out = run_dir(cfg)
    (out / rundir.METRICS).unlink()

    score_main([str(out)])
    assert rundir.read_json(out / rundir.METRICS) == metrics

    capsys.readouterr()
    score_main(["--benchmark", "ruler", str(out / rundir.PREDICTIONS)])
    printed = json.loads(capsys.readouterr().out)
    assert printed == {**metrics, "benchmark": "ruler"}


def test_default_benchmark_runs_on_the_tiny_model(tmp_path):
    # One byte per token: vt's solved example and cwe's lists do not fit RULER's budgets at 1024 (see
    # tests/test_ruler_synth.py), so the tiny model runs the tasks that do.
    tasks = ["niah_single_1", "niah_multikey_2", "fwe"]
    cfg = compose_config(
        tmp_path, "press=eg_chunkkv", "cr=0.9", "benchmark.max_seq_length=1024", f"benchmark.tasks=[{','.join(tasks)}]"
    )
    metrics = run(cfg)
    assert sorted(metrics["tasks"]) == sorted(tasks)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert len(rows) == 3 * len(tasks)
    for row in rows:
        assert row["context_length"] <= 1024
        assert row["kept_ratio"] * row["context_length"] == pytest.approx(max(1, int(row["context_length"] * 0.1)))


@pytest.mark.parametrize("press", PRESSES)
def test_presses_run_on_a_tiny_qwen3(tmp_path, press):
    cfg = with_shared_context(compose_config(tmp_path, "model=tiny_random_qwen3", f"press={press}", "cr=0.5"))
    run(cfg)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert len(rows) == 6
    for row in rows:
        assert_kept(press, row, 0.5)


def test_a_single_run_ends_with_its_score_next_to_the_uncompressed_one(tmp_path):
    compressed = with_shared_context(compose_config(tmp_path, "press=eg_chunkkv", "cr=0.5", "limit=1"))
    metrics = run(compressed)
    first = run_summary(resolve(compressed), metrics)
    assert f"eg_chunkkv_snapkv at cr 0.50 on shared_context (tiny-random, 2 samples): score {metrics['score']}" in first
    assert "of the KV pairs kept on average" in first
    assert "no uncompressed run of these samples and settings yet: python -m evaluate press=none" in first
    assert f"files: {run_dir(compressed)}/" in first and "python -m evaluate.report" in first

    # The uncompressed run of more samples than these: the summary scores it on these samples alone.
    uncompressed = with_shared_context(compose_config(tmp_path, "press=none", "limit=3"))
    run(uncompressed)
    rows = rundir.read_predictions(run_dir(uncompressed) / rundir.PREDICTIONS)
    same = [row for row in rows if row["id"] in {"doc-0-0", "doc-0-1"}]
    expected = SharedContextBenchmark().score(same)["score"]
    assert f"uncompressed, same samples: score {expected} ({run_dir(uncompressed)})" in run_summary(
        resolve(compressed), metrics
    )


@pytest.mark.slow  # one `python -m evaluate` process (imports torch and kvpress)
def test_the_command_line_summary_names_the_commands_that_follow(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "evaluate",
            "model=tiny_random",
            "limit=1",
            "benchmark.tasks=[fwe]",
            "benchmark.max_seq_length=512",
            f"output_dir={tmp_path}",
            "press=eg_chunkkv",
            "cr=0.9",
            "press=none",
        ],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-4:]
    assert summary[0].startswith("no_press at cr 0.00 on ruler_synth (tiny-random, 1 samples): score ")
    assert summary[1].startswith(f"files: {tmp_path}/ruler_synth__tiny-random__no_press__cr0.00__")
    assert summary[2] == f"next: python -m evaluate.report {tmp_path}   (tables and plots of every run)"
    # The last press= wins, as in Hydra; an uncompressed run suggests a sweep of presses that compress.
    assert summary[3].startswith("      python -m evaluate -m press=chunkkv,eg_chunkkv model=tiny_random limit=1 ")


def test_a_failed_pool_pass_fails_its_unanswered_contexts_and_the_run_goes_on(tmp_path, monkeypatch):
    from evaluate.engine.model_runner import ModelRunner

    original = ModelRunner._forward
    passes = []

    def fail_once(self, *args):
        passes.append(1)
        if len(passes) == 1:
            raise ValueError("a pass that cannot run (simulated)")
        return original(self, *args)

    monkeypatch.setattr(ModelRunner, "_forward", fail_once)
    # Room for one context's three questions at a time: the failed pass served the first context only.
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "limit=null", "decode_batch_size=3"))
    metrics = run(cfg)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    failed = [row for row in rows if row.get("error")]
    assert len(rows) == 9 and len(failed) == 3
    assert all("cannot run" in row["error"] and row["prediction"] == "" for row in failed)
    assert metrics["n_errors"] == 3
