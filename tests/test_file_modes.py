"""What the harness writes carries the user's umask, as any file a program creates does: results shared on a
cluster stay readable by the group, never owner-only as tempfile's staging files and folders are."""

import os
import stat
from pathlib import Path

import pytest

from evaluate import rundir
from evaluate.report import leaderboard
from evaluate.report.cli import main as report
from tests.fixtures.runs.builder import uniform, write_run


@pytest.fixture(params=[0o022, 0o077])
def umask(request):
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def modes(root: Path) -> dict[str, int]:
    """The permission bits of everything under ``root``, by path relative to it."""
    return {str(path.relative_to(root)): stat.S_IMODE(path.stat().st_mode) for path in sorted(root.rglob("*"))}


def test_run_files_tables_plots_and_leaderboard_folders_get_the_umask(umask, tmp_path, capsys):
    run = tmp_path / "runs" / "by_hand"
    rundir.write_yaml(run / rundir.CONFIG, {"config": {}})
    rundir.write_json(run / rundir.RUN, {"status": "running"})
    rundir.append_predictions(run / rundir.PREDICTIONS, [{"id": "a"}])
    write_run(tmp_path / "runs", uniform([True, True]), method="no_press")
    write_run(tmp_path / "runs", uniform([True, False]), method="snapkv", cr=0.5)
    report([str(tmp_path / "runs"), "--out", str(tmp_path / "tables"), "--bootstrap", "0"])
    leaderboard.main([str(tmp_path / "runs"), "--out", str(tmp_path / "submission")])
    capsys.readouterr()

    files, folders = 0o666 & ~umask, 0o777 & ~umask
    written = {**modes(run), **modes(tmp_path / "tables"), **modes(tmp_path / "submission")}
    assert {name for name, mode in written.items() if mode == folders} == {
        "plots",
        "ruler__4096__meta-llama--Llama-3.1-8B-Instruct__no_press__0.00",
        "ruler__4096__meta-llama--Llama-3.1-8B-Instruct__snapkv__0.50",
    }
    assert {name for name, mode in written.items() if mode != folders} == {
        name for name, mode in written.items() if mode == files
    }
    assert {"config.yaml", "run.json", "runs.csv", "leaderboard.csv", "plots/ruler.png"} <= set(written)
