"""Tables, intervals, comparisons and plots from hand-written finished runs (tests/fixtures/runs/builder.py).

Every sample scores 1 or 0, so a task scores 100 x (correct / samples) and a run the mean over tasks.
"""

import csv
import io
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import yaml

from evaluate.benchmarks import Source
from evaluate.benchmarks.longbench import LongBench
from evaluate.benchmarks.loogle import Loogle
from evaluate.benchmarks.ruler import TASKS as RULER_TASKS
from evaluate.benchmarks.ruler import Ruler
from evaluate.benchmarks.ruler_synth import RulerSynth
from evaluate.report import plots
from evaluate.report.build import build_report
from evaluate.report.cli import main
from evaluate.report.compare import load_references
from evaluate.report.differences import Effect, diff_table, load_effects
from evaluate.report.frame import runs_frame
from evaluate.report.plots import plot_benchmark
from evaluate.report.runs import collect_runs
from evaluate.score.bootstrap import Decomposition, difference_interval, headline_interval, mean_interval
from tests.fixtures.runs.builder import LLAMA, ruler_benchmark, uniform, write_run

# eg_chunkkv_snapkv at cr 0.9: the first six tasks all right, the other seven half right.
EG_AT_90 = {task: [True, True] if i < 6 else [True, False] for i, task in enumerate(RULER_TASKS)}


@pytest.fixture
def runs_dir(tmp_path):
    root = tmp_path / "runs"
    write_run(root, uniform([True, True]), method="no_press")
    write_run(root, uniform([True, True]), method="chunkkv_snapkv", cr=0.85)
    write_run(root, uniform([True, False]), method="chunkkv_snapkv", cr=0.9)
    write_run(root, uniform([True, True]), method="eg_chunkkv_snapkv", cr=0.85)
    write_run(root, EG_AT_90, method="eg_chunkkv_snapkv", cr=0.9)
    write_run(root, uniform([True, False, True]), method="snapkv", cr=0.9, limit=3)
    write_run(root, uniform([True]), method="snapkv", cr=0.5, status="running")
    return root


def report_of(runs_dir, **kwargs):
    runs, skipped = collect_runs(runs_dir)
    return build_report(runs, skipped, **kwargs)


