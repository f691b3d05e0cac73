"""LongBench v2: the answer rule, metrics against the reference values, every loader path, a local run.

Fixtures: tests/fixtures/longbench_v2/0shot.jsonl holds six rows in kvpress's hub schema (two per length group),
written by tests/fixtures/reference_longbench_v2.py with the templates of kvpress's own create_huggingface_dataset.py;
tests/fixtures/longbench_v2_predictions.jsonl holds prediction rows over every length and difficulty with the
answer rule's edge cases.
"""

import json
from pathlib import Path

import datasets
import pandas as pd
import pytest
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.benchmarks.longbench_v2 import LongBenchV2, is_correct, score_predictions
from evaluate.benchmarks.selection import select_fraction
from evaluate.points.config import ConfigError, run_dir
from evaluate.run.entry import run
from evaluate.score.answer_length import own_metrics
from evaluate.score.likelihood import likelihood_metrics
from evaluate.score.rescore import main as score_main
from tests.support import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HUB_ROWS = FIXTURES / "longbench_v2"
HUB_FILE = HUB_ROWS / "0shot.jsonl"
PREDICTIONS = FIXTURES / "longbench_v2_predictions.jsonl"

# kvpress 0.5.5's evaluation/benchmarks/longbenchv2/calculate_metrics.py on
# tests/fixtures/longbench_v2_predictions.jsonl, each fraction x100 and rounded to 2; printed by
# tests/fixtures/reference_longbench_v2.py (see its docstring).
REFERENCE = {"average": 57.14, "easy": 60.0, "hard": 55.56, "long": 60.0, "medium": 50.0, "short": 60.0}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# Metric
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prediction", "answer", "correct"),
    [
        ("The correct answer is (A).", "A", True),
        ("**The correct answer is (B)**", "B", True),  # asterisks are removed first
        ("The correct answer is *(B)*", "B", True),
        ("The correct answer is C.", "C", True),  # the letter without parentheses
        ("The correct answer is Apple", "A", True),  # kvpress's substring rule, kept
        ("Reasoning first.\nThe correct answer is (B)", "B", True),
        ("The correct answer is (C)", "D", False),
        ("the correct answer is (C)", "C", False),  # case-sensitive
        ("The correct answer is  (D)", "D", False),
        ("The correct answer is: (A)", "A", False),
        ("I think (A)", "A", False),
        ("", "A", False),
    ],
)
def test_the_answer_rule_is_longbench_extract_answer_as_kvpress_applies_it(prediction, answer, correct):
    assert is_correct(prediction, answer) is correct


def test_a_missing_prediction_is_wrong():
    metrics = score_predictions([{"task": "short", "difficulty": "easy", "answers": ["A"], "prediction": None}])
    assert metrics["score"] == 0.0 and metrics["tasks"]["short"] == {
        "score": 0.0,
        "n": 1,
        "metric": "accuracy",
        "easy": 0.0,
        "hard": None,
    }


def test_metrics_match_kvpress_calculate_metrics():
    metrics = score_predictions(read_jsonl(PREDICTIONS))
    assert metrics["score"] == REFERENCE["average"]
    assert metrics["difficulty"] == {"easy": REFERENCE["easy"], "hard": REFERENCE["hard"]}
    assert {task: values["score"] for task, values in metrics["tasks"].items()} == {
        "short": REFERENCE["short"],
        "medium": REFERENCE["medium"],
        "long": REFERENCE["long"],
    }
    assert metrics["difficulty_n"] == {"easy": 5, "hard": 9}
    assert {task: values["n"] for task, values in metrics["tasks"].items()} == {"short": 5, "medium": 4, "long": 5}
    # The headline pools every question (kvpress's average), not the mean of the three length groups (56.67).
    assert metrics["score_label"] == "accuracy ×100 over all 14 questions (kvpress's average)"
    short = metrics["tasks"]["short"]
    assert (short["easy"], short["hard"]) == (66.67, 50.0)


