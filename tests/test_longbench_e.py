"""LongBench-E: length buckets, metrics against hand-computed and reference values, every loader path, a local run.

Fixtures: tests/fixtures/longbench_e/{task}_e.jsonl are rows in kvpress's hub schema (4 of the 13 tasks), written by
tests/fixtures/reference_longbench_e.py with the tables of kvpress's own create_huggingface_dataset.py;
tests/fixtures/longbench_e_predictions.jsonl holds prediction rows for all 13 tasks, over the three length buckets
and their boundaries, with the edge cases of each metric (empty and blank predictions, exact and partial hits).
"""

import json
from pathlib import Path

import datasets
import pytest
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.benchmarks import longbench
from evaluate.benchmarks.longbench_e import (
    TASKS,
    LongBenchE,
    length_bucket,
    sample_score,
    score_predictions,
)
from evaluate.points.config import ConfigError, run_dir
from evaluate.run.entry import run
from evaluate.score.answer_length import own_metrics
from evaluate.score.diagnostics import diagnostics_metrics
from evaluate.score.likelihood import likelihood_metrics
from evaluate.score.rescore import main as score_main
from tests.support import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HUB_ROWS = FIXTURES / "longbench_e"
PREDICTIONS = FIXTURES / "longbench_e_predictions.jsonl"
FIXTURE_TASKS = ["qasper_e", "trec_e", "passage_count_e", "lcc_e"]
BUCKETS = ("0-4k", "4-8k", "8k+")

# kvpress 0.5.5's calculate_metrics_e on tests/fixtures/longbench_e_predictions.jsonl, called per task as kvpress's
# runner calls it (one data_dir per run), with rouge 1.0.1 and fuzzywuzzy 0.18.0 without python-Levenshtein; None
# where kvpress gives NaN (an empty bucket). Printed by tests/fixtures/reference_longbench_e.py (see its docstring).
REFERENCE = {
    "qasper_e": {"0-4k": 100.0, "4-8k": 66.67, "8k+": 0.0},
    "multifieldqa_en_e": {"0-4k": None, "4-8k": 33.33, "8k+": None},
    "hotpotqa_e": {"0-4k": 0.0, "4-8k": None, "8k+": 100.0},
    "2wikimqa_e": {"0-4k": 50.0, "4-8k": None, "8k+": None},
    "gov_report_e": {"0-4k": 72.73, "4-8k": 0.0, "8k+": 0.0},
    "multi_news_e": {"0-4k": None, "4-8k": 61.54, "8k+": None},
    "trec_e": {"0-4k": 75.0, "4-8k": 0.0, "8k+": 50.0},
    "triviaqa_e": {"0-4k": 100.0, "4-8k": 0.0, "8k+": None},
    "samsum_e": {"0-4k": 50.0, "4-8k": None, "8k+": 0.0},
    "passage_count_e": {"0-4k": 50.0, "4-8k": None, "8k+": 100.0},
    "passage_retrieval_en_e": {"0-4k": 0.0, "4-8k": 50.0, "8k+": 100.0},
    "lcc_e": {"0-4k": 100.0, "4-8k": 21.0, "8k+": 100.0},
    "repobench-p_e": {"0-4k": 100.0, "4-8k": 0.0, "8k+": 84.0},
}
TREC_CLASSES = ["Distance", "Date", "Other", "location", "Other location", "City", "Individual"]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# Metrics, hand-computed
# ---------------------------------------------------------------------------------------------------------------


def test_length_buckets_split_at_4000_and_8000():
    assert [length_bucket(length) for length in (0, 3999, 4000, 7999, 8000, 50000)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
        "8k+",
    ]


def test_samples_are_cleaned_as_longbench_eval_py_not_as_kvpress_longbench():
    # Only leading newlines are stripped before the first-line cut: " \nDate" keeps a blank first line.
    assert sample_score("trec_e", " \nDate", ["Date"], TREC_CLASSES) == 0.0
    assert longbench.sample_score("trec", " \nDate", ["Date"], TREC_CLASSES, "kvpress") == 1.0
    assert sample_score("triviaqa_e", "\n\nParis\nPassage: more", ["Paris"]) == 1.0
    # No left strip: an indented line keeps the indentation the gold line has.
    assert sample_score("lcc_e", "    return a * b\n", ["    return a * b"]) == 1.0


