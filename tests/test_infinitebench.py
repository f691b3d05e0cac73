"""InfiniteBench: the per-task metrics, parity with kvpress's calculate_metrics, loading, and a run end to end.

Fixtures: tests/fixtures/infinitebench/{task}.jsonl are rows in kvpress's hub schema (the 12 data_dirs), written by
tests/fixtures/reference_infinitebench.py with the tables of kvpress's create_huggingface_dataset.py;
tests/fixtures/infinitebench_predictions.jsonl holds prediction rows for the 11 scored tasks with the metrics' edge
cases (empty predictions, exact and partial hits, each step of the multiple-choice cascades);
tests/fixtures/infinitebench_label_cases.jsonl, labels the hub never has (several elements, code_debug's
``[function name, letter]``), each scored on its own.
"""

import json
from pathlib import Path

import datasets
import pytest
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.benchmarks.infinitebench import (
    SCORINGS,
    TASKS,
    InfiniteBench,
    choice_match,
    code_debug_match,
    first_integer_match,
    first_number_match,
    last_integer_match,
    prefix_match,
    qa_f1,
    qa_f1_chars,
    score_predictions,
    substring_match,
    word_match,
)
from evaluate.points.config import ConfigError, run_dir
from evaluate.report.cli import main as report_main
from evaluate.run.entry import run
from evaluate.score.bootstrap import Decomposition, headline_interval
from evaluate.score.rescore import main as score_main
from evaluate.score.tables import format_task_table
from tests.support import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HUB_ROWS = FIXTURES / "infinitebench"
PREDICTIONS = FIXTURES / "infinitebench_predictions.jsonl"
LABEL_CASES = FIXTURES / "infinitebench_label_cases.jsonl"

# kvpress 0.5.5's evaluation/benchmarks/infinite_bench/calculate_metrics.py on tests/fixtures/infinitebench_predictions
# .jsonl, task by task (one call per task, as kvpress scores one data_dir per run), x100 rounded to 2, printed by
#
#   PYTHONPATH=/tmp/refpkgs-numpy23 .venv/bin/python tests/fixtures/reference_infinitebench.py /tmp/kvsrc/kvpress-0.5.5
#
# (numpy 2.3.5; the script's docstring says how to get both folders). "typed labels": each label a list of
# InfiniteBench's own types, which is what the scorer's code expects: benchmark.scoring=infinitebench.
REFERENCE = {
    "passkey": 42.86,
    "kv_retrieval": 42.86,
    "number_string": 60.0,
    "longdialogue_qa_eng": 60.0,
    "longbook_qa_eng": 50.0,
    "longbook_choice_eng": 69.23,
    "code_run": 63.64,
    "code_debug": 76.92,
    "math_find": 60.0,
    "math_calc": 55.95,
    "longbook_qa_chn": 51.43,
}
REFERENCE_HEADLINE = 57.54  # "typed labels headline"
# The same run's "as loaded" values: the frame kvpress's evaluate.py builds from the hub (labels as numpy arrays of
# strings): benchmark.scoring=kvpress, the default. kvpress scores code_run 0 (a string label never equals an int) and
# raises on code_debug, math_find and math_calc (the exception's name stands for those); under numpy 2.4 (this
# environment) it also raises on passkey, number_string and code_run, which the scoring keeps at numpy 2.3's values.
REFERENCE_AS_LOADED = {
    "passkey": 42.86,
    "kv_retrieval": 42.86,
    "number_string": 60.0,
    "longdialogue_qa_eng": 60.0,
    "longbook_qa_eng": 50.0,
    "longbook_choice_eng": 69.23,
    "code_run": 0.0,
    "code_debug": "IndexError",
    "math_find": "TypeError",
    "math_calc": "AssertionError",
    "longbook_qa_chn": 51.43,
}
REFERENCE_AS_LOADED_HEADLINE = 47.05  # "as loaded headline": the mean of the 8 task scores that are numbers
# The same run's "label cases", each row of tests/fixtures/infinitebench_label_cases.jsonl on its own: (as loaded,
# typed), an exception's name where kvpress's scorer raises.
REFERENCE_LABEL_CASES = {
    "passkey-two-answers": ("TypeError", 100.0),
    "number_string-two-answers": ("TypeError", 0.0),
    "kv_retrieval-two-answers": ("ValueError", 100.0),
    "kv_retrieval-two-answers-no-words": (0.0, 0.0),
    "code_run-two-answers": ("TypeError", 100.0),
    "code_run-two-answers-no-integer": (0.0, 0.0),
    "code_debug-function-name": (100.0, 100.0),
    "code_debug-function-name-after-prefix": (100.0, 100.0),
    "code_debug-function-name-letter": (100.0, 100.0),
    "code_debug-function-name-wrong": (0.0, 0.0),
}
KVPRESS_UNSCORED = ("code_debug", "math_find", "math_calc")
E2E_TASKS = [task for task in TASKS if task != "math_calc"]  # math_calc generates up to 30,020 tokens


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------------------------------------------
# Metrics, hand-computed
# ---------------------------------------------------------------------------------------------------------------


