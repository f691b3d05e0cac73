"""Where a pooled run's answering time goes: its prefills, the pool's question passes and its decoding steps.

    python scripts/profile_pool.py -m model=smollm2_135m limit=4 likelihood=false benchmark=ruler_synth \\
        'benchmark.tasks=[niah_single_1,niah_multikey_2]' press=chunkkv,eg_chunkkv cr=0.5,0.7,0.9

Runs ``python -m evaluate`` with the given arguments in this process, the engine's prefill, the model runner's
question passes and its decoding steps timed (wall seconds, the whole call), and prints, at the end, each one's
seconds and count, with the rows and tokens the question passes ran and the rows the decoding steps served. A
question pass is as many forward tokens as its rows' questions, batched or not; a decoding step is one token for
every row it serves: the split says how much of the pool's time batching can shrink (docs/performance.md).
"""

import atexit
import runpy
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluate.engine.model_runner import ModelRunner  # noqa: E402
from evaluate.engine.pool_engine import PoolEngine  # noqa: E402

seconds: Counter = Counter()
counts: Counter = Counter()


def timed(cls, name: str, count=None) -> None:
    """Wrap ``cls.name`` to add its wall seconds and calls (and what ``count`` counts of its arguments)."""
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        result = original(self, *args, **kwargs)
        seconds[name] += time.perf_counter() - start
        counts[name] += 1
        if count is not None:
            counts.update(count(*args))
        return result

    setattr(cls, name, wrapper)


def question_rows(cache, slots, rows) -> dict:
    return {"question rows": len(rows), "question tokens": sum(row.input_ids.shape[1] for row in rows)}


def decoding_rows(cache, rows) -> dict:
    return {"decoded rows": len(rows)}


def report() -> None:
    steps = counts["decode"]
    print(
        f"prefills: {seconds['_prefill']:.1f} s for {counts['_prefill']} contexts\n"
        f"question passes: {seconds['ask_questions']:.1f} s for {counts['ask_questions']} passes of "
        f"{counts['question rows']} rows, {counts['question tokens']} tokens\n"
        f"decoding steps: {seconds['decode']:.1f} s for {steps} steps serving {counts['decoded rows']} rows "
        f"({counts['decoded rows'] / max(1, steps):.1f} a step)",
        file=sys.stderr,
    )


timed(PoolEngine, "_prefill")
timed(ModelRunner, "ask_questions", question_rows)
timed(ModelRunner, "decode", decoding_rows)
atexit.register(report)
sys.argv = ["evaluate", *sys.argv[1:]]
runpy.run_module("evaluate", run_name="__main__", alter_sys=True)
