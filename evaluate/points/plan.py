"""A point's work, planned before its model loads: what the engine answers and the recorder writes.

A :class:`Plan` holds a resolved point (evaluate/points/point.py), the press, benchmark and model source built for it,
its samples and what is left to answer; it does not change while the run executes. The run makes it
(evaluate/run/planning.py: the samples from evaluate/benchmarks/selection.py, the earlier rows from the run
directory); the engine reads it to answer (its groups, the text a press compresses, each context as cut), the
recorder to write.
"""

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpress import BasePress

from evaluate.benchmarks import Sample
from evaluate.points.point import PointSpec
from evaluate.press_profile import PressProfile


def context_id(context: str) -> str:
    return hashlib.sha1(context.encode("utf-8")).hexdigest()[:12]


def group_by_context(samples: list[Sample], query_aware: bool) -> list[list[Sample]]:
    """Samples answerable from one compressed cache, in first-appearance order.

    Query-aware runs compress the context with the question appended (as the kvpress leaderboard does), so
    each of their questions needs its own compression.
    """
    groups: dict[tuple, list[Sample]] = {}
    for sample in samples:
        question = sample.question if query_aware else None
        key = (sample.context, question, sample.answer_prefix, sample.max_new_tokens, sample.chat_template)
        groups.setdefault(key, []).append(sample)
    return list(groups.values())


def conversations(samples: tuple[Sample, ...], todo: tuple[Sample, ...]) -> list[list[Sample]]:
    """Each conversation with a turn left to answer, all its turns in order (those answered before are replayed)."""
    pending = {sample.conversation for sample in todo}
    turns: dict[str, list[Sample]] = {}
    for sample in samples:
        if sample.conversation in pending:
            turns.setdefault(sample.conversation, []).append(sample)
    return [sorted(members, key=lambda sample: sample.turn) for members in turns.values()]


def truncate(tokenizer, text: str, max_tokens: int, policy: str) -> str:
    """Cut a context to ``max_tokens`` tokens: keep the head, or both ends as LongBench's pred.py does."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    if policy == "head":
        return tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)
    half = max_tokens // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[len(ids) - (max_tokens - half) :], skip_special_tokens=True
    )


@dataclass(frozen=True)
class Plan:
    """One configuration of a run or sweep, planned: where it writes, what it runs, what is left to answer.

    ``kept_rows`` are the prediction rows of earlier sessions that stay, every shard's (none under ``overwrite``;
    failed ones are dropped under ``retry_errors``); ``share`` are the samples this process answers, all of them
    unless it is one shard of several (evaluate/points/shard.py); ``todo`` are those of them still to answer, in
    source order; ``answered_tokens`` the answer token ids the kept rows recorded, by sample id (a conversation
    resumed under ``turns=multi`` replays them).
    """

    spec: PointSpec
    benchmark: Any
    source: Any
    press: BasePress | None
    # Every fact about the press that the engine and the loader read (evaluate/press_profile.py).
    profile: PressProfile
    samples: tuple[Sample, ...]
    kept_rows: tuple[dict, ...]
    share: tuple[Sample, ...]
    todo: tuple[Sample, ...]
    context_tokens: Mapping[str, int]
    answered_tokens: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return self.spec.out

    def groups(self) -> list[list[Sample]]:
        """The samples answered together, in kvpress's order: row by row for decoding-time presses and on a cache
        that holds one question at a time (evaluate/kv_cache.py: a quantized one), else by context in
        ``groupby("context")``'s sorted order (which decides what a press drawing random numbers draws); under
        ``turns=multi``, each conversation's turns, in the order of its compressed text."""
        if self.spec.turns == "multi":
            return sorted(conversations(self.share, self.todo), key=lambda turns: self.compressed_text(turns[0]))
        if self.profile.decodes_per_sample or self.spec.kv_cache.one_question_per_cache:
            return [[sample] for sample in self.todo]
        groups = group_by_context(list(self.todo), self.spec.query_aware)
        return sorted(groups, key=lambda group: self.compressed_text(group[0]))

    def asked(self, group: list[Sample]) -> list[Sample]:
        """The samples of ``group`` still to answer: all of them, but for a conversation's turns answered before."""
        todo = {sample.id for sample in self.todo}
        return [sample for sample in group if sample.id in todo]

    @property
    def likelihood(self) -> bool:
        """Whether the rows get the likelihood fields (evaluate/engine/teacher_forcing.py)."""
        # A conversation's cache changes turn after turn: no fixed cache to teacher-force (docs/metrics.md).
        multi = self.spec.turns == "multi"
        return self.spec.likelihood and not multi and self.profile.why_not_teacher_forced is None

    def compressed_text(self, sample: Sample, context: str | None = None) -> str:
        """What the press compresses, as kvpress's runner builds it: the context (``context`` when cut), the press's
        suffix (Finch's delimiter), and the question in query-aware runs."""
        text = (sample.context if context is None else context) + self.profile.compressed_suffix
        return text + sample.question if self.spec.query_aware else text

    def context(self, sample: Sample, tokenizer, max_context: int) -> str:
        """The sample's context as the pipeline receives it; only the harness's own policies cut it here."""
        if self.spec.truncation == "pipeline" or self.context_tokens[sample.context] <= max_context:
            return sample.context
        return truncate(tokenizer, sample.context, max_context, self.spec.truncation)
