import pytest

from evaluate.benchmarks.ruler import clean_prediction, sample_score, score_predictions


def test_string_match_all_scores_the_fraction_of_references_found_case_insensitively():
    assert sample_score("niah_multivalue", "The numbers are 123 and 456.", ["123", "456", "789", "000"]) == 0.5
    assert sample_score("cwe", "APPLE banana", ["apple", "Banana"]) == 1.0
    assert sample_score("vt", "nothing here", ["XYZAB"]) == 0.0


def test_string_match_part_scores_one_when_any_reference_is_found():
    assert sample_score("qa_1", "It was Paris, I think", ["London", "paris"]) == 1.0
    assert sample_score("qa_2", "Berlin", ["London", "Paris"]) == 0.0


def test_control_characters_are_deleted_not_replaced_as_kvpress_does():
    assert clean_prediction("  ab\ncd\t\x00e  ") == "abcde"
    # Deleting the newline glues the two words, so a reference spanning the break matches.
    assert sample_score("niah_single_1", "foo\nbar", ["foobar"]) == 1.0


def test_task_scores_are_means_times_100_rounded_and_headline_is_unweighted_task_mean():
    rows = [
        {"task": "niah_single_1", "answers": ["1"], "prediction": "1"},
        {"task": "niah_single_1", "answers": ["1"], "prediction": "2"},
        {"task": "niah_single_1", "answers": ["1"], "prediction": "1"},
        {"task": "qa_1", "answers": ["x", "y"], "prediction": "y"},
    ]
    metrics = score_predictions(rows, benchmark="ruler")
    assert metrics["tasks"]["niah_single_1"] == {"score": 66.67, "n": 3}
    assert metrics["tasks"]["qa_1"] == {"score": 100.0, "n": 1}
    # Unweighted over tasks: (66.67 + 100) / 2, not the 3/4 sample mean.
    assert metrics["score"] == pytest.approx(83.34, abs=1e-9)
    assert metrics["benchmark"] == "ruler"
