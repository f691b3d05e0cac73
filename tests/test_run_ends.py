"""Every way a run ends leaves its directory telling the truth, and no loop of the engine waits forever.

Success, a refusal and Ctrl-C/SIGTERM are covered in tests/test_reliability.py and tests/test_overrides.py; here:
a failure of the machine (memory, disk) is never recorded as a sample's answer and the rerun retries it, an
exception records ``failed``, a run killed without closing is reported as such, memory budgets from zero up
admit every row, and a warning every sweep point repeats is printed once.
"""

import errno
import logging

import pytest
import torch

from evaluate import rundir
from evaluate.engine import model_runner
from evaluate.engine.decoding_pool import DecodingPool
from evaluate.engine.prefill import PrefillCapture
from evaluate.engine.requests import DecodeRequest, Prefilled
from evaluate.errors import RunIncomplete
from evaluate.points.config import run_dir
from evaluate.points.resolve import resolve
from evaluate.report.runs import unfinished
from evaluate.run import recorder as recorder_module
from evaluate.run.entry import command, run, run_sweep
from evaluate.run.summary import interrupted_summary
from tests.support import compose_config, with_shared_context


def shared(tmp_path, *overrides: str):
    return with_shared_context(compose_config(tmp_path, "press=topk", "limit=null", *overrides))


def fail_first_passes(monkeypatch, failure: BaseException, times: int = 1) -> None:
    original = model_runner.ModelRunner._forward
    calls = []

    def failing(self, *args):
        calls.append(1)
        if len(calls) <= times:
            raise failure
        return original(self, *args)

    monkeypatch.setattr(model_runner.ModelRunner, "_forward", failing)


@pytest.mark.parametrize(
    "failure",
    [torch.OutOfMemoryError("CUDA out of memory (simulated)"), OSError(errno.ENOSPC, "No space left on device")],
)
def test_a_failure_of_the_machine_leaves_its_samples_for_the_rerun_instead_of_scoring_them(
    tmp_path, monkeypatch, failure
):
    cfg = shared(tmp_path, "decode_batch_size=3")
    fail_first_passes(monkeypatch, failure)
    with pytest.raises(RunIncomplete, match="3 samples") as raised:
        run(cfg)
    assert "rerun the same command" in str(raised.value)
    out = run_dir(cfg)
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert len(rows) == 6 and not any(row.get("error") for row in rows)  # the failed context is not an answer
    record = rundir.read_json(out / rundir.RUN)
    assert (record["status"], record["unanswered"]) == ("incomplete", 3)
    assert type(failure).__name__ in record["error"]
    assert unfinished(out, record).startswith("status incomplete: 3 samples unanswered")
    partial = rundir.read_json(out / rundir.METRICS)["partial"]  # what it scored says it is short
    assert partial == {"samples": 6, "samples_expected": 9, "status": "incomplete"}

    monkeypatch.undo()
    metrics = run(shared(tmp_path, "decode_batch_size=3"))  # the rerun answers what was left, and only that
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert len(rows) == 9 and "n_errors" not in metrics and "partial" not in metrics
    record = rundir.read_json(out / rundir.RUN)
    assert (record["status"], record["session_samples"]) == ("complete", 3)
    assert "unanswered" not in record


def test_an_incomplete_run_ends_the_command_in_one_line_with_exit_code_1(tmp_path, monkeypatch, capsys):
    cfg = shared(tmp_path, "decode_batch_size=3")
    fail_first_passes(monkeypatch, torch.OutOfMemoryError("CUDA out of memory (simulated)"))
    with pytest.raises(SystemExit) as ended:
        command([cfg], [{}], single=True)
    assert ended.value.code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "CUDA out of memory" in errors[0] and str(run_dir(cfg)) in errors[0]


def test_a_full_disk_while_writing_ends_in_one_line_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    cfg = shared(tmp_path)
    original = rundir.append_predictions
    writes = []

    def full_after_one(path, rows):
        writes.append(path)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        original(path, rows)

    monkeypatch.setattr(rundir, "append_predictions", full_after_one)
    with pytest.raises(SystemExit) as ended:
        command([cfg], [{}], single=True)
    assert ended.value.code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "rerun the same command" in errors[0]
    out = run_dir(cfg)
    record = rundir.read_json(out / rundir.RUN)
    assert record["status"] == "failed" and "No space left on device" in record["error"]
    assert len(rundir.read_predictions(out / rundir.PREDICTIONS)) == 3  # only what was written

    monkeypatch.undo()
    run(shared(tmp_path))
    assert len(rundir.read_predictions(out / rundir.PREDICTIONS)) == 9
    assert rundir.read_json(out / rundir.RUN)["status"] == "complete"


def test_an_exception_records_failed_with_the_error(tmp_path, monkeypatch):
    cfg = shared(tmp_path)

    def broken(self, result):
        raise KeyError("a bug (simulated)")

    monkeypatch.setattr(recorder_module.Recorder, "record", broken)
    with pytest.raises(KeyError):
        run(cfg)
    record = rundir.read_json(run_dir(cfg) / rundir.RUN)
    assert record["status"] == "failed" and record["error"] == "KeyError: 'a bug (simulated)'"
    assert unfinished(run_dir(cfg), record) == "status failed (KeyError: 'a bug (simulated)')"


