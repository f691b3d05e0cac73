"""A report of any folder: every kind of run in one tree (tests/fixtures/runs/builder.py), labels that name only what
tells a table's or a figure's runs apart, figures that fit, and decoding-time presses read by what they kept.

Every sample scores 1 or 0, so a task scores 100 x (correct / samples) and a run the mean over tasks.
"""

import struct

import matplotlib.axes
import numpy as np
import pandas as pd
import pytest
import yaml

from evaluate.report import plots
from evaluate.report.build import build_report
from evaluate.report.cli import main
from evaluate.report.frame import runs_frame
from evaluate.report.runs import collect_runs, distinguishing_settings, variant_names
from evaluate.score.iso_quality import AT_LEAST, IsoCr, IsoInterval
from tests.fixtures.runs.builder import uniform, write_run

MEASURED = {"kv_bytes_per_token": 1024}  # run.json's KV bytes: 100 tokens x the kept share x 1024, 16 GB of weights


def first_right(k: int, n: int = 4) -> dict[str, list[bool]]:
    """The first ``k`` of ``n`` samples right in every task: each task, and the run, scores 100 x k / n."""
    return uniform([i < k for i in range(n)])


def report_of(root, resamples: int = 0):
    runs, skipped = collect_runs(root)
    return build_report(runs, skipped, resamples=resamples)


def markdown_rows(table) -> list[str]:
    return table.markdown.splitlines()[2:]


def set_config(run, **settings) -> None:
    """Record ``settings`` in a written run's config, as a run recorded with them would hold them."""
    record = yaml.safe_load((run / "config.yaml").read_text())
    record["config"].update(settings)
    (run / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))


def drawn_figures(monkeypatch) -> list:
    """The figures the plot functions draw, kept open instead of saved."""
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: figures.append(fig) or path)
    return figures


def legend_texts(figure) -> list[str]:
    """The legend's labels, each on one line again (plots.wrapped breaks them at a space here)."""
    return [text.get_text().replace("\n", " ") for legend in figure.legends for text in legend.get_texts()]


# ---------------------------------------------------------------------------------------------------------------
# Iso-quality intervals
# ---------------------------------------------------------------------------------------------------------------


def test_an_iso_interval_that_leaves_out_its_estimate_is_drawn_from_its_own_bounds(tmp_path, monkeypatch):
    # Every point passes (≥ 0.97), yet fewer than 2.5 % of the draws do: the interval ends below its estimate, and a
    # whisker measured from the estimate would have a negative side (matplotlib's "'xerr' must not contain
    # negative values").
    interval = IsoInterval(low=0.9, high=0.95, low_mark="", high_mark="", resamples=100, contexts=13)
    series = pd.DataFrame(
        [
            {
                "benchmark": "ruler",
                "model": "Llama-3.1-8B-Instruct",
                "query_aware": False,
                "label": "snapkv",
                "baseline_score": 100.0,
                "ratios": [0.5, 0.97],
                "scores": [100.0, 99.5],
                "absolute": IsoCr(0.97, AT_LEAST),
                "absolute_interval": interval,
                "relative": IsoCr(0.97, AT_LEAST),
                "relative_interval": interval,
            }
        ]
    )
    figures = drawn_figures(monkeypatch)
    plots.plot_iso("ruler", series, {"absolute": 1.0, "relative": 0.95}, tmp_path / "ruler_iso.png")
    (ax,) = [ax for ax in figures[0].axes if ax.get_visible()]
    assert not ax.containers  # no errorbar: nothing is drawn as a distance from the estimate
    bars = [line for line in ax.get_lines() if line.get_marker() == "|"]
    assert [(list(bar.get_xdata()), list(bar.get_ydata())) for bar in bars] == [
        ([0.9, 0.95], [99.0, 99.0]),  # on the absolute threshold, 100 - 1
        ([0.9, 0.95], [95.0, 95.0]),  # on the relative one, 0.95 x 100
    ]


# ---------------------------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------------------------


