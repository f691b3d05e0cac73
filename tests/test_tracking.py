"""wandb tracking: disabled by default without importing wandb; offline mode run for real, then read back.

The offline tests run the installed wandb package with WANDB_MODE=offline and a temporary WANDB_DIR, and read
the ``.wandb`` file it writes (a LevelDB-style log of wandb protobuf records) to check what was logged.
"""

import json
import sys
import time
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import open_dict

from evaluate.benchmarks.ruler import Ruler
from evaluate.points.config import ConfigError
from evaluate.points.resolve import resolve
from evaluate.run.tracking import Tracker
from evaluate.score.diagnostics import FIELDS as DIAGNOSTIC_FIELDS
from evaluate.score.likelihood import FIELDS as LIKELIHOOD_FIELDS
from evaluate.score.rescore import score_rows
from hydra_plugins.pressbench_sweep_launcher.sweep_launcher import group_by_sweep
from tests.fixtures.runs.builder import uniform, write_run
from tests.support import compose_config


def compose(tmp_path, *overrides: str):
    """The real config with the wandb group, whether or not conf/config.yaml lists it in its defaults."""
    try:
        return compose_config(tmp_path, *overrides)
    except ConfigCompositionException:
        return compose_config(tmp_path, *(f"+{o}" if o.startswith("wandb=") else o for o in overrides))


def test_disabled_tracking_is_a_no_op_that_never_imports_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now fails
    for cfg in (compose_config(tmp_path), compose(tmp_path, "wandb=disabled")):
        tracker = Tracker.from_spec(resolve(cfg))
        assert not tracker.enabled
        tracker.log_progress(1, 2, wall_seconds=1.0)
        tracker.log_metrics({"score": 1.0, "tasks": {}}, [], Ruler())
        tracker.finish()
    with pytest.raises(
        ConfigError, match=r"wandb.mode=offline needs the wandb package: pip install 'pressbench\[wandb\]'"
    ):
        Tracker.from_spec(resolve(compose(tmp_path, "wandb=offline")))
    with pytest.raises(ConfigError, match="wandb.mode='sometimes'; choose one of disabled, offline, online"):
        Tracker.from_spec(resolve(compose(tmp_path, "wandb=offline", "wandb.mode=sometimes")))


def test_a_wandb_failure_turns_tracking_off_without_stopping_the_run(caplog):
    class BrokenRun:
        def log(self, *args, **kwargs):
            raise ConnectionError("wandb.ai unreachable")

    tracker = Tracker(run=BrokenRun())
    tracker.log_progress(1, 2)
    assert not tracker.enabled
    assert "wandb logging failed and is turned off for this run: wandb.ai unreachable" in caplog.text
    tracker.log_progress(2, 2)  # now a no-op
    tracker.finish()


@pytest.fixture
def offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb_dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb_data"),
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
    }.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "wandb_dir").mkdir()
    # wandb reads its environment once per process; start and end each test with a fresh one.
    wandb.teardown()
    yield tmp_path / "wandb_dir"
    wandb.teardown()


def wandb_records(run_dir: Path, timeout: float = 60.0) -> list:
    """Every record of an offline run, once wandb's writer process has written its exit record.

    ``run.finish()`` returns before the separate wandb-core process has flushed the whole file, so a read can find a
    record half written (seen once in a full run on a loaded machine: a DecodeError): it is read again.
    """
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout
    while True:
        try:
            records = _parse_wandb_file(run_dir)
        except DecodeError:  # read while the writer was halfway through a record: read again
            if time.monotonic() > deadline:
                raise
            records = []
        kinds = {record.WhichOneof("record_type") for record in records}
        if {"run", "exit"} <= kinds or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _parse_wandb_file(run_dir: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, records, pending = 32768, 7, [], b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length = int.from_bytes(data[position + 4 : position + 6], "little")
        kind = data[position + 6]
        if position + 7 + length > len(data):  # a record the writer has not finished writing
            break
        payload = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 2):  # full, first
            pending = payload
        elif kind in (3, 4):  # middle, last
            pending += payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def items(updates) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}


