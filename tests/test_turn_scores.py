"""Scores by turn (SCBench's multi-turn setting): metrics.json's ``score_by_turn`` from hand-made rows, rescoring
without the model, the report's ``{benchmark}_turns`` table and figure, a multi-turn run told apart from its
independent twin in every table, the run's wandb summary and its closing line.

Every sample scores 1 or 0 (RULER's string match on tests/fixtures/runs/builder.py's rows), so a turn's score is the
unweighted mean over tasks of 100 x (correct / samples of that turn), computed here by hand.
"""

import csv
import io
import json
from pathlib import Path

import pytest

from evaluate import rundir
from evaluate.benchmarks.ruler import Ruler
from evaluate.points.config import run_dir
from evaluate.points.resolve import resolve
from evaluate.report import plots
from evaluate.report.build import build_report, write_report
from evaluate.report.cli import main as report_main
from evaluate.report.compare import Reference, compare_tables
from evaluate.report.differences import diff_table
from evaluate.report.leaderboard import Refused, prepare
from evaluate.report.runs import collect_runs
from evaluate.run.summary import run_summary, turn_line
from evaluate.run.tracking import Tracker, turn_summary
from evaluate.score.rescore import main as rescore_main
from evaluate.score.rescore import score_rows
from tests.fixtures.runs.builder import LLAMA, write_run
from tests.support import compose_config

# offline: test_tracking's fixture, an offline wandb in a temporary folder.
from tests.test_tracking import compose, items, offline, wandb_records  # noqa: F401

TASKS = ("niah_single_1", "vt")
# Each task's six samples are two conversations of three turns: sample i is turn i % 3 (builder.conversation_columns).
# niah_single_1 by turn: [T, T] 100, [T, F] 50, [F, F] 0; vt: [T, F] 50 on every turn. By turn, the mean of the two:
MULTI = {"niah_single_1": [True, True, False, True, False, False], "vt": [True, True, True, False, False, False]}
MULTI_BY_TURN = {"0": 75.0, "1": 50.0, "2": 25.0}
# Both tasks [T, F] on every turn: 50 each turn, as independent turns of a press that loses half the answers would.
INDEPENDENT = {task: [True, True, True, False, False, False] for task in TASKS}
ALL_RIGHT = {task: [True] * 6 for task in TASKS}


def rows_of(outcomes: dict[str, list[bool]], turns: int | None = 3) -> list[dict]:
    """Prediction rows as a run records them, a sample's turn and conversation where ``turns`` is given."""
    rows = []
    for task, results in outcomes.items():
        for index, correct in enumerate(results):
            reference = f"{task}-answer-{index}"
            conversation = {"conversation": f"{task}-{index // turns}", "turn": index % turns} if turns else {}
            prediction = f" {reference}." if correct else " I do not know."
            row = {"id": f"{task}-{index}", "task": task, "answers": [reference], "prediction": prediction}
            rows.append({**row, **conversation})
    return rows


def test_score_by_turn_is_the_benchmarks_own_score_on_each_turns_rows():
    metrics = score_rows(Ruler(), rows_of(MULTI))
    assert metrics["score"] == 50.0  # both tasks 3 of 6 over all turns
    assert metrics["score_by_turn"] == MULTI_BY_TURN and list(metrics["score_by_turn"]) == ["0", "1", "2"]
    assert metrics["samples_by_turn"] == {"0": 4, "1": 4, "2": 4}


def test_turns_are_keyed_in_turn_order_past_ten():
    twelve = {"vt": [turn % 2 == 0 for turn in range(12)]}
    metrics = score_rows(Ruler(), rows_of(twelve, turns=12))
    assert list(metrics["score_by_turn"]) == [str(turn) for turn in range(12)]  # "10" after "9", not after "1"
    assert metrics["score_by_turn"]["10"] == 100.0 and metrics["score_by_turn"]["11"] == 0.0


def test_rows_without_turns_give_no_by_turn_keys_and_no_summary_line():
    metrics = score_rows(Ruler(), rows_of(MULTI, turns=None))
    assert "score_by_turn" not in metrics and "samples_by_turn" not in metrics
    assert turn_line(metrics) == [] and turn_summary(metrics) == {}


def test_unanswered_turns_have_no_score_but_their_samples():
    rows = [row | {"prediction": None} for row in rows_of(MULTI)]  # generate=false
    metrics = score_rows(Ruler(), rows)
    assert metrics["score_by_turn"] == {"0": None, "1": None, "2": None}
    assert metrics["samples_by_turn"] == {"0": 4, "1": 4, "2": 4}
    assert turn_line(metrics) == []


