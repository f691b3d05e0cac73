"""LongBench: prompts under both protocols, every loader path, metrics against hand-computed and reference values.

Fixtures: tests/fixtures/longbench/original/ holds LongBench's original jsonl rows (7 tasks);
tests/fixtures/longbench/kvpress/ holds the same rows in kvpress's hub schema, written by
tests/fixtures/reference_values.py with the tables of kvpress's own create_huggingface_dataset.py, so that loading
the originals can be compared with kvpress's split; tests/fixtures/longbench_predictions.jsonl holds prediction rows
for all 16 tasks with the edge cases of each metric.
"""

import json
from difflib import SequenceMatcher
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
import pytest
from hydra.utils import instantiate

from evaluate.benchmarks import longbench
from evaluate.benchmarks.longbench import (
    TASKS,
    LongBench,
    classification_score,
    code_sim_score,
    count_score,
    fuzz_ratio,
    normalize_answer,
    qa_f1_score,
    retrieval_score,
    rouge_score,
    sample_score,
    score_predictions,
)
from evaluate.points.config import ConfigError
from evaluate.score.rescore import main as score_main
from tests.support import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ORIGINAL = FIXTURES / "longbench" / "original"
KVPRESS = FIXTURES / "longbench" / "kvpress"
PREDICTIONS = FIXTURES / "longbench_predictions.jsonl"
FIXTURE_TASKS = ["narrativeqa", "gov_report", "trec", "triviaqa", "passage_retrieval_en", "lcc", "repobench-p"]
TREC_CLASSES = ["Distance", "Date", "Other", "location", "Other location", "City", "Individual"]

