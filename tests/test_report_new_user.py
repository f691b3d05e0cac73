"""What a new user still hit (issue 34), report side: folders of only uncompressed runs, a baseline from another
setup (in the report and in a run's closing lines), a sweep's own Hydra folder, negative flags, Ctrl-C, intervals
rounded past their mean, and plots whose lines, labels and styles hid what they draw."""

import json

import pytest
import yaml

from evaluate.points.config import run_dir
from evaluate.points.resolve import resolve
from evaluate.report import cli, plots
from evaluate.report.build import build_report
from evaluate.report.cli import main
from evaluate.report.frame import runs_frame
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run
from evaluate.run.summary import run_summary
from evaluate.score.baseline import baseline_key, is_baseline
from evaluate.score.bootstrap import mean_interval
from evaluate.score.likelihood import likelihood_metrics
from tests.fixtures.runs.builder import ruler_benchmark, uniform, write_run
from tests.support import compose_config, with_shared_context


def report_files(root, tmp_path, *arguments: str) -> set[str]:
    tables, plots = tmp_path / "tables", tmp_path / "plots"
    main([str(root), "--out", str(tables), "--plots", str(plots), *arguments])
    return {path.name for folder in (tables, plots) for path in folder.iterdir()}


@pytest.mark.parametrize("bootstrap", ["0", "50"])
def test_a_folder_of_only_uncompressed_runs_reports_every_table_and_plot(tmp_path, capsys, bootstrap):
    root = tmp_path / "runs"
    write_run(root, uniform([True, False]), method="no_press", likelihood=True)
    files = report_files(root, tmp_path, "--bootstrap", bootstrap)
    assert {"ruler.md", "ruler_tasks.md", "likelihood.md", "cost.csv", "runs.csv", "report.md"} <= files
    assert {"ruler.png", "ruler_tasks.png", "ruler_kl.png"} <= files
    assert "| ruler | no compression | 50.00" in capsys.readouterr().out  # in its own cr=0.00 column


@pytest.mark.parametrize("generate", [True, False])
def test_a_folder_of_one_compressed_run_reports_with_a_whisker_for_its_interval(tmp_path, capsys, generate):
    root = tmp_path / "runs"
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5, likelihood=True, generate=generate)
    files = report_files(root, tmp_path, "--bootstrap", "50")
    assert "ruler_kl.png" in files and ("ruler.png" in files) == generate
    assert "No `no_press` run" in capsys.readouterr().out


def test_generate_false_runs_of_only_no_press_report(tmp_path):
    root = tmp_path / "runs"
    write_run(root, uniform([True, True]), method="no_press", likelihood=True, generate=False)
    assert {"likelihood.md", "ruler_kl.png", "report.md"} <= report_files(root, tmp_path, "--bootstrap", "50")


def test_a_likelihood_interval_contains_its_mean_however_small():
    # KL values around 1e-4, as a press that barely moves the model gives: rounded to 4 decimals, the interval of
    # these rows was [0.0001, 0.0001] around a mean of 0.0000956, which then sat below its own interval.
    kl = [9.1e-05, 9.9e-05, 9.3e-05, 9.9e-05, 9.4e-05, 9.7e-05]
    rows = [{"id": f"s{i}", "task": "t", "context_id": f"c{i}", "answer_kl": value} for i, value in enumerate(kl)]
    full = [{**row, "answer_nll": 1.0, "answer_nll_uncompressed": 1.0, "answer_top1": 1.0} for row in rows]
    mean = likelihood_metrics(full)["answer_kl"]
    interval = mean_interval(rows, kl, resamples=500)
    assert interval.low <= mean <= interval.high
    assert interval.high - interval.low < 1e-5  # and it keeps the precision of such values


def settings_of(run) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text())["config"]


def test_the_baseline_is_the_no_press_run_of_the_same_data_samples_and_settings_whatever_the_press(tmp_path):
    root = tmp_path / "runs"
    reference = write_run(root, uniform([True, True]), method="no_press")
    compressed = write_run(root, uniform([True, False]), method="snapkv", cr=0.9)
    record = yaml.safe_load((reference / "config.yaml").read_text())
    rows = [{"id": f"{task}-{i}"} for task in uniform([0]) for i in range(2)]
    ids = {row["id"] for row in rows}
    config = settings_of(compressed)
    assert is_baseline(record, lambda: rows, config, ids)
    # press, scorer, cr and the runner's knobs are what a baseline differs in; every other result key counts
    assert baseline_key({**config, "cr": 0.5, "threshold": 0.1, "press": {}, "scorer": None}) == baseline_key(config)
    assert baseline_key({**config, "limit": 7, "device": "cpu", "generate": True}) == baseline_key(config)
    for other in ({"max_context_length": 10}, {"seed": 1}, {"query_aware": True}, {"generate": False}):
        assert not is_baseline(record, lambda: rows, {**config, **other}, ids), other
    assert not is_baseline(record, lambda: rows, config, ids | {"niah_single_1-2"})  # a sample it did not answer
    assert not is_baseline(record, lambda: [{**row, "error": "oom"} for row in rows], config, ids)