def test_rescoring_rewrites_the_same_scores_by_turn_without_the_model(tmp_path, capsys):
    out = write_run(tmp_path, MULTI, method="snapkv", cr=0.5, conversation_turns=3, turns="multi")
    written = json.loads((out / rundir.METRICS).read_text())
    assert written["score_by_turn"] == MULTI_BY_TURN
    (out / rundir.METRICS).write_text(json.dumps({"score": None, "tasks": {}}))  # as if scored before by-turn scores
    rescore_main([str(out)])
    rescored = json.loads((out / rundir.METRICS).read_text())
    assert rescored == written
    assert rescored["samples_by_turn"] == {"0": 4, "1": 4, "2": 4}


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    """The same press and ratio in both modes, each beside its uncompressed baseline, and a run recorded before
    conversations (no turns, no settings) that must keep its label."""
    root = tmp_path / "runs"
    # An uncompressed run recorded before turns and history existed: the baseline of the independent runs.
    write_run(root, ALL_RIGHT, method="no_press", conversation_turns=3)
    write_run(root, ALL_RIGHT, method="no_press", conversation_turns=3, turns="multi", history="reference")
    write_run(root, INDEPENDENT, method="snapkv", cr=0.5, conversation_turns=3, turns="independent")
    write_run(root, MULTI, method="snapkv", cr=0.5, conversation_turns=3, turns="multi", history="reference")
    write_run(root, {task: [True, False] for task in TASKS}, method="knorm", cr=0.5)
    return root


def read_csv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_the_turns_table_holds_the_hand_computed_scores_a_row_per_run(runs_dir, tmp_path):
    runs, skipped = collect_runs(runs_dir)
    report = build_report(runs, skipped, resamples=0)
    (table,) = report.turns
    assert table.name == "ruler_turns"
    assert table.markdown.splitlines() == [
        "| method | cr | turns | history | turn 0 | turn 1 | turn 2 |",
        "|---|---|---|---|---|---|---|",
        "| no compression | cr=0.00 | independent | reference | 100.00 n=4 | 100.00 n=4 | 100.00 n=4 |",
        "| no compression (multi-turn) | cr=0.00 | multi | reference | 100.00 n=4 | 100.00 n=4 | 100.00 n=4 |",
        "| snapkv | cr=0.50 | independent | reference | 50.00 n=4 | 50.00 n=4 | 50.00 n=4 |",
        "| snapkv (multi-turn) | cr=0.50 | multi | reference | 75.00 n=4 | 50.00 n=4 | 25.00 n=4 |",
    ]
    rows = {row["method"]: row for row in read_csv(table.csv)}
    assert sorted(rows) == ["no compression (multi-turn)", "no_press", "snapkv", "snapkv (multi-turn)"]
    multi = rows["snapkv (multi-turn)"]
    assert (multi["turns"], multi["history"], multi["compression_ratio"]) == ("multi", "reference", "0.5")
    assert [multi[f"turn {turn}"] for turn in range(3)] == ["75.0", "50.0", "25.0"]
    assert [multi[f"turn {turn} n"] for turn in range(3)] == ["4", "4", "4"]
    written = write_report(report, tmp_path / "tables", runs_dir, 0)
    assert {path.name for path in written} >= {"ruler_turns.md", "ruler_turns.csv"}
    assert "### ruler: score by turn of the conversation" in (tmp_path / "tables" / "report.md").read_text()


def test_a_multi_turn_run_and_its_independent_twin_are_told_apart_in_every_table(runs_dir):
    runs, skipped = collect_runs(runs_dir)
    assert skipped == [] and len(runs) == 5  # neither twin taken for the other's duplicate
    assert {run.variant for run in runs} == {""}  # the mode is no variant: the older runs keep their labels
    report = build_report(runs, skipped, resamples=0)
    (headline,) = report.headline
    assert headline.markdown.splitlines() == [
        "| benchmark | method | cr=0.50 |",
        "|---|---|---|",
        "| ruler | no compression | 100.00 n=12* |",
        "| ruler | no compression (multi-turn) | 100.00 n=12* |",
        "| ruler | knorm | 50.00 n=4* |",
        "| ruler | snapkv | 50.00 n=12* |",
        "| ruler | snapkv (multi-turn) | 50.00 n=12* |",
    ]
    # Each run's baseline is the uncompressed run of its own mode; the older one pairs with the new independent run.
    against = diff_table(runs, "snapkv", "no_press", resamples=0)
    assert [line.split(" | ")[1] for line in against.markdown.splitlines()[2:]] == ["all", "all (multi-turn)"]
    assert {(pair["method_a"], pair["method_b"]) for pair in read_csv(against.csv)} == {
        ("snapkv", "no compression"),
        ("snapkv (multi-turn)", "no compression (multi-turn)"),
    }
    (pair,) = read_csv(diff_table(runs, "snapkv", "knorm", resamples=0).csv)  # the multi-turn run has no partner
    assert (pair["method_a"], pair["delta"]) == ("snapkv", "0.0")
    listed = read_csv(next(table for table in report.tables() if table.name == "runs").csv)
    assert sorted((row["method"], row["turns"], row["history"]) for row in listed) == [
        ("knorm", "independent", "reference"),
        ("no_press", "independent", "reference"),
        ("no_press", "multi", "reference"),
        ("snapkv", "independent", "reference"),
        ("snapkv", "multi", "reference"),
    ]
    # A published figure asks each question on its own: it is matched with the independent run alone.
    published = Reference("ruler", (), LLAMA, "snapkv", "", False, 0.5, 40.0, "string_match", "paper", "ref.csv")
    (compared,), unmatched = compare_tables(runs, [published], resamples=0)
    (row,) = read_csv(compared.csv)
    assert (unmatched, row["method"], row["measured"], row["delta"]) == (0, "snapkv", "50.0", "10.0")
    (tasks,) = report.tasks  # the columns of one cr, in the order the run directories sort in
    header = tasks.markdown.splitlines()[2].strip("| ").split(" | ")
    assert sorted(header) == sorted(
        ["task", "no compression", "no compression (multi-turn)", "knorm", "snapkv", "snapkv (multi-turn)"]
    )