def test_a_variant_writes_a_setting_missing_from_older_runs_as_the_value_they_ran_with():
    conversations = {"benchmark": {"name": "ruler_synth", "turns": 3}, "generate": False}
    older = {"benchmark": {"name": "ruler_synth"}}  # recorded before benchmark.turns and generate existed
    settings = [distinguishing_settings(config) for config in (conversations, older)]
    assert variant_names(settings, [("row",), ("row",)]) == [
        "benchmark.turns=3, generate=false",
        "benchmark.turns=1, generate=true",
    ]
    # A run of another row is told apart from nothing.
    assert variant_names(settings, [("row",), ("other row",)]) == ["", ""]


def test_a_tag_names_only_what_tells_apart_the_runs_of_its_own_table_or_figure(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    write_run(root, first_right(4), method="no_press")
    write_run(root, first_right(3), method="snapkv", cr=0.5)
    set_config(write_run(root, first_right(2), method="snapkv", cr=0.75), generate=True)  # recorded after the key
    write_run(root, first_right(3), method="snapkv", cr=0.5, generate=False, likelihood=True)
    report = report_of(root)
    assert markdown_rows(report.headline[0]) == [
        "| ruler | no compression | 100.00 n=52 | 100.00 n=52 |",
        "| ruler | snapkv [generate=false] | - n=52 |  |",
        # The run that recorded generate=true and the one recorded before the key ran alike: one row, never "null".
        "| ruler | snapkv [generate=true] | 75.00 n=52 | 50.00 n=52 |",
    ]
    figures = drawn_figures(monkeypatch)
    plots.plot_benchmark("ruler", report.frame, tmp_path / "ruler.png")
    # The generate=false run has no score: no line, no legend entry, and its tag tells nothing apart here.
    assert legend_texts(figures[0]) == ["snapkv", "no compression (100.00)"]


def test_baselines_that_show_the_same_are_one_dashed_line(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    write_run(root, first_right(4), method="no_press")
    write_run(root, first_right(3), method="snapkv", cr=0.5)
    conversations = {"conversation_turns": 2, "turns": "multi"}
    write_run(root, first_right(4), method="no_press", **conversations)
    write_run(root, first_right(2), method="snapkv", cr=0.5, **conversations)
    figures = drawn_figures(monkeypatch)
    plots.plot_benchmark("ruler", runs_frame(collect_runs(root)[0]), tmp_path / "ruler.png")
    (ax,) = figures[0].axes
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert [(line.get_label(), list(line.get_ydata())) for line in dashed] == [
        ("no compression (100.00): 2 baselines alike", [100, 100])
    ]
    assert legend_texts(figures[0]) == ["snapkv", "snapkv (multi-turn)", "no compression (100.00): 2 baselines alike"]


# ---------------------------------------------------------------------------------------------------------------
# Token-budget runs in the likelihood and answer-length tables; generate=false's footnote
# ---------------------------------------------------------------------------------------------------------------


def test_token_budget_runs_have_rows_in_the_likelihood_and_answer_length_tables(tmp_path):
    root = tmp_path / "runs"
    recorded = {"likelihood": True, "answer_tokens": True}
    write_run(root, uniform([True, True]), method="no_press", **recorded)
    # builder.likelihood_values at the run's recorded cr (0.9): a right answer KL 0.09, the wrong second 0.91; NLL
    # 0.5 + KL; top-1 0.75 and 0.25. builder.answer_token_columns: a right answer is 3 tokens, the wrong one runs to
    # its cap of 32 after 1 token in common with the baseline's.
    write_run(root, uniform([True, False]), method="snapkv", budget=64, **recorded)
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5, likelihood=True, generate=False)
    report = report_of(root)
    likelihood, _ = report.likelihood
    assert markdown_rows(likelihood) == [
        "| ruler | no compression | cr=0.00 | - | 0.500 | 0.500 | 0.000 | 1.000 | 26 |",
        "| ruler | snapkv [generate=false] | cr=0.50 | - | 0.780 | 0.500 | 0.280 | 0.500 | 26 |",
        "| ruler | snapkv [generate=true] | - | 64 | 1.000 | 0.500 | 0.500 | 0.500 | 26 |",
    ]
    (lengths,) = report.answer_length
    assert markdown_rows(lengths) == [
        "| no compression | cr=0.00 | - | 3.00 |  | 0.0 % |  |  |  | 26 |",
        "| snapkv [generate=false] | cr=0.50 | - | n/a | n/a | n/a | n/a | n/a | n/a | n/a |",
        "| snapkv [generate=true] | - | 64 | 17.50 | 3.00 | 50.0 % | 0.0 % | 0.0 % | 2.00 (median 2) | 26 |",
    ]
    assert [row["budget"] for row in lengths.cells().to_dict("records")] == ["", "", "64"]
    assert lengths.notes[1:] == [
        "n/a for snapkv [generate=false] cr=0.50: made with generate=false: such a run decodes no answer, so it has "
        "no answer lengths."
    ]  # and never "rerun to record them", which no rerun of a generate=false run would do


# ---------------------------------------------------------------------------------------------------------------
# Decoding-time presses
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def decoding_runs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, first_right(4), method="no_press", **MEASURED)
    write_run(root, first_right(2), method="snapkv", cr=0.5, **MEASURED)
    every_16 = {"target_size": 64, "compression_interval": 16}
    kept = {"rows_compressed": 52, "kept_ratio": 0.4, **MEASURED}
    write_run(root, first_right(3), method="decoding_knorm", decoding=every_16, **kept)
    # The answers never outgrew 1024 pairs: run.json counts no row compressed, and every row kept everything.
    never = {"target_size": 1024, "compression_interval": 16}
    none = {"rows_compressed": 0, "kept_ratio": 1.0, **MEASURED}
    write_run(root, first_right(4), method="decoding_knorm", decoding=never, **none)
    # run.json without decoding.rows_compressed: whether it compressed is read off the rows' kept_ratio.
    every_8 = {"compression_interval": 8}
    write_run(root, first_right(4), method="decoding_tova", decoding={"target_size": 64, **every_8}, kept_ratio=1.0)
    write_run(root, first_right(2), method="decoding_tova", decoding={"target_size": 32, **every_8}, kept_ratio=0.25)
    # Recorded before the contract: no decoding key, filed under its recorded cr as before.
    write_run(root, first_right(1), method="decoding_keydiff", cr=0.5)
    return root