def read_csv(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_headline_table_has_the_pr_layout_with_hand_computed_scores(runs_dir):
    report = report_of(runs_dir, resamples=0)
    (table,) = report.headline
    assert table.markdown.splitlines() == [
        "| benchmark | method | cr=0.85 | cr=0.90 |",
        "|---|---|---|---|",
        "| ruler | no compression | 100.00 n=26 | 100.00 n=26 |",
        "| ruler | chunkkv_snapkv | 100.00 n=26 | 50.00 n=26 |",
        # (6 x 100 + 7 x 50) / 13 = 73.08
        "| ruler | eg_chunkkv_snapkv | 100.00 n=26 | 73.08 n=26 |",
        # 2 of 3 right in every task; limit=3 makes it partial
        "| ruler | snapkv |  | 66.67 n=39* |",
    ]
    assert "limit=3 samples per task (1 of 6 runs)" in table.page()
    rows = {row["method"]: row for row in read_csv(table.csv)}
    assert rows["eg_chunkkv_snapkv"]["cr=0.90"] == "73.08"
    assert rows["snapkv"]["cr=0.90 n"] == "39" and rows["snapkv"]["cr=0.90 partial"] == "True"
    assert rows["snapkv"]["cr=0.85"] == ""
    assert [path.name for path, _ in report.skipped] == [p.name for p in runs_dir.glob("*snapkv__cr0.50*")]


def test_partial_reasons_name_limit_missing_tasks_and_local_data(tmp_path):
    root = tmp_path / "runs"
    write_run(root, {task: [True] for task in RULER_TASKS[:12]}, method="knorm", cr=0.5)
    write_run(root, uniform([True]), method="knorm", cr=0.25, benchmark=ruler_benchmark(path="/data/ruler"))
    write_run(root, uniform([True]), method="knorm", cr=0.75)
    runs, _ = collect_runs(root)
    reasons = {run.compression_ratio: run.partial_reasons for run in runs}
    assert reasons[0.5] == ["12 of 13 tasks (missing qa_2)"]
    assert reasons[0.25] == ["local data benchmark.path=/data/ruler, not the hub dataset simonjegou/ruler"]
    assert reasons[0.75] == []


def test_a_variant_names_each_differing_setting_once_though_the_config_holds_it_under_several_keys(tmp_path):
    root = tmp_path / "runs"
    for seed, window_size in ((1, 32), (2, 64)):
        out = write_run(root, uniform([True]), method="snapkv", cr=0.5, seed=seed)
        record = yaml.safe_load((out / "config.yaml").read_text())
        # As conf/press/topk.yaml and conf/scorer/snapkv.yaml resolve: press is ${scorer.press}, and the scorer's
        # min_context is ${.press.window_size}.
        record["config"]["scorer"]["press"]["window_size"] = window_size
        record["config"]["scorer"]["min_context"] = window_size
        record["config"]["press"]["window_size"] = window_size
        (out / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    runs, _ = collect_runs(root)
    assert sorted(run.variant for run in runs) == ["press.window_size=32, seed=1", "press.window_size=64, seed=2"]


def test_per_task_table_lists_every_task_with_its_n_then_the_headline(runs_dir):
    report = report_of(runs_dir, resamples=0)
    (table,) = report.tasks
    section = table.markdown.split("#### cr=0.90")[1]
    lines = section.strip().splitlines()
    assert lines[0] == "| task | no compression | chunkkv_snapkv | eg_chunkkv_snapkv | snapkv |"
    assert "| cwe | 100.00 n=2 | 50.00 n=2 | 50.00 n=2 | 66.67 n=3* |" in lines
    assert "| niah_single_1 | 100.00 n=2 | 50.00 n=2 | 100.00 n=2 | 66.67 n=3* |" in lines
    assert lines[-1] == "| **score** | 100.00 | 50.00 | 73.08 | 66.67 |"
    rows = read_csv(table.csv)
    assert len(rows) == 13 * 6  # every task of every finished run
    (vt,) = [
        row
        for row in rows
        if row["method"] == "eg_chunkkv_snapkv" and row["task"] == "vt" and row["compression_ratio"] == "0.9"
    ]
    assert (vt["score"], vt["n"], vt["partial"]) == ("50.0", "2", "False")


def test_gate_effect_is_eg_minus_chunkkv_with_a_paired_interval(runs_dir):
    report = report_of(runs_dir, resamples=500)
    (gate,) = report.differences
    body = gate.markdown.splitlines()
    assert body[0] == "| benchmark | inner scorer | cr=0.85 | cr=0.90 |"
    # Identical runs at 0.85: the difference and its whole interval are 0.
    assert body[2].startswith("| ruler | snapkv | +0.00 [+0.00, +0.00] n=26 | +23.08 [")
    (row_90,) = [row for row in read_csv(gate.csv) if row["compression_ratio"] == "0.9"]
    assert row_90["delta"] == "23.08"
    # EG is right wherever ChunkKV is, so no resample can favour ChunkKV; the gain is 6 of 13 tasks at most.
    assert 0 < float(row_90["ci_low"]) <= 23.08 <= float(row_90["ci_high"]) <= 600 / 13
    # Two contexts per task are too few for the bootstrap to show all the noise, and the table says so.
    assert any("resample only 2 contexts per task" in note for note in gate.notes)


def test_diff_pairs_any_two_methods_and_no_press_at_every_ratio(runs_dir):
    runs, _ = collect_runs(runs_dir)
    table = diff_table(runs, "eg_chunkkv_snapkv", "no_press", resamples=0)
    assert table.markdown.splitlines()[2] == "| ruler | all | +0.00 | -26.92 |"
    with pytest.raises(Exception, match="no finished run of method 'dropkv'"):
        diff_table(runs, "dropkv", "no_press", resamples=0)


def test_runs_of_one_method_that_differ_in_a_setting_get_their_own_rows(tmp_path):
    root = tmp_path / "runs"
    write_run(root, uniform([True, True]), method="snapkv", cr=0.5, seed=1)
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5, seed=2)
    report = report_of(root, resamples=0)
    lines = report.headline[0].markdown.splitlines()
    assert lines[2:] == ["| ruler | snapkv [seed=1] | 100.00 n=26 |", "| ruler | snapkv [seed=2] | 50.00 n=26 |"]


def test_the_eg_chunkkv_preset_shows_the_gate_effect_against_both_chunkkvs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, EG_AT_90, method="eg_chunkkv_snapkv", cr=0.9)
    write_run(root, uniform([True, False]), method="chunkkv_snapkv", cr=0.9)
    write_run(root, uniform([True, True]), method="chunkkv_exact_snapkv", cr=0.9)
    effects = load_effects("eg_chunkkv_pr")
    assert [(effect.name, effect.a, effect.b) for effect in effects] == [
        ("gate_effect", "eg_chunkkv_{scorer}", "chunkkv_{scorer}"),
        ("gate_effect_exact", "eg_chunkkv_{scorer}", "chunkkv_exact_{scorer}"),
    ]
    kvpress, exact = report_of(root, resamples=0, effects=effects).differences
    assert kvpress.title.startswith("Gate effect vs kvpress's ChunkKV")
    assert exact.title.startswith("Gate effect at an equal budget")
    assert kvpress.markdown.splitlines()[2] == "| ruler | snapkv | +23.08 |"
    # chunkkv_exact_snapkv scores 100: the gate loses 26.92 against it.
    assert exact.markdown.splitlines()[2] == "| ruler | snapkv | -26.92 |"
    assert [row["method_b"] for row in read_csv(exact.csv)] == ["chunkkv_exact_snapkv"]
    # The default configuration has the first table only.
    (default,) = report_of(root, resamples=0).differences
    assert default.csv == kvpress.csv


