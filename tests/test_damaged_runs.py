"""A predictions file damaged in the middle (a disk, an editor): refused with its file and line, left as it is,
moved aside on request and resumed, and skipped by the report with the reason; and a results tree holding every
other kind of damage beside good runs, which every reader skips entry by entry, naming each, in one line."""

import csv
import errno
import json
import os
import pathlib
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from evaluate import rundir
from evaluate.points.config import run_dir
from evaluate.report.cli import main as report_main
from evaluate.report.leaderboard import main as leaderboard_main
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run
from evaluate.run.repair import repair
from evaluate.score.rescore import main as score_main
from tests.fixtures.runs.builder import uniform, write_run
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
        f"Move the damaged lines aside with python -m evaluate.run.repair {out}, then rerun to answer their samples "
        "again"
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
        f"is left as it is. Move the damaged lines aside with python -m evaluate.run.repair {out}, then rerun to "
        "answer their samples again"
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


def damaged_tree(root: Path) -> dict[Path, Path]:
    """Two good runs beside every kind of damage a results tree can hold; returns each damaged entry with the file
    its readers must name (the entry itself for a stray file or an empty folder)."""
    write_run(root, uniform([True, True]), method="no_press")
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5)
    damage = {
        rundir.RUN: lambda path: path.write_text(path.read_text()[:25]),  # truncated
        rundir.CONFIG: lambda path: path.write_text("config: [unclosed\n  - : :"),  # not YAML
        rundir.METRICS: lambda path: path.write_text("[1, 2]"),  # a list, not a mapping
        rundir.PREDICTIONS: lambda path: path.write_text('{"id": 1}\nnot json\n{"id": 2}\n'),  # garbage
    }
    bad = {}
    for cr, (name, spoil) in zip((0.1, 0.2, 0.3, 0.4), damage.items(), strict=True):
        run_directory = write_run(root, uniform([True]), method="knorm", cr=cr)
        spoil(run_directory / name)
        bad[run_directory] = run_directory / name
    missing_keys = write_run(root, uniform([True]), method="knorm", cr=0.5)
    (missing_keys / rundir.CONFIG).write_text("method: knorm\n")  # no config: no benchmark to judge it by
    wrong_field = write_run(root, uniform([True]), method="knorm", cr=0.6)
    metrics = json.loads((wrong_field / rundir.METRICS).read_text())
    metrics["tasks"]["vt"]["n"] = "many"
    (wrong_field / rundir.METRICS).write_text(json.dumps(metrics))
    unreadable = write_run(root, uniform([True]), method="knorm", cr=0.7)
    (unreadable / rundir.PREDICTIONS).chmod(0)
    folder = write_run(root, uniform([True]), method="knorm", cr=0.8)
    (folder / rundir.RUN).unlink()
    (folder / rundir.RUN).mkdir()  # a folder where a file should be
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("a stray file\n")
    bad |= {
        missing_keys: missing_keys / rundir.CONFIG,
        wrong_field: wrong_field / rundir.METRICS,
        unreadable: unreadable / rundir.PREDICTIONS,
        folder: folder / rundir.RUN,
        root / "empty": root / "empty",
        root / "notes.txt": root / "notes.txt",
    }
    return bad


@pytest.fixture
def unreadable_when_chmod_0(monkeypatch):
    """As root, chmod 0 does not stop reading: the file refuses to open as it would for any other user."""
    if os.geteuid() != 0:
        return
    opened = pathlib.Path.open

    def refusing(path, *args, **kwargs):
        if path.exists() and stat.S_IMODE(path.stat().st_mode) == 0:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "open", refusing)


def named_once(lines: list[str], files: list[Path]) -> bool:
    """Every line names one of ``files``, and each of them is named by one line."""
    named = [[file for file in files if str(file) in line] for line in lines]
    return all(len(names) == 1 for names in named) and sorted(names[0] for names in named) == sorted(files)


def test_every_reader_skips_each_damaged_entry_in_one_line_naming_it_and_reports_the_good_runs(
    tmp_path, capsys, unreadable_when_chmod_0
):
    root = tmp_path / "runs"
    bad = damaged_tree(root)
    good = sorted(path for path in root.iterdir() if path not in bad)

    report_main([str(root), "--out", str(tmp_path / "tables"), "--bootstrap", "0"])
    out, err = capsys.readouterr()
    runs = list(csv.DictReader((tmp_path / "tables" / "runs.csv").open()))
    assert sorted(Path(row["run_dir"]) for row in runs) == good
    assert all(line.startswith("skipped ") for line in err.splitlines())
    assert named_once(err.splitlines(), list(bad.values()))
    assert "| ruler | snapkv | 50.00 n=26 |" in out

    leaderboard_main([str(root), "--out", str(tmp_path / "submission")])
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == len(good) + 1  # a line per submission, then the leaderboard.csv line
    assert all(line.startswith("refused ") for line in err.splitlines())
    assert named_once(err.splitlines(), list(bad.values()))

    # Rescoring reads config.yaml and predictions.jsonl alone, and rewrites metrics.json whatever it held.
    unscored = {entry: file for entry, file in bad.items() if file.name in (rundir.CONFIG, rundir.PREDICTIONS)}
    unscored |= {entry: file for entry, file in bad.items() if file == entry}
    with pytest.raises(SystemExit) as exit_code:
        score_main([str(path) for path in sorted(root.iterdir())])
    out, err = capsys.readouterr()
    assert exit_code.value.code == 2
    titles = [line for line in out.splitlines() if line.startswith(str(root))]
    assert titles == [str(path) for path in sorted(root.iterdir()) if path not in unscored]
    assert named_once(err.splitlines(), list(unscored.values()))
