"""Teacher forcing's time per sample: today's batched passes over one reused slot buffer against the way before
issue 28 (each call's rows one at a time through a fresh batch-1 pool), on the same caches, in one run.

    python scripts/bench_likelihood.py                                   # make run's workload, 1 sample per task
    python scripts/bench_likelihood.py --tasks niah_single_1,cwe,vt      # a subset of its tasks

Runs ``python -m evaluate press=eg_chunkkv cr=0.9 generate=false`` (``make run``'s point; the fields alone, which
are what both ways compute) in this process, and at every teacher-forcing call of the pooled path times both ways
on the same inputs, alternating which goes first. Prints seconds per sample for each, their ratio, and the largest
difference between the two ways' log-probabilities (batching rounds float32 sums in another order).
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from evaluate.engine import pool_engine  # noqa: E402
from evaluate.engine.decoding_pool import DecodingPool  # noqa: E402
from evaluate.engine.requests import DecodeRequest  # noqa: E402
from evaluate.engine.teacher_forcing import teacher_forced  # noqa: E402
from evaluate.run.entry import run  # noqa: E402


def one_row_at_a_time(pool, cache, hidden, questions, answers, context_length) -> list[torch.Tensor | None]:
    """Teacher forcing before issue 28: a fresh batch-1 pool per call (its own zero-filled slot buffer), each row
    in a forward pass of its own."""
    log_probs: list[torch.Tensor | None] = [None] * len(questions)
    alone = DecodingPool(pool.model, batch_size=1, memory_bytes=2**62)
    for index, (question, answer) in enumerate(zip(questions, answers, strict=True)):
        if answer is not None:
            alone.submit(DecodeRequest(cache, question, context_length, 0, hidden, answer, tag=index))
    while alone.busy():
        for row in alone.step():
            log_probs[row.tag] = row.output
    return log_probs


class Timings:
    """Both ways' seconds over every teacher-forcing call, and the largest log-probability difference."""

    def __init__(self):
        self.batched = self.before = self.difference = 0.0
        self.calls = 0

    def __call__(self, pool, cache, hidden, questions, answers, context_length):
        ways = [("before", one_row_at_a_time), ("batched", teacher_forced)]
        results = {}
        for name, way in ways if self.calls % 2 else ways[::-1]:
            start = time.perf_counter()
            results[name] = way(pool, cache, hidden, questions, answers, context_length)
            setattr(self, name, getattr(self, name) + time.perf_counter() - start)
        self.calls += 1
        for mine, theirs in zip(results["batched"][0], results["before"], strict=True):
            if mine is not None:
                self.difference = max(self.difference, float((mine - theirs).abs().max()))
        return results["batched"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=1, help="samples per task (make run: 2)")
    parser.add_argument("--tasks", default=None, help="comma-separated ruler_synth tasks (default: all it runs)")
    args = parser.parse_args()
    timings = Timings()
    pool_engine.teacher_forced = timings
    with tempfile.TemporaryDirectory() as out, initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        overrides = ["press=eg_chunkkv", "cr=0.9", "generate=false", f"limit={args.limit}", f"output_dir={out}"]
        if args.tasks:
            overrides.append(f"benchmark.tasks=[{args.tasks}]")
        metrics = run(compose(config_name="config", overrides=overrides))
    samples = metrics["likelihood"]["n"]
    print(f"{samples} samples, {timings.calls} teacher-forcing calls (uncompressed and compressed caches)")
    print(f"before: {timings.before / samples * 1e3:.1f} ms per sample")
    print(f"batched, reused buffer: {timings.batched / samples * 1e3:.1f} ms per sample")
    print(f"ratio batched / before: {timings.batched / timings.before:.3f}")
    print(f"largest |difference| of a log-probability between the two: {timings.difference:.2e}")


if __name__ == "__main__":
    main()
