"""MATH-500 as kvpress runs it: the hub dataset ``alessiodevoto/math500`` (no data_dir), 500 problems of the MATH
benchmark (OpenAI's "Let's Verify Step by Step" split), answers compared with the FIRST ``\\boxed{...}`` of the
prediction.

Rows, metric and headline: see :mod:`evaluate.benchmarks.boxed` (kvpress's ``benchmarks/math500/calculate_metrics.py``
calls ``extract_boxed(prediction)``, i.e. the first box). Headline ``score``: accuracy x 100.
"""

from dataclasses import dataclass
from typing import ClassVar

from evaluate.benchmarks import Source
from evaluate.benchmarks.boxed import BoxedAnswerBenchmark

HUB = Source(dataset="alessiodevoto/math500")


@dataclass
class Math500(BoxedAnswerBenchmark):
    """MATH-500 (one task, ``math500``), the first box counting; its fields: see :class:`BoxedAnswerBenchmark`."""

    name: str = "math500"
    all_tasks: ClassVar[tuple[str, ...]] = ("math500",)
    source: ClassVar[Source] = HUB
    last: ClassVar[bool] = False
