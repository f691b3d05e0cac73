"""LooGLE: loading from every source, and the metrics against hand-computed and reference values.

Fixtures: tests/fixtures/loogle/{task}.jsonl are rows in kvpress's hub schema, written by
tests/fixtures/reference_values.py with the tables of kvpress's own create_huggingface_dataset.py;
tests/fixtures/loogle_predictions.jsonl holds prediction rows for the four tasks with the metrics' edge cases.
"""

import json
import sys
import types
from pathlib import Path

import datasets
import pytest
import torch
from hydra.utils import instantiate

from evaluate.benchmarks import loogle
from evaluate.benchmarks.loogle import (
    TASKS,
    Loogle,
    bleu_scores,
    exact_match,
    partial_match,
    rouge_recalls,
    score_predictions,
    text_row_scores,
)
from evaluate.points.config import ConfigError
from evaluate.score.rescore import main as score_main
from tests.support import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HUB_ROWS = FIXTURES / "loogle"
PREDICTIONS = FIXTURES / "loogle_predictions.jsonl"

# kvpress 0.5.5's evaluation/benchmarks/loogle/calculate_metrics.py on tests/fixtures/loogle_predictions.jsonl, x100
# and rounded to 2 (kvpress reports fractions; cloze fractions rounded to 4 decimals), with rouge 1.0.1 and the
# project's nltk; METEOR and BERTScore stubbed out. Printed by tests/fixtures/reference_values.py (see its docstring).
REFERENCE = {
    "shortdep_qa": {"bleu1": 21.43, "bleu4": 6.67, "rouge-1": 50.0, "rouge-2": 33.33, "rouge-l": 50.0},
    "longdep_qa": {"bleu1": 22.22, "bleu4": 0.0, "rouge-1": 31.25, "rouge-2": 0.0, "rouge-l": 18.75},
    "longdep_summarization": {"bleu1": 44.45, "bleu4": 0.0, "rouge-1": 56.0, "rouge-2": 36.0, "rouge-l": 44.0},
    "shortdep_cloze": {"exact_match": 12.5, "partial_match": 16.67},
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def no_wordnet(monkeypatch):
    monkeypatch.setattr(loogle, "wordnet_on_disk", lambda: False)


# ---------------------------------------------------------------------------------------------------------------
# Metrics, hand-computed
# ---------------------------------------------------------------------------------------------------------------


def test_bleu_is_unsmoothed_nltk_on_whitespace_tokens():
    scores = bleu_scores("the cat sat on the mat", "the cat sat\non a mat")
    # 5 of 6 unigrams match, same length (no brevity penalty); 1 of 3 4-grams ("the cat sat on") matches.
    assert scores["bleu1"] == pytest.approx(5 / 6)
    assert scores["bleu4"] == pytest.approx(1 / 3)
    assert bleu_scores("the cat sat on the mat", "") == {"bleu1": 0, "bleu4": 0}


def test_rouge_recalls_count_distinct_ngrams_of_the_reference():
    scores = rouge_recalls("the cat sat on the mat", "the cat sat")
    # 3 of 5 distinct reference words; 2 of 5 distinct bigrams; union LCS 3 of 5 distinct words.
    assert scores == pytest.approx({"rouge-1": 0.6, "rouge-2": 0.4, "rouge-l": 0.6})


def test_a_metric_that_raises_scores_zero_on_that_row(no_wordnet):
    # rouge raises on an empty hypothesis; bleu does not.
    assert text_row_scores("the cat", "") == {"bleu1": 0, "bleu4": 0, "rouge-1": 0.0, "rouge-2": 0.0, "rouge-l": 0.0}
    assert text_row_scores("the cat", " \n ")["rouge-l"] == 0.0


def test_meteor_only_when_wordnet_is_on_disk(monkeypatch):
    monkeypatch.setattr(loogle, "wordnet_on_disk", lambda: False)
    assert "meteor" not in text_row_scores("the cat", "the cat")
    metrics = score_predictions([{"task": "shortdep_qa", "answers": ["the cat"], "prediction": "the cat"}])
    assert metrics["meteor"] == "skipped: NLTK WordNet data is not on disk"
    assert "meteor" not in metrics["tasks"]["shortdep_qa"]

    calls = []
    monkeypatch.setattr(loogle, "wordnet_on_disk", lambda: True)
    monkeypatch.setattr(
        "nltk.translate.meteor_score.single_meteor_score", lambda r, h: calls.append((r, h)) or 0.5, raising=True
    )
    assert text_row_scores("b a b", "c a")["meteor"] == 0.5
    # kvpress passes de-duplicated token sets; sorted here so that the value does not depend on set order.
    assert calls == [(["a", "b"], ["a", "c"])]


def test_cloze_exact_and_partial_match_parse_dict_strings():
    gold = '{"<mask-0>": "Tom Hanks", "<mask-1>": "Paris"}'
    assert exact_match(gold, " {'<mask-0>': 'Tom Hanks', '<mask-1>': 'London'}") == (1, 2)
    assert partial_match(gold, "{'<mask-0>': 'Hanks', '<mask-1>': 'Paris, France'}") == (1, 2)
    assert exact_match('{"<mask-0>": "New York City"}', "{'<mask-0>': 'New York'}") == (0, 1)
    assert partial_match('{"<mask-0>": "New York City"}', "{'<mask-0>': 'New York'}") == (1, 1)


def test_unparseable_cloze_predictions_count_one_missed_mask_for_exact_match():
    gold = '{"<mask-0>": "Bob", "<mask-1>": "Alice", "<mask-2>": "Oslo"}'
    for prediction in ("I think <mask-0> is Bob", "['Bob', 'Alice']", "", "   ", "{'<mask-0>': 'Bob'} and more"):
        assert exact_match(gold, prediction) == (0, 1), prediction
        assert partial_match(gold, prediction) == (0, 3), prediction
    # A non-string entity fails kvpress's token split: the whole row scores 0.
    assert partial_match('{"<mask-0>": "Acme"}', '{"<mask-0>": 42}') == (0, 1)


def test_cloze_predictions_are_never_evaluated(tmp_path):
    marker = tmp_path / "executed"
    prediction = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    assert exact_match('{"<mask-0>": "Berlin"}', prediction) == (0, 1)
    assert partial_match('{"<mask-0>": "Berlin"}', prediction) == (0, 1)
    assert not marker.exists()


@pytest.mark.parametrize("prediction", ["", "  \n", None])
def test_empty_predictions_score_zero_on_every_task(prediction, no_wordnet):
    rows = [
        {"task": task, "answers": ['{"<mask-0>": "Bob"}' if task == "shortdep_cloze" else "an answer"]}
        | {"prediction": prediction}
        for task in TASKS
    ]
    metrics = score_predictions(rows)
    assert metrics["score"] == 0.0
    for values in metrics["tasks"].values():
        assert all(value == 0.0 for key, value in values.items() if key not in ("n", "metric"))


def test_bertscore_only_when_asked_with_kvpress_argument_order(monkeypatch, no_wordnet):
    calls = []

    def score(candidates, references, lang):
        calls.append((candidates, references, lang))
        return None, torch.tensor([0.5, 0.25]), None

    rows = [
        {"task": "longdep_qa", "answers": ["gold one"], "prediction": "pred one"},
        {"task": "longdep_qa", "answers": ["gold two"], "prediction": "pred two"},
    ]
    monkeypatch.setitem(sys.modules, "bert_score", types.SimpleNamespace(score=score))
    assert "bertscore" not in score_predictions(rows)["tasks"]["longdep_qa"] and not calls
    assert score_predictions(rows, bertscore=True)["tasks"]["longdep_qa"]["bertscore"] == 37.5
    assert calls == [(["gold one", "gold two"], ["pred one", "pred two"], "en")]


# ---------------------------------------------------------------------------------------------------------------
# Metrics against the reference implementation
# ---------------------------------------------------------------------------------------------------------------


def test_metrics_match_kvpress_calculate_metrics(no_wordnet):
    metrics = score_predictions(read_jsonl(PREDICTIONS))
    for task, reference in REFERENCE.items():
        assert {key: metrics["tasks"][task][key] for key in reference} == reference, task
    assert metrics["tasks"]["shortdep_cloze"]["score"] == 12.5  # exact_match
    assert metrics["tasks"]["shortdep_cloze"]["n"] == 7
    text_rouge_l = [REFERENCE[task]["rouge-l"] for task in loogle.TEXT_TASKS]
    assert [metrics["tasks"][task]["score"] for task in loogle.TEXT_TASKS] == text_rouge_l
    assert metrics["score"] == round(sum(text_rouge_l) / 3, 2) == 37.58
    assert metrics["score_label"] == "ROUGE-L recall ×100, mean over the text tasks (3 of 3)"


def test_scores_from_a_file_on_the_command_line(tmp_path, capsys, no_wordnet):
    path = tmp_path / "predictions.jsonl"
    path.write_text(PREDICTIONS.read_text(encoding="utf-8"), encoding="utf-8")
    score_main(["--benchmark", "loogle", str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["score"] == 37.58 and printed["tasks"]["shortdep_cloze"]["partial_match"] == 16.67


def test_an_unknown_task_is_refused_when_scoring():
    with pytest.raises(ValueError, match="unknown LooGLE task 'summarization'"):
        score_predictions([{"task": "summarization", "answers": ["x"], "prediction": "x"}])


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def expected_samples() -> list[tuple]:
    rows = [row for task in TASKS for row in read_jsonl(HUB_ROWS / f"{task}.jsonl")]
    return [
        (row["task"], row["context"], row["question"], row["answer_prefix"], [row["answer"]], row["max_new_tokens"])
        for row in rows
    ]


def as_tuples(samples) -> list[tuple]:
    return [(s.task, s.context, s.question, s.answer_prefix, s.answers, s.max_new_tokens) for s in samples]


def test_local_rows_become_samples_unchanged(tiny_tokenizer):
    samples = Loogle(path=str(HUB_ROWS)).load(tiny_tokenizer)
    assert as_tuples(samples) == expected_samples()
    assert [sample.id for sample in samples] == [
        "shortdep_qa-0",
        "shortdep_qa-1",
        "longdep_qa-0",
        "longdep_summarization-0",
        "shortdep_cloze-0",
    ]
    assert all(sample.chat_template for sample in samples)
    summary = next(sample for sample in samples if sample.task == "longdep_summarization")
    assert (summary.question, summary.answer_prefix, summary.max_new_tokens) == ("\n", "Summarization: ", 500)


def test_every_local_format_and_the_hub_give_the_same_samples(monkeypatch, tmp_path, tiny_tokenizer):
    expected = Loogle(path=str(HUB_ROWS)).load(tiny_tokenizer)
    rows = {task: read_jsonl(HUB_ROWS / f"{task}.jsonl") for task in TASKS}
    for task, task_rows in rows.items():
        datasets.Dataset.from_list(task_rows).to_parquet(str(tmp_path / "snapshot" / task / "test-00000.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list([r for t in TASKS for r in rows[t]])}).save_to_disk(
        str(tmp_path / "saved")
    )
    for path in (tmp_path / "snapshot", tmp_path / "saved"):
        assert Loogle(path=str(path)).load(tiny_tokenizer) == expected, path

    calls = []

    def hub(name, data_dir=None, split=None):
        calls.append((name, data_dir, split))
        return datasets.Dataset.from_list(rows[data_dir])

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert Loogle().load(tiny_tokenizer) == expected
    assert calls == [("simonjegou/loogle", task, "test") for task in TASKS]


def test_offline_hub_stops_with_the_dataset_and_the_local_alternative(monkeypatch, tiny_tokenizer):
    def offline(name, data_dir=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match=r"simonjegou/loogle \(data_dir shortdep_qa\).*benchmark\.path=DIR"):
        Loogle().load(tiny_tokenizer)


def test_limit_task_selection_and_errors(tmp_path, tiny_tokenizer):
    samples = Loogle(path=str(HUB_ROWS), tasks=["shortdep_cloze", "shortdep_qa"]).load(tiny_tokenizer, limit=1)
    assert [sample.id for sample in samples] == ["shortdep_cloze-0", "shortdep_qa-0"]
    with pytest.raises(ConfigError, match="unknown LooGLE task.*summarization"):
        Loogle(path=str(HUB_ROWS), tasks=["summarization"]).load(tiny_tokenizer)
    row = read_jsonl(HUB_ROWS / "longdep_qa.jsonl")[0]
    del row["max_new_tokens"]
    (tmp_path / "longdep_qa.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="longdep_qa.jsonl:1: the row lacks the column.s. max_new_tokens"):
        Loogle(path=str(tmp_path), tasks=["longdep_qa"]).load(tiny_tokenizer)


def test_bertscore_without_its_package_is_refused_before_the_model_loads(monkeypatch, tiny_tokenizer):
    monkeypatch.setitem(sys.modules, "bert_score", None)  # makes the import fail
    with pytest.raises(ConfigError, match="pip install bert-score"):
        Loogle(path=str(HUB_ROWS), bertscore=True).load(tiny_tokenizer)


def test_config_composes_and_instantiates(tmp_path):
    benchmark = instantiate(compose_config(tmp_path, "benchmark=loogle").benchmark)
    assert isinstance(benchmark, Loogle)
    assert (benchmark.name, benchmark.dataset, benchmark.split, benchmark.bertscore) == (
        "loogle",
        "simonjegou/loogle",
        "test",
        False,
    )
