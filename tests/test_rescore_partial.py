"""Rescoring a run that has not answered every sample (issue 44): metrics.json says it is partial, and a warning
line says how much was scored and how to finish the run."""

import json

import pytest

from evaluate import rundir
from evaluate.score.rescore import main as rescore
from tests.fixtures.runs.builder import uniform, write_run

ANSWERED = uniform([True, True])  # 13 tasks x 2 samples: 26 rows


def stop_early(run, status: str, expected: int | None) -> None:
    """Record in run.json that ``run`` stopped with ``status``, expecting ``expected`` samples (no count: None)."""
    record = json.loads((run / rundir.RUN).read_text())
    record["status"] = status
    if expected is None:
        del record["samples_expected"]
    else:
        record["samples_expected"] = expected
    (run / rundir.RUN).write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("status", "expected", "scored"),
    [("incomplete", 40, "26 of 40 expected"), ("running", 30, "26 of 30 expected"), ("interrupted", None, "26")],
)
def test_an_unfinished_run_is_rescored_as_partial_with_one_warning_line(tmp_path, capsys, status, expected, scored):
    run = write_run(tmp_path / "runs", ANSWERED, method="snapkv", cr=0.5)
    stop_early(run, status, expected)
    rescore([str(run)])
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning == (
        f"warning: {run} is unfinished (run.json status {status}): {scored} samples scored, so metrics.json is "
        "marked partial; rerun the command that made the run to answer the rest (it resumes where it stopped and "
        "rescores the whole run)"
    )
    metrics = json.loads((run / rundir.METRICS).read_text())
    assert metrics["partial"] == {"samples": 26, "samples_expected": expected, "status": status}
    assert metrics["score"] == 100.0  # the rows it has, scored as ever


def test_a_complete_run_with_rows_missing_is_partial_too(tmp_path, capsys):
    run = write_run(tmp_path / "runs", ANSWERED, method="snapkv", cr=0.5)
    lines = (run / rundir.PREDICTIONS).read_text().splitlines(keepends=True)
    (run / rundir.PREDICTIONS).write_text("".join(lines[:20]))
    rescore([str(run)])
    assert "20 of 26 expected samples scored" in capsys.readouterr().err
    assert json.loads((run / rundir.METRICS).read_text())["partial"]["status"] == "complete"


@pytest.mark.parametrize("status", ["running", "complete"])
def test_a_run_with_every_expected_sample_is_not_partial(tmp_path, capsys, status):
    # A session killed while scoring leaves every row and run.json at running: the metrics cover the whole run.
    run = write_run(tmp_path / "runs", ANSWERED, method="snapkv", cr=0.5)
    stop_early(run, status, 26)
    rescore([str(run)])
    assert capsys.readouterr().err == ""
    assert "partial" not in json.loads((run / rundir.METRICS).read_text())