def test_passkey_and_number_string_compare_the_first_run_of_ascii_digits():
    assert first_integer_match("The pass key is 71432.", ["71432"]) == 1.0
    assert first_integer_match("-71432 then 5", ["71432"]) == 1.0  # a sign is not a digit
    assert first_integer_match("7143 2", ["71432"]) == 0.0
    assert first_integer_match("071432", ["71432"]) == 0.0  # compared as text
    assert first_integer_match("٧١٤٣٢", ["71432"]) == 0.0  # Arabic-Indic digits are not [0-9]
    assert first_integer_match("", ["71432"]) == 0.0


def test_kv_retrieval_looks_for_the_value_among_words_split_on_its_punctuation():
    value = "00a00042-6bcb-494f-9c35-57180f1e7251"
    assert word_match(f'{{"key": "{value}"}}.', [value]) == 1.0
    assert word_match(f"value:{value}!", [value]) == 1.0
    assert word_match(f"({value})", [value]) == 0.0  # parentheses are not separators
    assert word_match(f"{value}abc", [value]) == 0.0
    assert word_match("", [value]) == 0.0


def test_code_run_parses_the_last_word_as_an_integer():
    assert last_integer_match("The return value is: -12.", ["-12"]) == 1.0
    assert last_integer_match("`-12`", ["-12"]) == 1.0
    assert last_integer_match("07", ["7"]) == 1.0  # int("07") == 7
    assert last_integer_match("-12.0", ["-12"]) == 0.0  # "." splits it: the last word is "0"
    assert last_integer_match("-12 is the value", ["-12"]) == 0.0
    assert last_integer_match("   ", ["-12"]) == 0.0


def test_code_debug_takes_the_first_letter_with_no_other_after_it_on_its_line():
    assert code_debug_match("A or B", ["B"]) == 1.0
    assert code_debug_match("B\nA", ["B"]) == 1.0  # B has no other letter after it on its own line
    assert code_debug_match("A\nB", ["B"]) == 0.0  # the search stops at A; "A B" does not start with B
    assert code_debug_match("Option B", ["B"]) == 1.0
    assert code_debug_match("B or maybe C", ["B"]) == 1.0  # the regex finds C, but the prediction starts with B


def test_code_debug_takes_the_function_name_too_when_the_label_holds_one():
    # InfiniteBench's own label, [function name, letter]; the hub's rows hold the letter alone.
    assert code_debug_match("func_b is wrong", ["func_b", "B"]) == 1.0
    assert code_debug_match("It is: func_b", ["func_b", "B"]) == 1.0
    assert code_debug_match("B", ["func_b", "B"]) == 1.0
    assert code_debug_match("func_b is wrong", ["B"]) == 0.0


def test_code_debug_reads_the_text_after_the_first_answer_prefix_found():
    # No standalone A-J anywhere: the prefix decides on what follows it, one character later.
    assert code_debug_match("The answer is: Bfoo", ["B"]) == 1.0
    assert code_debug_match("E is wrong, answer is: Bxx", ["B"]) == 1.0
    assert code_debug_match("the correct option is: Cfoo", ["C"]) == 1.0
    assert code_debug_match("the correct option is: Cfoo", ["B"]) == 0.0
    assert code_debug_match("the answer is:", ["B"]) == 0.0