def test_an_effect_pairs_the_methods_its_scorer_patterns_share():
    effect = Effect(name="e", title="t", a="eg_chunkkv_{scorer}", b="chunkkv_{scorer}")
    methods = ["eg_chunkkv_snapkv", "chunkkv_snapkv", "chunkkv_exact_tova", "eg_chunkkv_tova", "snapkv", "no_press"]
    assert effect.method_pairs(methods) == [("snapkv", "eg_chunkkv_snapkv", "chunkkv_snapkv")]
    suffixed = Effect(name="e", title="t", a="adakv_{scorer}", b="{scorer}")
    assert suffixed.method_pairs(["adakv_dropkv", "dropkv", "adakv_snapkv"]) == [("dropkv", "adakv_dropkv", "dropkv")]


@dataclass
class TwoTaskRuler(Ruler):
    """A benchmark added by its module alone: the report reads its full extent from the class."""

    all_tasks: ClassVar[tuple[str, ...]] = ("vt", "cwe")
    source: ClassVar[Source] = Source(dataset="me/two-tasks")
    name: str = "two_tasks"
    dataset: str = "me/two-tasks"


def test_partial_reasons_come_from_the_benchmark_the_run_recorded(tmp_path):
    root = tmp_path / "runs"
    benchmark = {"_target_": f"{__name__}.TwoTaskRuler", "name": "two_tasks", "dataset": "me/two-tasks"}
    write_run(root, {"vt": [True, False], "cwe": [True, True]}, method="snapkv", cr=0.5, benchmark=benchmark)
    write_run(root, {"vt": [True]}, method="snapkv", cr=0.7, benchmark={**benchmark, "dataset": "other/data"})
    runs, _ = collect_runs(root)
    reasons = {run.compression_ratio: run.partial_reasons for run in runs}
    assert reasons == {
        0.5: [],
        0.7: ["1 of 2 tasks (missing cwe)", "dataset other/data, not the hub dataset me/two-tasks"],
    }


