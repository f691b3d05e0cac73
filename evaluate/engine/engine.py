"""The interface the run asks both answer paths through: :class:`Engine`.

:class:`~evaluate.engine.pool_engine.PoolEngine` (each context prefilled once, every point's questions decoded in one
pool) and :class:`~evaluate.engine.pipeline_engine.PipelineEngine` (kvpress's pipeline, one point after the other)
both implement it, so evaluate/run/entry.py hands each its points the same way and records what either yields.
"""

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from evaluate.engine.requests import AnsweredGroup, Prefilled
from evaluate.points.plan import Plan


@runtime_checkable
class Engine(Protocol):
    """Answers planned points on one loaded model."""

    def answer(self, plans: list[Plan], budgets: list[int]) -> Iterator[AnsweredGroup | Prefilled]:
        """Yield each point's answered groups as they are finished (``point`` indexes ``plans``; a failed group
        carries its failure), and, where contexts are prefilled once for several points, how many are done.
        ``budgets`` are the points' context budgets in tokens (evaluate/engine/context_budget.py)."""
        ...
