"""The gpus launcher (one pinned worker per GPU) and the SLURM launcher (submitit), without a GPU or a cluster."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra.core.utils import JobStatus
from submitit.core.utils import DelayedSubmission

from evaluate import rundir
from evaluate.points.config import run_dir
from evaluate.run.entry import run, run_sweep
from hydra_plugins.pressbench_gpus_launcher.gpus_launcher import _combined, _outcomes, _Worker, visible_gpus
from tests.support import SharedContextBenchmark, compose_config

REPO = Path(__file__).resolve().parent.parent
RECORDED = ("cuda_visible_devices", "pid")


@dataclass
class DeviceRecordingBenchmark(SharedContextBenchmark):
    """The shared-context benchmark, each sample recording which process loaded it and the GPUs it saw."""

    def load(self, tokenizer, limit: int | None = None):
        seen = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid()}
        return [replace(sample, extra=seen) for sample in super().load(tokenizer, limit)]


def in_code_benchmark(target: str, *settings: str) -> list[str]:
    return ["~benchmark", f"+benchmark._target_={target}", "+benchmark.name=shared_context", *settings]


def cli(output_dir: Path, *overrides: str, env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "evaluate", "-m", f"output_dir={output_dir}", "device=cpu", *overrides],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def rows_without(path: Path, keys: tuple[str, ...]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in keys} for row in rundir.read_predictions(path)]


# --- gpus launcher -------------------------------------------------------------------------------------------


def test_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert visible_gpus() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, GPU-1f2e,MIG-77")
    assert visible_gpus() == ["3", "GPU-1f2e", "MIG-77"]
    # CUDA stops at the first invalid entry.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,-1,3")
    assert visible_gpus() == ["2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    # The launcher's own list wins over the environment.
    assert visible_gpus([4, 5]) == ["4", "5"] and visible_gpus("6,7") == ["6", "7"] and visible_gpus(1) == ["1"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert visible_gpus() == ["0", "1", "2"]


def test_worker_outcomes_become_job_statuses(tmp_path):
    log_path = tmp_path / "0.log"
    log_path.write_text("".join(f"line {n}\n" for n in range(30)))
    result_path = tmp_path / "result.json"

    def worker(returncode: int) -> _Worker:
        process = SimpleNamespace(returncode=returncode)
        return _Worker("0", [None, None], process, result_path, log_path, None)

    result_path.write_text(json.dumps({"metrics": [{"score": 12.5}, {"score": 80.0}]}))
    assert _outcomes(worker(0)) == [(JobStatus.COMPLETED, 12.5), (JobStatus.COMPLETED, 80.0)]

    result_path.write_text(json.dumps({"error": "ConfigError: cr=2 is outside [0, 1)"}))
    outcomes = _outcomes(worker(1))
    assert [status for status, _ in outcomes] == [JobStatus.FAILED] * 2
    message = str(outcomes[0][1])
    assert "worker on GPU 0 failed: ConfigError: cr=2" in message
    # The last lines of the worker's log come with the error, not the whole log.
    assert "line 29" in message and "line 10\n" in message and "line 9\n" not in message

    result_path.unlink()
    assert "worker on GPU 0 exited with code -9 before finishing" in str(_outcomes(worker(-9))[0][1])


GPUS_SWEEP = (
    "hydra/launcher=gpus",
    "model=tiny_random,tiny_random_qwen3",
    "press=eg_chunkkv",
    "cr=0.3,0.6",
    "limit=null",
    # Without the likelihood fields: once in CI, with the two workers sharing two CPU cores, the uncompressed
    # answer_nll of a worker differed from a separate run's by 1e-7 relative, and the random model's near-tied keys
    # turned that into another kept set and a compressed answer_nll 4e-4 apart, while every prediction was equal.
    # This test is about the launcher; tests/test_likelihood.py proves a sweep's fields equal separate runs'.
    "likelihood=false",
    *in_code_benchmark(f"{__name__}.DeviceRecordingBenchmark"),
)


@pytest.mark.slow  # a multirun whose two workers each start Python, torch and kvpress (~30 s on 2 CPU cores)
@pytest.mark.parametrize(("visible", "expected"), [("0,1", {"0", "1"}), ("", {""})])
def test_each_worker_sees_only_its_own_gpu_and_its_shard_gives_a_separate_runs_rows(tmp_path, visible, expected):
    process = cli(tmp_path / "sweep", *GPUS_SWEEP, env={"CUDA_VISIBLE_DEVICES": visible})
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]

    workers = set()
    for model, cr in [(m, c) for m in ("tiny_random", "tiny_random_qwen3") for c in ("0.3", "0.6")]:
        overrides = (f"model={model}", "press=eg_chunkkv", f"cr={cr}", "limit=null", "likelihood=false")
        benchmark = in_code_benchmark(f"{__name__}.DeviceRecordingBenchmark")
        swept = run_dir(compose_config(tmp_path / "sweep", *overrides, *benchmark))
        rows = rundir.read_predictions(swept / rundir.PREDICTIONS)
        # With two GPUs, each worker answered its shard of the contexts of every point, seeing its own GPU only.
        seen = {(row["pid"], row["cuda_visible_devices"]) for row in rows}
        assert len(rows) == 9 and {devices for _, devices in seen} == expected and len(seen) == len(expected)
        assert json.loads((swept / rundir.RUN).read_text())["status"] == "complete"
        workers |= seen
        reference = compose_config(tmp_path / "reference", *overrides, *benchmark)
        run(reference)
        assert rows_without(swept / rundir.PREDICTIONS, RECORDED) == rows_without(
            run_dir(reference) / rundir.PREDICTIONS, RECORDED
        )

    assert process.pid not in {pid for pid, _ in workers} and len(workers) == len(expected)
    sweep_logs = next((tmp_path / "sweep" / "multirun").iterdir()) / "gpus"
    assert sorted(path.name for path in sweep_logs.iterdir()) == sorted(f"{d or 'cpu'}.log" for d in expected)


def test_a_job_takes_the_score_of_the_shard_that_scored_its_point():
    failure = RuntimeError("worker on GPU 1 failed")
    done, waiting, failed = (JobStatus.COMPLETED, 31.0), (JobStatus.COMPLETED, None), (JobStatus.FAILED, failure)
    assert _combined([waiting, done]) == done and _combined([done, failed]) == done
    assert _combined([waiting, failed]) == failed and _combined([waiting, waiting]) == waiting


# --- torchrun ------------------------------------------------------------------------------------------------

TORCHRUN_SWEEP = (
    "model=tiny_random",
    "press=eg_chunkkv",
    "cr=0.3,0.6",
    "limit=null",
    "likelihood=false",  # as GPUS_SWEEP: processes on shared cores, and the test is about the launch
    *in_code_benchmark("tests.support.SharedContextBenchmark", "+benchmark.contexts=4"),
)


@pytest.mark.slow  # torchrun and two `python -m evaluate` ranks (~40 s on 2 CPU cores)
def test_torchrun_ranks_shard_a_sweep_and_write_what_one_process_writes(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--log-dir", str(tmp_path / "logs"), "--redirects", "3", "-m", "evaluate", "-m"]
    command += [f"output_dir={tmp_path / 'sweep'}", "device=cpu", *TORCHRUN_SWEEP]
    finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stderr[-3000:]

    points = [(cr, *TORCHRUN_SWEEP[:2], *TORCHRUN_SWEEP[3:]) for cr in ("cr=0.3", "cr=0.6")]
    run_sweep([compose_config(tmp_path / "reference", *point) for point in points])
    for point in points:
        sharded, alone = (run_dir(compose_config(tmp_path / where, *point)) for where in ("sweep", "reference"))
        for name in (rundir.PREDICTIONS, rundir.METRICS):
            assert (sharded / name).read_text() == (alone / name).read_text()
        assert not list((sharded / rundir.SHARDS).glob("*.json*"))
    # Each rank's output in a log of its own, under the directory torchrun was given.
    logs = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert len(logs) == 2
    summaries = [log.read_text() for log in logs]
    assert any("sweep of 2 points" in text for text in summaries)


# --- SLURM launcher ------------------------------------------------------------------------------------------


def fake_slurm(bin_dir: Path) -> None:
    """``srun`` to pass submitit's cluster check, ``sbatch`` that keeps the script it is given and refuses it."""
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").write_text('#!/bin/sh\ncp "$1" "$SBATCH_RECORD"\necho "sbatch: no cluster" >&2\nexit 1\n')
    for name in ("srun", "sbatch"):
        (bin_dir / name).chmod(0o755)