def test_every_benchmark_judges_its_own_coverage():
    config = {"limit": None, "fraction": 0.5, "benchmark": {}}
    rows = [{"task": "shortdep_qa"}, {"task": "longdep_qa", "error": "out of memory"}]
    assert Loogle(path="/data/loogle").coverage(rows, config) == [
        "fraction=0.5",
        "2 of 4 tasks (missing longdep_summarization, shortdep_cloze)",
        "local data benchmark.path=/data/loogle, not the hub dataset simonjegou/loogle",
        "1 samples failed",
    ]
    assert LongBench().coverage([{"task": task} for task in LongBench.all_tasks], {"limit": 1}) == [
        "limit=1 samples per task"
    ]
    synthetic = [{"task": task} for task in RulerSynth.all_tasks for _ in range(3)]
    assert RulerSynth(num_samples=3).coverage(synthetic, {"limit": 5}) == []
    assert RulerSynth(num_samples=4).coverage(synthetic, {"limit": None}) == ["3 of 4 samples per task"]
    assert RulerSynth(num_samples=4, tasks=["vt"]).coverage([{"task": "vt"}] * 3, {}) == [
        "3 of 4 samples per task",
        "1 of 13 tasks (missing niah_single_1, niah_single_2, niah_single_3, niah_multikey_1, ...)",
    ]


def test_compare_puts_measured_published_and_delta_side_by_side(runs_dir, tmp_path):
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "scores.csv").write_text(
        "benchmark,benchmark_settings,model,method,query_aware,compression_ratio,score,source\n"
        f"ruler,data_dir=4096,{LLAMA},eg_chunkkv_snapkv,false,0.90,36.45,PR\n"
        f"ruler,data_dir=4096,{LLAMA},eg_chunkkv_snapkv,true,0.90,50.00,query-aware: no such run\n"
        f"ruler,data_dir=8192,{LLAMA},eg_chunkkv_snapkv,false,0.90,20.00,other data: no such run\n"
        "ruler,data_dir=4096,Qwen/Qwen3-8B,no_press,false,0.0,95.3,other model: no such run\n"
        # a local copy of the weights keeps the repo name
        "ruler,,/models/Llama-3.1-8B-Instruct,no_press,false,0.0,95.7,leaderboard\n"
    )
    (reference / "deltas.csv").write_text(
        "benchmark,benchmark_settings,model,method_a,method_b,query_aware,compression_ratio,delta,source\n"
        f"ruler,data_dir=4096,{LLAMA},eg_chunkkv_snapkv,chunkkv_snapkv,false,0.90,4.85,PR comment\n"
    )
    report = report_of(runs_dir, resamples=0, reference_dir=reference)
    scores, deltas = report.comparisons
    assert scores.markdown.splitlines()[2:] == [
        f"| ruler | {LLAMA} | eg_chunkkv_snapkv | false | 0.9 | 73.08 n=26 | 36.45 | +36.63 | PR |",
        "| ruler | /models/Llama-3.1-8B-Instruct | no compression | false | 0 | 100.00 n=26 | 95.70 | +4.30 "
        "| leaderboard |",
    ]
    assert deltas.markdown.splitlines()[2] == (
        f"| ruler | {LLAMA} | eg_chunkkv_snapkv − chunkkv_snapkv | false | 0.9 | +23.08 | +4.85 | +18.23 | PR comment |"
    )
    assert report.unmatched_references == 3
    assert "3 published figures have no matching run." in report.page(runs_dir, 0)


def test_the_committed_reference_numbers_load_with_their_sources():
    references = load_references(Path(__file__).parent.parent / "results" / "reference")
    assert all(reference.source for reference in references)
    eg = [r for r in references if r.method == "eg_chunkkv_snapkv" and r.benchmark == "ruler" and not r.method_b]
    assert {(r.compression_ratio, r.value) for r in eg} == {(0.85, 46.12), (0.9, 36.45), (0.95, 21.99)}
    assert all(r.settings == (("data_dir", "4096"),) for r in eg)
    swap = [r for r in references if r.method_b == "chunkkv_tova"]
    assert {(r.compression_ratio, r.value) for r in swap} == {(0.85, -1.57), (0.9, 3.94), (0.95, 1.76)}


# ---------------------------------------------------------------------------------------------------------------
# Bootstrap
# ---------------------------------------------------------------------------------------------------------------