def test_blank_predictions_are_scored_as_they_are():
    # kvpress's scorer_e has no blank shortcut: 4 spaces against 8 leading ones score fuzz.ratio 21 in code_sim.
    gold = "        self.assertEqual(result, 4)"
    assert sample_score("lcc_e", "    ", [gold]) == 0.21
    assert longbench.sample_score("lcc", "    ", [gold], None, "official") == 0.0
    assert sample_score("qasper_e", "   ", ["yes"]) == 0.0


def test_an_empty_bucket_is_null_and_a_missing_prediction_is_empty():
    rows = [
        {"task": "hotpotqa_e", "answers": ["Paris"], "prediction": "Paris", "length": 9000},
        {"task": "hotpotqa_e", "answers": ["Oslo"], "prediction": None, "length": 100},
    ]
    values = score_predictions(rows)["tasks"]["hotpotqa_e"]
    assert {bucket: values[bucket] for bucket in BUCKETS} == {"0-4k": 0.0, "4-8k": None, "8k+": 100.0}
    assert values["n_by_length"] == {"0-4k": 1, "4-8k": 0, "8k+": 1}
    assert (values["score"], values["n"], values["metric"]) == (50.0, 2, "qa_f1")


# ---------------------------------------------------------------------------------------------------------------
# Metrics against the reference implementation
# ---------------------------------------------------------------------------------------------------------------


def test_metrics_match_kvpress_calculate_metrics():
    metrics = score_predictions(read_jsonl(PREDICTIONS))
    assert list(metrics["tasks"]) == list(TASKS)
    assert {task: {b: values[b] for b in BUCKETS} for task, values in metrics["tasks"].items()} == REFERENCE
    # A task's score is the mean over all its samples: the buckets weighted by their sizes.
    for values in metrics["tasks"].values():
        counts = values["n_by_length"]
        weighted = sum(values[b] * counts[b] for b in BUCKETS if counts[b]) / values["n"]
        assert values["score"] == pytest.approx(weighted, abs=0.01)
        assert values["n"] == sum(counts.values())
    assert metrics["tasks"]["qasper_e"]["score"] == 66.67  # (1 + 1 + 2/3 + 0) / 4
    assert metrics["tasks"]["lcc_e"]["score"] == 73.67  # (1 + 0.21 + 1) / 3
    assert metrics["score"] == round(sum(values["score"] for values in metrics["tasks"].values()) / 13, 2) == 51.6
    assert metrics["score_label"] == "mean over the 13 task scores (each over all its lengths)"
    expected = {}
    for bucket in BUCKETS:
        present = [values[bucket] for values in REFERENCE.values() if values[bucket] is not None]
        expected[bucket] = round(sum(present) / len(present), 2)
    assert metrics["lengths"] == expected == {"0-4k": 63.43, "4-8k": 25.84, "8k+": 59.33}