def test_longbook_choice_cascade():
    assert choice_match("The answer is A.", ["A"]) == 1.0
    assert choice_match("Option A or B", ["A"]) == 1.0  # regex finds B (wrong), then the first word in "ABCD" is A
    assert choice_match("AB", ["A"]) == 1.0  # not a standalone letter; its first character decides
    assert choice_match("Dolphins are mammals", ["D"]) == 1.0  # so does a word's first capital
    assert choice_match("I'd say: BC D", ["A"]) == 0.0  # "BC" is a substring of "ABCD": it stops the search
    assert choice_match("the answer is: a", ["A"]) == 0.0  # the prefix decides, on a lower-case letter
    assert choice_match("", ["A"]) == 0.0


def test_math_find_compares_the_first_number_with_the_answer_type():
    assert first_number_match("The largest number is 94.", ["94"]) == 1.0
    assert first_number_match("-94", ["94"]) == 1.0  # no sign in the pattern
    assert first_number_match("94.0", ["94"]) == 0.0  # a decimal is not the integer answer
    assert first_number_match("3.50", ["3.5"]) == 1.0
    assert first_number_match("3", ["3.5"]) == 0.0
    assert first_number_match("none", ["94"]) == 0.0


def test_a_decimal_for_an_integer_answer_scores_0_and_is_named_as_a_deviation_from_infinitebench():
    rows = [
        {"task": "math_find", "answers": ["94"], "prediction": "94.0"},  # InfiniteBench's int("94.0") raises here
        {"task": "math_find", "answers": ["94"], "prediction": "The answer is 94."},
        {"task": "math_find", "answers": ["3.5"], "prediction": "3.50"},  # a decimal answer: compared as floats
    ]
    math_find = score_predictions(rows, scoring="infinitebench")["tasks"]["math_find"]
    assert math_find == {
        "score": 66.67,
        "n": 3,
        "metric": "first_number_match",
        "note": "1 of 3 predictions give a decimal for an integer answer (e.g. 94.0 for 94): InfiniteBench's "
        "compute_scores raises ValueError on them, here they score 0",
    }
    assert "note" not in score_predictions(rows[1:], scoring="infinitebench")["tasks"]["math_find"]


def test_math_calc_counts_the_values_right_before_the_first_miss():
    assert prefix_match("1, 4, 8, 6", ["1", "4", "8", "6"]) == 1.0
    assert prefix_match("[1, 4, 9, 6]", ["1", "4", "8", "6"]) == 0.5
    assert prefix_match("1 4 8 6 7 9", ["1", "4", "8", "6"]) == 1.0  # extra values are ignored
    assert prefix_match("3, -2, 5", ["3", "-2", "5"]) == pytest.approx(1 / 3)  # signs are dropped from predictions
    assert prefix_match("", ["1", "4"]) == 0.0


def test_dialogue_and_qa_metrics():
    assert substring_match("grace", ["ACE", "ACE ROTHSTEIN"]) == 1.0  # a substring, not a word
    assert substring_match("Rothstein", ["ACE", "ACE ROTHSTEIN"]) == 0.0
    # SQuAD normalisation drops the quotes and the article: best of the answers.
    assert qa_f1("A red house.", ["the red house", "red cottage"]) == 1.0
    assert qa_f1("It is Peyton", ['"Peyton"']) == pytest.approx(0.5)
    # Characters: 在北京 against 北京大学 share 2 (precision 2/3, recall 1/2).
    assert qa_f1_chars("在北京", ["北京大学"]) == pytest.approx(4 / 7)
    assert qa_f1_chars("北 京 大 学。", ["北京大学"]) == 1.0


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("prediction", ["", None])
def test_empty_predictions_score_zero_on_every_task_that_scores(prediction, scoring):
    answers = {"math_calc": ["1", "4"], "math_find": ["94"], "code_run": ["-12"]}
    rows = [{"task": task, "answers": answers.get(task, ["A"]), "prediction": prediction} for task in TASKS]
    metrics = score_predictions(rows, scoring=scoring)
    assert metrics["score"] == 0.0 and metrics["scoring"] == scoring
    unscored = KVPRESS_UNSCORED if scoring == "kvpress" else ()
    assert {task: values["score"] for task, values in metrics["tasks"].items()} == {
        task: None if task in unscored else 0.0 for task in TASKS
    }
    assert all(values["n"] == 1 for values in metrics["tasks"].values())