def ruler_rows(outcomes: dict[str, list[bool]], context_of=None) -> list[dict]:
    rows = []
    for task, results in outcomes.items():
        for i, correct in enumerate(results):
            rows.append(
                {
                    "id": f"{task}-{i}",
                    "task": task,
                    "context_id": context_of(task, i) if context_of else f"{task}-{i}",
                    "answers": ["needle"],
                    "prediction": "the needle" if correct else "nothing",
                }
            )
    return rows


def brute_force_interval(benchmark, rows, resamples, seed, tasks):
    """Resample contexts within each task with the decomposed path's draws, and score each resample with
    ``benchmark.score`` itself."""
    rng = np.random.default_rng(seed)
    clusters = {}
    for row in rows:
        clusters.setdefault(row["task"], {}).setdefault(row["context_id"], []).append(row)
    draws = {}
    for task in tasks:
        ids = sorted(clusters[task])
        draws[task] = (ids, rng.integers(0, len(ids), size=(resamples, len(ids))))
    values = []
    for b in range(resamples):
        picked = [row for task, (ids, idx) in draws.items() for i in idx[b] for row in clusters[task][ids[i]]]
        values.append(benchmark.score(picked)["score"])
    return np.percentile(values, [2.5, 97.5])


def test_bootstrap_interval_equals_brute_force_resampling_with_benchmark_score():
    generator = np.random.default_rng(7)
    outcomes = {
        task: list(generator.random(9) < p) for task, p in zip(RULER_TASKS[:4], (0.2, 0.5, 0.7, 0.9), strict=True)
    }
    # Three questions share each context, as LOOGLE's do: whole contexts are resampled.
    rows = ruler_rows(outcomes, context_of=lambda task, i: f"{task}-ctx{i // 3}")
    benchmark = Ruler()
    decomposition = Decomposition(benchmark, rows)
    assert decomposition.decomposed and list(decomposition.tasks) == list(outcomes)
    interval = headline_interval(benchmark, rows, resamples=300, seed=3)
    low, high = brute_force_interval(benchmark, rows, 300, 3, list(decomposition.tasks))
    # benchmark.score rounds each task and the headline to 2 decimals; the decomposed path does not.
    assert interval.decomposed and interval.low == pytest.approx(low, abs=0.02)
    assert interval.high == pytest.approx(high, abs=0.02)
    assert interval.low < benchmark.score(rows)["score"] < interval.high


def test_a_task_with_a_single_context_gives_no_interval_rather_than_a_zero_width_one(tmp_path):
    root = tmp_path / "runs"
    write_run(root, uniform([True]), method="snapkv", cr=0.5)
    write_run(root, uniform([False]), method="snapkv", cr=0.7)
    (table,) = report_of(root, resamples=100).headline
    assert table.markdown.splitlines()[2] == "| ruler | snapkv | 100.00 n=13 | 0.00 n=13 |"
    assert "No interval: cwe, fwe, niah_multikey_1, ... have a single context (2 cells)." in table.notes


def test_constant_outcomes_give_a_zero_width_interval():
    rows = ruler_rows(uniform([True, True, True], RULER_TASKS[:3]))
    interval = headline_interval(Ruler(), rows, resamples=200)
    assert (interval.low, interval.high) == (100.0, 100.0)


def test_paired_difference_of_a_run_with_itself_is_exactly_zero_and_dominance_excludes_zero():
    generator = np.random.default_rng(1)
    outcomes = {task: list(generator.random(20) < 0.5) for task in RULER_TASKS[:3]}
    rows = ruler_rows(outcomes)
    same = difference_interval(Ruler(), rows, Ruler(), rows, resamples=200)
    assert (same.low, same.high, same.shared_samples, same.same_samples) == (0.0, 0.0, 60, True)
    better = ruler_rows({task: [True] * 20 for task in outcomes})
    gain = difference_interval(Ruler(), better, Ruler(), rows, resamples=200)
    assert gain.low > 0


class WithoutCloze:
    """A headline over some tasks only, as LOOGLE's leaves out its cloze task: rows of that task alone have none."""

    def score(self, rows):
        metrics = Ruler().score(rows)
        counted = [values["score"] for task, values in metrics["tasks"].items() if task != "cloze"]
        metrics["score"] = round(sum(counted) / len(counted), 2) if counted else None
        return metrics


