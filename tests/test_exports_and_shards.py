"""What a new user still hit (issue 34): a predictions line written twice, leaderboard exports into one folder, a
single sharded run's closing lines and the shards' lock files."""

import csv
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from evaluate import rundir
from evaluate.report import leaderboard
from evaluate.report.cli import main as report
from evaluate.score.rescore import main as rescore
from tests.fixtures.runs.builder import uniform, write_run

REPO = Path(__file__).resolve().parents[1]
QWEN = "Qwen/Qwen3-8B"
# One of two answers right on every task, the first wrong: counted twice, it would move its task from 50 to 33.33.
HALF = uniform([False, True])


def append_first_line(run: Path, answered_right: bool = False) -> str:
    """Append the run's first prediction line again (with the right answer instead when ``answered_right``);
    returns its id."""
    path = run / rundir.PREDICTIONS
    first = path.read_text(encoding="utf-8").splitlines()[0]
    row = json.loads(first)
    line = json.dumps({**row, "prediction": f" {row['answers'][0]}."}) if answered_right else first
    with path.open("a", encoding="utf-8") as handle:
        handle.write(line + "\n")
    return row["id"]


# 1. A duplicated predictions line counts once.


def test_a_duplicated_line_is_rescored_once_and_named_in_one_line(tmp_path):
    run = write_run(tmp_path / "runs", HALF, method="snapkv", cr=0.5, model=QWEN)
    before = json.loads((run / rundir.METRICS).read_text())
    sample = append_first_line(run)
    result = subprocess.run(
        [sys.executable, "-m", "evaluate.score", str(run)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((run / rundir.METRICS).read_text()) == before  # n=2 per task, not 3
    warnings = [line for line in result.stderr.splitlines() if "several rows" in line]
    assert len(warnings) == 1
    assert f"1 sample has several rows, each counted once, as its first row: {sample} (lines 1, 27)" in warnings[0]
    assert "the copies are identical" in warnings[0]
    assert len((run / rundir.PREDICTIONS).read_text().splitlines()) == 27  # the file is left as it is


def test_copies_that_differ_are_named_and_the_first_counts(tmp_path, caplog):
    run = write_run(tmp_path / "runs", HALF, method="snapkv", cr=0.5, model=QWEN)
    before = json.loads((run / rundir.METRICS).read_text())
    sample = append_first_line(run, answered_right=True)
    with caplog.at_level(logging.WARNING, logger="evaluate.rundir"):
        rescore([str(run)])
    assert json.loads((run / rundir.METRICS).read_text()) == before  # the first row, wrong, counts
    (warning,) = [record.getMessage() for record in caplog.records if "several rows" in record.getMessage()]
    assert f"the copies of 1 of them differ (of {sample}, in prediction): delete the line that is wrong" in warning
    rows = rundir.read_predictions(run / rundir.PREDICTIONS)
    assert len(rows) == 26 and rows[0]["prediction"] == " I do not know."


def test_the_report_of_a_run_with_a_duplicated_line_is_the_report_without_it(tmp_path, caplog, capsys):
    clean = tmp_path / "clean"
    run = write_run(clean, HALF, method="snapkv", cr=0.5, model=QWEN)
    write_run(clean, uniform([True, True]), method="no_press", model=QWEN)
    doubled = tmp_path / "doubled"
    shutil.copytree(clean, doubled)
    sample = append_first_line(doubled / run.name)
    rescore([str(doubled / run.name)])
    for root in (clean, doubled):
        report([str(root), "--out", str(tmp_path / f"tables_{root.name}"), "--no-plots", "--bootstrap", "200"])
    capsys.readouterr()
    tables = {
        root: {
            path.name: path.read_text().replace(str(tmp_path / root), "ROOT")
            for path in sorted((tmp_path / f"tables_{root}").iterdir())
            if path.is_file()
        }
        for root in ("clean", "doubled")
    }
    assert tables["clean"] and tables["clean"] == tables["doubled"]  # the same n, scores and intervals
    named = [record.getMessage() for record in caplog.records if "several rows" in record.getMessage()]
    assert named and all(f"{sample} (lines 1, 27)" in message for message in named)


def test_a_resume_keeps_the_first_row_of_a_duplicated_sample_and_says_so_once(tmp_path, caplog):
    path = tmp_path / rundir.PREDICTIONS
    rundir.append_predictions(path, [{"id": "a", "prediction": "first"}, {"id": "b"}, {"id": "a", "prediction": "2"}])
    with caplog.at_level(logging.WARNING, logger="evaluate.rundir"):
        assert rundir.read_all_predictions(tmp_path) == [{"id": "a", "prediction": "first"}, {"id": "b"}]
        rundir.read_predictions(path)  # a run's plan, recorder and summary each read the file: one warning
    assert [record.getMessage() for record in caplog.records] == [
        f"{path}: 1 sample has several rows, each counted once, as its first row: a (lines 1, 3); the copies of 1 of "
        "them differ (of a, in prediction): delete the line that is wrong to count the other"
    ]
    # A bare file scored with --benchmark needs no ids: each of its rows counts.
    rundir.append_predictions(path, [{"task": "t"}, {"task": "t"}])
    assert len(rundir.read_predictions(path)) == 4


# 2. Leaderboard exports into one --out.


def export(runs: Path, out: Path, *flags: str) -> int | str | None:
    """``python -m evaluate.report.leaderboard RUNS --out OUT``: how it exits (None: 0; a message: 1 with it)."""
    code = None
    try:
        leaderboard.main([str(runs), "--out", str(out), *flags])
    except SystemExit as end:
        code = end.code
    return code


def leaderboard_rows(out: Path) -> list[dict]:
    with (out / leaderboard.LEADERBOARD_CSV).open(newline="") as handle:
        return list(csv.DictReader(handle))


def submissions(out: Path) -> list[str]:
    return sorted(path.name for path in out.iterdir() if path.is_dir())


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(path.relative_to(out)): path.read_bytes() for path in sorted(out.rglob("*")) if path.is_file()}


@pytest.fixture
def two_sets(tmp_path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, HALF, method="snapkv", cr=0.5, model=QWEN)
    write_run(a, uniform([True, True]), method="no_press", model=QWEN)
    write_run(b, uniform([True, False]), method="knorm", cr=0.25, model=QWEN)
    write_run(b, uniform([True, True]), method="snapkv", cr=0.75, model=QWEN)
    return a, b


def test_exports_of_two_sets_into_one_folder_add_up(two_sets, tmp_path, capsys):
    a, b = two_sets
    out = tmp_path / "submission"
    assert export(a, out) is None
    assert export(b, out) is None
    stdout = capsys.readouterr().out
    assert (
        stdout.splitlines()[-1]
        == f"2 submissions and {out / 'leaderboard.csv'} (of 4: {out} holds earlier exports too)"
    )
    names = submissions(out)
    assert len(names) == 4
    rows = leaderboard_rows(out)
    assert [(row["method"], row["compression_ratio"], row["score"]) for row in rows] == [
        ("knorm", "0.25", "50.00"),
        ("no_press", "0.0", "100.00"),
        ("snapkv", "0.5", "50.00"),
        ("snapkv", "0.75", "100.00"),
    ]
    assert names == sorted(
        f"ruler__4096__Qwen--Qwen3-8B__{row['method']}__{float(row['compression_ratio']):.2f}" for row in rows
    )


def test_the_same_export_twice_changes_nothing(two_sets, tmp_path, capsys):
    a, _ = two_sets
    out = tmp_path / "submission"
    export(a, out)
    first = snapshot(out)
    capsys.readouterr()
    assert export(a, out) is None
    assert snapshot(out) == first
    lines = capsys.readouterr().out.splitlines()
    assert [line.endswith("(unchanged)") for line in lines] == [True, True, False]
    assert lines[-1] == f"2 submissions and {out / 'leaderboard.csv'}"


def test_a_changed_export_of_the_same_name_is_refused_unless_replace(two_sets, tmp_path, capsys):
    a, _ = two_sets
    out = tmp_path / "submission"
    export(a, out)
    kept = snapshot(out)
    changed = tmp_path / "a_changed"
    write_run(changed, uniform([True, True]), method="snapkv", cr=0.5, model=QWEN)  # the same name, other answers
    capsys.readouterr()
    assert export(changed, out) == f"error: nothing exported from {changed}"
    stderr = capsys.readouterr().err.splitlines()
    target = out / "ruler__4096__Qwen--Qwen3-8B__snapkv__0.50"
    assert stderr == [
        f"refused {next(changed.iterdir())}: {target} already holds another export by that name (its metrics.json, "
        "predictions.csv would change); pass --replace to replace it, or --out another folder to keep both"
    ]
    assert snapshot(out) == kept
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]  # no staging folder left

    assert export(changed, out, "--replace") is None
    assert capsys.readouterr().out.splitlines()[0] == f"{target}  score 100.00 (replaced)"
    assert submissions(out) == ["ruler__4096__Qwen--Qwen3-8B__no_press__0.00", target.name]
    assert {row["method"]: row["score"] for row in leaderboard_rows(out)} == {"no_press": "100.00", "snapkv": "100.00"}


