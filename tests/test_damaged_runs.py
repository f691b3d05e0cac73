"""A predictions file damaged in the middle (a disk, an editor): refused with its file and line, left as it is,
moved aside on request and resumed, and skipped by the report with the reason."""

import subprocess
import sys
from pathlib import Path

import pytest

from evaluate import rundir
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run
from evaluate.run.repair import repair
from evaluate.spec.config import run_dir
from tests.support import compose_config, with_shared_context

REPO = Path(__file__).resolve().parent.parent
RUN = ("press=topk", "cr=0.5", "limit=null")


def finished_run(output_dir: Path) -> Path:
    """A finished run of 3 contexts x 3 questions on the tiny model; returns its directory."""
    cfg = with_shared_context(compose_config(output_dir, *RUN))
    run(cfg)
    return run_dir(cfg)


def damage_line(predictions: Path, number: int) -> bytes:
    """Overwrite line ``number`` (1-based) with bytes that are not JSON; returns the whole file as damaged."""
    lines = predictions.read_bytes().split(b"\n")
    lines[number - 1] = b'{"id": "half a row'
    predictions.write_bytes(b"\n".join(lines))
    return predictions.read_bytes()


def test_a_damaged_middle_line_is_refused_naming_file_and_line_and_the_file_is_untouched(tmp_path):
    out = finished_run(tmp_path)
    predictions = out / rundir.PREDICTIONS
    damaged = damage_line(predictions, 4)
    with pytest.raises(rundir.DamagedPredictions) as refused:
        run(with_shared_context(compose_config(tmp_path, *RUN)))
    assert str(refused.value) == (
        f"{predictions}:4 is not a prediction row (Unterminated string starting at); the file is left as it is. "
        f"Move the damaged lines aside with python -m evaluate.run.repair {out}, then rerun to answer their samples again"
    )
    assert refused.value.line == 4
    assert predictions.read_bytes() == damaged


def test_a_torn_last_line_is_still_cut_and_resumed_not_refused(tmp_path):
    out = finished_run(tmp_path)
    predictions = out / rundir.PREDICTIONS
    complete = predictions.read_bytes()
    predictions.write_bytes(complete + b'{"id": "tor')
    assert rundir.read_predictions(predictions, repair=True) == rundir.read_predictions(predictions)
    assert predictions.read_bytes() == complete


def test_repair_moves_damaged_lines_aside_and_the_rerun_equals_an_undamaged_run(tmp_path):
    out = finished_run(tmp_path / "damaged")
    predictions = out / rundir.PREDICTIONS
    intact = predictions.read_bytes()
    original_lines = intact.splitlines(keepends=True)
    damaged = damage_line(predictions, 2)
    predictions.write_bytes(damaged + b'{"id": "torn')  # and a torn last line: moved too, never dropped
    message = repair(out)
    aside = predictions.with_name("predictions.jsonl.damaged")
    assert message == (f"{predictions}: moved 2 damaged lines to {aside}, kept 8 rows; rerun the run to answer them")
    assert aside.read_bytes() == b'{"id": "half a row\n{"id": "torn\n'
    assert predictions.read_bytes() == b"".join(original_lines[:1] + original_lines[2:])
    assert repair(out) == f"{predictions}: nothing damaged, 8 rows"

    run(with_shared_context(compose_config(tmp_path / "damaged", *RUN)))
    reference = finished_run(tmp_path / "reference")
    # The moved sample is answered again; the resumed run then orders its rows as an uninterrupted run does.
    assert predictions.read_bytes() == (reference / rundir.PREDICTIONS).read_bytes()


def test_rescoring_a_damaged_run_is_refused_in_one_line_and_metrics_stay(tmp_path):
    out = finished_run(tmp_path)
    metrics = (out / rundir.METRICS).read_bytes()
    damage_line(out / rundir.PREDICTIONS, 3)
    result = subprocess.run(
        [sys.executable, "-m", "evaluate.score", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"error: {out / rundir.PREDICTIONS}:3 is not a prediction row (Unterminated string starting at); the file "
        f"is left as it is. Move the damaged lines aside with python -m evaluate.run.repair {out}, then rerun to answer "
        "their samples again"
    ]
    assert (out / rundir.METRICS).read_bytes() == metrics


def test_the_report_skips_a_damaged_run_with_the_reason_and_keeps_the_others(tmp_path):
    damaged = finished_run(tmp_path)
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.25", "limit=null"))
    run(cfg)
    damage_line(damaged / rundir.PREDICTIONS, 5)
    runs, skipped = collect_runs(tmp_path)
    assert [result.path for result in runs] == [run_dir(cfg)]
    assert [(path, reason.split(" is not")[0]) for path, reason in skipped] == [
        (damaged, f"{damaged / rundir.PREDICTIONS}:5")
    ]
