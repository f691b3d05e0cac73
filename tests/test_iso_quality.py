"""Compression at iso-quality (evaluate/score/iso_quality.py, the report's iso_quality table and figure), checked
against hand-computed values on finished runs written by tests/fixtures/runs/builder.py.

The runs hold one RULER task of 200 samples, each its own context, scoring 1 or 0: a run's score is
100 x correct / 200, so 100 right is 50.0, 99 is 49.5, 96 is 48.0, 60 is 30.0 and 80 is 40.0.
"""

import csv
import io
from pathlib import Path

import numpy as np
import pytest

from evaluate.errors import ConfigError
from evaluate.report import leaderboard
from evaluate.report.build import build_report
from evaluate.report.cli import main
from evaluate.report.runs import collect_runs
from evaluate.score.iso_quality import (
    ABOVE,
    AT_LEAST,
    AT_MOST,
    BELOW,
    INTERPOLATED,
    MEASURED,
    IsoInterval,
    Threshold,
    _draw_iso_crs,
    budget_interval,
    check_thresholds,
    iso_budget,
    iso_cr,
    iso_intervals,
)
from tests.fixtures.runs.builder import uniform, write_run

TASK = "niah_single_1"
SAMPLES = 200


def right(correct: int) -> dict[str, list[bool]]:
    """One task of SAMPLES samples, the first ``correct`` of them right."""
    return {TASK: [True] * correct + [False] * (SAMPLES - correct)}


# snapkv: 50, 49.5, 48, 30 at cr 0.25, 0.5, 0.75, 0.9, against an uncompressed 50.
SNAPKV = [(0.25, 100), (0.5, 99), (0.75, 96), (0.9, 60)]


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    root = tmp_path / "runs"
    write_run(root, right(100), method="no_press")
    for cr, correct in SNAPKV:
        write_run(root, right(correct), method="snapkv", cr=cr)
    write_run(root, right(100), method="knorm", cr=0.25)  # 50 and 50: passes at every measured cr
    write_run(root, right(100), method="knorm", cr=0.5)
    write_run(root, right(80), method="tova", cr=0.5)  # 40: fails at its only (smallest) cr
    write_run(root, right(100), method="keydiff", cr=0.5, seed=7)  # another seed: no baseline here
    return root


def rows_of(text: str) -> dict[str, dict]:
    return {row["method"]: row for row in csv.DictReader(io.StringIO(text))}


def test_iso_cr_by_hand():
    ratios, scores = [0.25, 0.5, 0.75, 0.9], [50.0, 49.5, 48.0, 30.0]
    # Absolute, threshold 50 - 1 = 49: 0.25 and 0.5 pass, 0.75 (48) fails first. The line from (0.5, 49.5) to
    # (0.75, 48) crosses 49 at 0.5 + 0.25 x (49.5 - 49) / (49.5 - 48) = 0.5 + 0.25 x 0.5 / 1.5 = 0.58333...
    found = iso_cr(ratios, scores, 49.0)
    assert found.mark == INTERPOLATED and found.cr == 0.5833 and found.text == "≈0.583"
    # Relative, threshold 0.95 x 50 = 47.5: 0.25, 0.5 and 0.75 pass, 0.9 (30) fails first:
    # 0.75 + 0.15 x (48 - 47.5) / (48 - 30) = 0.75 + 0.15 x 0.5 / 18 = 0.754166...
    found = iso_cr(ratios, scores, 47.5)
    assert found.mark == INTERPOLATED and found.cr == 0.7542
    # Every point passes: at least the largest measured cr; the smallest fails: below the smallest.
    assert iso_cr(ratios, scores, 20.0) == iso_cr(ratios, [60.0] * 4, 50.0)
    assert iso_cr(ratios, scores, 20.0).mark == AT_LEAST and iso_cr(ratios, scores, 20.0).cr == 0.9
    assert iso_cr(ratios, scores, 20.0).text == "≥0.9"
    below = iso_cr(ratios, scores, 50.5)
    assert (below.cr, below.mark, below.text) == (0.25, BELOW, "<0.25")
    # The last passing point exactly on the threshold: that point, measured.
    assert iso_cr(ratios, scores, 48.0) == iso_cr(ratios, scores, 48.0).__class__(0.75, MEASURED)
    # A point that passes again after the first failure does not count: the series did not stay within.
    found = iso_cr([0.25, 0.5, 0.75], [50.0, 40.0, 50.0], 49.0)
    assert found.mark == INTERPOLATED and found.cr == 0.275  # 0.25 + 0.25 x (50 - 49) / (50 - 40)


