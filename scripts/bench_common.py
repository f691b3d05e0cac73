"""What the benchmark scripts of scripts/ share: how they time (a child process's wall seconds and its own peak
resident memory, a call on a device, calls interleaved over rounds), the warm-up run before a timing, the random-weight
model they can run instead of a configured one, and how they lay out and write their tables (Markdown and CSV, under
results/bench/ by default).

It imports nothing heavy at module level: the scripts that only start ``python -m evaluate`` processes
(bench_sweep.py, bench_turns.py, bench_revisions.py) would otherwise pay for importing torch; the device helpers
import it when called.
"""

import argparse
import csv
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
# A random-weight model of Llama-3.1-8B's shape, built on the device by each process (evaluate/models/random_models.py);
# shrink it with e.g. --override +model.source.num_hidden_layers=2.
RANDOM_MODEL = [
    "model=tiny_random",
    "model.name=random-llama-8b",
    "model.source._target_=evaluate.models.random_models.RandomModel",
]
RANDOM_MODEL_LABEL = "random-llama-8b (random weights)"

Result = TypeVar("Result")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--random-model``, the choice of model of the scripts that can run either."""
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument(
        "--random-model",
        action="store_true",
        help="instead of --model: a random-weight model of Llama-3.1-8B's shape (evaluate/models/random_models.py)",
    )


def model_overrides(args: argparse.Namespace) -> list[str]:
    """The Hydra overrides that pick the model ``add_model_arguments``'s options chose."""
    return RANDOM_MODEL if args.random_model else [f"model={args.model}"]


def model_label(args: argparse.Namespace) -> str:
    """The chosen model as the tables name it."""
    return RANDOM_MODEL_LABEL if args.random_model else args.model


def wait_for(child: subprocess.Popen) -> float:
    """Wait for ``child`` to end and return its own peak resident memory in MiB; raise if it failed."""
    # wait4 gives this child's own rusage (ru_maxrss in KiB on Linux), not the maximum over all children.
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), child.args)
    return usage.ru_maxrss / 1024


def timed(command: list[str], cwd: Path = REPO) -> tuple[float, float]:
    """Wall seconds of a child process (run in ``cwd``) and its own peak resident memory in MiB."""
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL)
    peak = wait_for(child)
    return time.perf_counter() - start, peak


def warm_up(command: list[str], scratch: Path | str) -> None:
    """One sample of ``command`` without a press, into ``scratch``/warm: it dequantizes and caches the model and warms
    the file cache once, so that neither weighs on the first of the timings that follow."""
    subprocess.run([*command, "limit=1", "press=none", f"output_dir={scratch}/warm"], cwd=REPO, check=True)


def synchronize(device: object) -> None:
    """Wait for the work queued on a CUDA device (nothing to wait for on the CPU), so that a clock read next counts
    that work."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def device_timed(
    device: object, fn: Callable[..., Result], *args: object, clock: Callable[[], float] = time.perf_counter
) -> tuple[Result, float]:
    """``fn(*args)`` and its seconds by ``clock``, the device synchronised on both sides: CUDA calls return before
    their kernels end."""
    synchronize(device)
    start = clock()
    result = fn(*args)
    synchronize(device)
    return result, clock() - start


def time_interleaved(
    calls: dict[str, Callable[[], object]],
    device: str,
    warmup: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds of each timed call; every round runs each call once, in the same order, so that drift in the machine's
    load over the run spreads evenly over the calls. The first ``warmup`` rounds are not kept."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(warmup + repeats):
        for name, fn in calls.items():
            _, seconds = device_timed(device, fn, clock=clock)
            if round_index >= warmup:
                times[name].append(seconds)
    return times


def table_row(*cells: object) -> str:
    """One line of a Markdown table."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def table_head(columns: Sequence[str], align: str) -> list[str]:
    """A Markdown table's header line and rule; ``align`` has a letter per column: ``l`` for text, left-aligned, or
    ``r`` for numbers, right-aligned."""
    if len(align) != len(columns) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r} does not fit {len(columns)} columns")
    return [table_row(*columns), "|" + "".join("---|" if side == "l" else "---:|" for side in align)]


def write_report(path: Path, text: str) -> None:
    """``text`` and a final newline into ``path``, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_csv(path: Path, rows: list[dict], fieldnames: list[str] | None = None) -> None:
    """``rows`` as a CSV file with a header; the columns are ``fieldnames``, else the first row's keys."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fieldnames or list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
