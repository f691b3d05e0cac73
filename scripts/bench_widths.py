"""The attention of one decoding step (SmolLM2's 30 layers and heads, 32 rows) under three width rules.

    python scripts/bench_widths.py --out results/bench/widths_cpu.md

Each rule cuts the slots (sorted by length, as the scheduler arranges them) into segments with
evaluate.engine.slot_cache.segments and attends each over its width: every row over the widest row's keys (the pool
before issue 28), powers of two, and the pool's ladder (WIDTH_LADDER). Times are the process's CPU time on one
thread, the median of five interleaved rounds, so that a machine shared with other jobs moves them less than wall
time; the row × key count beside each is the work the rule asks for.
"""

import argparse
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import table_head, table_row, time_interleaved, write_report  # noqa: E402

from evaluate.engine.attention import _attend  # noqa: E402
from evaluate.engine.slot_cache import segments, width_bucket  # noqa: E402

LAYERS, ROWS, KV_HEADS, GROUPS, HEAD_DIM = 30, 32, 3, 3, 64


def workloads() -> dict[str, list[int]]:
    """Each row's keys: whole 2,046-key caches beside SnapKV's 20 % (the issue's case), and the decode-bound sweep's
    1,024-token contexts at cr 0 to 0.875 with a question and part of an answer."""
    generator = random.Random(0)
    sweep = [generator.choice([1024, 768, 512, 256, 128]) + 20 + generator.randrange(128) for _ in range(ROWS)]
    return {"2,046 and 396 keys, alternating": [2046, 396] * (ROWS // 2), "decode-bound sweep's lengths": sweep}


def rules(lengths: list[int]) -> dict[str, tuple[tuple[int, int, int], ...]]:
    ordered = sorted(lengths, reverse=True)
    capacity = ordered[0] + 1
    return {
        "widest row": ((0, ROWS, capacity),),
        "powers of two": segments(tuple(min(capacity, 1 << (n - 1).bit_length()) for n in ordered)),
        "ladder": segments(tuple(min(capacity, width_bucket(n)) for n in ordered)),
    }


def attention_step(plan, keys, values, visible, query) -> None:
    """One decoding step's attention over every layer, each segment of ``plan`` over its own width."""
    for layer in range(LAYERS):
        parts = [
            _attend(query[a:b], keys[layer][a:b, :, :w], values[layer][a:b, :, :w], visible[a:b, :, None, :w], 0.125)
            for a, b, w in plan
        ]
        torch.cat(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lines = table_head(["rows' keys", "width rule", "segments", "rows × keys", "attention CPU ms per step"], "llrrr")
    print("\n".join(lines), flush=True)
    for name, lengths in workloads().items():
        capacity = max(lengths) + 1
        keys = [torch.randn(ROWS, KV_HEADS, capacity, HEAD_DIM) for _ in range(LAYERS)]
        values = [torch.randn(ROWS, KV_HEADS, capacity, HEAD_DIM) for _ in range(LAYERS)]
        visible = torch.ones(ROWS, KV_HEADS, capacity, dtype=torch.bool)
        query = torch.randn(ROWS, KV_HEADS * GROUPS, 1, HEAD_DIM)
        plans = rules(lengths)
        # CPU time, not wall time: a machine shared with other jobs moves it less.
        steps = {rule: partial(attention_step, plan, keys, values, visible, query) for rule, plan in plans.items()}
        times = time_interleaved(steps, "cpu", warmup=0, repeats=5, clock=time.process_time)
        for rule, plan in plans.items():
            work = sum((b - a) * w for a, b, w in plan)
            line = table_row(name, rule, len(plan), work, f"{statistics.median(times[rule]) * 1000:.0f}")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        write_report(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