def test_tasks_outside_the_headline_are_left_out_of_its_resamples():
    generator = np.random.default_rng(5)
    rows = ruler_rows({task: list(generator.random(12) < 0.5) for task in ("vt", "cwe", "cloze")})
    decomposition = Decomposition(WithoutCloze(), rows)
    assert decomposition.decomposed and sorted(decomposition.tasks) == ["cwe", "vt"]
    interval = headline_interval(WithoutCloze(), rows, resamples=300, seed=2)
    low, high = brute_force_interval(WithoutCloze(), rows, 300, 2, list(decomposition.tasks))
    assert (interval.low, interval.high) == pytest.approx((low, high), abs=0.02)


class MaxOfTasks:
    """A benchmark whose headline is the best task, not a mean: the bootstrap must score every resample."""

    def score(self, rows):
        metrics = Ruler().score(rows)
        metrics["score"] = max(task["score"] for task in metrics["tasks"].values()) if metrics["tasks"] else None
        return metrics


def test_a_headline_that_is_not_a_mean_over_tasks_is_resampled_through_benchmark_score():
    rows = ruler_rows({"vt": [True, False, False, False], "cwe": [True, True, False, False]})
    assert not Decomposition(MaxOfTasks(), rows).decomposed
    interval = headline_interval(MaxOfTasks(), rows, resamples=100, seed=0)
    assert not interval.decomposed
    assert 25.0 <= interval.low <= 50.0 <= interval.high <= 100.0


# ---------------------------------------------------------------------------------------------------------------
# Command line: files written, plots produced
# ---------------------------------------------------------------------------------------------------------------


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_command_writes_tables_and_readable_plots(runs_dir, tmp_path, capsys):
    tables, plots = tmp_path / "tables", tmp_path / "plots"
    main(
        [
            str(runs_dir),
            "--out",
            str(tables),
            "--plots",
            str(plots),
            "--bootstrap",
            "50",
            "--diff",
            "chunkkv_snapkv",
            "no_press",
        ]
    )
    out = capsys.readouterr()
    assert "| ruler | eg_chunkkv_snapkv | 100.00 [100.00, 100.00] n=26 | 73.08 [" in out.out
    assert "status running" in out.err
    assert sorted(path.name for path in tables.iterdir()) == [
        "cost.csv",
        "cost.md",
        "diff__chunkkv_snapkv__no_press.csv",
        "diff__chunkkv_snapkv__no_press.md",
        "gate_effect.csv",
        "gate_effect.md",
        "iso_quality.csv",
        "iso_quality.md",
        "report.md",
        "ruler.csv",
        "ruler.md",
        "ruler_tasks.csv",
        "ruler_tasks.md",
        "runs.csv",
    ]
    runs = read_csv((tables / "runs.csv").read_text())
    assert len(runs) == 6 and {row["status"] for row in runs} == {"complete"}
    assert all(float(row["ci_low"]) <= float(row["score"]) <= float(row["ci_high"]) for row in runs)
    width, height = png_size(plots / "ruler.png")
    assert width >= 1000 and height >= 600
    width, height = png_size(plots / "ruler_tasks.png")
    assert width >= 1200 and height >= 1000  # 13 task panels, 4 per row


def test_plots_go_beside_the_tables_given_by_out_unless_plots_is_given(runs_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # where the default results/tables/plots/ would land
    main([str(runs_dir), "--out", str(tmp_path / "tables"), "--bootstrap", "0"])
    plotted = sorted(path.name for path in (tmp_path / "tables" / "plots").iterdir())
    assert plotted == ["ruler.png", "ruler_iso.png", "ruler_tasks.png"]
    assert not (tmp_path / "results").exists()


def test_a_long_legend_label_is_wrapped_whole_inside_a_figure_no_wider_than_a_short_one(tmp_path, monkeypatch):
    long = "a_press_whose_name_runs_far_beyond_the_legend_margin_of_the_figure_snapkv"
    widths = []
    for method in ("snapkv", long):
        root = tmp_path / method
        write_run(root, uniform([True]), method=method, cr=0.5)
        frame = runs_frame(collect_runs(root)[0])
        widths.append(png_size(plot_benchmark("ruler", frame, tmp_path / f"{method}.png"))[0])
    assert widths[0] == widths[1] <= plots.MAX_WIDTH_PX  # the label wraps: the canvas does not grow for it
    figures = drawn_figures(monkeypatch)
    plot_benchmark("ruler", runs_frame(collect_runs(tmp_path / long)[0]), tmp_path / "again.png")
    (legend,) = figures[0].legends
    (text,) = [text.get_text() for text in legend.get_texts()]
    assert text.replace("\n", "") == long and all(len(line) <= 36 for line in text.splitlines())
    figures[0].canvas.draw()
    inside, box = legend.get_window_extent(), figures[0].bbox
    assert box.x0 <= inside.x0 and inside.x1 <= box.x1 and box.y0 <= inside.y0 and inside.y1 <= box.y1


def drawn_figures(monkeypatch) -> list:
    """The figures the plot functions draw, kept open instead of saved."""
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: figures.append(fig) or path)
    return figures