def test_decoding_time_runs_get_a_table_of_their_own_by_what_they_kept(decoding_runs):
    report = report_of(decoding_runs)
    (table,) = report.decoding
    assert table.name == "ruler_decoding"
    assert markdown_rows(table) == [
        "| decoding_knorm | 64 | 16 | 40.0 % | 75.00 n=52 | 100.00 | -25.00 |  |",
        "| decoding_knorm | 1024 | 16 | 100.0 % | 100.00 n=52 | 100.00 | +0.00 | yes |",
        "| decoding_tova | 32 | 8 | 25.0 % | 50.00 n=52 | 100.00 | -50.00 |  |",
        "| decoding_tova | 64 | 8 | 100.0 % | 100.00 n=52 | 100.00 | +0.00 | yes |",
    ]
    rows = table.cells().to_dict("records")
    assert [(row["kept_ratio"], row["never_compressed"], row["rows_compressed"]) for row in rows] == [
        ("0.4", "False", "52"),
        ("1.0", "True", "0"),
        ("0.25", "False", ""),
        ("1.0", "True", ""),
    ]
    assert any(
        note.startswith("Never compressed: ruler decoding_knorm target_size=1024, ruler decoding_tova ")
        for note in table.notes
    )


def test_decoding_time_runs_leave_the_ratio_tables_and_iso_quality(decoding_runs):
    report = report_of(decoding_runs)
    (headline,) = report.headline
    # Only the runs at a ratio, the one recorded before the contract among them, as before.
    assert markdown_rows(headline) == [
        "| ruler | no compression | 100.00 n=52 |",
        "| ruler | decoding_keydiff | 25.00 n=52 |",
        "| ruler | snapkv | 50.00 n=52 |",
    ]
    (iso,) = report.iso
    assert sorted(row["method"] for row in iso.cells().to_dict("records")) == ["decoding_keydiff", "snapkv"]
    # No run that never compressed holds quality at any ratio: none of them is a series.
    assert not report.iso_series.method.isin(["decoding_knorm", "decoding_tova"]).any()
    cr = {row["method"]: row["compression_ratio"] for row in report.tables()[-1].cells().to_dict("records")}
    assert cr["decoding_knorm"] == cr["decoding_tova"] == ""  # runs.csv: no cr credited


