"""Crashes, concurrency, bad input and failing samples: each provoked, each outcome checked."""

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
from kvpress import KnormPress

from evaluate import rundir
from evaluate.benchmarks import Sample
from evaluate.benchmarks.selection import check_samples, select_fraction
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import ConfigError, run_dir
from evaluate.points.plan import truncate
from evaluate.points.resolve import resolve
from evaluate.run.entry import run, run_sweep
from evaluate.run.summary import sweep_summary
from tests.support import SharedContextBenchmark, compose_config, with_shared_context

REPO = Path(__file__).resolve().parent.parent
# The CLI on the tiny model with the in-code benchmark of tests/support.py: 12 contexts x 3 questions, through the
# decoding pool with room for one context's questions at a time, so that contexts are recorded one after another.
KILL_RUN = (
    "model=tiny_random",
    "decode_batch_size=3",
    "press=eg_chunkkv",
    "cr=0.5",
    "limit=null",
    "~benchmark",
    "+benchmark._target_=tests.support.SharedContextBenchmark",
    "+benchmark.name=shared_context",
    "+benchmark.contexts=12",
    "+benchmark.max_new_tokens=24",
)


def _interruptible() -> None:
    # A child inherits an ignored SIGINT (Python then installs no KeyboardInterrupt handler); an earlier test of the
    # suite can leave this process ignoring it, so the child starts with the default disposition, as from a shell.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli(output_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "evaluate", f"output_dir={output_dir}", "device=cpu", *overrides],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,
    )


def count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_sigkill_at_random_moments_then_resume_equals_an_uninterrupted_run(tmp_path):
    killed = tmp_path / "killed"
    final_cfg = compose_config(killed, *KILL_RUN)
    out = run_dir(final_cfg)
    predictions = out / rundir.PREDICTIONS
    rng = random.Random(7)
    kills = 0
    for _ in range(4):
        before = count_lines(predictions)
        process = cli(killed, *KILL_RUN)
        # Wait until this process has written something, then kill it at a random moment after that.
        while count_lines(predictions) <= before and process.poll() is None:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills += 1
        process.wait()
    assert kills >= 2, "the run finished before it could be killed; make the workload longer"
    assert rundir.read_json(out / rundir.RUN)["status"] in ("running", "complete")
    final = cli(killed, *KILL_RUN)
    assert final.wait(timeout=300) == 0, final.stderr.read()

    reference = compose_config(tmp_path / "reference", *KILL_RUN)
    run(reference)
    lines = predictions.read_text().splitlines()
    assert lines == (run_dir(reference) / rundir.PREDICTIONS).read_text().splitlines()
    assert len({json.loads(line)["id"] for line in lines}) == len(lines) == 36
    assert (out / rundir.METRICS).read_text() == (run_dir(reference) / rundir.METRICS).read_text()
    record = rundir.read_json(out / rundir.RUN)
    assert record["status"] == "complete" and record["sessions"] >= kills