# ---------------------------------------------------------------------------------------------------------------
# Metrics against the reference implementation
# ---------------------------------------------------------------------------------------------------------------


def outcomes(metrics: dict) -> dict:
    """Task -> its score, or the name of the exception kvpress's scorer raises on it (from the task's note)."""
    return {
        task: values["score"] if values["score"] is not None else values["note"].split("(")[1].split(")")[0]
        for task, values in metrics["tasks"].items()
    }


def test_kvpress_scoring_matches_calculate_metrics_on_the_labels_as_loaded():
    metrics = score_predictions(read_jsonl(PREDICTIONS))  # scoring="kvpress", the default
    assert metrics["scoring"] == "kvpress"
    assert outcomes(metrics) == REFERENCE_AS_LOADED
    assert list(metrics["tasks"]) == list(TASKS)
    assert metrics["tasks"]["code_debug"] == {
        "score": None,
        "n": 13,
        "metric": "code_debug_match",
        "note": (
            "kvpress 0.5.5's scorer fails on these labels (IndexError); benchmark.scoring=infinitebench scores them"
        ),
    }
    assert metrics["score"] == REFERENCE_AS_LOADED_HEADLINE
    assert metrics["score_label"] == (
        "mean task score ×100 over the InfiniteBench tasks present (8 of 11; code_debug, math_find, math_calc "
        "unscored by kvpress 0.5.5)"
    )


def test_infinitebench_scoring_matches_calculate_metrics_on_typed_labels():
    metrics = score_predictions(read_jsonl(PREDICTIONS), scoring="infinitebench")
    assert metrics["scoring"] == "infinitebench"
    assert outcomes(metrics) == REFERENCE
    assert list(metrics["tasks"]) == list(TASKS)
    assert metrics["tasks"]["code_debug"] == {"score": 76.92, "n": 13, "metric": "code_debug_match"}
    assert metrics["score"] == round(sum(REFERENCE.values()) / 11, 2) == REFERENCE_HEADLINE
    assert metrics["score_label"] == "mean task score ×100 over the InfiniteBench tasks present (11 of 11)"


def test_what_infinitebench_scoring_changes_against_kvpress_on_the_same_predictions():
    rows = read_jsonl(PREDICTIONS)
    kvpress, typed = score_predictions(rows), score_predictions(rows, scoring="infinitebench")
    changed = {
        task: (kvpress["tasks"][task]["score"], typed["tasks"][task]["score"])
        for task in TASKS
        if kvpress["tasks"][task] != typed["tasks"][task]
    }
    # code_run: kvpress compares the string label with the int the prediction ends in; InfiniteBench compares ints.
    # code_debug, math_find, math_calc: kvpress's scorer raises, so there is no score and no place in the headline.
    assert changed == {
        "code_run": (0.0, 63.64),
        "code_debug": (None, 76.92),
        "math_find": (None, 60.0),
        "math_calc": (None, 55.95),
    }
    kept = [typed["tasks"][task]["score"] for task in TASKS if task not in KVPRESS_UNSCORED and task != "code_run"]
    assert kvpress["score"] == round((sum(kept) + 0.0) / 8, 2) == 47.05
    assert typed["score"] == round((sum(kept) + 63.64 + 76.92 + 60.0 + 55.95) / 11, 2) == 57.54
    assert kvpress["score_label"].endswith("(8 of 11; code_debug, math_find, math_calc unscored by kvpress 0.5.5)")
    assert typed["score_label"].endswith("(11 of 11)")


@pytest.mark.parametrize("case", read_jsonl(LABEL_CASES), ids=lambda case: case["id"])
def test_labels_the_hub_never_has_score_as_calculate_metrics_scores_them(case):
    as_loaded, typed = REFERENCE_LABEL_CASES[case["id"]]
    assert outcomes(score_predictions([case])) == {case["task"]: as_loaded}
    assert outcomes(score_predictions([case], scoring="infinitebench")) == {case["task"]: typed}


