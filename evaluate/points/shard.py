"""Which share of a run's contexts this process answers: a shard, when a sweep is split over processes or GPUs.

A shard takes every ``count``-th context of kvpress's context order (the distinct contexts sorted, as
``groupby("context")`` sorts them), starting at its ``index``, and answers every point of the sweep on them, so that
each context is prefilled once across all shards. Striding rather than cutting blocks keeps the shards balanced
when a benchmark's contexts grow longer task by task.

Where the shard comes from, first found first: the ``shard=INDEX/COUNT`` setting (a launcher sets it for each of
its processes), else torchrun's and ``accelerate launch``'s ``RANK`` and ``WORLD_SIZE``, else the whole run. The
shard is not a result: the run directory and fingerprint of a point do not depend on it, so a point begun with four
shards can be finished with one.
"""

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from evaluate.errors import ConfigError


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0-based)."""

    index: int = 0
    count: int = 1

    @property
    def whole(self) -> bool:
        return self.count == 1

    @property
    def name(self) -> str:
        """The shard's name in file names: ``1-of-4``."""
        return f"{self.index}-of-{self.count}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def contexts(self, contexts: Iterable[str]) -> set[str]:
        """The shard's share of ``contexts``: every ``count``-th of them in kvpress's (sorted) order."""
        return set(sorted(set(contexts))[self.index :: self.count])


def parse_shard(text: str) -> Shard:
    """``INDEX/COUNT`` (``shard=1/4``) as a shard; a ConfigError naming the form for anything else."""
    try:
        index, count = (int(part) for part in str(text).split("/"))
    except ValueError:
        index = count = -1
    if not 0 <= index < count:
        raise ConfigError(f"shard={text} is not INDEX/COUNT with 0 <= INDEX < COUNT, e.g. shard=0/4 ... shard=3/4")
    return Shard(index, count)


def resolve_shard(setting: str | None, environ: Mapping[str, str] = os.environ) -> Shard:
    """The shard of this process: ``setting`` when given, else torchrun's RANK/WORLD_SIZE, else the whole run."""
    if setting is not None:
        return parse_shard(setting)
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return parse_shard(f"{environ['RANK']}/{environ['WORLD_SIZE']}")
    return Shard()