def test_a_folder_in_out_that_is_no_submission_is_named_and_left_out_of_the_csv(two_sets, tmp_path, capsys):
    a, _ = two_sets
    out = tmp_path / "submission"
    (out / "notes").mkdir(parents=True)
    assert export(a, out) is None
    assert capsys.readouterr().err == (
        f"refused {out / 'notes'}: not a submission, left out of leaderboard.csv (no config.yaml nor metrics.json)\n"
    )
    assert [row["method"] for row in leaderboard_rows(out)] == ["no_press", "snapkv"]


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_that_is_no_folder_is_refused_in_one_line(two_sets, tmp_path, capsys, where):
    a, _ = two_sets
    file = tmp_path / "leaderboard.csv"
    file.write_text("mine\n")
    out = file if where == "a file" else file / "submission"
    before = sorted(tmp_path.iterdir())
    assert export(a, out) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    where = "" if out == file else f" lies under {file}, which"
    assert captured.err == f"error: --out {out}{where} is not a folder; pass a folder for the submissions\n"
    assert sorted(tmp_path.iterdir()) == before and file.read_text() == "mine\n"


# 3 and 4. A single sharded run: its closing lines, the next commands, no lock left after the merge.


def test_a_single_run_of_each_shard_ends_in_its_lines_and_leaves_no_lock(tmp_path):
    def shard(index: int) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "evaluate", "model=tiny_random", "press=topk", "cr=0.5", "device=cpu"]
        command += [f"output_dir={tmp_path}", "limit=1", "benchmark.tasks=[niah_single_1,niah_single_2]"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        return subprocess.run(
            [*command, f"shard={index}/2"], cwd=REPO, capture_output=True, text=True, timeout=600, env=env
        )

    first = shard(1)
    assert first.returncode == 0, first.stderr
    assert "Traceback" not in first.stderr and "TypeError" not in first.stderr
    (out,) = [path for path in tmp_path.iterdir() if path.is_dir()]
    assert f"shard 1/2 of {out} is done; the point is incomplete: shards 0/2 have samples unanswered" in first.stdout
    assert (
        f"1 points wait for other shards (the last shard to finish scores each):\n  {out}: incomplete" in first.stdout
    )
    assert sorted(path.name for path in (out / rundir.SHARDS).iterdir()) == ["1-of-2.json", "1-of-2.jsonl"]
    # Run again, it has nothing left to answer, and points to what redoes it (a shard refuses overwrite=true).
    again = shard(1)
    assert again.returncode == 0, again.stderr
    assert "already complete (1 samples); pass overwrite=true without shard= to redo the point" in again.stdout
    assert f"shard 1/2 of {out} is done; the point is incomplete" in again.stdout

    last = shard(0)
    assert last.returncode == 0, last.stderr
    assert "niah_single_1" in last.stdout and f"results in {out}" in last.stdout
    commands = [line for line in last.stdout.splitlines() if "python -m evaluate " in line]
    assert len(commands) == 2 and not [line for line in commands if "shard=" in line]
    assert not (out / rundir.SHARDS).exists()  # rows merged, sessions folded, locks gone
    assert json.loads((out / rundir.RUN).read_text())["status"] == "complete"


def test_the_merge_removes_a_killed_shards_lock_but_never_a_live_one(tmp_path):
    out = tmp_path / "run"
    killed = rundir.shard_path(out, "1-of-2", ".lock")
    with rundir.locked(out, shard="0-of-2"):
        killed.write_text("pid 1 on gone (since then)")  # its holder died: nothing holds it
        rundir.remove_shard_files(out)
        assert not killed.exists()
        assert rundir.shard_path(out, "0-of-2", ".lock").exists()
        assert set(rundir.live_shards(out)) == {"0-of-2"}
    assert not (out / rundir.SHARDS).exists()  # the live shard removed its own as it let go


def test_a_shard_waiting_on_a_lock_that_is_removed_takes_the_one_in_its_place(tmp_path):
    out = tmp_path / "run"
    path = rundir.shard_path(out, "0-of-2", ".lock")
    inside, leave = threading.Event(), threading.Event()

    def waiter() -> None:
        with rundir.locked(out, wait=True, shard="0-of-2"):
            inside.set()
            leave.wait(10)

    with rundir.locked(out, shard="0-of-2"):
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.5)  # the waiter opened the file and waits for its lock
        assert not inside.is_set()
    assert inside.wait(10)
    # The waiter holds the file now at the path (not the one removed under it): a third process is refused.
    assert path.exists() and set(rundir.live_shards(out)) == {"0-of-2"}
    with pytest.raises(rundir.RunLocked, match="shard 0-of-2"):
        with rundir.locked(out, shard="0-of-2"):
            pass
    leave.set()
    thread.join(10)
    assert not path.exists()


def test_a_later_export_keeps_the_iso_quality_an_earlier_one_computed(two_sets, tmp_path):
    """Set a holds snapkv at cr 0.5 (score 50) and its uncompressed run (100): below either threshold at its only
    ratio, so '<' 0.5. Set b has no uncompressed run; exporting it after rebuilds leaderboard.csv and keeps a's."""
    a, b = two_sets
    out = tmp_path / "submission"
    export(a, out)
    first = {(row["method"], row["compression_ratio"]): row for row in leaderboard_rows(out)}
    assert (first["snapkv", "0.5"]["iso_cr_absolute"], first["snapkv", "0.5"]["iso_mark_absolute"]) == ("0.5", "<")
    export(b, out)
    after = {(row["method"], row["compression_ratio"]): row for row in leaderboard_rows(out)}
    assert after["snapkv", "0.5"] == first["snapkv", "0.5"]
    assert after["knorm", "0.25"]["iso_cr_absolute"] == ""  # b has no uncompressed run: nothing to compare with