def test_a_variant_holding_a_long_path_gets_a_short_unique_legend_label_that_fits_the_plot(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    deep = "/data/" + "a_folder_whose_name_is_rather_long/" * 4
    for folder in ("first", "second"):
        ruler = ruler_benchmark(path=f"{deep}{folder}/ruler.jsonl")
        write_run(root, uniform([True]), method="snapkv", cr=0.5, benchmark=ruler)
    write_run(root, uniform([True]), method="no_press", benchmark=ruler_benchmark(path=f"{deep}first/ruler.jsonl"))
    frame = runs_frame(collect_runs(root)[0])
    figures = drawn_figures(monkeypatch)
    plots.plot_benchmark("ruler", frame, tmp_path / "ruler.png")
    plots.plot_task_grid("ruler", frame, tmp_path / "ruler_tasks.png")
    (headline, grid) = figures
    # Each label whole, on lines that fit beside the panel (plots.wrapped).
    assert [text.get_text().replace("\n", "") for text in headline.legends[0].get_texts()] == [
        'snapkv [benchmark.path="…/first/ruler.jsonl"]',
        'snapkv [benchmark.path="…/second/ruler.jsonl"]',
        "no compression (100.00)",
    ]
    for figure, width in ((headline, headline.axes[0]), (grid, grid)):
        figure.canvas.draw()
        assert figure.legends[0].get_window_extent().width < width.get_window_extent().width


def test_task_panels_share_one_y_scale_that_shows_zero_scores_above_the_axis(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    halves = {task: [index % 2 == 0] for index, task in enumerate(RULER_TASKS)}  # tasks of 100 and tasks of 0
    write_run(root, halves, method="snapkv", cr=0.5)
    write_run(root, uniform([False]), method="snapkv", cr=0.75)
    figures = drawn_figures(monkeypatch)
    plots.plot_task_grid("ruler", runs_frame(collect_runs(root)[0]), tmp_path / "ruler_tasks.png")
    panels = [ax for ax in figures[0].axes if ax.get_visible()]
    assert len(panels) == len(RULER_TASKS)
    assert all(panels[0].get_shared_y_axes().joined(panels[0], ax) for ax in panels)
    bottom, top = panels[0].get_ylim()
    assert {ax.get_ylim() for ax in panels} == {(bottom, top)}
    assert bottom < 0 < 100 <= top  # a score of 0 is drawn above the axis, 100 below the top


def test_report_without_finished_runs_says_why(tmp_path):
    write_run(tmp_path / "runs", uniform([True]), method="snapkv", status="interrupted")
    with pytest.raises(SystemExit, match="(?s)no finished run under .*status interrupted"):
        main([str(tmp_path / "runs"), "--out", str(tmp_path / "tables"), "--no-plots"])


# The likelihood fields (tests/fixtures/runs/builder.py's likelihood_values): at cr 0.5, a right answer has KL 0.05
# and top-1 0.75, the wrong second sample KL 0.5 + 0.01 = 0.51 and top-1 0.25; NLL is 0.5 + KL.
@pytest.fixture
def likelihood_runs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, uniform([True, True]), method="no_press", likelihood=True)
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5, likelihood=True)
    write_run(root, uniform([True, False]), method="knorm", cr=0.5)  # made with likelihood=false
    return root