def test_offline_run_logs_config_progress_metrics_and_a_predictions_table(tmp_path, offline):
    cfg = compose(tmp_path, "wandb=offline", "press=eg_chunkkv", "cr=0.9")
    with open_dict(cfg):
        cfg.benchmark = {"_target_": "evaluate.benchmarks.ruler.Ruler", "name": "ruler"}
    # A job of a multirun: the launcher names the group after the sweep folder.
    group_by_sweep(cfg, "/sweeps/multirun/2026-01-02_03-04-05")
    tracker = Tracker.from_spec(resolve(cfg))
    run_dir = tracker.run_dir
    assert run_dir.parent.parent == offline and run_dir.name.startswith("offline-run-")
    rows = [
        {"id": "vt-0", "task": "vt", "question": "Q0?", "answers": ["a", "b"], "prediction": "a b", "kept_ratio": 0.1},
        {"id": "vt-1", "task": "vt", "question": "Q1?", "answers": ["a", "b"], "prediction": "a", "kept_ratio": 0.1},
        {"id": "cwe-0", "task": "cwe", "question": "Q2?", "answers": ["c"], "prediction": "-", "kept_ratio": 0.3},
    ]
    for row, kl in zip(rows, (0.25, 0.75, 2.0), strict=True):  # answer KL: vt 0.5, cwe 2.0, headline 1.25
        row |= {"answer_nll": 1.0 + kl, "answer_nll_uncompressed": 1.0, "answer_kl": kl, "answer_top1": 0.5}
    # Answer retention: vt 0.5, cwe not in its context (null), headline 0.5; by layer [0.25, 0.75].
    for row, retention in zip(rows, (0.25, 0.75, None), strict=True):
        by_layer = None if retention is None else [retention - 0.25, retention + 0.25]
        row |= {"answer_retention": retention, "answer_retention_by_layer": by_layer}
    metrics = score_rows(Ruler(), rows)  # vt: (1 + 0.5) / 2 = 75; cwe: 0; headline 37.5
    tracker.log_progress(2, 3, wall_seconds=1.5, prefill_seconds=1.0, decode_seconds=0.5, kept_ratio=0.1)
    tracker.log_progress(3, 3, wall_seconds=2.5, prefill_seconds=1.8, decode_seconds=0.7, kept_ratio=0.3)
    tracker.log_metrics(metrics, rows, Ruler(), {"wall_seconds": 2.5, "peak_memory_mb": 512.0, "errors": 0})
    tracker.finish()
    assert not tracker.enabled

    records = wandb_records(run_dir)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_group, run.job_type, run.display_name) == (
        "sweep-2026-01-02_03-04-05",
        "ruler",
        resolve(cfg).out.name,
    )
    config = items(run.config.update)
    assert config["cr"] == 0.9 and config["press"]["method"] == "eg_chunkkv_snapkv"
    assert config["model"]["name"] == "tiny-random" and config["wandb"]["mode"] == "offline"
    history = [items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    progress = [h for h in history if "progress/samples" in h]
    assert [(h["progress/samples"], h["progress/fraction"], h["progress/kept_ratio"]) for h in progress] == [
        (2, 2 / 3, 0.1),
        (3, 1.0, 0.3),
    ]
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(items(r.summary.update))
    assert summary["score"] == 37.5 and summary["tasks/vt/score"] == 75.0 and summary["tasks/cwe/n"] == 1
    assert summary["kept_ratio"] == pytest.approx((0.1 + 0.1 + 0.3) / 3)
    assert (summary["wall_seconds"], summary["peak_memory_mb"], summary["samples"]) == (2.5, 512.0, 3)
    assert (summary["likelihood/answer_kl"], summary["likelihood/answer_top1"], summary["likelihood/n"]) == (
        1.25,
        0.5,
        3,
    )
    assert (summary["likelihood/tasks/vt/answer_kl"], summary["likelihood/tasks/cwe/answer_nll"]) == (0.5, 3.0)
    assert (summary["diagnostics/answer_retention"], summary["diagnostics/answer_retention/n"]) == (0.5, 2)
    assert summary["diagnostics/answer_retention/layers/1"] == 0.75
    assert summary["diagnostics/answer_retention/tasks/vt"] == 0.5

    (table_file,) = (run_dir / "files" / "media" / "table").glob("predictions_*.table.json")
    table = json.loads(table_file.read_text())
    columns = ["id", "task", "question", "answers", "prediction", "correct", *LIKELIHOOD_FIELDS, *DIAGNOSTIC_FIELDS]
    assert table["columns"] == columns
    assert sorted(table["data"]) == sorted(
        [
            ["vt-0", "vt", "Q0?", "a | b", "a b", 1.0, 1.25, 1.0, 0.25, 0.5, 0.25, None],
            ["vt-1", "vt", "Q1?", "a | b", "a", 0.5, 1.75, 1.0, 0.75, 0.5, 0.75, None],
            ["cwe-0", "cwe", "Q2?", "c", "-", 0.0, 3.0, 1.0, 2.0, 0.5, None, None],
        ]
    )


def test_report_logs_tables_plots_and_a_score_chart_to_one_offline_run(tmp_path, offline, capsys):
    from evaluate.report.cli import main

    root = tmp_path / "runs"
    write_run(root, uniform([True, True]), method="no_press", likelihood=True)
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5, likelihood=True)
    main([str(root), "--out", str(tmp_path / "tables"), "--plots", str(tmp_path / "plots"), "--wandb", "offline"])
    location = capsys.readouterr().out.split("wandb summary run: ")[1].strip()
    run_dir = Path(location)
    assert run_dir.parent.parent == offline
    records = wandb_records(run_dir)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.job_type == "report"
    logged = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            logged.update(items(r.history.item))
    # wandb flattens each media value into nested keys: {key}/_type, {key}/path, ...
    tables = ("tables/ruler", "tables/ruler_tasks", "tables/runs", "tables/likelihood", "tables/likelihood_tasks")
    for key in (*tables, "charts/ruler_table", "charts/ruler_kl_table"):
        assert logged.get(f"{key}/_type") == "table-file", key
    for key in ("plots/ruler", "plots/ruler_tasks", "plots/ruler_kl"):
        assert logged.get(f"{key}/_type") == "image-file", key
    assert (run_dir / "files" / logged["plots/ruler/path"]).is_file()
    (chart,) = (run_dir / "files" / "media" / "table" / "charts").glob("ruler_table_*.table.json")
    data = json.loads(chart.read_text())
    assert data["columns"] == ["method", "compression_ratio", "score"]
    assert sorted(data["data"]) == [
        ["no compression · Llama-3.1-8B-Instruct", 0.0, 100.0],
        ["snapkv · Llama-3.1-8B-Instruct", 0.5, 50.0],
    ]
    (chart,) = (run_dir / "files" / "media" / "table" / "charts").glob("ruler_kl_table_*.table.json")
    assert sorted(json.loads(chart.read_text())["data"]) == [
        ["no compression · Llama-3.1-8B-Instruct", 0.0, 0.0],
        ["snapkv · Llama-3.1-8B-Instruct", 0.5, pytest.approx(0.28)],
    ]