def test_a_run_killed_without_closing_is_reported_as_stopped_not_as_running(tmp_path):
    out = tmp_path / "killed"
    with rundir.locked(out):
        assert rundir.held(out)
        assert unfinished(out, {"status": "running"}) == "status running"  # a live run
    assert not rundir.held(out)  # the kernel let go of the lock, as it does when its holder is killed
    assert unfinished(out, {"status": "running"}).startswith("status running, but no process holds it")


def test_ctrl_c_counts_only_what_this_session_answered(tmp_path, monkeypatch):
    cfg = shared(tmp_path, "decode_batch_size=1")
    original = recorder_module.Recorder.record

    def interrupt_after(groups: int):
        calls = []

        def record(self, result):
            if len(calls) == groups:
                raise KeyboardInterrupt
            calls.append(1)
            original(self, result)

        return record

    monkeypatch.setattr(recorder_module.Recorder, "record", interrupt_after(1))
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    monkeypatch.setattr(recorder_module.Recorder, "record", interrupt_after(1))
    with pytest.raises(KeyboardInterrupt):
        run(shared(tmp_path, "decode_batch_size=1"))
    out = run_dir(cfg)
    assert len(rundir.read_predictions(out / rundir.PREDICTIONS)) == 6  # two sessions, one context of 3 each
    assert interrupted_summary([resolve(cfg)]).startswith(f"interrupted: 3 samples answered and kept in {out};")
    record = rundir.read_json(out / rundir.RUN)
    assert (record["status"], record["signal"], record["samples"]) == ("interrupted", "SIGINT", 6)


@pytest.fixture(scope="module")
def cache_and_questions():
    cfg = compose_config("unused", "press=none")
    from hydra.utils import instantiate

    source = instantiate(cfg.model.source)
    model, tokenizer = source.load_model("cpu", "float32", "sdpa"), source.load_tokenizer()
    ids = tokenizer("A context of a few words, long enough to hold keys.", return_tensors="pt").input_ids
    capture = PrefillCapture(model.model.layers)
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), capture:
        model.model(input_ids=ids, past_key_values=cache)
    questions = [tokenizer(q, return_tensors="pt").input_ids for q in ("Which?", "What is it?", "Why not?")]
    return model, cache, questions, ids.shape[1]


@pytest.mark.parametrize("memory_bytes", [0, 1, 1000, 2**16, 2**20, 2**30])
def test_memory_budgets_from_zero_up_admit_every_row_and_each_loop_ends(cache_and_questions, memory_bytes, caplog):
    model, cache, questions, length = cache_and_questions
    pool = DecodingPool(model, batch_size=4, memory_bytes=memory_bytes)
    finished, steps = [], 0
    # The engine's loop: submit while there is room, step otherwise; each step must make progress.
    with caplog.at_level(logging.WARNING, logger="evaluate.engine.decoding_pool"):
        for index, question in enumerate(questions * 3):
            while pool.busy() and not pool.has_room():
                finished += pool.step()
                steps += 1
                assert steps < 200
            assert pool.has_room() or not pool.busy()
            pool.submit(DecodeRequest(cache, question, length, 4, tag=index))
        while pool.busy():
            finished += pool.step()
            steps += 1
            assert steps < 200
    assert sorted(row.tag for row in finished) == list(range(9))
    warnings = [record for record in caplog.records if "holds no row" in record.getMessage()]
    assert len(warnings) <= 1  # said once, when the budget holds no row at all
    if memory_bytes == 0:
        assert len(warnings) == 1 and pool.peak_rows == 1


def test_a_tiny_decode_memory_still_answers_every_sample(tmp_path):
    cfg = shared(tmp_path, "decode_memory=0.0000001")
    run(cfg)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert len(rows) == 9 and not any(row.get("error") for row in rows)


def test_progress_names_the_contexts_prefilled(tmp_path, monkeypatch):
    from evaluate.run import entry

    seen = []
    original = entry._record

    def spying(answered, recorders, label):
        def tee():
            for item in answered:
                if isinstance(item, Prefilled):
                    seen.append((item.contexts, item.of))
                yield item

        original(tee(), recorders, label)

    monkeypatch.setattr(entry, "_record", spying)
    run(shared(tmp_path))
    assert seen == [(0, 3), (1, 3), (2, 3), (3, 3)]


def test_a_warning_every_point_repeats_is_printed_once_per_sweep(tmp_path, caplog):
    from evaluate.benchmarks import ruler_synth

    cfgs = [
        compose_config(
            tmp_path,
            "benchmark=ruler_synth",
            "benchmark.tasks=[niah_single_1,qa_1]",  # qa_1 is skipped: no qa_path
            "benchmark.max_seq_length=1024",
            "limit=1",
            cr,
        )
        for cr in ("cr=0.25", "cr=0.5")
    ]
    with caplog.at_level(logging.WARNING):
        run_sweep(cfgs)
    skipped = [record for record in caplog.records if record.name == ruler_synth.__name__ and "skipping" in record.msg]
    assert len(skipped) == 1