def test_the_report_pairs_no_run_with_a_no_press_run_of_other_data(tmp_path):
    root = tmp_path / "runs"
    write_run(root, uniform([True, True]), method="no_press", benchmark=ruler_benchmark(data_dir="8192"))
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5)
    report = build_report(*collect_runs(root), resamples=0)
    (headline,) = report.headline
    lines = headline.markdown.splitlines()
    assert lines[0] == "| benchmark | method | cr=0.00 | cr=0.50 |"
    assert lines[2:] == ["| ruler | no compression | 100.00 n=26 |  |", "| ruler | snapkv |  | 50.00 n=26 |"]
    notes = " ".join(headline.notes)
    assert "No uncompressed baseline for snapkv cr=0.50" in notes and "cr=0.00: `no_press` runs" in notes
    task_sections = [heading for heading, _ in report.tasks[0].sections]
    assert task_sections == ["#### cr=0.00", "#### cr=0.50"]
    with pytest.raises(SystemExit, match="no pair of runs with its uncompressed baseline"):
        main([str(root), "--out", str(tmp_path / "tables"), "--no-plots", "--diff", "snapkv", "no_press"])


def test_every_ratio_of_a_sweep_with_press_none_finds_the_one_no_press_run(tmp_path, capsys):
    root = tmp_path / "runs"
    write_run(root, uniform([True, True]), method="no_press")
    for cr in (0.5, 0.9):
        write_run(root, uniform([True, False]), method="snapkv", cr=cr)
    sweep = root / "multirun" / "2026-12-06_11-42-30"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    report = build_report(*collect_runs(root), resamples=0)
    assert report.skipped == []  # the sweep's own Hydra folder is no stray file
    assert report.headline[0].markdown.splitlines()[2] == "| ruler | no compression | 100.00 n=26 | 100.00 n=26 |"
    assert not any("baseline" in note for note in report.headline[0].notes)
    main(
        [str(root), "--out", str(tmp_path / "tables"), "--no-plots", "--bootstrap", "0", "--diff", "snapkv", "no_press"]
    )
    assert "| ruler | all | -50.00 | -50.00 |" in capsys.readouterr().out


@pytest.mark.parametrize(("flag", "value"), [("--bootstrap", "-5"), ("--seed", "-1")])
def test_a_negative_numeric_flag_is_refused_in_one_line(tmp_path, capsys, flag, value):
    root = tmp_path / "runs"
    write_run(root, uniform([True]), method="no_press")
    with pytest.raises(SystemExit) as stop:
        main([str(root), "--out", str(tmp_path / "tables"), flag, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {flag} {value}: cannot be negative; pass 0 or more ({flag} 0: {cli._ZERO[flag]})"
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("build_report", "no table or plot was written"),
        ("write_report", "the tables in"),
        ("plot_all", "the tables are"),
    ],
)
def test_ctrl_c_ends_the_report_in_one_line_with_130(tmp_path, capsys, monkeypatch, where, said):
    root = tmp_path / "runs"
    write_run(root, uniform([True]), method="no_press")

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    module = plots if where == "plot_all" else cli
    monkeypatch.setattr(module, where, interrupt)
    with pytest.raises(SystemExit) as stop:
        main([str(root), "--out", str(tmp_path / "tables"), "--bootstrap", "0"])
    assert stop.value.code == 130
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"interrupted: {said}") and line.endswith("rerun the same command to write the report")


def drawn(monkeypatch) -> list:
    """The figures the plot functions draw, kept open instead of saved."""
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path, dpi: figures.append(fig) or path)
    return figures


def kv_held(run, cr: float) -> None:
    """Record in run.json the KV bytes a context's cache held, as a run of ratio ``cr`` over 16 MiB would."""
    record = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**record, "kv_bytes_held_per_context": (1 - cr) * 2**24}))


@pytest.fixture
def equal_runs(tmp_path):
    """Three methods with equal scores at every ratio, 0.998 and 0.999 among them, all scoring 0 there."""
    root = tmp_path / "runs"
    kv_held(write_run(root, uniform([True, True]), method="no_press"), 0.0)
    for method in ("knorm", "snapkv", "tova"):
        for cr, outcomes in ((0.5, [True, False]), (0.998, [False, False]), (0.999, [False, False])):
            kv_held(write_run(root, uniform(outcomes), method=method, cr=cr), cr)
    return runs_frame(collect_runs(root)[0])


