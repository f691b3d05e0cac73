"""kvpress leaderboard submissions from hand-written finished runs (tests/fixtures/runs/builder.py)."""

import ast
import csv
import json

import pytest
import yaml

from evaluate.benchmarks.ruler import TASKS as RULER_TASKS
from evaluate.report import leaderboard
from evaluate.report.leaderboard import main
from evaluate.report.runs import collect_runs
from evaluate.score.likelihood import FIELDS as LIKELIHOOD_FIELDS
from tests.fixtures.runs.builder import ruler_benchmark, uniform, write_run

QWEN = "Qwen/Qwen3-8B"
# 7 of 13 tasks right on both samples, the rest on one of two: (7 x 100 + 6 x 50) / 13 = 76.92.
MIXED = {task: [True, True] if i < 7 else [False, True] for i, task in enumerate(RULER_TASKS)}


def read_leaderboard_dir(folder) -> dict[str, float]:
    """What the leaderboard does: every direct subdirectory with metrics.json and config.yaml is a result,
    scored as the mean of its tasks' string_match."""
    scores = {}
    for sub in sorted(folder.iterdir()):
        if sub.is_dir() and (sub / "metrics.json").is_file() and (sub / "config.yaml").is_file():
            metrics = json.loads((sub / "metrics.json").read_text())
            scores[sub.name] = sum(task["string_match"] for task in metrics.values()) / len(metrics)
    return scores


@pytest.fixture
def runs_dir(tmp_path):
    root = tmp_path / "runs"
    write_run(root, MIXED, method="adakv_dropkv", cr=0.875, model=QWEN, query_aware=True)
    write_run(root, uniform([True, True]), method="no_press", model=QWEN)
    return root


def test_submission_directories_have_kvpress_names_and_files(runs_dir, tmp_path, capsys):
    out = tmp_path / "submission"
    main([str(runs_dir), "--out", str(out)])
    names = sorted(path.name for path in out.iterdir())
    assert names == [
        "leaderboard.csv",
        "ruler__4096__Qwen--Qwen3-8B__adakv_dropkv__0.88__query_aware",
        "ruler__4096__Qwen--Qwen3-8B__no_press__0.00",
    ]
    folder = out / names[1]
    assert sorted(path.name for path in folder.iterdir()) == ["config.yaml", "metrics.json", "predictions.csv"]
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert list(config) == [
        "dataset",
        "data_dir",
        "model",
        "press_name",
        "compression_ratio",
        "query_aware",
        "fraction",
        "max_new_tokens",
        "max_context_length",
        "seed",
        "press_init_command",
    ]
    assert config == {
        "dataset": "ruler",
        "data_dir": "4096",
        "model": QWEN,
        "press_name": "adakv_dropkv",
        "compression_ratio": 0.875,
        "query_aware": True,
        "fraction": 1.0,
        "max_new_tokens": None,
        "max_context_length": None,
        "seed": 42,
        "press_init_command": "adakv_dropkv(compression_ratio=0.875)",
    }
    metrics = json.loads((folder / "metrics.json").read_text())
    assert list(metrics) == sorted(RULER_TASKS)
    assert metrics["niah_single_1"] == {"string_match": 100.0} and metrics["qa_2"] == {"string_match": 50.0}

    with (folder / "predictions.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == [
        "question",
        "answer_prefix",
        "answer",
        "task",
        "max_new_tokens",
        "predicted_answer",
        "compression_ratio",
    ]
    assert len(rows) == 26
    first = rows[0]
    assert ast.literal_eval(first["answer"]) == ["niah_single_1-answer-0"]
    assert (first["predicted_answer"], first["compression_ratio"]) == (" niah_single_1-answer-0.", "0.875")
    assert "no_press__0.00  score 100.00" in capsys.readouterr().out


