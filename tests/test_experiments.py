"""Experiment presets: each composes, expands to exactly its hand-written grid, and the smoke preset runs."""

import json
import subprocess
import sys
from itertools import product
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from omegaconf import OmegaConf

from evaluate import rundir
from evaluate.benchmarks.ruler import TASKS
from evaluate.points.config import effective_cr, method_name, run_dir
from hydra_plugins.pressbench_gpus_launcher.grids_sweeper import GridsSweeper, expand
from tests.support import CONF_DIR

REPO = Path(__file__).resolve().parent.parent
LLAMA, QWEN, SMOLLM = "Llama-3.1-8B-Instruct", "Qwen3-8B", "smollm2-135m"
CHUNK_PRESSES = ("chunkkv", "eg_chunkkv")
# The PR preset adds ChunkKV at EG-ChunkKV's exact budget as a control row.
PR_CHUNK_PRESSES = ("chunkkv", "chunkkv_exact", "eg_chunkkv")


def preset_jobs(name: str, *arguments: str) -> list[list[str]]:
    """The preset's jobs, expanded by the grids sweeper from the composed hydra.sweeper node."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=[f"+experiment={name}"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == f"{GridsSweeper.__module__}.{GridsSweeper.__name__}"
    params = OmegaConf.to_container(sweeper.params) if sweeper.params else {}
    return expand(
        OverridesParser.create(), params, OmegaConf.to_container(sweeper.grids), [f"+experiment={name}", *arguments]
    )


def compose_jobs(jobs: list[list[str]]) -> list:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return [compose(config_name="config", overrides=job) for job in jobs]


def point(cfg) -> tuple:
    return cfg.benchmark.name, cfg.model.name, method_name(cfg), effective_cr(cfg), cfg.query_aware


def check_expansion(name: str, expected: set[tuple]) -> list:
    cfgs = compose_jobs(preset_jobs(name))
    points = [point(cfg) for cfg in cfgs]
    assert len(points) == len(expected), "a point is listed twice or missing"
    assert set(points) == expected
    # run_sweep refuses two jobs on one run directory; the preset never asks for that.
    assert len({run_dir(cfg) for cfg in cfgs}) == len(cfgs)
    for cfg in cfgs:
        if method_name(cfg).startswith("eg_chunkkv"):
            # The PR's rescue size.
            assert cfg.press.press.low_entropy_chunk_length == 4
    return cfgs


def test_eg_chunkkv_pr_is_the_prs_grid_on_llama():
    expected = (
        {
            (benchmark, LLAMA, f"{press}_snapkv", cr, False)
            for benchmark, press, cr in product(("longbench", "loogle"), PR_CHUNK_PRESSES, (0.7, 0.8, 0.9))
        }
        | {
            ("ruler", LLAMA, f"{press}_{scorer}", cr, False)
            for press, scorer, cr in product(
                PR_CHUNK_PRESSES, ("snapkv", "expected_attention", "tova"), (0.85, 0.9, 0.95)
            )
        }
        | {(benchmark, LLAMA, "no_press", 0.0, False) for benchmark in ("longbench", "loogle", "ruler")}
    )
    cfgs = check_expansion("eg_chunkkv_pr", expected)
    assert len(cfgs) == 48
    for cfg in cfgs:
        assert cfg.limit is None and cfg.model.source.name_or_path == "meta-llama/Llama-3.1-8B-Instruct"
        if cfg.press.press is not None:
            assert cfg.press.press.chunk_length == 10
        if cfg.benchmark.name == "ruler":
            assert instantiate(cfg.benchmark).data_dir == "4096"


def test_dropkv_leaderboard_is_ruler_query_aware_on_both_leaderboard_models():
    methods = ("dropkv", "adakv_dropkv", "snapkv", "adakv_snapkv", "chunkkv")
    expected = {
        ("ruler", model, method, cr, True)
        for model, method, cr in product((QWEN, LLAMA), methods, (0.25, 0.5, 0.75, 0.875, 0.9375, 0.96875))
    } | {("ruler", model, "no_press", 0.0, True) for model in (QWEN, LLAMA)}
    cfgs = check_expansion("dropkv_leaderboard", expected)
    assert len(cfgs) == 62
    for cfg in cfgs:
        assert cfg.limit is None and instantiate(cfg.benchmark).data_dir == "4096"
        if method_name(cfg) == "chunkkv":
            # The leaderboard's ChunkKVPress(SnapKVPress(), chunk_length=20), kvpress's class.
            assert cfg.press.press.chunk_length == 20 and cfg.press.press._target_ == "kvpress.ChunkKVPress"
        if cfg.press.method.endswith("dropkv"):
            assert cfg.scorer.press._target_ == "scorers.dropkv.DropKVPress"


def test_smoke_has_both_presets_shapes_on_the_embedded_model():
    expected = (
        {("ruler_synth", SMOLLM, f"{press}_snapkv", cr, False) for press, cr in product(CHUNK_PRESSES, (0.7, 0.9))}
        | {
            ("ruler_synth", SMOLLM, f"{press}_{scorer}", 0.9, False)
            for press, scorer in product(CHUNK_PRESSES, ("expected_attention", "tova"))
        }
        | {
            ("ruler_synth", SMOLLM, method, 0.875, True)
            for method in ("dropkv", "adakv_dropkv", "snapkv", "adakv_snapkv", "chunkkv")
        }
        | {("ruler_synth", SMOLLM, "no_press", 0.0, query_aware) for query_aware in (False, True)}
    )
    cfgs = check_expansion("smoke", expected)
    assert len(cfgs) == 15
    for cfg in cfgs:
        assert cfg.limit == 1 and list(cfg.benchmark.tasks) == ["niah_single_1", "fwe"]
        assert cfg.benchmark.max_seq_length == 1024
        if cfg.query_aware and cfg.press.press is not None and cfg.press.press._target_ == "kvpress.ChunkKVPress":
            assert method_name(cfg) == "chunkkv" and cfg.press.press.chunk_length == 20


def test_why_presses_fail_is_four_presses_at_two_ratios_and_snapkvs_two_dtypes():
    jobs = preset_jobs("why_presses_fail")
    cfgs = compose_jobs(jobs)
    points = [(*point(cfg), cfg.dtype) for cfg in cfgs]
    methods = ("snapkv", "knorm", "streaming_llm", "eg_chunkkv_snapkv")
    expected = {("ruler_synth", SMOLLM, method, cr, False, "auto") for method, cr in product(methods, (0.5, 0.9))}
    expected |= {("ruler_synth", SMOLLM, "no_press", 0.0, False, "auto")}
    expected |= {
        ("ruler_synth", SMOLLM, "snapkv", cr, False, dtype)
        for cr, dtype in product((0.5, 0.9), ("float32", "bfloat16"))
    }
    assert len(points) == 13 and set(points) == expected
    assert len({run_dir(cfg) for cfg in cfgs}) == 13
    for cfg in cfgs:
        assert (cfg.diagnostics, cfg.save_kept, cfg.limit, cfg.benchmark.max_seq_length) == ("attention", True, 2, 4096)
        assert list(cfg.benchmark.tasks) == [task for task in TASKS if task.startswith("niah")]


def test_command_line_values_replace_the_grids_values():
    cfgs = compose_jobs(preset_jobs("eg_chunkkv_pr", "cr=0.9", "benchmark=ruler"))
    # Every grid collapses onto RULER at cr 0.9: 3 presses x 3 scorers, and no_press, once.
    assert sorted(point(cfg)[2:4] for cfg in cfgs) == sorted(
        [
            (f"{press}_{scorer}", 0.9)
            for press in PR_CHUNK_PRESSES
            for scorer in ("expected_attention", "snapkv", "tova")
        ]
        + [("no_press", 0.0)]
    )


@pytest.mark.slow  # one `python -m evaluate` process (imports torch and kvpress: ~10 s, more on a loaded CPU)
def test_the_cli_dry_run_lists_the_preset_jobs_and_runs_nothing(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "evaluate", "-m", "+experiment=dropkv_leaderboard", "hydra.sweeper.dry_run=true"]
        + [f"output_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    listed = [line.split(" : ", 1)[1].split() for line in result.stdout.splitlines() if line.startswith("#")]
    assert listed == preset_jobs("dropkv_leaderboard", f"output_dir={tmp_path}")
    assert result.stdout.splitlines()[-1] == "62 jobs (dry run: nothing launched)"
    assert not any(path.name.startswith("ruler") for path in tmp_path.iterdir())


@pytest.mark.slow  # runs the preset's 15 points through the CLI on the tiny model (about a minute on 2 cores)
def test_smoke_preset_runs_end_to_end_on_the_tiny_model(tmp_path):
    # fwe alone (50 new tokens; niah_single_1 asks for 128) keeps the test short. On niah_single_1 the random
    # model's queries also defeat AdaKV's fake-key search (see tests/support.py).
    overrides = ["model=tiny_random", "benchmark.tasks=[fwe]", f"output_dir={tmp_path}", "device=cpu"]
    result = subprocess.run(
        [sys.executable, "-m", "evaluate", "-m", "+experiment=smoke", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    cfgs = compose_jobs(preset_jobs("smoke", *overrides))
    assert {path.name for path in tmp_path.iterdir() if path.name != "multirun"} == {run_dir(c).name for c in cfgs}
    for cfg in cfgs:
        out = run_dir(cfg)
        rows = rundir.read_predictions(out / rundir.PREDICTIONS)
        record = json.loads((out / rundir.RUN).read_text())
        assert [row["task"] for row in rows] == ["fwe"] and record["samples"] == 1
        assert record["status"] == "complete" and "error" not in rows[0], out.name