def hold(out: Path) -> subprocess.Popen:
    """Another process holding ``out``'s lock until killed."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from evaluate.rundir import locked\n"
            "with locked(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
            str(out),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_process_on_a_running_directory_is_refused_with_the_holders_name(tmp_path):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk"))
    out = run_dir(cfg)
    holder = hold(out)
    try:
        with pytest.raises(rundir.RunLocked, match=f"pid {holder.pid} on "):
            run(cfg)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The killed holder's lock file is still there, but its flock died with it: the run takes over.
    assert (out / rundir.LOCK).exists()
    run(cfg)
    assert rundir.read_json(out / rundir.RUN)["status"] == "complete"
    assert str(os.getpid()) in (out / rundir.LOCK).read_text()


def test_a_sweep_leaves_held_points_to_their_holder_runs_the_rest_and_lists_them(tmp_path, capsys):
    cfgs = [
        with_shared_context(compose_config(tmp_path, "press=topk", f"cr={cr}", "limit=1")) for cr in (0.2, 0.4, 0.6)
    ]
    holder = hold(run_dir(cfgs[1]))
    try:
        metrics = run_sweep(cfgs)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert metrics[1] is None and metrics[0] is not None and metrics[2] is not None
    assert not (run_dir(cfgs[1]) / rundir.PREDICTIONS).exists()
    printed = capsys.readouterr().out
    assert "1 of 3 points were left to the processes holding them; rerun to resume them:" in printed
    assert f"{run_dir(cfgs[1])} (held by pid {holder.pid} on " in printed
    # Rerun: the two finished points are complete, the third runs now.
    assert all(m is not None for m in run_sweep(cfgs))


def test_wait_for_locks_waits_for_the_holder_instead(tmp_path):
    cfgs = [
        with_shared_context(compose_config(tmp_path, "press=topk", f"cr={cr}", "limit=1", "wait_for_locks=true"))
        for cr in (0.2, 0.4)
    ]
    holder = hold(run_dir(cfgs[1]))
    threading.Timer(2.0, holder.kill).start()
    try:
        metrics = run_sweep(cfgs)
    finally:
        holder.wait()
    assert all(m is not None for m in metrics)
    assert rundir.read_json(run_dir(cfgs[1]) / rundir.RUN)["status"] == "complete"


def test_a_model_that_cannot_be_loaded_is_refused_in_one_line_naming_the_fix(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "evaluate",
            "model=hub",
            f"model.name_or_path={tmp_path}/nonexistent",
            f"output_dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the tokenizer of ") and "could not be loaded" in last
    assert "point the model's name_or_path at a local directory holding config.json" in last
    assert "Traceback" not in result.stderr


def test_a_refused_point_ends_a_sweep_in_one_line_before_any_point_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "evaluate", "-m", "model=tiny_random", "cr=0.5,1.5", f"output_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: cr=1.5 is outside [0, 1): cr is the fraction of KV pairs removed, e.g. cr=0.5"
    )
    assert "Traceback" not in result.stderr
    # The good point did not run either, and Hydra's record of the sweep (multirun/) is removed with the refusal.
    assert list(tmp_path.iterdir()) == []


def test_resuming_with_a_different_configuration_is_refused(tmp_path):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "limit=1"))
    run(cfg)
    record = rundir.read_yaml(run_dir(cfg) / rundir.CONFIG)
    record["fingerprint"] = "0" * 64
    rundir.write_yaml(run_dir(cfg) / rundir.CONFIG, record)
    with pytest.raises(ConfigError, match="different configuration; pass overwrite=true"):
        run(with_shared_context(compose_config(tmp_path, "press=topk", "limit=2")))
    before = (run_dir(cfg) / rundir.PREDICTIONS).read_text()
    assert len(before.splitlines()) == 2


@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.2"])
def test_fraction_outside_unit_interval_is_refused(tmp_path, fraction):
    with pytest.raises(ConfigError, match=r"outside \(0, 1\]"):
        run(compose_config(tmp_path, f"fraction={fraction}"))


def test_fraction_selects_the_same_random_share_as_pandas_sample():
    samples = SharedContextBenchmark(contexts=10).load(None)
    chosen = select_fraction(samples, 0.3, seed=42, by_task=False)
    # Printed by pandas 3: sorted(DataFrame(range(30)).sample(frac=0.3, random_state=42).index).
    assert [samples.index(sample) for sample in chosen] == [8, 9, 12, 15, 17, 23, 24, 27, 28]


def test_fraction_draws_within_each_task_where_kvpress_loads_a_data_dir_per_task():
    samples = SharedContextBenchmark(contexts=10).load(None)  # tasks niah_task0 and niah_task1, interleaved
    chosen = {sample.id for sample in select_fraction(samples, 0.3, seed=42, by_task=True)}
    for task in ("niah_task0", "niah_task1"):
        frame = pd.DataFrame([sample.__dict__ for sample in samples if sample.task == task])
        # The frame kvpress would load for this task's data_dir, sampled as kvpress samples it.
        expected = set(frame.sample(frac=0.3, random_state=42)["id"])
        assert {sample_id for sample_id in chosen if sample_id in set(frame["id"])} == expected


def test_the_pipeline_truncates_the_templated_context_by_default(tmp_path, tiny_tokenizer):
    cfg = with_shared_context(compose_config(tmp_path, "press=none", "max_context_length=200"))
    assert cfg.truncation == "pipeline"
    run(cfg)
    out = run_dir(cfg)
    assert rundir.read_json(out / rundir.RUN)["truncated_samples"] == 6
    # The pipeline cuts after the chat template: 200 tokens in all, the template's user-turn prefix among them.
    assert {row["context_length"] for row in rundir.read_predictions(out / rundir.PREDICTIONS)} == {200}


@pytest.mark.parametrize("query_aware", [False, True])
def test_the_truncation_count_is_exact_at_the_budgets_edge(tmp_path, query_aware):
    # The full templated length of the contexts (all the same length here), as the pipeline feeds them.
    full = with_shared_context(compose_config(tmp_path / "full", "press=none", f"query_aware={query_aware}"))
    run(full)
    length = rundir.read_predictions(run_dir(full) / rundir.PREDICTIONS)[0]["context_length"]
    for budget, truncated in ((length, 0), (length - 1, 6)):
        cfg = with_shared_context(
            compose_config(
                tmp_path / str(budget), "press=none", f"query_aware={query_aware}", f"max_context_length={budget}"
            )
        )
        run(cfg)
        assert rundir.read_json(run_dir(cfg) / rundir.RUN)["truncated_samples"] == truncated, budget


def test_empty_context_is_refused_naming_the_sample_but_an_empty_question_is_allowed():
    sample = Sample(id="s-1", task="t", context="c", question="\n", answer_prefix="", answers=["a"], max_new_tokens=1)
    assert check_samples([sample]) == [sample]
    broken = Sample(**{**sample.__dict__, "context": "  \n", "id": "s-2"})
    with pytest.raises(ConfigError, match="'s-2' has an empty context"):
        check_samples([sample, broken])


def test_duplicate_sample_ids_are_refused():
    sample = Sample(id="s-1", task="t", context="c", question="q", answer_prefix="", answers=["a"], max_new_tokens=1)
    with pytest.raises(ConfigError, match="appears twice"):
        check_samples([sample, sample])


@pytest.mark.parametrize("policy", ["head", "middle"])
def test_long_contexts_are_truncated_by_the_recorded_policy(tmp_path, tiny_tokenizer, policy):
    text = "".join(chr(ord("a") + i % 26) for i in range(300))
    cut = truncate(tiny_tokenizer, text, 100, policy)
    assert len(tiny_tokenizer.encode(cut, add_special_tokens=False)) == 100
    assert cut == (text[:100] if policy == "head" else text[:50] + text[-50:])

    cfg = with_shared_context(compose_config(tmp_path, "press=none", "max_context_length=200", f"truncation={policy}"))
    run(cfg)
    out = run_dir(cfg)
    assert rundir.read_json(out / rundir.RUN)["truncated_samples"] == 6
    assert rundir.read_yaml(out / rundir.CONFIG)["config"]["truncation"] == policy
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    # 200 context tokens plus the chat template's user-turn prefix.
    assert {row["context_length"] for row in rows} == {200 + len(tiny_tokenizer.encode("<|im_start|>user\n"))}


@pytest.mark.parametrize("decode_batch_size", [1, 32])  # kvpress's pipeline path, and the decoding pool
def test_a_failing_context_is_recorded_scored_wrong_and_does_not_stop_the_run(tmp_path, monkeypatch, decode_batch_size):
    from kvpress import KVPressTextGenerationPipeline

    original = KVPressTextGenerationPipeline.preprocess

    def fail_on_document_1(self, context, *args, **kwargs):
        # Both paths tokenize the context through the pipeline's preprocess before its prefill.
        if "Document 1." in context:
            raise ValueError("a context this press cannot take (simulated)")
        return original(self, context, *args, **kwargs)

    monkeypatch.setattr(KVPressTextGenerationPipeline, "preprocess", fail_on_document_1)
    path = f"decode_batch_size={decode_batch_size}"
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "limit=null", path))
    metrics = run(cfg)
    out = run_dir(cfg)
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    failed = [row for row in rows if row.get("error")]
    assert [row["id"] for row in failed] == ["doc-1-0", "doc-1-1", "doc-1-2"]
    assert all(row["prediction"] == "" and "cannot take" in row["error"] for row in failed)
    assert len(rows) == 9
    record = rundir.read_json(out / rundir.RUN)
    assert (record["status"], record["errors"]) == ("complete_with_errors", 3)
    assert metrics["n_errors"] == 3
    assert metrics["tasks"]["niah_task0"]["n_errors"] == 2 and metrics["tasks"]["niah_task1"]["n_errors"] == 1

    with pytest.raises(ValueError, match="simulated"):
        run(with_shared_context(compose_config(tmp_path / "fast", "press=topk", "limit=null", "fail_fast=true", path)))

    monkeypatch.undo()
    metrics = run(with_shared_context(compose_config(tmp_path, "press=topk", "limit=null", "retry_errors=true", path)))
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert len(rows) == 9 and not any(row.get("error") for row in rows)
    assert rundir.read_json(out / rundir.RUN)["status"] == "complete"
    assert "n_errors" not in metrics


def test_undecodable_and_control_characters_round_trip_deterministically(tmp_path, monkeypatch):
    weird = "caf\u00e9 \x00\x07 tab\t bell \udcff end"

    class WeirdBenchmark(SharedContextBenchmark):
        def load(self, tokenizer, limit=None):
            return [
                Sample(**{**sample.__dict__, "question": sample.question + weird, "answers": [weird]})
                for sample in super().load(tokenizer, limit)
            ]

    monkeypatch.setattr("tests.support.SharedContextBenchmark", WeirdBenchmark)
    cfg = with_shared_context(compose_config(tmp_path, "press=topk"))
    run(cfg)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    # The lone surrogate (an undecodable byte) becomes U+FFFD; control characters are kept as they are.
    assert {row["answers"][0] for row in rows} == {weird.replace("\udcff", "\ufffd")}
    assert all(row["question"].endswith(weird.replace("\udcff", "\ufffd")) for row in rows)
    first = (run_dir(cfg) / rundir.PREDICTIONS).read_bytes()
    run(with_shared_context(compose_config(tmp_path, "press=topk", "overwrite=true")))
    assert (run_dir(cfg) / rundir.PREDICTIONS).read_bytes() == first


def test_a_scorer_that_needs_eager_attention_is_refused_under_sdpa(tmp_path, monkeypatch):
    monkeypatch.setattr(TinyRandomModel, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ConfigError, match="use attn_implementation=eager"):
        run(compose_config(tmp_path, "+scorer.needs_eager=true"))


def test_an_architecture_kvpress_does_not_patch_is_warned_about(caplog):
    from evaluate.models.loading import warn_if_unpatched

    warn_if_unpatched(object())
    assert "not an architecture kvpress patches" in caplog.text


SHARED_CONTEXT_CLI = (
    "model=tiny_random",
    "limit=null",
    "~benchmark",
    "+benchmark._target_=tests.support.SharedContextBenchmark",
    "+benchmark.name=shared_context",
)


def evaluate_cli(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "evaluate", *arguments, "device=cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_press_and_method_together_are_refused_in_one_line_before_anything_runs(tmp_path):
    for sweep in ([], ["-m"]):
        result = evaluate_cli(*sweep, "press=chunkkv", "method=knorm", f"output_dir={tmp_path}", *SHARED_CONTEXT_CLI)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            "error: press=chunkkv and method=knorm both choose the press; give one: method=knorm runs kvpress's "
            "registry entry, press=chunkkv the press of conf/press/chunkkv.yaml"
        )
        assert "Traceback" not in result.stderr
    assert not list(tmp_path.iterdir())  # no run, and no sweep folder: a refused sweep removes Hydra's record too


def test_a_run_stopped_after_its_last_answer_but_before_it_closed_is_closed_by_the_rerun(tmp_path):
    # SIGKILL between the last prediction line and run.json's "complete": every answer is in, the status is not.
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "scorer=snapkv", "cr=0.5"))
    run(cfg)
    out = run_dir(cfg)
    record = rundir.read_json(out / rundir.RUN)
    predictions = (out / rundir.PREDICTIONS).read_text()
    rundir.write_json(out / rundir.RUN, {**record, "status": "running"})
    run(cfg)
    closed = rundir.read_json(out / rundir.RUN)
    assert (closed["status"], closed["sessions"]) == ("complete", record["sessions"] + 1)
    assert closed["samples"] == closed["samples_expected"] == record["samples"]
    assert (out / rundir.PREDICTIONS).read_text() == predictions  # nothing answered again


def test_a_run_whose_every_sample_failed_exits_non_zero_and_says_why(tmp_path):
    result = evaluate_cli(
        "press=topk", "scorer.press._target_=tests.support.FailingScorer", f"output_dir={tmp_path}", *SHARED_CONTEXT_CLI
    )
    assert result.returncode == 1
    assert (
        "9 of 9 samples failed and count as wrong answers; the first: RuntimeError: this scorer always fails "
        "(rerun with retry_errors=true to answer them again)"
    ) in result.stdout.splitlines()
    (out,) = tmp_path.iterdir()
    assert rundir.read_json(out / rundir.RUN)["status"] == "complete_with_errors"


def test_a_sweep_ends_with_its_method_by_cr_table_and_lists_its_failed_points(tmp_path, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("knorm is broken")

    monkeypatch.setattr(KnormPress, "score", broken)
    points = [(scorer, cr) for scorer in ("snapkv", "knorm") for cr in ("0.25", "0.5")]
    cfgs = [
        with_shared_context(compose_config(tmp_path, "press=topk", f"scorer={scorer}", f"cr={cr}", "limit=null"))
        for scorer, cr in points
    ]
    metrics = run_sweep(cfgs)
    lines = sweep_summary([resolve(cfg) for cfg in cfgs], metrics).splitlines()
    assert lines[0] == "sweep of 4 points, score (answer KL) by method and cr:"
    assert lines[1].split() == ["cr", "0.25", "0.50"]
    assert lines[2].split() == ["method"]
    assert lines[3].split() == ["knorm", "0.0", "0.0"]  # failed samples have no likelihood fields
    kl = [f"({result['likelihood']['answer_kl']:.3g})" for result in metrics[:2]]
    assert lines[4].split() == ["snapkv", str(metrics[0]["score"]), kl[0], str(metrics[1]["score"]), kl[1]]
    assert lines[5] == "2 points had failed samples (rerun with retry_errors=true to answer them again):"
    assert lines[6:] == [
        f"  {run_dir(cfg)}: 9 of 9 samples failed; the first: RuntimeError: knorm is broken" for cfg in cfgs[2:]
    ]


# KILL_RUN, one question at a time and on 200 contexts: the signal must arrive while the run still answers, and
# on a loaded machine this process can wake up seconds after the first line is written (with 12 contexts, all 36
# samples were answered by then, once even one at a time, and the run ended before it was interrupted).
INTERRUPTED_CONTEXTS = 200
INTERRUPTED_RUN = tuple(
    {
        "decode_batch_size": "decode_batch_size=1",
        "+benchmark.contexts": f"+benchmark.contexts={INTERRUPTED_CONTEXTS}",
    }.get(item.split("=")[0], item)
    for item in KILL_RUN
)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_ends_in_one_line_with_what_was_kept_and_the_command_that_resumes(tmp_path, signum, code):
    process = cli(tmp_path, *INTERRUPTED_RUN)
    predictions = run_dir(compose_config(tmp_path, *INTERRUPTED_RUN)) / rundir.PREDICTIONS
    while count_lines(predictions) == 0 and process.poll() is None:
        time.sleep(0.02)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr
    assert "Traceback" not in stderr
    kept = len(rundir.read_predictions(predictions))
    assert 0 < kept < INTERRUPTED_CONTEXTS * 3
    command = shlex.join(["python", "-m", "evaluate", f"output_dir={tmp_path}", "device=cpu", *INTERRUPTED_RUN])
    assert stderr.strip().splitlines()[-1] == (
        f"interrupted: {kept} samples answered and kept in {predictions.parent}; rerun to resume: {command}"
    )
    record = rundir.read_json(predictions.parent / rundir.RUN)
    assert (record["status"], record["signal"], record["samples"]) == ("interrupted", signal.Signals(signum).name, kept)


@pytest.mark.parametrize("shard", [[], ["shard=1/2"]], ids=["whole", "shard"])
def test_a_run_refused_while_planning_leaves_no_folder_holding_only_its_lock(tmp_path, shard):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "scorer.press.window_size=100000", *shard))
    with pytest.raises(ConfigError, match="scorer snapkv needs contexts longer than 100000 tokens"):
        run(cfg)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides, line",
    [
        (
            ["benchmark.tasks=[niah_single_1,niah_typo]"],
            "error: unknown ruler_synth task(s) niah_typo; valid tasks: niah_single_1, niah_single_2, niah_single_3, "
            "niah_multikey_1, niah_multikey_2, niah_multikey_3, niah_multivalue, niah_multiquery, vt, cwe, fwe, qa_1, "
            "qa_2",
        ),
        (
            ["benchmark.max_seq_length=10"],
            "error: niah: no prompt fits in max_seq_length=10 even with the smallest haystack (5); raise "
            "benchmark.max_seq_length",
        ),
        (
            [],  # the default benchmark, whose vt example does not fit the tiny model's tokenizer
            "error: vt: RULER's in-context example does not fit in its fixed 500-token budget with this tokenizer, "
            "even with the smallest haystack; leave vt out of benchmark.tasks for this model",
        ),
    ],
    ids=["task-typo", "max-seq-length-10", "vt-does-not-fit"],
)
def test_benchmark_data_that_cannot_be_generated_is_refused_in_one_line_leaving_no_folder(tmp_path, overrides, line):
    out = tmp_path / "runs"
    result = evaluate_cli("model=tiny_random", f"output_dir={out}", *overrides)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in result.stderr
    assert not out.exists()  # neither the run's folder with its lock nor the output_dir above it


@pytest.mark.parametrize("generate", ["true", "false"])
def test_rows_without_references_are_refused_at_load_in_one_line_leaving_no_folder(tmp_path, generate):
    # Once, a generating run crashed with ZeroDivisionError after the whole model run, and generate=false measured
    # nothing; the row is now refused before the model loads.
    rows = [json.loads(line) for line in (REPO / "tests/fixtures/ruler_4096.jsonl").read_text().splitlines()]
    rows[2]["answer"] = []
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    out = tmp_path / "runs"
    result = evaluate_cli(
        "model=tiny_random", "benchmark=ruler", f"benchmark.path={data}", f"generate={generate}", f"output_dir={out}"
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {data}:3: field 'answer' is [], not a non-empty list of strings (the reference answers a row is "
        "scored against); fix the row or drop it"
    )
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_a_scoring_failure_marks_the_run_failed_without_metrics_and_ends_in_one_line(tmp_path):
    result = evaluate_cli(
        "press=topk",
        f"output_dir={tmp_path}",
        *SHARED_CONTEXT_CLI[:-2],
        "+benchmark._target_=tests.support.UnscorableBenchmark",
        "+benchmark.name=shared_context",
    )
    (out,) = tmp_path.iterdir()
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {out}: scoring failed: ZeroDivisionError: division by zero; its predictions are kept: fix the "
        f"cause, then python -m evaluate.score {out}"
    )
    assert "Traceback" not in result.stderr
    record = rundir.read_json(out / rundir.RUN)
    assert (record["status"], record["error"]) == ("failed", "scoring failed: ZeroDivisionError: division by zero")
    assert record["samples"] == record["samples_expected"] == 9
    assert not (out / rundir.METRICS).exists()
    assert len(rundir.read_predictions(out / rundir.PREDICTIONS)) == 9


def test_a_rerun_whose_scoring_fails_drops_the_metrics_it_had(tmp_path, monkeypatch):
    cfg = with_shared_context(compose_config(tmp_path, "press=topk", "scorer=snapkv", "cr=0.5"))
    run(cfg)
    out = run_dir(cfg)
    assert rundir.read_json(out / rundir.RUN)["status"] == "complete" and (out / rundir.METRICS).exists()
    monkeypatch.setattr(SharedContextBenchmark, "score", lambda self, rows: 1 / 0)
    with pytest.raises(ConfigError, match=r"scoring failed: ZeroDivisionError: division by zero; its predictions"):
        run(cfg)  # nothing left to answer: the rerun only scores
    assert rundir.read_json(out / rundir.RUN)["status"] == "failed"
    assert not (out / rundir.METRICS).exists()
    monkeypatch.undo()
    run(cfg)  # the cause fixed, the rerun closes it
    assert rundir.read_json(out / rundir.RUN)["status"] == "complete" and (out / rundir.METRICS).exists()


def test_rescoring_rows_without_references_is_refused_in_one_line(tmp_path, capsys):
    from evaluate.score.rescore import main as score_main

    predictions = tmp_path / "predictions.jsonl"
    rows = [
        {"id": "qa_1-0", "task": "qa_1", "answers": ["Paris"], "prediction": "Paris"},
        {"id": "qa_1-1", "task": "qa_1", "answers": [], "prediction": "Rome"},
    ]
    predictions.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(SystemExit) as ended:
        score_main(["--benchmark", "ruler", str(predictions)])
    assert ended.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {predictions} row 2 (sample qa_1-1): no reference answer (answers []), and ruler scores every row "
        "against its references; rerun on data whose rows have answers"
    ]