def test_a_task_table_shows_a_task_without_a_score_as_a_dash():
    table = format_task_table(score_predictions(read_jsonl(PREDICTIONS)))
    assert [line.split() for line in table.splitlines() if line.startswith(KVPRESS_UNSCORED)] == [
        ["code_debug", "-", "13"],
        ["math_find", "-", "10"],
        ["math_calc", "-", "7"],
    ]
    assert table.splitlines()[-1].split()[-1] == "47.05"


@pytest.mark.parametrize("scoring", SCORINGS)
def test_the_bootstrap_resamples_exactly_the_tasks_in_the_headline(scoring):
    benchmark = InfiniteBench(scoring=scoring)
    decomposition = Decomposition(benchmark, read_jsonl(PREDICTIONS))
    unscored = KVPRESS_UNSCORED if scoring == "kvpress" else ()
    assert decomposition.decomposed and sorted(decomposition.tasks) == sorted(set(TASKS) - set(unscored))
    interval = headline_interval(benchmark, read_jsonl(PREDICTIONS), resamples=50)
    assert interval.decomposed and interval.low <= decomposition.headline <= interval.high


def test_scores_from_a_file_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "predictions.jsonl"
    path.write_text(PREDICTIONS.read_text(encoding="utf-8"), encoding="utf-8")
    score_main(["--benchmark", "infinitebench", str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["scoring"] == "kvpress" and printed["score"] == REFERENCE_AS_LOADED_HEADLINE
    assert printed["tasks"]["math_calc"]["score"] is None and printed["tasks"]["code_run"]["score"] == 0.0


def test_an_unknown_scoring_is_refused():
    with pytest.raises(ConfigError, match=r"benchmark.scoring='numpy'; choose one of kvpress, infinitebench"):
        InfiniteBench(scoring="numpy").score(read_jsonl(PREDICTIONS))
    with pytest.raises(ConfigError, match=r"benchmark.scoring='numpy'"):
        InfiniteBench(path=str(HUB_ROWS), scoring="numpy").load(None)
    with pytest.raises(ValueError, match="unknown InfiniteBench scoring 'numpy'"):
        score_predictions([], scoring="numpy")


def test_an_unknown_task_is_refused_when_scoring():
    with pytest.raises(ValueError, match="unknown InfiniteBench task 'longbook_sum_eng'"):
        score_predictions([{"task": "longbook_sum_eng", "answers": ["x"], "prediction": "x"}])


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def test_local_rows_become_samples_unchanged(tiny_tokenizer):
    samples = InfiniteBench(path=str(HUB_ROWS)).load(tiny_tokenizer)
    rows = [row for task in TASKS for row in read_jsonl(HUB_ROWS / f"{task}.jsonl")]
    assert [
        (s.task, s.context, s.question, s.answer_prefix, s.answers, s.max_new_tokens, s.chat_template) for s in samples
    ] == [
        (r["task"], r["context"], r["question"], r["answer_prefix"], r["answer"], r["max_new_tokens"], True)
        for r in rows
    ]
    assert [sample.id for sample in samples[:3]] == ["passkey-0", "passkey-1", "kv_retrieval-0"]
    choice = next(sample for sample in samples if sample.task == "longbook_choice_eng")
    assert choice.answers == ["A"] and choice.question.endswith("\nD. Light housework")


def test_the_hub_is_read_one_data_dir_per_task(monkeypatch, tiny_tokenizer):
    calls = []

    def hub(name, data_dir=None, split=None):
        calls.append((name, data_dir, split))
        return datasets.Dataset.from_list(read_jsonl(HUB_ROWS / f"{data_dir}.jsonl"))

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert InfiniteBench().load(tiny_tokenizer) == InfiniteBench(path=str(HUB_ROWS)).load(tiny_tokenizer)
    assert calls == [("MaxJeblick/InfiniteBench", task, "test") for task in TASKS]


def test_offline_hub_stops_with_the_dataset_and_the_local_alternative(monkeypatch, tiny_tokenizer):
    def offline(name, data_dir=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match=r"MaxJeblick/InfiniteBench \(data_dir passkey\).*benchmark\.path=DIR"):
        InfiniteBench().load(tiny_tokenizer)


def test_task_selection_limit_and_errors(tmp_path, tiny_tokenizer):
    samples = InfiniteBench(path=str(HUB_ROWS), tasks=["code_run", "passkey"]).load(tiny_tokenizer, limit=1)
    assert [sample.id for sample in samples] == ["code_run-0", "passkey-0"]
    with pytest.raises(ConfigError, match="kvpress does not score longbook_sum_eng.*benchmark.tasks"):
        InfiniteBench(path=str(HUB_ROWS), tasks=["longbook_sum_eng"]).load(tiny_tokenizer)
    with pytest.raises(ConfigError, match="unknown InfiniteBench task.*passkeys"):
        InfiniteBench(path=str(HUB_ROWS), tasks=["passkeys"]).load(tiny_tokenizer)
    row = read_jsonl(HUB_ROWS / "passkey.jsonl")[0]
    (tmp_path / "passkey.jsonl").write_text(json.dumps(row | {"answer": "71432"}) + "\n", encoding="utf-8")
    with pytest.raises(
        ConfigError, match=r"passkey.jsonl:1: field 'answer' is \"71432\", not a non-empty list of strings"
    ):
        InfiniteBench(path=str(tmp_path), tasks=["passkey"]).load(tiny_tokenizer)
    del row["max_new_tokens"]
    (tmp_path / "passkey.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="passkey.jsonl:1: the row lacks the column.s. max_new_tokens"):
        InfiniteBench(path=str(tmp_path), tasks=["passkey"]).load(tiny_tokenizer)


def test_config_composes_and_instantiates(tmp_path):
    benchmark = instantiate(compose_config(tmp_path, "benchmark=infinitebench").benchmark)
    assert isinstance(benchmark, InfiniteBench)
    assert (benchmark.name, benchmark.scoring, benchmark.dataset, benchmark.split, benchmark.tasks, benchmark.path) == (
        "infinitebench",
        "kvpress",
        "MaxJeblick/InfiniteBench",
        "test",
        None,
        None,
    )
    assert benchmark.fraction_by_task
    typed = instantiate(
        compose_config(tmp_path, "benchmark=infinitebench", "benchmark.scoring=infinitebench").benchmark
    )
    assert typed.score(read_jsonl(PREDICTIONS))["score"] == REFERENCE_HEADLINE


# ---------------------------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------------------------


def test_a_run_on_local_rows_writes_predictions_and_metrics(tmp_path):
    cfg = compose_config(
        tmp_path, "benchmark=infinitebench", f"benchmark.path={HUB_ROWS}", f"benchmark.tasks=[{','.join(E2E_TASKS)}]"
    )
    metrics = run(cfg)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    expected_n = {task: len(read_jsonl(HUB_ROWS / f"{task}.jsonl")) for task in E2E_TASKS}
    assert {task: sum(row["task"] == task for row in rows) for task in E2E_TASKS} == expected_n
    assert not [row for row in rows if row.get("error")]
    by_id = {row["id"]: row for row in rows}
    assert by_id["code_run-0"]["answers"] == ["-12"] and by_id["code_run-0"]["max_new_tokens"] == 25
    assert by_id["math_find-0"]["max_new_tokens"] == 23
    assert by_id["longbook_choice_eng-0"]["answer_prefix"] == "The letter of the correct answer is"
    written = rundir.read_json(run_dir(cfg) / rundir.METRICS)
    assert written["benchmark"] == "infinitebench" and written["tasks"] == metrics["tasks"]
    assert {task: values["n"] for task, values in written["tasks"].items()} == expected_n
    assert written["scoring"] == "kvpress" and written["tasks"]["code_debug"]["score"] is None
    assert written["score_label"].endswith("(8 of 11; code_debug, math_find unscored by kvpress 0.5.5)")
    tables = tmp_path / "tables"
    report_main([str(tmp_path), "--out", str(tables), "--no-plots", "--bootstrap", "20"])
    task_lines = (tables / "infinitebench_tasks.md").read_text(encoding="utf-8").splitlines()
    assert "| code_debug | - n=1* |" in task_lines and "| math_find | - n=1* |" in task_lines
    assert "| code_run | 0.00 n=1* |" in task_lines
    benchmark = instantiate(cfg.benchmark)
    assert benchmark.coverage(rows, {"limit": 3}) == [
        "10 of 11 tasks (missing math_calc)",
        f"local data benchmark.path={HUB_ROWS}, not the hub dataset MaxJeblick/InfiniteBench",
    ]