def test_likelihood_table_holds_hand_computed_means_with_intervals(likelihood_runs):
    report = report_of(likelihood_runs, resamples=200)
    headline, tasks = report.likelihood
    rows = {row["method"]: row for row in read_csv(headline.csv)}
    assert sorted(rows) == ["no_press", "snapkv"]  # the run without the fields has no row
    snapkv, reference = rows["snapkv"], rows["no_press"]
    expected = {"answer_nll": 0.78, "answer_nll_uncompressed": 0.5, "answer_kl": 0.28, "answer_top1": 0.5, "n": 26}
    assert {name: float(snapkv[name]) for name in expected} == pytest.approx(expected)
    assert float(snapkv["answer_kl_low"]) < 0.28 < float(snapkv["answer_kl_high"])
    assert float(reference["answer_kl"]) == float(reference["answer_kl_low"]) == float(reference["answer_kl_high"]) == 0
    assert float(reference["answer_top1"]) == 1.0
    task_rows = [row for row in read_csv(tasks.csv) if row["method"] == "snapkv"]
    assert sorted(row["task"] for row in task_rows) == sorted(RULER_TASKS)
    assert {(float(row["answer_kl"]), int(row["n"])) for row in task_rows} == {(0.28, 2)}
    assert "| ruler | snapkv | cr=0.50 | 0.780 [" in headline.markdown and "| 0.280 [" in headline.markdown
    assert "snapkv cr=0.50" in tasks.markdown


def test_likelihood_table_without_bootstrap_shows_no_intervals(likelihood_runs):
    (headline, _) = report_of(likelihood_runs, resamples=0).likelihood
    assert "[" not in headline.markdown and "bootstrap" not in " ".join(headline.notes)
    assert {row["answer_kl_low"] for row in read_csv(headline.csv)} == {""}


def test_a_likelihood_interval_is_drawn_as_the_headline_score_interval():
    # Per-sample values 100 / 0 are the RULER scores of the same rows: both intervals resample the same contexts.
    patterns = [[True, False, True], [False, False, True], [True, True, True, False]]
    outcomes = {task: patterns[i % 3] for i, task in enumerate(RULER_TASKS)}
    rows = [
        {"id": f"{task}-{i}", "task": task, "context_id": f"{task}-{i}", "answers": ["x"], "prediction": "x" * ok}
        for task, pattern in outcomes.items()
        for i, ok in enumerate(pattern)
    ]
    values = [100.0 if row["prediction"] else 0.0 for row in rows]
    interval = mean_interval(rows, values, resamples=300, seed=3)
    score_interval = headline_interval(Ruler(), rows, resamples=300, seed=3)
    assert (round(interval.low, 2), round(interval.high, 2)) == (score_interval.low, score_interval.high)
    assert interval.low < interval.high


def test_generate_false_runs_get_likelihood_tables_and_plot_but_no_score(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, uniform([True, True]), method="no_press", likelihood=True, generate=False)
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5, likelihood=True, generate=False)
    write_run(root, uniform([False, False]), method="snapkv", cr=0.75, likelihood=True, generate=False)
    tables, plots = tmp_path / "tables", tmp_path / "plots"
    main([str(root), "--out", str(tables), "--plots", str(plots), "--bootstrap", "50"])
    out = capsys.readouterr().out
    assert {"likelihood.csv", "likelihood.md", "likelihood_tasks.csv", "likelihood_tasks.md"} <= set(
        path.name for path in tables.iterdir()
    )
    assert sorted(path.name for path in plots.iterdir()) == ["ruler_kl.png"]  # no score to plot
    assert "made with generate=false" in out and "| ruler | snapkv | - n=26 | - n=26 |" in out
    kl = {
        float(row["compression_ratio"]): float(row["answer_kl"])
        for row in read_csv((tables / "likelihood.csv").read_text())
    }
    assert kl == {0.0: 0.0, 0.5: 0.28, 0.75: pytest.approx(0.75 + 0.005)}
    width, height = png_size(plots / "ruler_kl.png")
    assert width >= 1000 and height >= 600
