"""Benchmarks: one module per benchmark, each declaring its loader, prompt format, metric and full extent.

A benchmark is a :class:`Benchmark` dataclass in its own module, instantiated from ``conf/benchmark/<name>.yaml``
(docs/benchmarks.md). It exposes:

- ``name``: the benchmark name used in run directories and metrics.json;
- ``all_tasks``: every task of the full benchmark, which a run is measured against;
- ``source``: the hub dataset (and data_dir) of the full benchmark; None for data generated locally (a benchmark
  with a source is a :class:`HubBenchmark`, and one whose run may keep some tasks a :class:`TaskedHubBenchmark`);
- ``scored_on_references``: whether every row is scored against its reference answers (False where a benchmark
  publishes none and scores no row, ZeroSCROLLS), so that rows without references are refused;
- ``fraction_by_task``: whether ``fraction`` draws within each task's rows (one hub data_dir per task, as kvpress
  loads them) or from all rows at once;
- ``load(tokenizer, limit) -> list[Sample]``: the samples to run, at most ``limit`` per task;
- ``score(rows) -> dict``: metrics.json content computed from prediction rows alone;
- ``coverage(rows, config) -> list[str]``: why a run covers less than the full benchmark (empty when it is full).
"""

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from evaluate.errors import ConfigError


@dataclass(frozen=True)
class Sample:
    """One question about one context, in the kvpress dataset schema.

    ``chat_template`` is False for prompts a protocol feeds raw (LongBench's official protocol does so for
    few-shot tasks). ``extra`` holds fields a metric needs besides the answers (e.g. LongBench's
    ``all_classes``); they are copied into the prediction row so that rescoring needs nothing else.

    A turn of a conversation (SCBench's multi-turn setting, ``ruler_synth``'s ``benchmark.turns=K``) names its
    ``conversation`` and its ``turn`` in it, counted from 0; the turns of one conversation share their context and
    are asked in turn order, each turn's question and answer staying in the cache for the next, under
    ``turns=multi`` (evaluate/engine/turns.py), or each on its own under the default ``turns=independent``. Both are
    None for a question on its own.
    """

    id: str
    task: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int
    chat_template: bool = True
    extra: dict[str, Any] = field(default_factory=dict)
    conversation: str | None = None
    turn: int | None = None


@dataclass(frozen=True)
class Source:
    """Where the full benchmark lives on the Hugging Face hub."""

    dataset: str
    data_dir: str | None = None  # None: one data_dir per task
    samples_per_task: int | None = None  # None: it differs between tasks


class Benchmark(ABC):
    """A benchmark: its data, its metric and what a full run of it covers.

    Subclasses are dataclasses that set ``all_tasks``; those that read hub data derive from :class:`HubBenchmark`.
    """

    name: str
    all_tasks: ClassVar[tuple[str, ...]]
    source: ClassVar[Source | None] = None
    fraction_by_task: ClassVar[bool]
    scored_on_references: ClassVar[bool] = True

    @abstractmethod
    def load(self, tokenizer, limit: int | None = None) -> list[Sample]: ...

    @abstractmethod
    def score(self, rows: list[dict]) -> dict: ...

    def reference_answer(self, sample: Sample) -> str:
        """The answer the likelihood fields teacher-force (evaluate/engine/teacher_forcing.py): the first reference, the
        one a benchmark with several lists first (LongBench's and LooGLE's are alternatives); empty, and so no fields,
        where a benchmark publishes none (ZeroSCROLLS)."""
        return str(sample.answers[0]) if sample.answers else ""

    def coverage(self, rows: Sequence[dict], config: Mapping[str, Any]) -> list[str]:
        """Why a run with these prediction rows and this resolved config covers less than the full benchmark."""
        counts = Counter(row["task"] for row in rows)
        return [
            *self.sample_coverage(counts, config.get("limit")),
            *fraction_coverage(config),
            *self.task_coverage(counts),
            *self.source_coverage(),
            *failure_coverage(rows),
        ]

    def sample_coverage(self, counts: Mapping[str, int], limit: int | None) -> list[str]:
        # The source's size per task is not known here: a task that reached the limit may have been cut.
        if limit is not None and counts and max(counts.values()) >= int(limit):
            return [f"limit={limit} samples per task"]
        return []

    def task_coverage(self, counts: Mapping[str, int], shown: int | None = 4) -> list[str]:
        """The tasks of the full benchmark without a sample, the first ``shown`` of them named (None: all)."""
        missing = [task for task in self.all_tasks if task not in counts]
        if not missing:
            return []
        listed = ", ".join(missing[:shown]) + (", ..." if shown is not None and len(missing) > shown else "")
        return [f"{len(self.all_tasks) - len(missing)} of {len(self.all_tasks)} tasks (missing {listed})"]

    def source_coverage(self) -> list[str]:
        """Why the run's data is not the full benchmark's (none for data generated locally)."""
        return []


@dataclass(kw_only=True)
class HubBenchmark(Benchmark):
    """A benchmark whose rows live in a hub dataset (``source``), or in local files with the same columns.

    It declares the fields every such benchmark has, keyword-only so that a subclass's own fields keep their order:

    - ``path``: a local source instead of the hub (see :mod:`evaluate.benchmarks.sources`);
    - ``dataset``: the hub dataset a run reads; None (the YAMLs leave it out) is the full benchmark's,
      ``source.dataset``, so that the hub id is written in one place, the benchmark's module;
    - ``split``: the split a run reads.
    """

    source: ClassVar[Source]
    path: str | None = None
    dataset: str | None = None
    split: str = "test"

    def __post_init__(self) -> None:
        if self.dataset is None:
            self.dataset = self.source.dataset

    def source_coverage(self) -> list[str]:
        if self.path:
            return [f"local data benchmark.path={self.path}, not the hub dataset {self.source.dataset}"]
        if self.dataset != self.source.dataset:
            return [f"dataset {self.dataset}, not the hub dataset {self.source.dataset}"]
        return []


@dataclass(kw_only=True)
class TaskedHubBenchmark(HubBenchmark):
    """A hub benchmark whose run may keep some of its tasks: ``tasks`` (None: all of ``all_tasks``)."""

    tasks: list[str] | None = None

    def selected_tasks(self, label: str, kind: str = "task") -> list[str]:
        """The tasks the run keeps, refusing any the benchmark does not have.

        ``label`` names the benchmark and ``kind`` its tasks in the error (e.g. "LongBench v2", "length").
        """
        tasks = list(self.all_tasks) if self.tasks is None else list(self.tasks)
        unknown = [task for task in tasks if task not in self.all_tasks]
        if unknown:
            raise ConfigError(
                f"unknown {label} {kind}(s) {', '.join(unknown)}; choose from {', '.join(self.all_tasks)}"
            )
        return tasks


def fraction_coverage(config: Mapping[str, Any]) -> list[str]:
    """A share of the samples drawn at random, run-wide or by the benchmark."""
    fractions = (config.get("fraction"), config.get("benchmark", {}).get("fraction"))
    return [f"fraction={fraction}" for fraction in fractions if fraction is not None and float(fraction) < 1]


def failure_coverage(rows: Sequence[dict]) -> list[str]:
    failed = sum(1 for row in rows if row.get("error"))
    return [f"{failed} samples failed"] if failed else []