def test_draws_follow_the_scalar_definition():
    """The vectorised per-draw iso-quality cr is the scalar definition on every draw."""
    rng = np.random.default_rng(3)
    ratios = np.array([0.1, 0.3, 0.5, 0.7, 0.9])
    scores = rng.uniform(40, 60, size=(500, 5))
    thresholds = rng.uniform(40, 60, size=500)
    values, at_least, below = _draw_iso_crs(ratios, scores, thresholds)
    for draw in range(500):
        found = iso_cr(list(ratios), list(scores[draw]), thresholds[draw])
        assert values[draw] == pytest.approx(found.cr, abs=1e-4)
        assert at_least[draw] == (found.mark == AT_LEAST) and below[draw] == (found.mark == BELOW)


def test_iso_quality_table_of_a_sweep(runs_dir):
    runs, skipped = collect_runs(runs_dir)
    report = build_report(runs, skipped, resamples=200)
    (table,) = report.iso
    assert table.name == "iso_quality"
    rows = rows_of(table.csv)
    snapkv = rows["snapkv"]
    assert snapkv["baseline_score"] == "50.0" and snapkv["compression_ratios"] == "0.25 0.5 0.75 0.9"
    assert (snapkv["iso_cr_absolute"], snapkv["iso_mark_absolute"]) == ("0.5833", "interpolated")
    assert (snapkv["iso_cr_relative"], snapkv["iso_mark_relative"]) == ("0.7542", "interpolated")
    # The interval holds the estimate and stays within the measured ratios.
    for name, estimate in (("absolute", 0.5833), ("relative", 0.7542)):
        low, high = float(snapkv[f"iso_low_{name}"]), float(snapkv[f"iso_high_{name}"])
        assert 0.25 <= low <= estimate <= high <= 0.9
        assert low < high  # 200 contexts of mixed outcomes: the iso-quality cr moves between draws
    # knorm scores 50 at 0.25 and 0.5: within both thresholds at every measured cr.
    assert (rows["knorm"]["iso_cr_absolute"], rows["knorm"]["iso_mark_absolute"]) == ("0.5", "≥")
    assert (rows["knorm"]["iso_cr_relative"], rows["knorm"]["iso_mark_relative"]) == ("0.5", "≥")
    # tova scores 40 at 0.5, below 49 and 47.5 alike: below its smallest cr.
    assert (rows["tova"]["iso_cr_absolute"], rows["tova"]["iso_mark_absolute"]) == ("0.5", "<")
    assert (rows["tova"]["iso_cr_relative"], rows["tova"]["iso_mark_relative"]) == ("0.5", "<")
    # keydiff has no baseline: named, no figure, and every other table is still built.
    assert rows["keydiff"]["iso_cr_absolute"] == "" and rows["keydiff"]["note"] == "no uncompressed run to compare with"
    assert any("No uncompressed run to compare with for ruler keydiff" in note for note in table.notes)
    lines = table.markdown.splitlines()
    assert lines[0] == "| benchmark | method | no compression | cr measured | ≥ baseline − 1 | ≥ 0.95 × baseline |"
    assert any(line.startswith("| ruler | snapkv | 50.00 | 0.25, 0.5, 0.75, 0.9 | ≈0.583 [") for line in lines)
    # knorm answers as its baseline and tova 40 on every draw: the draws only bound the figure, as the estimate.
    assert "| ruler | knorm | 50.00 | 0.25, 0.5 | ≥0.5 [≥0.5, ≥0.5] | ≥0.5 [≥0.5, ≥0.5] |" in lines
    assert rows["tova"]["iso_interval_absolute"] == "[<0.5, <0.5]"
    assert "| ruler | keydiff | - | 0.5 | - | - |" in lines
    assert report.headline and "iso_quality" in {t.name for t in report.tables()}


def test_thresholds_are_options(runs_dir):
    runs, skipped = collect_runs(runs_dir)
    report = build_report(runs, skipped, resamples=0, iso_delta=2.5, iso_relative=0.5)
    snapkv = rows_of(report.iso[0].csv)["snapkv"]
    # 50 - 2.5 = 47.5 gives the relative default's figure; 0.5 x 50 = 25: every point passes.
    assert (snapkv["iso_cr_absolute"], snapkv["iso_mark_absolute"]) == ("0.7542", "interpolated")
    assert (snapkv["iso_cr_relative"], snapkv["iso_mark_relative"]) == ("0.9", "≥")
    assert snapkv["iso_low_absolute"] == "" and snapkv["iso_interval_absolute"] == ""  # --bootstrap 0