def test_scores_from_a_file_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "predictions.jsonl"
    path.write_text(PREDICTIONS.read_text(encoding="utf-8"), encoding="utf-8")
    score_main(["--benchmark", "longbench_v2", str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["score"] == REFERENCE["average"] and printed["tasks"]["medium"]["hard"] == 66.67


def test_an_unknown_length_is_refused_when_scoring():
    with pytest.raises(ValueError, match="unknown LongBench v2 length 'huge'"):
        score_predictions([{"task": "huge", "difficulty": "easy", "answers": ["A"], "prediction": ""}])


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def test_local_rows_become_samples_unchanged_in_source_order(tiny_tokenizer):
    rows = read_jsonl(HUB_FILE)
    samples = LongBenchV2(path=str(HUB_FILE)).load(tiny_tokenizer)
    assert [sample.id for sample in samples] == ["short-0", "short-1", "medium-0", "medium-1", "long-0", "long-1"]
    for sample, row in zip(samples, rows, strict=True):
        assert (sample.task, sample.context, sample.question, sample.answer_prefix) == (
            row["length"],
            row["context"],
            row["question"],
            "",
        )
        assert (sample.answers, sample.max_new_tokens, sample.chat_template) == ([row["answer"]], 16, True)
        assert sample.extra == {"difficulty": row["difficulty"]}
    assert samples[0].context.startswith("Please read the following text and answer the question below.\n<text>\n")
    assert samples[0].question.endswith('Format your response as follows: "The correct answer is (insert answer here).')


def test_every_local_format_and_the_hub_give_the_same_samples(monkeypatch, tmp_path, tiny_tokenizer):
    expected = LongBenchV2(path=str(HUB_FILE)).load(tiny_tokenizer)
    rows = read_jsonl(HUB_FILE)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "snapshot" / "0shot" / "test-00000.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    for path in (HUB_ROWS, tmp_path / "snapshot", tmp_path / "saved"):
        assert LongBenchV2(path=str(path)).load(tiny_tokenizer) == expected, path

    calls = []

    def hub(name, data_dir=None, split=None):
        calls.append((name, data_dir, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert LongBenchV2().load(tiny_tokenizer) == expected
    assert calls == [("simonjegou/LongBench-v2", "0shot", "test")]


def test_offline_hub_stops_with_the_dataset_and_the_local_alternative(monkeypatch, tiny_tokenizer):
    def offline(name, data_dir=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match=r"simonjegou/LongBench-v2 \(data_dir 0shot\).*benchmark\.path=DIR"):
        LongBenchV2().load(tiny_tokenizer)


def test_limit_task_selection_and_errors(tmp_path, tiny_tokenizer):
    samples = LongBenchV2(path=str(HUB_FILE), tasks=["long", "short"]).load(tiny_tokenizer, limit=1)
    assert [sample.id for sample in samples] == ["short-0", "long-0"]  # source order, whatever the tasks' order
    with pytest.raises(ConfigError, match="unknown LongBench v2 length.*huge"):
        LongBenchV2(path=str(HUB_FILE), tasks=["huge"]).load(tiny_tokenizer)
    row = read_jsonl(HUB_FILE)[0]
    del row["difficulty"]
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="rows.jsonl:1: the row lacks the column.s. difficulty"):
        LongBenchV2(path=str(tmp_path / "rows.jsonl")).load(tiny_tokenizer)


def test_fraction_draws_from_the_whole_split_as_kvpress(tiny_tokenizer):
    samples = LongBenchV2(path=str(HUB_FILE)).load(tiny_tokenizer)
    drawn = select_fraction(samples, 0.5, 42, LongBenchV2.fraction_by_task)
    # kvpress: df.sample(frac=fraction, random_state=seed) on the split's frame, not within each length group.
    frame = pd.DataFrame(read_jsonl(HUB_FILE)).assign(id=[sample.id for sample in samples])
    assert [sample.id for sample in drawn] == [
        i for i in frame["id"] if i in set(frame.sample(frac=0.5, random_state=42)["id"])
    ]


def test_config_composes_and_instantiates(tmp_path):
    benchmark = instantiate(compose_config(tmp_path, "benchmark=longbench_v2").benchmark)
    assert isinstance(benchmark, LongBenchV2)
    assert (benchmark.name, benchmark.dataset, benchmark.data_dir, benchmark.split, benchmark.path) == (
        "longbench_v2",
        "simonjegou/LongBench-v2",
        "0shot",
        "test",
        None,
    )
    assert not benchmark.fraction_by_task and benchmark.all_tasks == ("short", "medium", "long")


# ---------------------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------------------


def test_a_local_run_records_predictions_and_metrics(tmp_path):
    cfg = compose_config(tmp_path, "benchmark=longbench_v2", f"benchmark.path={HUB_ROWS}", "limit=1", "press=none")
    metrics = run(cfg)
    out = run_dir(cfg)
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert [row["id"] for row in rows] == ["short-0", "medium-0", "long-0"]
    assert [(row["answers"], row["difficulty"]) for row in rows] == [(["B"], "easy"), (["C"], "hard"), (["A"], "hard")]
    assert all(isinstance(row["prediction"], str) and not row.get("error") for row in rows)
    assert json.loads((out / rundir.METRICS).read_text()) == metrics
    assert {task: values["n"] for task, values in metrics["tasks"].items()} == {"short": 1, "medium": 1, "long": 1}
    lengths = own_metrics(rows)
    assert lengths["n"] == len(rows)
    assert metrics == {**score_predictions(rows), "likelihood": likelihood_metrics(rows), "answer_length": lengths}
