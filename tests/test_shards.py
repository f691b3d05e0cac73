"""A sweep split into shards by context writes, once every shard has run, what one process writes, byte for byte."""

import json

import pytest
from omegaconf import OmegaConf

from evaluate import rundir
from evaluate.errors import ConfigError
from evaluate.points.config import fingerprint, run_dir
from evaluate.points.resolve import resolve
from evaluate.points.shard import Shard, parse_shard, resolve_shard
from evaluate.report.runs import ReportError, read_run
from evaluate.run import recorder
from evaluate.run.entry import run_sweep
from evaluate.run.summary import sweep_summary
from tests.support import compose_config

POINTS = [("press=none", "cr=0"), ("press=eg_chunkkv", "cr=0.6"), ("press=topk", "scorer=knorm", "cr=0.3")]


def sweep(output_dir, *extra: str):
    """Three points on five contexts of three questions each, as one sweep."""
    configs = []
    for point in POINTS:
        cfg = compose_config(output_dir, *point, "limit=null", "+model.source.weight_scale=3.0", *extra)
        cfg.benchmark = OmegaConf.create(
            {"_target_": "tests.support.SharedContextBenchmark", "name": "shared_context", "contexts": 5}
        )
        configs.append(cfg)
    return configs


def files(cfg) -> tuple[str, str]:
    out = run_dir(cfg)
    return (out / rundir.PREDICTIONS).read_text(), (out / rundir.METRICS).read_text()


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The sweep in one process: what every sharded sweep must reproduce."""
    configs = sweep(tmp_path_factory.mktemp("whole"))
    run_sweep(configs)
    return [files(cfg) for cfg in configs]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_shards_together_write_what_one_process_writes(tmp_path, whole, count):
    for index in range(count):
        metrics = run_sweep(sweep(tmp_path, f"shard={index}/{count}"))
        # Only the shard that answers a point's last samples scores it.
        assert all((result is None) == (index < count - 1) for result in metrics)
    configs = sweep(tmp_path)
    assert [files(cfg) for cfg in configs] == whole
    for cfg in configs:
        out = run_dir(cfg)
        assert not list((out / rundir.SHARDS).glob("*.json*"))  # merged, then removed
        record = json.loads((out / rundir.RUN).read_text())
        assert record["status"] == "complete" and record["samples"] == record["samples_expected"] == 15
        assert record["sessions"] == count and record["questions"] == 15 and "shards" not in record
        read_run(out)  # the report takes it


def test_each_shard_takes_every_countth_context_in_kvpress_order():
    contexts = [f"context {letter}" for letter in "dbeca"]
    shares = [Shard(index, 2).contexts(contexts) for index in range(2)]
    assert shares == [{"context a", "context c", "context e"}, {"context b", "context d"}]
    assert Shard().contexts(contexts) == set(contexts)


def test_a_killed_shard_is_rerun_alone_and_the_point_is_never_complete_before(tmp_path, whole, monkeypatch):
    original = recorder.Recorder.record
    calls = []

    def killed_after_its_first_context(self, result):
        calls.append(1)
        if len(calls) > 3:  # every point has recorded one context
            raise KeyboardInterrupt("SIGTERM")
        return original(self, result)

    monkeypatch.setattr(recorder.Recorder, "record", killed_after_its_first_context)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep(tmp_path, "shard=0/2"))
    monkeypatch.setattr(recorder.Recorder, "record", original)
    assert run_sweep(sweep(tmp_path, "shard=1/2")) == [None, None, None]

    out = run_dir(sweep(tmp_path)[1])
    record = json.loads((out / rundir.RUN).read_text())
    # Shard 1/2's two contexts are answered, and what shard 0/2 recorded of its three before it was stopped.
    assert record["status"] == "incomplete" and 0 < record["unanswered"] == 15 - record["samples"] <= 9
    assert "shards 0/2 have samples unanswered" in record["error"]
    assert record["shards"]["0-of-2"]["status"] == "interrupted"
    assert record["shards"]["1-of-2"]["status"] == "complete"
    with pytest.raises(ReportError, match=f"status incomplete: {record['unanswered']} samples unanswered"):
        read_run(out)
    assert not (out / rundir.METRICS).exists()
    # The sweep's closing lines name the points that wait, and for which shards.
    summary = sweep_summary([resolve(cfg) for cfg in sweep(tmp_path)], [None, None, None])
    assert "3 points wait for other shards" in summary and "shards 0/2 have samples unanswered" in summary

    finished = run_sweep(sweep(tmp_path, "shard=0/2"))
    assert all(result is not None for result in finished)
    assert [files(cfg) for cfg in sweep(tmp_path)] == whole
    assert json.loads((out / rundir.RUN).read_text())["sessions"] == 3


def test_a_point_begun_with_four_shards_is_finished_by_one_process(tmp_path, whole):
    for index in (0, 2):
        run_sweep(sweep(tmp_path, f"shard={index}/4"))
    finished = run_sweep(sweep(tmp_path))
    assert all(result is not None for result in finished)
    configs = sweep(tmp_path)
    assert [files(cfg) for cfg in configs] == whole
    out = run_dir(configs[0])
    assert not list((out / rundir.SHARDS).glob("*.json*"))
    record = json.loads((out / rundir.RUN).read_text())
    assert record["status"] == "complete" and record["sessions"] == 3 and record["questions"] == 15


def test_the_shard_is_not_a_result_key(tmp_path):
    alone, sharded = sweep(tmp_path)[1], sweep(tmp_path, "shard=2/3")[1]
    assert run_dir(alone) == run_dir(sharded)
    assert fingerprint(alone) == fingerprint(sharded)


def test_shards_of_a_point_run_beside_each_other_and_nothing_else_does(tmp_path):
    out = tmp_path / "run"
    with rundir.locked(out, shard="0-of-2"):
        with rundir.locked(out, shard="1-of-2"):
            assert rundir.held(out) and set(rundir.live_shards(out)) == {"0-of-2", "1-of-2"}
        with pytest.raises(rundir.RunLocked, match="shard 0-of-2"):
            with rundir.locked(out, shard="0-of-2"):
                pass
        with pytest.raises(rundir.RunLocked, match="of another shard count"):
            with rundir.locked(out, shard="1-of-4"):
                pass
        with pytest.raises(rundir.RunLocked, match=r"shard 0-of-2 \(pid"):
            with rundir.locked(out):
                pass
    assert not rundir.held(out)
    with rundir.locked(out):
        with pytest.raises(rundir.RunLocked):
            with rundir.locked(out, shard="0-of-2"):
                pass


def test_where_the_shard_comes_from():
    assert resolve_shard(None, {}) == Shard()
    assert resolve_shard(None, {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == Shard(3, 8)
    assert resolve_shard("1/2", {"RANK": "3", "WORLD_SIZE": "8"}) == Shard(1, 2)
    for wrong in ("2/2", "1", "a/b", "-1/2"):
        with pytest.raises(ConfigError, match="INDEX/COUNT"):
            parse_shard(wrong)


def test_overwrite_and_retry_errors_are_refused_to_a_shard(tmp_path):
    for setting in ("overwrite=true", "retry_errors=true"):
        with pytest.raises(ConfigError, match="without shards"):
            run_sweep(sweep(tmp_path, "shard=0/2", setting))
