"""aime25 and math500: the boxed-answer metric, parity with kvpress's calculate_metrics, loading, and runs end to end.

Fixtures: tests/fixtures/{aime25,math500}.jsonl are rows in the column schema kvpress's evaluate.py reads (the hub
datasets' creation scripts are not published; the problems are illustrative); tests/fixtures/{aime25,math500}
_predictions.jsonl hold prediction rows with the metric's edge cases (several boxes, nested and unclosed braces,
no box, an empty prediction).
"""

import json
from pathlib import Path

import datasets
import pytest
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.benchmarks.aime25 import Aime25
from evaluate.benchmarks.boxed import BoxedAnswerBenchmark, extract_boxed, score_boxed
from evaluate.benchmarks.math500 import Math500
from evaluate.points.config import ConfigError, run_dir
from evaluate.run.entry import run
from evaluate.score.rescore import main as score_main
from tests.support import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
BENCHMARKS = {"aime25": Aime25, "math500": Math500}

# kvpress 0.5.5's evaluation/benchmarks/{aime25,math500}/calculate_metrics.py on tests/fixtures/{name}_predictions
# .jsonl, printed by tests/fixtures/reference_math_reasoning.py (see its docstring).
REFERENCE = {
    "aime25": {"correct": 4, "answered": 9, "accuracy": 0.3333333333333333, "total": 12},
    "math500": {"correct": 5, "answered": 10, "accuracy": 0.4166666666666667, "total": 12},
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# The boxed answer
# ---------------------------------------------------------------------------------------------------------------


def test_extract_boxed_takes_the_first_or_the_last_box():
    text = "First \\boxed{16}, then \\boxed{70}."
    assert extract_boxed(text) == "16"
    assert extract_boxed(text, last=True) == "70"


def test_extract_boxed_matches_nested_braces():
    assert extract_boxed("\\boxed{\\frac{1}{2}} and more}") == "\\frac{1}{2}"
    assert extract_boxed("$\\boxed{{3}}$") == "{3}"
    assert extract_boxed("\\boxed{}") == ""


def test_an_unclosed_box_gives_none_without_trying_another():
    assert extract_boxed("\\boxed{70} and finally \\boxed{7", last=True) is None
    assert extract_boxed("\\boxed{\\frac{1}{2} then \\boxed{3}") is None  # the braces never balance
    assert extract_boxed("The answer is 70.") is None
    assert extract_boxed("\\boxed {70}") is None


def test_any_boxed_marker_counts():
    assert extract_boxed("boxed{3}") == "3"
    assert extract_boxed("\\fboxed{70}") == "70"


def test_correct_and_answered_counts():
    rows = [
        {"task": "math500", "answers": ["3"], "prediction": "\\boxed{3}"},
        {"task": "math500", "answers": ["3"], "prediction": "\\boxed{ 3 }"},  # answered, not equal
        {"task": "math500", "answers": ["3"], "prediction": "\\boxed{3"},  # answered, unclosed
        {"task": "math500", "answers": ["3"], "prediction": "3"},
        {"task": "math500", "answers": ["3"], "prediction": None},  # a failed sample
    ]
    metrics = score_boxed(rows, "math500", last=False, label="label")
    assert metrics["tasks"]["math500"] == {
        "score": 20.0,
        "n": 5,
        "metric": "accuracy",
        "correct": 1,
        "answered": 3,
        "accuracy": 0.2,
        "total": 5,
    }
    assert metrics["score"] == 20.0 and metrics["score_label"] == "label"


def test_no_rows_no_score_and_foreign_rows_refused():
    assert score_boxed([], "aime25", last=True, label="label")["score"] is None
    with pytest.raises(ValueError, match="a math500 row has task 'aime25'"):
        Math500().score([{"task": "aime25", "answers": ["3"], "prediction": "\\boxed{3}"}])


def test_the_two_benchmarks_differ_only_in_the_box_and_the_data():
    assert issubclass(Aime25, BoxedAnswerBenchmark) and issubclass(Math500, BoxedAnswerBenchmark)
    assert (Aime25.last, Math500.last) == (True, False)
    assert (Aime25.source.dataset, Math500.source.dataset) == ("alessiodevoto/aime25", "alessiodevoto/math500")
    assert (Aime25.all_tasks, Math500.all_tasks) == (("aime25",), ("math500",))
    row = {"answers": ["70"], "prediction": "\\boxed{16} no, \\boxed{70}"}
    assert Aime25().score([row | {"task": "aime25"}])["score"] == 100.0
    assert Math500().score([row | {"task": "math500"}])["score"] == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Metrics against the reference implementation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_metrics_match_kvpress_calculate_metrics(name):
    metrics = BENCHMARKS[name]().score(read_jsonl(FIXTURES / f"{name}_predictions.jsonl"))
    values = metrics["tasks"][name]
    assert {key: values[key] for key in REFERENCE[name]} == REFERENCE[name]
    assert values["n"] == 12 and values["metric"] == "accuracy"
    assert metrics["score"] == values["score"] == round(100 * REFERENCE[name]["accuracy"], 2)
    which = "last" if name == "aime25" else "first"
    assert metrics["score_label"] == f"accuracy ×100: the {which} \\boxed{{}} of the prediction equals the answer"


def test_scores_from_a_file_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "predictions.jsonl"
    path.write_text((FIXTURES / "aime25_predictions.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    score_main(["--benchmark", "aime25", str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["score"] == 33.33 and printed["tasks"]["aime25"]["answered"] == 9


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_local_rows_become_samples_with_the_answer_as_a_string(name, tiny_tokenizer):
    rows = read_jsonl(FIXTURES / f"{name}.jsonl")
    samples = BENCHMARKS[name](path=str(FIXTURES / f"{name}.jsonl")).load(tiny_tokenizer)
    assert [(s.id, s.task, s.context, s.question, s.answer_prefix, s.max_new_tokens) for s in samples] == [
        (f"{name}-{i}", name, r["context"], r["question"], r["answer_prefix"], r["max_new_tokens"])
        for i, r in enumerate(rows)
    ]
    assert [sample.answers for sample in samples] == [[str(row["answer"])] for row in rows]
    assert BENCHMARKS[name](path=str(FIXTURES / f"{name}.jsonl")).load(tiny_tokenizer, limit=2) == samples[:2]


def test_aime_answers_may_be_numbers_or_strings(tiny_tokenizer):
    samples = Aime25(path=str(FIXTURES / "aime25.jsonl")).load(tiny_tokenizer)
    assert [sample.answers for sample in samples] == [["70"], ["117"], ["4"]]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_the_hub_is_read_as_kvpress_reads_it(name, monkeypatch, tiny_tokenizer):
    calls = []

    def hub(dataset, data_dir=None, split=None):
        calls.append((dataset, data_dir, split))
        return datasets.Dataset.from_list(read_jsonl(FIXTURES / f"{name}.jsonl")[:2])

    monkeypatch.setattr(datasets, "load_dataset", hub)
    local = BENCHMARKS[name](path=str(FIXTURES / f"{name}.jsonl")).load(tiny_tokenizer)
    assert BENCHMARKS[name]().load(tiny_tokenizer) == local[:2]
    assert calls == [(f"alessiodevoto/{name}", None, "test")]


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_offline_hub_stops_with_the_dataset_and_the_local_alternative(name, monkeypatch, tiny_tokenizer):
    def offline(dataset, data_dir=None, split=None):
        raise ConnectionError(f"Couldn't reach '{dataset}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match=rf"cannot load alessiodevoto/{name} from the .*benchmark\.path="):
        BENCHMARKS[name]().load(tiny_tokenizer)


def test_rows_without_a_column_are_refused(tmp_path, tiny_tokenizer):
    row = read_jsonl(FIXTURES / "math500.jsonl")[0]
    del row["answer"]
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="rows.jsonl:1: the row lacks the column.s. answer"):
        Math500(path=str(tmp_path / "rows.jsonl")).load(tiny_tokenizer)


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_config_composes_and_instantiates(name, tmp_path):
    benchmark = instantiate(compose_config(tmp_path, f"benchmark={name}").benchmark)
    assert type(benchmark) is BENCHMARKS[name]
    assert (benchmark.name, benchmark.dataset, benchmark.split, benchmark.path) == (
        name,
        f"alessiodevoto/{name}",
        "test",
        None,
    )
    assert not benchmark.fraction_by_task


# ---------------------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_a_run_on_local_rows_writes_predictions_and_metrics(name, tmp_path):
    path = FIXTURES / f"{name}.jsonl"
    # As kvpress runs these sets: a DecodingPress, here compressing to 8 pairs every 4 generated tokens.
    decoding = ("press=registry", "press.method=decoding_knorm", "compression_interval=4", "target_size=8")
    cfg = compose_config(tmp_path, f"benchmark={name}", f"benchmark.path={path}", *decoding)
    metrics = run(cfg)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    source = read_jsonl(path)
    assert [(row["id"], row["task"]) for row in rows] == [(f"{name}-{i}", name) for i in range(len(source))]
    assert [row["max_new_tokens"] for row in rows] == [row["max_new_tokens"] for row in source]
    assert not [row for row in rows if row.get("error")]
    assert all(row["kept_ratio"] < 1 for row in rows)  # the cache was compressed while decoding
    written = rundir.read_json(run_dir(cfg) / rundir.METRICS)
    assert written["benchmark"] == name and written["tasks"] == metrics["tasks"]
    assert written["tasks"][name]["n"] == written["tasks"][name]["total"] == len(source)
    assert instantiate(cfg.benchmark).coverage(rows, {"limit": 3}) == [
        "limit=3 samples per task",
        f"local data benchmark.path={path}, not the hub dataset alessiodevoto/{name}",
    ]