def test_scores_from_a_file_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "predictions.jsonl"
    path.write_text(PREDICTIONS.read_text(encoding="utf-8"), encoding="utf-8")
    score_main(["--benchmark", "longbench_e", str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["score"] == 51.6 and printed["tasks"]["lcc_e"]["4-8k"] == 21.0


def test_an_unknown_task_is_refused_when_scoring():
    with pytest.raises(ValueError, match="unknown LongBench-E task 'qasper'"):
        score_predictions([{"task": "qasper", "answers": ["x"], "prediction": "x", "length": 1}])


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def test_local_rows_become_samples_unchanged(tiny_tokenizer):
    samples = LongBenchE(path=str(HUB_ROWS), tasks=FIXTURE_TASKS).load(tiny_tokenizer)
    rows = [row for task in FIXTURE_TASKS for row in read_jsonl(HUB_ROWS / f"{task}.jsonl")]
    assert len(samples) == len(rows) == 8
    for sample, row in zip(samples, rows, strict=True):
        assert sample.task == row["task"] + "_e"
        assert (sample.context, sample.question, sample.answer_prefix) == (
            row["context"],
            row["question"],
            row["answer_prefix"],
        )
        assert (sample.answers, sample.max_new_tokens, sample.chat_template) == (
            row["answers"],
            row["max_new_tokens"],
            True,
        )
        assert sample.extra == {"all_classes": row["all_classes"], "length": row["length"]}
    assert [sample.id for sample in samples][:4] == ["qasper_e-0", "qasper_e-1", "qasper_e-2", "trec_e-0"]
    trec = next(sample for sample in samples if sample.task == "trec_e")
    assert (trec.answer_prefix, trec.max_new_tokens, trec.extra["all_classes"]) == ("Type:", 84, TREC_CLASSES)


def test_every_local_format_and_the_hub_give_the_same_samples(monkeypatch, tmp_path, tiny_tokenizer):
    expected = LongBenchE(path=str(HUB_ROWS), tasks=FIXTURE_TASKS).load(tiny_tokenizer)
    rows = {task: read_jsonl(HUB_ROWS / f"{task}.jsonl") for task in FIXTURE_TASKS}
    for task, task_rows in rows.items():
        datasets.Dataset.from_list(task_rows).to_parquet(str(tmp_path / "snapshot" / task / "test-00000.parquet"))
    assert LongBenchE(path=str(tmp_path / "snapshot"), tasks=FIXTURE_TASKS).load(tiny_tokenizer) == expected

    calls = []

    def hub(name, data_dir=None, split=None):
        calls.append((name, data_dir, split))
        return datasets.Dataset.from_list(rows[data_dir])

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert LongBenchE(tasks=FIXTURE_TASKS).load(tiny_tokenizer) == expected
    assert calls == [("Xnhyacinth/LongBench", task, "test") for task in FIXTURE_TASKS]


def test_offline_hub_stops_with_the_dataset_and_the_local_alternative(monkeypatch, tiny_tokenizer):
    def offline(name, data_dir=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match=r"Xnhyacinth/LongBench \(data_dir qasper_e\).*benchmark\.path=DIR"):
        LongBenchE().load(tiny_tokenizer)


def test_limit_task_selection_and_errors(tmp_path, tiny_tokenizer):
    samples = LongBenchE(path=str(HUB_ROWS), tasks=["lcc_e", "qasper_e"]).load(tiny_tokenizer, limit=1)
    assert [sample.id for sample in samples] == ["lcc_e-0", "qasper_e-0"]
    with pytest.raises(ConfigError, match="unknown LongBench-E task.*narrativeqa_e"):
        LongBenchE(path=str(HUB_ROWS), tasks=["narrativeqa_e"]).load(tiny_tokenizer)
    with pytest.raises(ConfigError, match="has no data for hotpotqa_e"):
        LongBenchE(path=str(HUB_ROWS), tasks=["hotpotqa_e"]).load(tiny_tokenizer)
    row = read_jsonl(HUB_ROWS / "lcc_e.jsonl")[0]
    del row["length"]
    (tmp_path / "lcc_e.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="lcc_e.jsonl:1: the row lacks the column.s. length"):
        LongBenchE(path=str(tmp_path), tasks=["lcc_e"]).load(tiny_tokenizer)


def test_config_composes_and_instantiates(tmp_path):
    benchmark = instantiate(compose_config(tmp_path, "benchmark=longbench_e").benchmark)
    assert isinstance(benchmark, LongBenchE)
    assert (benchmark.name, benchmark.dataset, benchmark.split, benchmark.tasks, benchmark.path) == (
        "longbench_e",
        "Xnhyacinth/LongBench",
        "test",
        None,
        None,
    )
    assert benchmark.fraction_by_task and len(benchmark.all_tasks) == 13


# ---------------------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------------------


def test_a_local_run_records_predictions_and_metrics(tmp_path):
    cfg = compose_config(
        tmp_path,
        "benchmark=longbench_e",
        f"benchmark.path={HUB_ROWS}",
        "benchmark.tasks=[qasper_e,trec_e,passage_count_e]",
        "limit=2",
        "press=none",
    )
    metrics = run(cfg)
    out = run_dir(cfg)
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert [row["id"] for row in rows] == ["qasper_e-0", "qasper_e-1", "trec_e-0", "trec_e-1", "passage_count_e-0"]
    assert all(isinstance(row["prediction"], str) and not row.get("error") for row in rows)
    assert [row["length"] for row in rows] == [1200, 5200, 3000, 6100, 8400]
    assert rows[2]["all_classes"] == TREC_CLASSES
    assert json.loads((out / rundir.METRICS).read_text()) == metrics
    assert {task: values["n"] for task, values in metrics["tasks"].items()} == {
        "qasper_e": 2,
        "trec_e": 2,
        "passage_count_e": 1,
    }
    assert metrics["tasks"]["qasper_e"]["n_by_length"] == {"0-4k": 1, "4-8k": 1, "8k+": 0}
    lengths = own_metrics(rows)
    assert lengths["n"] == len(rows)
    expected = {**score_predictions(rows), "likelihood": likelihood_metrics(rows), "answer_length": lengths}
    assert metrics == {**expected, "diagnostics": diagnostics_metrics(rows)}  # where an answer is in its context