def test_capacity_and_cost_read_the_bytes_a_decoding_time_run_kept_never_its_cr(decoding_runs, tmp_path, monkeypatch):
    report = report_of(decoding_runs)
    (capacity,) = report.capacity
    rows = {(row["method"], row["target_size"]): row for row in capacity.cells().to_dict("records")}
    # (80 - 16) GB over 100 x 0.4 x 1024 bytes, against the uncompressed 100 x 1024: 2.5 x the rows.
    kept = rows[("decoding_knorm", "64")]
    assert (kept["compression_ratio"], kept["kv_bytes_held_per_context"]) == ("", "40960.0")
    assert (kept["rows_that_fit"], kept["uncompressed_rows_that_fit"], kept["rows_ratio"]) == (
        "1562500",
        "625000",
        "2.5",
    )
    assert rows[("decoding_knorm", "1024")]["rows_ratio"] == "1.0"
    assert "| decoding_knorm | - | 64 | 16 | 16.00 | 0.04 | 1562500 | 625000 | 2.50× | - |" in capacity.markdown
    (never,) = [note for note in capacity.notes if note.startswith("Never compressed: ")]
    assert never.startswith(
        "Never compressed: ruler decoding_knorm target_size=1024, ruler decoding_tova target_size=64:"
    )
    figures = drawn_figures(monkeypatch)
    written = plots.plot_all(report.frame, tmp_path / "plots", report.iso_series)
    assert sorted(path.name for path in written) == [
        "ruler.png",
        "ruler_cost.png",
        "ruler_decoding.png",
        "ruler_iso.png",
        "ruler_tasks.png",
    ]
    (cost,) = [figure for figure, path in zip(figures, written, strict=True) if path.name == "ruler_cost.png"]
    labels = sorted(text.get_text() for text in cost.axes[0].texts)
    assert labels == ["0.50", "kept 100 %", "kept 40 %"]  # the decoding_tova runs recorded no bytes
    (decoding,) = [figure for figure, path in zip(figures, written, strict=True) if path.name == "ruler_decoding.png"]
    ax = decoding.axes[0]
    assert [tick.get_text() for tick in ax.get_xticklabels()] == ["25 %", "40 %", "100 %"]
    points = {line.get_label(): list(zip(line.get_xdata(), line.get_ydata(), strict=True)) for line in ax.get_lines()}
    assert points["decoding_knorm"] == [(pytest.approx(40.0), 75.0), (100.0, 100.0)]  # 0.4 x 100, over 52 rows
    assert points["decoding_tova"] == [(pytest.approx(25.0), 50.0), (100.0, 100.0)]


# ---------------------------------------------------------------------------------------------------------------
# One folder of every kind of run
# ---------------------------------------------------------------------------------------------------------------


