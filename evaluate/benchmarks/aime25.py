"""AIME 2025 as kvpress runs it: the hub dataset ``alessiodevoto/aime25`` (no data_dir), the problems of AIME
2025-I and II, answers compared with the LAST ``\\boxed{...}`` of the prediction.

Rows, metric and headline: see :mod:`evaluate.benchmarks.boxed` (kvpress's ``benchmarks/aime25/calculate_metrics.py``
calls ``extract_boxed(prediction, last=True)``). The integer answers are compared as ``str(answer)``. Headline
``score``: accuracy x 100.
"""

from dataclasses import dataclass
from typing import ClassVar

from evaluate.benchmarks import Source
from evaluate.benchmarks.boxed import BoxedAnswerBenchmark

HUB = Source(dataset="alessiodevoto/aime25")


@dataclass
class Aime25(BoxedAnswerBenchmark):
    """AIME 2025 (one task, ``aime25``), the last box counting; its fields: see :class:`BoxedAnswerBenchmark`."""

    name: str = "aime25"
    all_tasks: ClassVar[tuple[str, ...]] = ("aime25",)
    source: ClassVar[Source] = HUB
    last: ClassVar[bool] = True