@pytest.mark.slow  # one `python -m evaluate` process (~10 s)
def submitted(tmp_path, *overrides: str) -> tuple[set[str], list[DelayedSubmission]]:
    """What a sweep of three ratios through ``hydra/launcher=slurm`` hands a fake ``sbatch``: its #SBATCH lines, and
    the submissions submitit pickled (what each array task will run)."""
    fake_slurm(tmp_path / "bin")
    script = tmp_path / "sbatch.sh"
    process = cli(
        tmp_path / "runs",
        "hydra/launcher=slurm",
        *overrides,
        "model=tiny_random",
        "cr=0.3,0.5,0.7",
        env={"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "SBATCH_RECORD": str(script)},
    )
    _, stderr = process.communicate(timeout=600)
    assert process.returncode != 0 and "sbatch: no cluster" in stderr
    flags = {line for line in script.read_text().splitlines() if line.startswith("#SBATCH")}
    pickles = sorted(next((tmp_path / "runs" / "multirun").iterdir()).glob(".submitit/*.pkl"))
    return flags, [DelayedSubmission.load(path) for path in pickles]


def test_slurm_launcher_submits_one_requeueable_array_with_the_configured_resources(tmp_path):
    flags, submissions = submitted(
        tmp_path,
        "hydra.launcher.partition=gpu_test",
        "hydra.launcher.array_parallelism=2",
        "hydra.launcher.timeout_min=90",
    )
    assert {
        "#SBATCH --partition=gpu_test",
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --time=90",
        "#SBATCH --array=0-2%2",
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --job-name=pressbench",
    } <= flags

    # What each array task will run: the job's own overrides; requeued, it resubmits exactly those.
    assert len(submissions) == 3
    crs = set()
    for submission in submissions:
        assert submission._timeout_countdown == 5
        overrides = submission.args[0]
        crs |= {item for item in overrides if item.startswith("cr=")}
        requeued = submission._checkpoint_function()
        assert requeued.args[0] == overrides and requeued.args[2] == submission.args[2]
    assert crs == {"cr=0.3", "cr=0.5", "cr=0.7"}


# 6 contexts x 3 questions per job: the job is preempted once its first context is written.
REQUEUE_RUN = (
    "model=tiny_random",
    "press=eg_chunkkv",
    "limit=null",
    # A pool of one context's three questions answers the contexts one after another, so the signal lands mid-run;
    # the default pool would hold all 18 rows and answer them in one burst.
    "decode_batch_size=3",
    *in_code_benchmark("tests.support.SharedContextBenchmark", "+benchmark.contexts=6", "+benchmark.max_new_tokens=12"),
)


@pytest.mark.slow  # a two-job multirun through submitit's local executor, one job preempted and requeued (~1 min)
def test_submitit_local_job_preempted_mid_run_is_requeued_and_resumes_to_the_uninterrupted_result(tmp_path):
    process = cli(tmp_path / "runs", "hydra/launcher=submitit_local", *REQUEUE_RUN, "cr=0.3,0.6")
    preempted = run_dir(compose_config(tmp_path / "runs", *REQUEUE_RUN, "cr=0.3"))
    predictions = preempted / rundir.PREDICTIONS
    deadline = time.monotonic() + 600
    while not predictions.exists() or not predictions.read_bytes().count(b"\n"):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.05)
    # The job's process holds the run directory's lock, which names it; USR2 is what SLURM sends on
    # preemption or near the time limit (submitit's signal), and what submitit's local executor forwards.
    holder = int((preempted / rundir.LOCK).read_text().split()[1])
    os.kill(holder, signal.SIGUSR2)
    answered_before = predictions.read_bytes().count(b"\n")
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]

    assert answered_before < 18
    record = rundir.read_json(preempted / rundir.RUN)
    assert record["status"] == "complete" and record["sessions"] == 2
    assert str(holder) not in (preempted / rundir.LOCK).read_text()
    job_logs = "".join(p.read_text() for p in (tmp_path / "runs" / "multirun").rglob("*_log.*"))
    assert "this job is preempted" in job_logs and "Requeued job" in job_logs
    for cr, sessions in (("0.3", 2), ("0.6", 1)):
        swept = run_dir(compose_config(tmp_path / "runs", *REQUEUE_RUN, f"cr={cr}"))
        reference = compose_config(tmp_path / "reference", *REQUEUE_RUN, f"cr={cr}")
        run(reference)
        lines = (swept / rundir.PREDICTIONS).read_text().splitlines()
        assert len(lines) == 18 and lines == (run_dir(reference) / rundir.PREDICTIONS).read_text().splitlines()
        assert (swept / rundir.METRICS).read_text() == (run_dir(reference) / rundir.METRICS).read_text()
        assert rundir.read_json(swept / rundir.RUN)["sessions"] == sessions