def test_wandb_mode_in_the_environment_tracks_a_run_of_the_default_config(tmp_path, offline):
    # The offline fixture sets WANDB_MODE=offline; the command line names no wandb option.
    tracker = Tracker.from_spec(resolve(compose_config(tmp_path)))
    run_dir = tracker.run_dir
    assert tracker.enabled and run_dir.parent.parent == offline and run_dir.name.startswith("offline-run-")
    tracker.finish()
    (run,) = [r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run"]
    assert items(run.config.update)["wandb"]["mode"] == "offline"  # the mode it ran in, not the config's null


def test_wandb_disabled_on_the_command_line_wins_over_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now fails
    assert not Tracker.from_spec(resolve(compose(tmp_path, "wandb=disabled"))).enabled
    # Without the package, the default config refuses in one line naming the variable and both ways out.
    with pytest.raises(ConfigError) as refused:
        Tracker.from_spec(resolve(compose_config(tmp_path)))
    assert str(refused.value) == (
        "WANDB_MODE=offline needs the wandb package: pip install 'pressbench[wandb]' (or unset WANDB_MODE, or "
        "wandb=disabled)"
    )


def test_a_wandb_mode_that_cannot_track_is_named_as_ignored(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)
    for value, warned in (("disabled", False), ("dryrun", True)):
        monkeypatch.setenv("WANDB_MODE", value)
        caplog.clear()
        assert not Tracker.from_spec(resolve(compose_config(tmp_path))).enabled
        lines = [record.getMessage() for record in caplog.records]
        assert lines == (["WANDB_MODE=dryrun is ignored: set it to offline or online to track (or disabled)"] * warned)