def every_kind_of_run(root) -> None:
    """A ratio sweep of snapkv with its uncompressed run; AdaKV, ChunkKV and EG-ChunkKV at 16:1 and 32:1; token-budget
    runs; decoding-time runs (one that never compressed); conversations (turns=multi); generate=false runs; a failed
    run (every sample an error) and two unfinished ones."""
    recorded = {"likelihood": True, "answer_tokens": True, **MEASURED}
    write_run(root, first_right(4), method="no_press", **recorded)
    for cr, right in ((0.25, 4), (0.5, 4), (0.75, 3), (0.9, 3), (0.97, 1)):
        write_run(root, first_right(right), method="snapkv", cr=cr, **recorded)
    for method in ("adakv_snapkv", "chunkkv_snapkv", "eg_chunkkv_snapkv"):
        for cr, right in ((0.9375, 3), (0.96875, 2)):
            write_run(root, first_right(right), method=method, cr=cr, **recorded)
    for budget, right in ((256, 4), (64, 2)):
        write_run(root, first_right(right), method="snapkv", budget=budget, **recorded)
    every_16 = {"target_size": 64, "compression_interval": 16}
    # Decoding-time presses get no likelihood fields (docs/metrics.md): their runs record answers and bytes only.
    kept = {"rows_compressed": 52, "kept_ratio": 0.4, "answer_tokens": True, **MEASURED}
    write_run(root, first_right(3), method="decoding_knorm", decoding=every_16, **kept)
    never = {"target_size": 1024, "compression_interval": 16}
    write_run(
        root,
        first_right(4),
        method="decoding_knorm",
        decoding=never,
        **{**kept, "rows_compressed": 0, "kept_ratio": 1.0},
    )
    conversations = {"conversation_turns": 2, "turns": "multi"}
    write_run(root, first_right(4), method="no_press", **conversations)
    write_run(root, first_right(3), method="snapkv", cr=0.5, **conversations)
    for method, cr in (("no_press", 0.0), ("snapkv", 0.5), ("snapkv", 0.75)):
        write_run(root, first_right(3), method=method, cr=cr, generate=False, likelihood=True)
    write_run(root, first_right(0), method="tova", cr=0.5, errors=True, status="complete_with_errors")
    write_run(root, first_right(1), method="knorm", cr=0.5, status="running")
    write_run(root, first_right(1), method="knorm", cr=0.75, status="incomplete")


def png_width(path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])[0]


def test_a_folder_of_every_kind_of_run_reports_with_every_plot_whiskers_from_bounds_and_figures_that_fit(
    tmp_path, monkeypatch, capsys
):
    every_kind_of_run(tmp_path / "runs")
    whiskers, bars, outside = [], [], []
    errorbar = matplotlib.axes.Axes.errorbar

    def checked_errorbar(self, x, y, yerr=None, xerr=None, **kwargs):
        whiskers.extend(np.ravel(error) for error in (xerr, yerr) if error is not None)
        return errorbar(self, x, y, yerr=yerr, xerr=xerr, **kwargs)

    bar = plots._interval_bar
    save = plots._save

    def checked_save(fig, path, dpi):
        fig.canvas.draw()
        box = fig.bbox
        for legend in fig.legends:
            extent = legend.get_window_extent()
            if not (box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1):
                outside.append(path.name)
            assert all(text.get_text() for text in legend.get_texts())
        return save(fig, path, dpi)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", checked_errorbar)

    def checked_bar(ax, low, high, *rest):
        bars.append((low, high))
        return bar(ax, low, high, *rest)

    monkeypatch.setattr(plots, "_interval_bar", checked_bar)
    monkeypatch.setattr(plots, "_save", checked_save)
    tables, folder = tmp_path / "tables", tmp_path / "plots"
    main([str(tmp_path / "runs"), "--out", str(tables), "--plots", str(folder), "--bootstrap", "100"])  # exits 0
    err = capsys.readouterr().err
    assert "status running" in err and "status incomplete" in err
    assert sorted(path.name for path in folder.iterdir()) == [
        "ruler.png",
        "ruler_answer_length.png",
        "ruler_budget.png",
        "ruler_cost.png",
        "ruler_decoding.png",
        "ruler_iso.png",
        "ruler_iso_budget.png",
        "ruler_kl.png",
        "ruler_tasks.png",
        "ruler_turns.png",
    ]
    assert whiskers and all((error >= 0).all() for error in whiskers)
    assert bars and all(low <= high for low, high in bars)
    assert outside == []
    widths = {path.name: png_width(path) for path in folder.glob("*.png")}
    assert max(widths.values()) <= plots.MAX_WIDTH_PX, widths
    for name in ("ruler_decoding.md", "capacity.md", "likelihood.md", "ruler_answer_length.md", "ruler_budget.md"):
        assert (tables / name).is_file()