@pytest.mark.slow  # one `python -m evaluate` process (~10 s)
def test_sharded_slurm_launcher_submits_one_array_task_per_shard_each_with_every_job(tmp_path):
    flags, submissions = submitted(tmp_path, "hydra.launcher.shards=4")
    assert {"#SBATCH --array=0-3%4", "#SBATCH --requeue", "#SBATCH --signal=USR2@120"} <= flags
    tasks = set()
    for submission in submissions:
        overrides, _, task, shards, _ = submission.args
        assert shards == 4 and {item for job in overrides for item in job if item.startswith("cr=")} == {
            "cr=0.3",
            "cr=0.5",
            "cr=0.7",
        }
        assert submission._checkpoint_function().args == submission.args  # requeued as it was
        tasks.add(task)
    assert tasks == {0, 1, 2, 3}


@pytest.mark.slow  # two shards through submitit's local executor, one preempted and requeued (~1 min)
def test_a_preempted_shard_is_requeued_and_the_sharded_sweep_ends_as_one_process_would(tmp_path):
    sharded = ("hydra/launcher=slurm_local", "hydra.launcher.shards=2")
    process = cli(tmp_path / "runs", *sharded, *REQUEUE_RUN, "cr=0.3,0.6")
    preempted = run_dir(compose_config(tmp_path / "runs", *REQUEUE_RUN, "cr=0.3"))
    predictions = rundir.shard_path(preempted, "0-of-2", ".jsonl")
    deadline = time.monotonic() + 600
    while not predictions.exists() or not predictions.read_bytes().count(b"\n"):
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-3000:]
        time.sleep(0.05)
    lock = rundir.shard_path(preempted, "0-of-2", ".lock")
    holder = int(lock.read_text().split()[1])
    os.kill(holder, signal.SIGUSR2)
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]

    job_logs = "".join(p.read_text() for p in (tmp_path / "runs" / "multirun").rglob("*_log.*"))
    assert "this job is preempted" in job_logs and "Requeued job" in job_logs
    for cr in ("0.3", "0.6"):
        swept = run_dir(compose_config(tmp_path / "runs", *REQUEUE_RUN, f"cr={cr}"))
        reference = compose_config(tmp_path / "reference", *REQUEUE_RUN, f"cr={cr}")
        run(reference)
        for name in (rundir.PREDICTIONS, rundir.METRICS):
            assert (swept / name).read_text() == (run_dir(reference) / name).read_text()
        record = rundir.read_json(swept / rundir.RUN)
        assert record["status"] == "complete" and record["samples"] == 18
    assert rundir.read_json(preempted / rundir.RUN)["sessions"] == 3  # shard 0/2 twice, shard 1/2 once


def test_launcher_module_imports_no_torch_at_plugin_scan():
    # Hydra imports every plugin module at start-up, for every command; the launcher must stay cheap to import.
    modules = ("pressbench_gpus_launcher.gpus_launcher", "pressbench_slurm_launcher.slurm_launcher")
    code = f"import sys, {', '.join('hydra_plugins.' + module for module in modules)}; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True).stdout == "False\n"