def test_interval_is_degenerate_when_every_context_is_alike(tmp_path):
    """Every sample right in the baseline and at cr 0.25, every one wrong at 0.5: every draw scores 100, 100 and 0,
    so every draw's iso-quality cr is the estimate: 0.25 + 0.25 x (100 - 99) / (100 - 0) = 0.2525."""
    root = tmp_path / "runs"
    write_run(root, right(SAMPLES), method="no_press")
    write_run(root, right(SAMPLES), method="snapkv", cr=0.25)
    write_run(root, right(0), method="snapkv", cr=0.5)
    runs, _ = collect_runs(root)
    baseline = next(run for run in runs if run.method == "no_press")
    points = sorted((run for run in runs if run.method == "snapkv"), key=lambda run: run.compression_ratio)
    chosen = [Threshold("absolute", 1.0), Threshold("relative", 0.95)]
    absolute, relative = iso_intervals(
        baseline.benchmark_object,
        baseline.rows,
        [run.benchmark_object for run in points],
        [run.rows for run in points],
        [0.25, 0.5],
        chosen,
        resamples=100,
    )
    assert (absolute.low, absolute.high) == (0.2525, 0.2525)
    # 0.95 x 100 = 95: 0.25 + 0.25 x (100 - 95) / 100 = 0.2625
    assert (relative.low, relative.high) == (0.2625, 0.2625)
    assert absolute.low_mark == absolute.high_mark == "" and absolute.text == "[0.253, 0.253]"


@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (["--iso-delta", "-1"], "error: --iso-delta -1.0: the absolute threshold is points below the uncompressed"),
        (["--iso-relative", "0"], "error: --iso-relative 0.0: the relative threshold is a share of the uncompressed"),
        (["--iso-relative", "1.5"], "error: --iso-relative 1.5: the relative threshold is a share"),
        (["--iso-delta", "nan"], "error: --iso-delta nan: the absolute threshold"),
    ],
)
def test_thresholds_out_of_range_are_refused_in_one_line(runs_dir, tmp_path, capsys, arguments, line):
    with pytest.raises(SystemExit) as exit:
        main([str(runs_dir), "--out", str(tmp_path / "tables"), "--no-plots", *arguments])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "tables").exists()


def test_threshold_bounds_are_accepted():
    check_thresholds(0.0, 1.0)  # δ = 0: no loss at all; ρ = 1: the full uncompressed score
    with pytest.raises(ConfigError):
        check_thresholds(1.0, float("inf"))


def test_a_tree_without_baselines_still_writes_every_table_and_plot(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, right(100), method="snapkv", cr=0.25)
    write_run(root, right(90), method="snapkv", cr=0.5)
    out = tmp_path / "tables"
    main([str(root), "--out", str(out), "--bootstrap", "50"])
    printed = capsys.readouterr().out
    assert "No uncompressed run to compare with for ruler snapkv" in printed
    assert {path.name for path in out.iterdir()} >= {"ruler.csv", "ruler_tasks.csv", "iso_quality.csv", "runs.csv"}
    assert sorted(path.name for path in (out / "plots").iterdir()) == ["ruler.png", "ruler_tasks.png"]  # no _iso


def test_the_iso_quality_figure_is_drawn(runs_dir, tmp_path, capsys):
    out = tmp_path / "tables"
    main([str(runs_dir), "--out", str(out), "--bootstrap", "50"])
    capsys.readouterr()
    assert (out / "plots" / "ruler_iso.png").stat().st_size > 0
    assert "### Compression at iso-quality" in (out / "report.md").read_text()