def test_leaderboard_reads_back_the_harness_scores(runs_dir, tmp_path):
    out = tmp_path / "submission"
    main([str(runs_dir), "--out", str(out)])
    runs, _ = collect_runs(runs_dir)
    harness = {leaderboard.submission_name(run): run.score for run in runs}
    assert read_leaderboard_dir(out) == pytest.approx(harness, abs=0.005)
    assert harness["ruler__4096__Qwen--Qwen3-8B__adakv_dropkv__0.88__query_aware"] == 76.92

    with (out / "leaderboard.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows == [
        {
            "dataset": "ruler",
            "data_dir": "4096",
            "model": QWEN,
            "method": "adakv_dropkv",
            "compression_ratio": "0.875",
            "score": "76.92",
            "query_aware": "True",
            "press_init_command": "adakv_dropkv(compression_ratio=0.875)",
            # Query-aware, its no_press run not: no baseline (tests/test_iso_quality.py checks the figures).
            **dict.fromkeys(["iso_cr_absolute", "iso_mark_absolute", "iso_cr_relative", "iso_mark_relative"], ""),
            "iso_note": "no uncompressed run to compare with",
        },
        {
            "dataset": "ruler",
            "data_dir": "4096",
            "model": QWEN,
            "method": "no_press",
            "compression_ratio": "0.0",
            "score": "100.00",
            "query_aware": "False",
            "press_init_command": "None",
            **dict.fromkeys(["iso_cr_absolute", "iso_mark_absolute", "iso_cr_relative", "iso_mark_relative"], ""),
            "iso_note": "",
        },
    ]


def test_partial_runs_are_refused_with_their_reasons_unless_allowed(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, uniform([True]), method="snapkv", cr=0.5, model=QWEN, limit=1)
    write_run(root, {task: [True] for task in RULER_TASKS[:11]}, method="snapkv", cr=0.25, model=QWEN)
    write_run(
        root, uniform([True]), method="snapkv", cr=0.75, model=QWEN, benchmark=ruler_benchmark(dataset="me/ruler")
    )
    write_run(root, uniform([True]), method="snapkv", cr=0.6, model=QWEN, benchmark=ruler_benchmark(data_dir="8192"))
    write_run(root, uniform([True]), method="snapkv", cr=0.4, model=QWEN, status="running")
    out = tmp_path / "submission"
    with pytest.raises(SystemExit, match="nothing exported"):
        main([str(root), "--out", str(out)])
    err = capsys.readouterr().err
    assert "limit=1 (samples per task); rerun with limit=null" in err
    assert "11 of 13 tasks (missing qa_1, qa_2)" in err
    assert "dataset me/ruler, not the hub dataset simonjegou/ruler" in err
    assert "not a ruler 4096 run" in err and "status running" in err
    assert err.count("--allow-partial") == 3
    assert not out.exists() or not any(out.iterdir())

    main([str(root), "--out", str(out), "--allow-partial"])
    exported = sorted(path.name for path in out.iterdir() if path.is_dir())
    assert exported == [f"ruler__4096__Qwen--Qwen3-8B__snapkv__{cr}" for cr in ("0.25", "0.50", "0.75")]
    fraction = yaml.safe_load((out / exported[1] / "config.yaml").read_text())["fraction"]
    assert fraction == round(13 / 6500, 4)  # one sample of each task out of RULER-4096's 13 x 500


def test_a_failed_export_leaves_no_directory_that_looks_valid(runs_dir, tmp_path, monkeypatch):
    out = tmp_path / "submission"

    def fail(run):
        raise OSError("disk full")

    monkeypatch.setattr(leaderboard, "predictions_csv", fail)
    with pytest.raises(OSError, match="disk full"):
        main([str(runs_dir), "--out", str(out)])
    assert list(out.iterdir()) == []
    # Nor is a staging folder left beside it.
    assert {path.name for path in tmp_path.iterdir()} == {"runs", "submission"}


def test_local_model_paths_are_refused_since_the_leaderboard_names_models_by_hub_id(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, uniform([True]), method="snapkv", cr=0.5, model="/models/Qwen3-8B")
    with pytest.raises(SystemExit):
        main([str(root), "--out", str(tmp_path / "submission")])
    assert "model /models/Qwen3-8B is not a hub id" in capsys.readouterr().err


