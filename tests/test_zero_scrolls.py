"""ZeroSCROLLS: no score (the test answers are not public), every loader path, the submission file, a local run and
the report on it.

Fixture: tests/fixtures/zero_scrolls/test.jsonl holds five rows (gov_report, qasper, quality) in kvpress's hub schema,
written by tests/fixtures/zero_scrolls_rows.py with the cut and the max_new_tokens table of kvpress's own
create_huggingface_dataset.py. kvpress 0.5.5's ``calculate_metrics`` for ZeroSCROLLS returns ``{}`` whatever the
predictions, so there is no reference value to match: PressBench records a null score with the reason.
"""

import io
import json
from pathlib import Path

import datasets
import pandas as pd
import pytest
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.benchmarks import zero_scrolls
from evaluate.benchmarks.selection import select_fraction
from evaluate.benchmarks.zero_scrolls import TASKS, ZeroScrolls, score_predictions, submission_csv
from evaluate.points.config import ConfigError, run_dir
from evaluate.report.cli import main as report_main
from evaluate.run.entry import run
from evaluate.score.bootstrap import sample_scores
from evaluate.score.rescore import main as score_main
from evaluate.score.tables import format_task_table
from tests.support import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HUB_ROWS = FIXTURES / "zero_scrolls"
HUB_FILE = HUB_ROWS / "test.jsonl"
LABEL = "not scored: ZeroSCROLLS test answers are not public"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def prediction_rows() -> list[dict]:
    return [
        {
            "id": "gov_report-0",
            "task": "gov_report",
            "answers": [],
            "prediction": "A summary.",
            "zero_scrolls_id": "a1",
        },
        {"id": "qasper-0", "task": "qasper", "answers": [], "prediction": "", "zero_scrolls_id": "c3"},
        {"id": "qasper-1", "task": "qasper", "answers": [], "prediction": None, "zero_scrolls_id": "c4", "error": "x"},
        {"id": "quality-0", "task": "quality", "answers": [], "prediction": 'B) "Tom", 2', "zero_scrolls_id": "d4"},
    ]


# ---------------------------------------------------------------------------------------------------------------
# Score
# ---------------------------------------------------------------------------------------------------------------


def test_metrics_hold_no_score_the_reason_and_the_sample_counts():
    metrics = score_predictions(prediction_rows())
    assert metrics["score"] is None and metrics["score_label"] == LABEL
    assert metrics["tasks"] == {
        "gov_report": {"score": None, "n": 1, "metric": "none (answers not public)"},
        "qasper": {"score": None, "n": 2, "metric": "none (answers not public)"},
        "quality": {"score": None, "n": 1, "metric": "none (answers not public)"},
    }
    assert "python -m evaluate.benchmarks.zero_scrolls RUN_DIR" in metrics["submission"]


def test_the_run_table_prints_a_dash_for_the_missing_scores():
    lines = format_task_table(score_predictions(prediction_rows())).splitlines()
    assert lines[2].split() == ["gov_report", "-", "1"]
    assert lines[-1].split()[-1] == "-" and lines[-1].startswith(f"score ({LABEL})")


def test_samples_without_a_score_stay_without_one_for_wandb_and_the_bootstrap():
    rows = prediction_rows()
    assert sample_scores(ZeroScrolls(), rows) == [None] * len(rows)