# kvpress 0.5.5's calculate_metrics (protocol kvpress) and its scorer_e with every row in the 0-4k bucket, which is
# LongBench eval.py's scorer (protocol official), on tests/fixtures/longbench_predictions.jsonl, with rouge 1.0.1
# and fuzzywuzzy 0.18.0 without python-Levenshtein; printed by tests/fixtures/reference_values.py (see its
# docstring for the exact commands).
REFERENCE_KVPRESS = {
    "narrativeqa": 37.78, "qasper": 80.0, "multifieldqa_en": 33.33, "hotpotqa": 33.33, "2wikimqa": 50.0,
    "musique": 44.44, "gov_report": 32.35, "qmsum": 43.48, "multi_news": 29.41, "trec": 80.0, "triviaqa": 83.33,
    "samsum": 33.33, "passage_count": 50.0, "passage_retrieval_en": 75.0, "lcc": 71.5, "repobench-p": 83.0,
}  # fmt: skip
REFERENCE_OFFICIAL = {
    **REFERENCE_KVPRESS,
    "trec": 60.0,  # " \nDate": its first line is blank without kvpress's full left strip
    "triviaqa": 50.0,  # " \nParis": idem
    "lcc": 75.0,  # "    return a * b": kvpress's left strip removes the indentation the gold line has
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def official_prompt(task: str, row: dict) -> str:
    """LongBench pred.py's prompt, straight from the reference template."""
    return longbench.prompt_template(task).format(**row)


def pipeline_text(sample) -> str:
    """The text kvpress's pipeline feeds after BOS when no chat template is used."""
    return sample.context + sample.question + "\n" + sample.answer_prefix


# ---------------------------------------------------------------------------------------------------------------
# Metrics, hand-computed
# ---------------------------------------------------------------------------------------------------------------


def test_qa_f1_uses_squad_normalisation():
    assert normalize_answer("The Cat, a dog!  An owl.") == "cat dog owl"
    # "tom fisherman" vs "fisherman named tom": 2 shared tokens, precision 1, recall 2/3, F1 0.8.
    assert qa_f1_score(" Tom, a fisherman.", "A fisherman named Tom") == pytest.approx(0.8)
    assert qa_f1_score("", "Tom") == 0.0
    assert qa_f1_score("the", "a") == 0.0  # both normalise to nothing


def test_rouge_is_the_rouge_package_rouge_l_f_with_distinct_words_and_sentence_union():
    # One sentence each: LCS 3, recall 3 / 5 distinct reference words, precision 3 / 3, F = 2rp / (r + p + 1e-8).
    assert rouge_score("the cat sat", "the cat sat on the mat") == pytest.approx(2 * 0.6 / 1.6, abs=1e-7)
    # Two hypothesis sentences: the union LCS {cat, sat, on, the, mat} covers the 5 distinct reference words;
    # precision 5 / 8 distinct hypothesis words ("The" and "the" differ).
    assert rouge_score("The cat sat. It was on the mat.", "the cat sat on the mat") == pytest.approx(
        2 * 0.625 / 1.625, abs=1e-7
    )
    assert rouge_score("", "the cat") == 0.0  # the package raises "Hypothesis is empty"
    assert rouge_score("...", "the cat") == 0.0


def test_classification_keeps_longbench_removal_while_iterating():
    assert classification_score("City or Individual", "City", all_classes=TREC_CLASSES) == 0.5
    assert classification_score("Distance", "Date", all_classes=TREC_CLASSES) == 0.0
    # Found: Other, location, Other location. "Other" is dropped (strict substring of the gold label), which shifts
    # "location" under the iterator, so it is never checked and stays: 2 labels found, score 1/2.
    assert classification_score("Other location", "Other location", all_classes=TREC_CLASSES) == 0.5
    with pytest.raises(ValueError, match="all_classes"):
        classification_score("Date", "Date", all_classes=None)


def test_retrieval_and_count_score_the_share_of_matching_integers():
    assert retrieval_score("Paragraph 12, not Paragraph 2", "Paragraph 2") == 0.5
    assert retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    assert retrieval_score("I cannot tell", "Paragraph 2") == 0.0
    assert count_score("There are 3 unique paragraphs out of 5", "3") == 0.5
    assert count_score("none", "3") == 0.0


def test_fuzz_ratio_is_difflib_ratio_times_100_rounded_half_to_even():
    # "abcde" is the only common block: 2 * 5 / 16 = 62.5, which rounds to the even 62.
    assert SequenceMatcher(None, "abcdeXYZ", "abcdefgh").ratio() == 0.625
    assert fuzz_ratio("abcdeXYZ", "abcdefgh") == 62
    # "call(" and ")": 2 * 6 / 16 = 75.
    assert fuzz_ratio("call(bc)", "call(a);") == 75
    # 2 * 7 / 16 = 87.5 rounds to the even 88.
    assert fuzz_ratio("return y", "return x") == 88
    assert fuzz_ratio("", "") == 100  # equality is checked before emptiness, as in fuzzywuzzy
    assert fuzz_ratio("", "x = 1") == 0


def test_code_sim_skips_comment_and_fence_lines():
    gold = "        self.assertEqual(result, 4)"
    assert code_sim_score("\n# check the result\n" + gold + "\nmore", gold) == 1.0
    assert code_sim_score("```python\nx = compute(a, b)\n```", "x = compute(a, b)") == 1.0
    assert code_sim_score("y = 1  // note\n// only comments", "int y = 0;") == 0.0  # no line left: ""
    assert code_sim_score("print(cwd())", "    print(cwd())") == 0.86  # 2 * 12 / 28 = 85.7 -> 86


def test_protocols_differ_in_how_predictions_are_stripped():
    # kvpress strips all leading whitespace before the first-line cut; LongBench only leading newlines.
    assert sample_score("trec", " \nDate", ["Date"], TREC_CLASSES, "kvpress") == 1.0
    assert sample_score("trec", " \nDate", ["Date"], TREC_CLASSES, "official") == 0.0
    assert sample_score("triviaqa", "\n\nParis\nPassage: more", ["Paris"], None, "official") == 1.0
    # kvpress left-strips every prediction, so a correctly indented line loses its indentation.
    assert sample_score("lcc", "    return a * b\n", ["    return a * b"], None, "kvpress") == 0.86
    assert sample_score("lcc", "    return a * b\n", ["    return a * b"], None, "official") == 1.0
    # Only the first line counts for samsum; later lines would add matches.
    first_line = sample_score("samsum", "Anna brings cake.\nAnna will bring the cake", ["Anna will bring the cake"])
    assert first_line == rouge_score("Anna brings cake.", "Anna will bring the cake")


def test_each_sample_takes_the_max_over_its_answers():
    assert sample_score("narrativeqa", "Tom", ["A fisherman named Tom", "Tom"]) == 1.0
    assert sample_score("narrativeqa", "Tom", ["A fisherman named Tom"]) == pytest.approx(0.5)
    assert sample_score("narrativeqa", "Tom", []) == 0.0


@pytest.mark.parametrize("prediction", ["", "   ", "\n \n", None])
@pytest.mark.parametrize("protocol", ["kvpress", "official"])
def test_empty_predictions_score_zero_on_every_task(prediction, protocol):
    rows = [
        {"task": task, "answers": ["Date" if task == "trec" else "Paragraph 1"], "prediction": prediction}
        | ({"all_classes": TREC_CLASSES} if task == "trec" else {})
        for task in TASKS
    ]
    metrics = score_predictions(rows, protocol=protocol)
    assert all(values["score"] == 0.0 for values in metrics["tasks"].values())
    assert metrics["score"] == 0.0 and metrics["category_average"] == 0.0


# ---------------------------------------------------------------------------------------------------------------
# Metrics against the reference implementation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("protocol", "reference"), [("kvpress", REFERENCE_KVPRESS), ("official", REFERENCE_OFFICIAL)])
def test_task_scores_match_the_reference_scorers(protocol, reference):
    metrics = score_predictions(read_jsonl(PREDICTIONS), protocol=protocol)
    assert {task: values["score"] for task, values in metrics["tasks"].items()} == reference
    assert list(metrics["tasks"]) == list(TASKS)
    assert metrics["score"] == round(sum(reference.values()) / 16, 2)
    categories = {
        category: round(sum(reference[task] for task in tasks) / len(tasks), 2)
        for category, tasks in longbench.CATEGORIES.items()
    }
    assert metrics["categories"] == categories
    assert metrics["category_average"] == round(sum(categories.values()) / 6, 2)
    assert metrics["score_label"] == "mean over the 16 task scores"
    assert metrics["category_average_label"] == "macro average over 6 LongBench categories"


def test_scores_from_a_file_on_the_command_line(tmp_path, capsys):
    rows = read_jsonl(PREDICTIONS)
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    score_main(["--benchmark", "longbench", str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["score"] == round(sum(REFERENCE_KVPRESS.values()) / 16, 2)
    assert printed["tasks"]["lcc"]["score"] == 71.5 and printed["tasks"]["lcc"]["metric"] == "code_sim"


def test_an_unknown_task_is_refused_when_scoring():
    with pytest.raises(ValueError, match="unknown LongBench task 'lsht'"):
        score_predictions([{"task": "lsht", "answers": ["x"], "prediction": "x"}])


# ---------------------------------------------------------------------------------------------------------------
# Loading: protocol kvpress
# ---------------------------------------------------------------------------------------------------------------


def test_original_rows_are_split_exactly_as_kvpress_splits_them(tiny_tokenizer):
    from_original = LongBench(path=str(ORIGINAL), tasks=FIXTURE_TASKS).load(tiny_tokenizer)
    from_kvpress = LongBench(path=str(KVPRESS), tasks=FIXTURE_TASKS).load(tiny_tokenizer)
    assert from_original == from_kvpress
    assert len(from_original) == 9
    hub_rows = [row for task in FIXTURE_TASKS for row in read_jsonl(KVPRESS / f"{task}.jsonl")]
    for sample, row in zip(from_original, hub_rows, strict=True):
        assert (sample.context, sample.question, sample.answer_prefix) == (
            row["context"],
            row["question"],
            row["answer_prefix"],
        )
        assert sample.max_new_tokens == row["max_new_tokens"]  # dataset2maxlen + 20
        assert sample.chat_template is True
        assert sample.extra == {"all_classes": row["all_classes"]}


def test_kvpress_prompt_joins_back_to_longbench_prompt_except_lcc(tiny_tokenizer):
    samples = LongBench(path=str(ORIGINAL), tasks=FIXTURE_TASKS).load(tiny_tokenizer)
    rows = {
        (task, index): row for task in FIXTURE_TASKS for index, row in enumerate(read_jsonl(ORIGINAL / f"{task}.jsonl"))
    }
    for sample in samples:
        task, index = sample.id.rsplit("-", 1)
        row = rows[task, int(index)]
        joined = sample.context + sample.question + sample.answer_prefix
        # kvpress appends lcc's input, for which LongBench's lcc template has no slot (empty in this fixture).
        assert joined == official_prompt(task, row), sample.id


def test_every_local_format_and_the_hub_give_the_same_samples(monkeypatch, tmp_path, tiny_tokenizer):
    expected = LongBench(path=str(KVPRESS), tasks=["trec", "lcc"]).load(tiny_tokenizer)
    rows = {task: read_jsonl(KVPRESS / f"{task}.jsonl") for task in ("trec", "lcc")}
    for task, task_rows in rows.items():
        table = pyarrow.Table.from_pylist(task_rows)
        (tmp_path / "snapshot" / task).mkdir(parents=True)
        pyarrow.parquet.write_table(table, tmp_path / "snapshot" / task / "test-00000-of-00001.parquet")
        pyarrow.parquet.write_table(table, tmp_path / f"{task}.parquet")
    datasets.Dataset.from_list(rows["trec"] + rows["lcc"]).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "all.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows["lcc"] + rows["trec"]), encoding="utf-8"
    )
    for path in (tmp_path / "snapshot", tmp_path, tmp_path / "saved", tmp_path / "all.jsonl"):
        assert LongBench(path=str(path), tasks=["trec", "lcc"]).load(tiny_tokenizer) == expected, path

    calls = []

    def hub(name, data_dir=None, split=None):
        calls.append((name, data_dir, split))
        return datasets.Dataset.from_list(rows[data_dir])

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert LongBench(tasks=["trec", "lcc"]).load(tiny_tokenizer) == expected
    assert calls == [("Xnhyacinth/LongBench", "trec", "test"), ("Xnhyacinth/LongBench", "lcc", "test")]


def test_offline_hub_stops_with_the_dataset_and_the_local_alternative(monkeypatch, tiny_tokenizer):
    def offline(name, data_dir=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError) as error:
        LongBench().load(tiny_tokenizer)
    assert "Xnhyacinth/LongBench (data_dir narrativeqa)" in str(error.value)
    assert "benchmark.path=DIR" in str(error.value) and "{task}.jsonl" in str(error.value)


def test_limit_and_task_selection(tiny_tokenizer):
    samples = LongBench(path=str(ORIGINAL), tasks=["trec", "narrativeqa"], protocol="official").load(tiny_tokenizer, 1)
    assert [sample.id for sample in samples] == ["trec-0", "narrativeqa-0"]


def test_configuration_errors(tiny_tokenizer):
    with pytest.raises(ConfigError, match="unknown LongBench task.*lsht"):
        LongBench(path=str(ORIGINAL), tasks=["lsht"]).load(tiny_tokenizer)
    with pytest.raises(ConfigError, match="protocol='pred'"):
        LongBench(path=str(ORIGINAL), protocol="pred").load(tiny_tokenizer)
    with pytest.raises(ConfigError, match="no data for qasper"):
        LongBench(path=str(ORIGINAL), tasks=["trec", "qasper"]).load(tiny_tokenizer)
    with pytest.raises(ConfigError, match="max_length=1"):
        LongBench(path=str(ORIGINAL), protocol="official", max_length=1).load(tiny_tokenizer)


def test_rows_missing_columns_are_refused(tmp_path, tiny_tokenizer):
    rows = read_jsonl(KVPRESS / "trec.jsonl")
    del rows[0]["answers"]
    (tmp_path / "trec.jsonl").write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="trec.jsonl:1: the row lacks the column.s. answers"):
        LongBench(path=str(tmp_path), tasks=["trec"]).load(tiny_tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# Loading: protocol official
# ---------------------------------------------------------------------------------------------------------------


def test_official_prompts_are_pred_py_prompts(tiny_tokenizer):
    samples = LongBench(path=str(ORIGINAL), tasks=FIXTURE_TASKS, protocol="official").load(tiny_tokenizer)
    rows = {
        (task, index): row for task in FIXTURE_TASKS for index, row in enumerate(read_jsonl(ORIGINAL / f"{task}.jsonl"))
    }
    maxlen = json.loads((Path(longbench.__file__).parent / "longbench_data" / "dataset2maxlen.json").read_text())
    for sample in samples:
        task, index = sample.id.rsplit("-", 1)
        prompt = official_prompt(task, rows[task, int(index)])
        assert sample.max_new_tokens == maxlen[task]
        if task in ("trec", "triviaqa", "lcc", "repobench-p"):
            # Raw prompt: the pipeline joins question and answer prefix with "\n", giving back pred.py's prompt.
            assert sample.chat_template is False
            assert pipeline_text(sample) == prompt, sample.id
        else:
            # The whole prompt is the user turn, as pred.py's build_chat wraps it.
            assert sample.chat_template is True and sample.answer_prefix == ""
            assert sample.context + sample.question == prompt, sample.id
    trec = next(sample for sample in samples if sample.task == "trec")
    assert (trec.question, trec.answer_prefix) == ("Question: How far is the Moon from the Earth?", "Type:")
    lcc = next(sample for sample in samples if sample.task == "lcc")
    assert (lcc.question, lcc.answer_prefix) == ("Next line of code:", "")


def test_official_prompts_are_the_same_from_hub_rows(tiny_tokenizer):
    from_original = LongBench(path=str(ORIGINAL), tasks=FIXTURE_TASKS, protocol="official").load(tiny_tokenizer)
    from_kvpress = LongBench(path=str(KVPRESS), tasks=FIXTURE_TASKS, protocol="official").load(tiny_tokenizer)
    assert from_original == from_kvpress


def test_official_truncation_keeps_the_first_and_last_halves_as_pred_py(tiny_tokenizer):
    """The byte-level tokenizer has one token per byte and no BOS, so pred.py's decode of the two halves is exact."""
    row = read_jsonl(ORIGINAL / "trec.jsonl")[0]
    prompt = official_prompt("trec", row)
    ids = tiny_tokenizer(prompt)["input_ids"]
    max_length = 121
    half = max_length // 2
    assert len(ids) > max_length
    pred_py = tiny_tokenizer.decode(ids[:half]) + tiny_tokenizer.decode(ids[-half:])
    (sample,) = LongBench(path=str(ORIGINAL), tasks=["trec"], protocol="official", max_length=max_length).load(
        tiny_tokenizer, 1
    )
    assert pipeline_text(sample) == pred_py
    assert len(tiny_tokenizer(pipeline_text(sample))["input_ids"]) == 2 * half
    # The question fits in the kept tail, so it survives whole and only the document lost its middle.
    assert (sample.question, sample.answer_prefix) == ("Question: How far is the Moon from the Earth?", "Type:")
    assert sample.context == prompt[:half] + prompt[len(prompt) - half : prompt.index("Question: How far")]


def test_official_truncation_can_reach_into_the_question(tiny_tokenizer):
    row = read_jsonl(ORIGINAL / "narrativeqa.jsonl")[0]
    prompt = official_prompt("narrativeqa", row)
    (sample,) = LongBench(path=str(ORIGINAL), tasks=["narrativeqa"], protocol="official", max_length=40).load(
        tiny_tokenizer, 1
    )
    assert sample.context == prompt[:20]
    # The kept tail (20 tokens) is shorter than "Question: ...\n\nAnswer:", so the question lost its start.
    assert sample.question == prompt[-20:]
    assert sample.chat_template is True and sample.answer_prefix == ""


def test_config_composes_and_instantiates(tmp_path):
    cfg = compose_config(tmp_path, "benchmark=longbench", "benchmark.protocol=official")
    benchmark = instantiate(cfg.benchmark)
    assert isinstance(benchmark, LongBench)
    assert (benchmark.name, benchmark.protocol, benchmark.max_length) == ("longbench", "official", 31500)
    assert (benchmark.dataset, benchmark.split, benchmark.path, benchmark.tasks) == (
        "Xnhyacinth/LongBench",
        "test",
        None,
        None,
    )