def test_names_that_would_pass_for_a_registry_entry_they_are_not_are_refused(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, uniform([True]), method="expected_attention_variant", cr=0.5, model=QWEN)
    # Recorded before names followed the registry: topk over ExpectedAttentionPress, named expected_attention.
    topk = write_run(root, uniform([True]), method="expected_attention", cr=0.25, model=QWEN)
    entry = write_run(root, uniform([True]), method="expected_attention", cr=0.75, model=QWEN)
    for run, press in (
        (topk, {"_target_": "kvpress.ExpectedAttentionPress", "compression_ratio": 0.25}),
        (
            entry,
            {
                "_target_": "kvpress.AdaKVPress",
                "press": {"_target_": "kvpress.ExpectedAttentionPress", "epsilon": 0.01},
            },
        ),
    ):
        record = yaml.safe_load((run / "config.yaml").read_text())
        record["config"]["press"]["press"] = press
        (run / "config.yaml").write_text(yaml.safe_dump(record))
    out = tmp_path / "submission"
    main([str(root), "--out", str(out), "--allow-partial"])
    err = capsys.readouterr().err
    assert "no leaderboard name: expected_attention_variant is not kvpress's expected_attention entry" in err
    assert f"refused {topk}: no leaderboard name: expected_attention was run with" in err
    exported = sorted(path.name for path in out.iterdir() if path.is_dir())
    assert exported == ["ruler__4096__Qwen--Qwen3-8B__expected_attention__0.75"]


def test_likelihood_fields_stay_out_of_the_export_and_generate_false_runs_are_refused(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, MIXED, method="snapkv", cr=0.5, model=QWEN, likelihood=True)
    write_run(root, MIXED, method="knorm", cr=0.5, model=QWEN, likelihood=True, generate=False)
    out = tmp_path / "submission"
    main([str(root), "--out", str(out)])
    assert (
        "made with generate=false: no generated answers to score; rerun with generate=true" in capsys.readouterr().err
    )
    (folder,) = [path for path in out.iterdir() if path.is_dir()]
    assert folder.name == "ruler__4096__Qwen--Qwen3-8B__snapkv__0.50"
    assert list(json.loads((folder / "metrics.json").read_text())["niah_single_1"]) == ["string_match"]
    for path in folder.iterdir():
        text = path.read_text()
        assert not [word for word in (*LIKELIHOOD_FIELDS, "likelihood") if word in text], path.name
    assert next(csv.DictReader((folder / "predictions.csv").open())).keys() == set(leaderboard.PREDICTION_COLUMNS)


@pytest.mark.parametrize("allow_partial", [False, True], ids=["full", "allow_partial"])
def test_budget_runs_are_refused_whatever_the_flag_naming_the_true_fix(tmp_path, capsys, allow_partial):
    root = tmp_path / "runs"
    write_run(root, uniform([True]), method="snapkv", cr=0.5, model=QWEN, budget=64)
    # Partial as well: the budget, which --allow-partial cannot lift, is what the refusal names.
    write_run(root, uniform([True]), method="knorm", cr=0.5, model=QWEN, budget=128, limit=1)
    with pytest.raises(SystemExit, match="nothing exported"):
        main([str(root), "--out", str(tmp_path / "submission"), *(["--allow-partial"] if allow_partial else [])])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    for budget, line in zip((128, 64), sorted(lines, key=lambda line: "snapkv" in line), strict=True):
        assert line.endswith(
            f"not exportable: budget={budget}: kvpress's leaderboard places each submission at one compression "
            "ratio, and a token budget compresses each context at its own; rerun with cr= to submit it"
        )
        assert "--allow-partial" not in line


def test_runs_on_a_quantized_cache_are_refused_whatever_the_flag(tmp_path, capsys):
    root = tmp_path / "runs"
    quantized = {"_target_": "evaluate.kv_cache.QuantizedKVCache", "backend": "quanto", "nbits": 2}
    write_run(root, uniform([True]), method="snapkv", cr=0.5, model=QWEN, cache=quantized)
    with pytest.raises(SystemExit, match="nothing exported"):
        main([str(root), "--out", str(tmp_path / "submission"), "--allow-partial"])
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(
        "not exportable: a quantized cache (quanto 2-bit): kvpress's leaderboard holds each press's keys and values "
        "at the model's dtype; its score is in the report's bytes_at_iso_quality table"
    )


def test_decoding_time_runs_are_refused_whatever_the_flag(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(
        root,
        uniform([True]),
        method="decoding_knorm",
        model=QWEN,
        decoding={"target_size": 256, "compression_interval": 8},
    )
    with pytest.raises(SystemExit, match="nothing exported"):
        main([str(root), "--out", str(tmp_path / "submission"), "--allow-partial"])
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(
        "not exportable: a decoding-time press (target_size=256, compression_interval=8) reads no compression ratio, "
        "and kvpress's leaderboard places each submission at one; its score is in the report's decoding table"
    )