def test_scores_from_a_file_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "predictions.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in prediction_rows()), encoding="utf-8")
    score_main(["--benchmark", "zero_scrolls", str(path)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["score"] is None and printed["n_errors"] == 1 and printed["tasks"]["qasper"]["n_errors"] == 1


def test_an_unknown_task_is_refused_when_scoring():
    with pytest.raises(ValueError, match="unknown ZeroSCROLLS task.*narrativeqa"):
        score_predictions([{"task": "narrativeqa", "answers": [], "prediction": "x"}])


# ---------------------------------------------------------------------------------------------------------------
# Submission file
# ---------------------------------------------------------------------------------------------------------------


def test_the_submission_is_zero_scrolls_prepare_submission_csv():
    rows = [*prediction_rows(), {**prediction_rows()[0], "prediction": "a second answer to the same id"}]
    text = submission_csv(rows)
    # Read back as ZeroSCROLLS's verify_submission.py reads it.
    frame = pd.read_csv(io.StringIO(text), dtype=object, keep_default_na=False, na_values=["!@#$%^&*()"])
    assert frame.columns.tolist() == ["Task", "ID", "Prediction"]
    assert frame.to_numpy().tolist() == [
        ["gov_report", "a1", "A summary."],
        ["qasper", "c3", ""],
        ["qasper", "c4", ""],
        ["quality", "d4", 'B) "Tom", 2'],
    ]


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def test_fixture_rows_are_kvpress_cut_of_the_zero_scrolls_input():
    for row in read_jsonl(HUB_FILE):
        document_end, query_end = row["document_end_index"], row["query_end_index"]
        assert row["context"] == row["input"][:document_end]
        assert row["question"] == row["input"][document_end:query_end]
        assert row["answer_prefix"] == row["input"][query_end:].strip()
        assert row["answer"] == ""


def test_local_rows_become_samples_unchanged_in_source_order(tiny_tokenizer):
    rows = read_jsonl(HUB_FILE)
    samples = ZeroScrolls(path=str(HUB_FILE)).load(tiny_tokenizer)
    assert [sample.id for sample in samples] == ["gov_report-0", "gov_report-1", "qasper-0", "quality-0", "quality-1"]
    for sample, row in zip(samples, rows, strict=True):
        assert (sample.task, sample.context, sample.question, sample.answer_prefix) == (
            row["task"],
            row["context"],
            row["question"],
            row["answer_prefix"],
        )
        assert (sample.answers, sample.chat_template, sample.extra) == ([], True, {"zero_scrolls_id": row["id"]})
    assert [sample.max_new_tokens for sample in samples] == [1024, 1024, 128, 10, 10]
    assert (samples[1].question, samples[3].answer_prefix) == ("", "Answer:\n(")


def test_every_local_format_and_the_hub_give_the_same_samples(monkeypatch, tmp_path, tiny_tokenizer):
    expected = ZeroScrolls(path=str(HUB_FILE)).load(tiny_tokenizer)
    rows = read_jsonl(HUB_FILE)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "snapshot" / "data" / "test-00000.parquet"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    for path in (HUB_ROWS, tmp_path / "snapshot", tmp_path / "saved"):
        assert ZeroScrolls(path=str(path)).load(tiny_tokenizer) == expected, path

    calls = []

    def hub(name, data_dir=None, split=None):
        calls.append((name, data_dir, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert ZeroScrolls().load(tiny_tokenizer) == expected
    assert calls == [("simonjegou/zero_scrolls", None, "test")]


def test_offline_hub_stops_with_the_dataset_and_the_local_alternative(monkeypatch, tiny_tokenizer):
    def offline(name, data_dir=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        ConfigError, match=r"cannot load simonjegou/zero_scrolls from the Hugging Face hub.*benchmark\.path=DIR"
    ):
        ZeroScrolls().load(tiny_tokenizer)


def test_limit_task_selection_and_errors(tmp_path, tiny_tokenizer):
    samples = ZeroScrolls(path=str(HUB_FILE), tasks=["quality", "gov_report"]).load(tiny_tokenizer, limit=1)
    assert [sample.id for sample in samples] == ["gov_report-0", "quality-0"]
    with pytest.raises(ConfigError, match="unknown ZeroSCROLLS task.*narrativeqa"):
        ZeroScrolls(path=str(HUB_FILE), tasks=["narrativeqa"]).load(tiny_tokenizer)
    row = read_jsonl(HUB_FILE)[0]
    del row["id"]
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="rows.jsonl:1: the row lacks the column.s. id"):
        ZeroScrolls(path=str(tmp_path / "rows.jsonl")).load(tiny_tokenizer)


def test_fraction_draws_from_the_whole_split_as_kvpress(tiny_tokenizer):
    samples = ZeroScrolls(path=str(HUB_FILE)).load(tiny_tokenizer)
    drawn = select_fraction(samples, 0.5, 42, ZeroScrolls.fraction_by_task)
    # kvpress: df.sample(frac=fraction, random_state=seed) on the split's frame.
    ids = pd.DataFrame(read_jsonl(HUB_FILE)).sample(frac=0.5, random_state=42)["id"]
    assert sorted(sample.extra["zero_scrolls_id"] for sample in drawn) == sorted(ids)


def test_config_composes_and_instantiates(tmp_path):
    benchmark = instantiate(compose_config(tmp_path, "benchmark=zero_scrolls").benchmark)
    assert isinstance(benchmark, ZeroScrolls)
    assert (benchmark.name, benchmark.dataset, benchmark.split, benchmark.tasks, benchmark.path) == (
        "zero_scrolls",
        "simonjegou/zero_scrolls",
        "test",
        None,
        None,
    )
    assert benchmark.all_tasks == TASKS and len(TASKS) == 10


# ---------------------------------------------------------------------------------------------------------------
# End to end: a run, its submission file, and the report
# ---------------------------------------------------------------------------------------------------------------


def test_a_local_run_records_predictions_a_submission_and_a_report(tmp_path, capsys):
    runs = tmp_path / "runs"
    # quality and qasper only: gov_report's 1024 new tokens would dominate the test's time.
    overrides = ("benchmark=zero_scrolls", f"benchmark.path={HUB_ROWS}", "benchmark.tasks=[qasper,quality]")
    cfg = compose_config(runs, *overrides, "press=none")
    metrics = run(cfg)
    out = run_dir(cfg)
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert [(row["id"], row["zero_scrolls_id"]) for row in rows] == [
        ("qasper-0", "c3d2"),
        ("quality-0", "d4c3"),
        ("quality-1", "e5b4"),
    ]
    assert all(isinstance(row["prediction"], str) and not row.get("error") for row in rows)
    assert json.loads((out / rundir.METRICS).read_text()) == metrics
    assert metrics["score"] is None
    assert {task: (values["score"], values["n"]) for task, values in metrics["tasks"].items()} == {
        "qasper": (None, 1),
        "quality": (None, 2),
    }

    zero_scrolls.main([str(out)])
    assert (out / zero_scrolls.SUBMISSION_FILE).read_text() == submission_csv(rows)
    assert "3 predictions of 2 of 10 tasks" in capsys.readouterr().out

    run(compose_config(runs, *overrides, "press=chunkkv", "cr=0.5"))
    report_main([str(runs), "--out", str(tmp_path / "tables"), "--plots", str(tmp_path / "plots"), "--bootstrap", "50"])
    page = capsys.readouterr().out
    assert "| zero_scrolls | no compression | - n=3* |" in page
    assert "| zero_scrolls | chunkkv_snapkv | - n=3* |" in page
    # No score and no likelihood fields (no published answers to teacher-force): only the answer-length figure,
    # which compares the compressed answers with the uncompressed ones and needs no reference answer.
    assert [path.name for path in (tmp_path / "plots").glob("zero_scrolls*.png")] == ["zero_scrolls_answer_length.png"]
    assert rows[0].get("answer_kl") is None
    tasks = (tmp_path / "tables" / "zero_scrolls_tasks.md").read_text()
    assert "| quality | - n=2* | - n=2* |" in tasks