def test_leaderboard_csv_has_each_method_at_iso_quality(tmp_path, capsys):
    """leaderboard.csv gives every submission its method's figures; the no-compression row and a method without a
    baseline have none (the latter says why)."""
    root = tmp_path / "runs"
    qwen = "Qwen/Qwen3-8B"
    write_run(root, uniform([True, True]), method="no_press", model=qwen)
    write_run(root, uniform([True, True]), method="snapkv", cr=0.25, model=qwen)  # 100
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5, model=qwen)  # 50
    write_run(root, uniform([True, True]), method="knorm", cr=0.5, model=qwen)  # 100: within everywhere
    write_run(root, uniform([True, False]), method="tova", cr=0.5, model=qwen, query_aware=True)  # no baseline
    out = tmp_path / "submission"
    leaderboard.main([str(root), "--out", str(out)])
    capsys.readouterr()
    rows = {(row["method"], row["compression_ratio"]): row for row in csv.DictReader((out / "leaderboard.csv").open())}
    iso = ["iso_cr_absolute", "iso_mark_absolute", "iso_cr_relative", "iso_mark_relative", "iso_note"]
    # snapkv: 100 at 0.25, 50 at 0.5 against 100. Absolute (t = 99): 0.25 + 0.25 x (100 - 99) / (100 - 50) = 0.255;
    # relative (t = 95): 0.25 + 0.25 x (100 - 95) / (100 - 50) = 0.275. Both its rows carry the method's figures.
    for cr in ("0.25", "0.5"):
        assert [rows["snapkv", cr][key] for key in iso] == ["0.255", "interpolated", "0.275", "interpolated", ""]
    assert [rows["knorm", "0.5"][key] for key in iso] == ["0.5", "≥", "0.5", "≥", ""]
    assert [rows["tova", "0.5"][key] for key in iso] == ["", "", "", "", "no uncompressed run to compare with"]
    assert [rows["no_press", "0.0"][key] for key in iso] == ["", "", "", "", ""]


def test_iso_budget_by_hand():
    """Budgets scan from the largest down: the smallest budget whose score stays within the threshold."""
    budgets, scores = [1024, 256, 64], [50.0, 49.5, 40.0]
    # Absolute, threshold 49: 1024 and 256 pass, 64 (40) fails first. The line from (256, 49.5) to (64, 40) crosses
    # 49 at 256 + (64 - 256) x (49.5 - 49) / (49.5 - 40) = 256 - 96 / 9.5 = 245.8947...
    found = iso_budget(budgets, scores, 49.0)
    assert found.mark == INTERPOLATED and found.cr == round(256 + (64 - 256) * (49.5 - 49) / (49.5 - 40), 4)
    assert (found.cr, found.text) == (245.8947, "≈245.895")
    # Every budget passes: at most the smallest; the largest already fails: above the largest.
    assert (iso_budget(budgets, scores, 30.0).cr, iso_budget(budgets, scores, 30.0).mark) == (64, AT_MOST)
    assert iso_budget(budgets, scores, 30.0).text == "≤64"
    above = iso_budget(budgets, scores, 50.5)
    assert (above.cr, above.mark, above.text) == (1024, ABOVE, ">1024")
    # The last passing budget exactly on the threshold: that budget, measured.
    assert iso_budget(budgets, scores, 49.5) == found.__class__(256, MEASURED)
    with pytest.raises(ValueError, match="budgets descending"):
        iso_budget([64, 256, 1024], scores[::-1], 49.0)


def test_a_budget_interval_swaps_its_bounds_and_marks():
    """On the axis -budget a draw interval [<-1024, -200] (some draws fail at the largest budget) reads [200, >1024]
    in budgets; [-300, ≥-64] (some draws pass everywhere) reads [≤64, 300]."""
    found = budget_interval(IsoInterval(-1024.0, -200.0, BELOW, "", resamples=10, contexts=5))
    assert (found.low, found.high, found.low_mark, found.high_mark) == (200.0, 1024.0, "", ABOVE)
    assert found.text == "[200, >1024]" and (found.resamples, found.contexts) == (10, 5)
    assert budget_interval(IsoInterval(-300.0, -64.0, "", AT_LEAST, 10, 5)).text == "[≤64, 300]"


@pytest.fixture
def budget_runs(tmp_path) -> Path:
    """snapkv at budgets 1024, 256, 64 scoring 50, 49.5, 40 against an uncompressed 50, and at cr 0.5; knorm 50 at
    256 and 64; tova 40 at 1024."""
    root = tmp_path / "runs"
    write_run(root, right(100), method="no_press")
    for budget, correct in ((1024, 100), (256, 99), (64, 80)):
        write_run(root, right(correct), method="snapkv", budget=budget)
    write_run(root, right(99), method="snapkv", cr=0.5)
    write_run(root, right(100), method="knorm", budget=256)
    write_run(root, right(100), method="knorm", budget=64)
    write_run(root, right(80), method="tova", budget=1024)
    return root