def test_lines_of_equal_scores_stay_visible_each_under_the_next(equal_runs, tmp_path, monkeypatch):
    figures = drawn(monkeypatch)
    plots.plot_benchmark("ruler", equal_runs, tmp_path / "ruler.png")
    lines = [line for line in figures[0].axes[0].get_lines() if line.get_label() in ("knorm", "snapkv", "tova")]
    assert [line.get_label() for line in lines] == ["knorm", "snapkv", "tova"]  # drawn in this order
    widths, sizes = [line.get_linewidth() for line in lines], [line.get_markersize() for line in lines]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3  # each one wider than the next
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3
    assert len({line.get_marker() for line in lines}) == 3


def test_ratio_labels_that_would_touch_go_to_a_second_line():
    assert plots.ratio_labels([0.5, 0.998, 0.999]) == ["0.50", "0.998", "\n0.999"]
    assert plots.ratio_labels([0.5, 0.7, 0.9]) == ["0.50", "0.70", "0.90"]


def test_the_cost_plot_looks_like_the_others_labels_each_ratio_once_and_reads_zero_near_zero(
    equal_runs, tmp_path, monkeypatch
):
    figures = drawn(monkeypatch)
    plots.plot_cost("ruler", equal_runs, tmp_path / "ruler_cost.png")
    (figure,) = figures
    ax = figure.axes[0]
    bottom, top = ax.get_ylim()
    assert bottom < 0 < 50 <= top <= 105  # a score axis, as the others: never -0.04..0.04
    labels = sorted(text.get_text() for text in ax.texts)
    assert labels == ["0.50", "0.998", "0.999"]  # once each, though three lines share every point
    offsets = {text.get_text(): text.xyann[1] for text in ax.texts}
    assert offsets["0.998"] * offsets["0.999"] < 0  # neighbours on opposite sides of their points
    assert any("labels: compression ratio" in text.get_text() for text in figure.texts)  # the footnote
    assert ax.title.get_fontsize() == 13 and ax.xaxis.label.get_fontsize() == 12
    assert "no compression (50.00)" not in [t.get_text() for t in figure.legends[0].get_texts()]
    assert "no compression (100.00)" in [t.get_text() for t in figure.legends[0].get_texts()]


def test_an_all_zero_cost_plot_has_a_score_axis(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    kv_held(write_run(root, uniform([False]), method="snapkv", cr=0.5), 0.5)
    figures = drawn(monkeypatch)
    plots.plot_cost("ruler", runs_frame(collect_runs(root)[0]), tmp_path / "ruler_cost.png")
    assert figures[0].axes[0].get_ylim() == pytest.approx((-0.4, 10.0))


def test_a_single_point_gets_the_whisker_of_its_bounds_wherever_its_value_lies(tmp_path, monkeypatch):
    # A one-run line draws its interval as a whisker; a value outside its bounds (a figure rounded otherwise than
    # its interval) used to make matplotlib refuse the negative error bar and end the report.
    root = tmp_path / "runs"
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5, likelihood=True)
    frame = runs_frame(collect_runs(root)[0]).assign(answer_kl=0.0004, answer_kl_low=0.0005, answer_kl_high=0.0007)
    figures = drawn(monkeypatch)
    plots.plot_kl("ruler", frame, tmp_path / "ruler_kl.png")
    (bar,) = figures[0].axes[0].containers
    (segment,) = bar.lines[2][0].get_segments()
    assert segment[:, 1] == pytest.approx([0.0005, 0.0007])


def test_the_run_summary_takes_no_no_press_run_of_another_context_budget_as_its_baseline(tmp_path):
    compressed = with_shared_context(compose_config(tmp_path, "press=topk", "cr=0.5", "limit=1"))
    metrics = run(compressed)
    other = with_shared_context(compose_config(tmp_path, "press=none", "limit=1", "max_context_length=200"))
    run(other)
    summary = run_summary(resolve(compressed), metrics)
    assert "no uncompressed run of these samples and settings yet: python -m evaluate press=none" in summary
    assert str(run_dir(other)) not in summary
    same = with_shared_context(compose_config(tmp_path, "press=none", "cr=0.9", "scorer=knorm", "limit=1"))
    uncompressed = run(same)  # recorded at another cr and scorer, as a sweep's press=none point may be: the baseline
    expected = f"uncompressed, same samples: score {uncompressed['score']} ({run_dir(same)})"
    assert expected in run_summary(resolve(compressed), metrics)