def test_the_leaderboard_refuses_a_multi_turn_run(tmp_path):
    write_run(tmp_path / "runs", MULTI, method="snapkv", cr=0.5, conversation_turns=3, turns="multi")
    (run,), _ = collect_runs(tmp_path / "runs")
    with pytest.raises(Refused, match="turns=multi: kvpress's leaderboard asks each question on its own"):
        prepare(run, allow_partial=True)


def test_a_report_without_turns_has_no_turns_table_and_keeps_its_columns(tmp_path):
    root = tmp_path / "runs"
    write_run(root, {task: [True, False] for task in TASKS}, method="snapkv", cr=0.5)
    runs, skipped = collect_runs(root)
    report = build_report(runs, skipped, resamples=0)
    assert report.turns == []
    runs_table = next(table for table in report.tables() if table.name == "runs")
    assert "turns" not in read_csv(runs_table.csv)[0]


def test_the_report_command_draws_score_against_turn_a_line_per_run(runs_dir, tmp_path, monkeypatch, capsys):
    tables, folder = tmp_path / "tables", tmp_path / "plots"
    report_main([str(runs_dir), "--out", str(tables), "--plots", str(folder), "--bootstrap", "0"])
    assert "| snapkv (multi-turn) | cr=0.50 | multi | reference | 75.00 n=4 |" in capsys.readouterr().out
    assert (tables / "ruler_turns.md").is_file() and (tables / "ruler_turns.csv").is_file()
    assert (folder / "ruler_turns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: figures.append(fig) or path)
    plots.plot_turns("ruler", build_report(*collect_runs(runs_dir), resamples=0).frame, tmp_path / "turns.png")
    lines = {line.get_label(): list(line.get_ydata()) for line in figures[0].axes[0].get_lines()}
    assert lines["snapkv (multi-turn) · cr=0.50"] == [75.0, 50.0, 25.0]
    assert lines["snapkv · cr=0.50"] == [50.0, 50.0, 50.0]
    assert lines["no compression (multi-turn) · cr=0.00"] == [100.0, 100.0, 100.0]  # dashed, as baselines are
    assert list(figures[0].axes[0].get_xticks()) == [0, 1, 2]


def test_the_run_summary_ends_with_the_score_by_turn(tmp_path):
    cfg = compose_config(tmp_path, "press=topk", "cr=0.5")
    rows = rows_of(MULTI)
    out = run_dir(cfg)
    out.mkdir(parents=True)
    (out / rundir.PREDICTIONS).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    metrics = score_rows(Ruler(), rows)
    lines = run_summary(resolve(cfg), metrics).splitlines()
    assert lines[1] == "score by turn: 0 → 75.00, 1 → 50.00, 2 → 25.00"
    assert "score by turn" not in run_summary(resolve(cfg), score_rows(Ruler(), rows_of(MULTI, turns=None)))


def test_the_runs_wandb_summary_holds_the_score_by_turn(tmp_path, offline):  # noqa: F811
    assert turn_summary(score_rows(Ruler(), rows_of(MULTI))) == {
        "score_by_turn/0": 75.0,
        "score_by_turn/1": 50.0,
        "score_by_turn/2": 25.0,
        "samples_by_turn/0": 4,
        "samples_by_turn/1": 4,
        "samples_by_turn/2": 4,
    }
    tracker = Tracker.from_spec(resolve(compose(tmp_path, "wandb=offline", "press=topk", "cr=0.5")))
    rows = rows_of(MULTI)
    tracker.log_metrics(score_rows(Ruler(), rows), rows, Ruler())
    folder = tracker.run_dir
    tracker.finish()
    summary = {}
    for record in wandb_records(folder):
        if record.WhichOneof("record_type") == "summary":
            summary.update(items(record.summary.update))
    assert (summary["score_by_turn/0"], summary["score_by_turn/2"], summary["samples_by_turn/1"]) == (75.0, 25.0, 4)
    (table,) = (folder / "files" / "media" / "table").glob("turns_*.table.json")
    logged = json.loads(table.read_text())
    assert logged["columns"] == ["turn", "score", "n"]
    assert logged["data"] == [[0, 75.0, 4], [1, 50.0, 4], [2, 25.0, 4]]