def test_iso_quality_table_of_a_budget_sweep(budget_runs):
    report = build_report(*collect_runs(budget_runs), resamples=200)
    by_cr, by_budget = report.iso
    assert (by_cr.name, by_budget.name) == ("iso_quality", "iso_quality_budget")
    assert set(rows_of(by_cr.csv)) == {"snapkv"}  # the cr table reads the cr run alone
    assert rows_of(by_cr.csv)["snapkv"]["compression_ratios"] == "0.5"
    rows = rows_of(by_budget.csv)
    snapkv = rows["snapkv"]
    assert (snapkv["baseline_score"], snapkv["budgets"]) == ("50.0", "1024 256 64")
    assert (snapkv["iso_budget_absolute"], snapkv["iso_mark_absolute"]) == ("245.8947", "interpolated")
    # Relative, threshold 47.5: 256 + (64 - 256) x (49.5 - 47.5) / (49.5 - 40) = 256 - 384 / 9.5 = 215.5789...
    assert (snapkv["iso_budget_relative"], snapkv["iso_mark_relative"]) == ("215.5789", "interpolated")
    for name, estimate in (("absolute", 245.8947), ("relative", 215.5789)):
        low, high = float(snapkv[f"iso_low_{name}"]), float(snapkv[f"iso_high_{name}"])
        assert 64 <= low <= estimate <= high <= 1024 and low < high
    # knorm answers as its baseline on every draw, tova 40 on every draw: the draws only bound the figure.
    assert (rows["knorm"]["iso_budget_absolute"], rows["knorm"]["iso_mark_absolute"]) == ("64.0", "≤")
    assert rows["knorm"]["iso_interval_absolute"] == "[≤64, ≤64]"
    assert (rows["tova"]["iso_budget_relative"], rows["tova"]["iso_mark_relative"]) == ("1024.0", ">")
    assert rows["tova"]["iso_interval_relative"] == "[>1024, >1024]"
    lines = by_budget.markdown.splitlines()
    assert lines[0] == "| benchmark | method | no compression | budget measured | ≥ baseline − 1 | ≥ 0.95 × baseline |"
    assert any(line.startswith("| ruler | snapkv | 50.00 | 1024, 256, 64 | ≈245.895 [") for line in lines)
    assert "| ruler | knorm | 50.00 | 256, 64 | ≤64 [≤64, ≤64] | ≤64 [≤64, ≤64] |" in lines
    assert by_budget.title.startswith("Compression at iso-quality: the smallest token budget whose score stays")
    assert "> the largest measured budget already fails" in by_budget.notes[0]


def test_a_budget_interval_is_degenerate_when_every_context_is_alike(tmp_path):
    """Every sample right in the baseline and at budget 1024, every one wrong at 256: every draw scores 100, 100 and
    0, so the interval is the estimate, 1024 + (256 - 1024) x (100 - 99) / (100 - 0) = 1016.32 (absolute) and
    1024 - 768 x 5 / 100 = 985.6 (relative, 0.95 x 100 = 95)."""
    root = tmp_path / "runs"
    write_run(root, right(SAMPLES), method="no_press")
    write_run(root, right(SAMPLES), method="snapkv", budget=1024)
    write_run(root, right(0), method="snapkv", budget=256)
    (table,) = [t for t in build_report(*collect_runs(root), resamples=100).iso if t.name == "iso_quality_budget"]
    snapkv = rows_of(table.csv)["snapkv"]
    assert [snapkv[f"iso_{key}_absolute"] for key in ("budget", "low", "high")] == ["1016.32"] * 3
    assert [snapkv[f"iso_{key}_relative"] for key in ("budget", "low", "high")] == ["985.6"] * 3
    assert snapkv["iso_interval_absolute"] == "[1016.32, 1016.32]"


def test_the_budget_iso_quality_figure_is_drawn(budget_runs, tmp_path, capsys):
    out = tmp_path / "tables"
    main([str(budget_runs), "--out", str(out), "--bootstrap", "50"])
    capsys.readouterr()
    assert (out / "plots" / "ruler_iso_budget.png").stat().st_size > 0
    assert (out / "iso_quality_budget.md").exists() and (out / "iso_quality_budget.csv").exists()
    assert "the smallest token budget whose score stays" in (out / "report.md").read_text()
