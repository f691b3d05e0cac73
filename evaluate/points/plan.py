"""Everything decided about one configuration before its model loads: the plan of a run.

``make_plan`` takes a resolved point (evaluate/points/point.py), builds its benchmark, model source and press, loads
its samples and reads what an earlier session already answered, in one step and without writing anything; the
resulting :class:`Plan` does not change while the run executes (the engine answers, evaluate/run/recorder.py
writes).
"""

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.utils import instantiate
from kvpress import BasePress
from omegaconf import DictConfig

from evaluate import rundir
from evaluate.benchmarks import Sample
from evaluate.errors import ConfigError
from evaluate.points.config import build_press, press_sources, validate_context_lengths
from evaluate.points.point import PointSpec
from evaluate.points.press_traits import compressed_suffix, decodes_per_sample, why_not_teacher_forced


def context_id(context: str) -> str:
    return hashlib.sha1(context.encode("utf-8")).hexdigest()[:12]


def sample_identity(sample: Sample) -> dict:
    """What a prediction row records of its sample first (resuming checks it, with ``max_new_tokens``, unchanged)."""
    return {
        "id": sample.id,
        "task": sample.task,
        "context_id": context_id(sample.context),
        "question": sample.question,
        "answer_prefix": sample.answer_prefix,
        "answers": list(sample.answers),
    }


def check_same_samples(out: Path, rows: list[dict], samples: list[Sample]) -> None:
    """Refuse to resume on rows answered for other data than the benchmark now loads (a data file edited in place
    under the same path): a stale row would otherwise be reported as complete."""
    now = {sample.id: {**sample_identity(sample), "max_new_tokens": sample.max_new_tokens} for sample in samples}
    stale = [
        (row["id"], changed)
        for row in rows
        if (changed := [key for key, value in now.get(row["id"], {}).items() if key in row and row[key] != value])
    ]
    if stale:
        first, changed = stale[0]
        raise ConfigError(
            f"{out}: {len(stale)} of its {len(rows)} predictions answer samples that have changed since (the first, "
            f"{first}: its {', '.join(changed)}); the data changed under the same name: pass overwrite=true to redo "
            "the run or output_dir=... to keep both"
        )


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


def valid_unicode(text: str) -> str:
    """Replace lone surrogates (what undecodable bytes become under ``surrogateescape``) with U+FFFD.

    Tokenizers reject such strings outright, so they are mapped to the replacement character, the same way
    on every run; control characters are kept, since some benchmarks put them in prompts on purpose.
    """
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def check_samples(samples: list[Sample]) -> list[Sample]:
    """Refuse samples no model can answer meaningfully, naming the sample; make their text valid Unicode.

    An empty question is legitimate: the reference datasets use one where the context already ends with the
    instruction (LOOGLE's summarization, LongBench's lcc), and query-aware runs always ask one.
    """
    if not samples:
        raise ConfigError("the benchmark produced no samples; check benchmark.tasks and limit")
    seen: set[str] = set()
    for sample in samples:
        if sample.id in seen:
            raise ConfigError(f"sample id {sample.id!r} appears twice; ids must be unique within a benchmark")
        seen.add(sample.id)
        if not sample.context.strip():
            raise ConfigError(f"sample {sample.id!r} has an empty context")
    return [
        replace(
            sample,
            context=valid_unicode(sample.context),
            question=valid_unicode(sample.question),
            answer_prefix=valid_unicode(sample.answer_prefix),
            answers=[valid_unicode(answer) for answer in sample.answers],
        )
        for sample in samples
    ]


def select_fraction(samples: list[Sample], fraction: float, seed: int, by_task: bool) -> list[Sample]:
    """kvpress's ``fraction``: pandas ``sample(frac=fraction, random_state=seed)`` of each data_dir's rows.

    kvpress loads one data_dir at a time, one per task for LongBench and LOOGLE (``by_task``), the whole split
    for RULER; pandas draws the rows from the frame's length and the seed alone, so drawing positions from a frame
    of the same length in the same source order picks the same rows. Samples keep their source order.
    """
    if fraction >= 1:
        return samples
    frames: dict[str, list[Sample]] = {}
    for sample in samples:
        frames.setdefault(sample.task if by_task else "", []).append(sample)
    chosen: set[str] = set()
    for frame in frames.values():
        positions = pd.DataFrame({"position": range(len(frame))}).sample(frac=fraction, random_state=seed)["position"]
        chosen.update(frame[position].id for position in positions)
    return [sample for sample in samples if sample.id in chosen]


def first_per_task(samples: list[Sample], limit: int | None) -> list[Sample]:
    """At most ``limit`` samples of each task, in source order."""
    if limit is None:
        return samples
    counts: dict[str, int] = {}
    kept = []
    for sample in samples:
        counts[sample.task] = counts.get(sample.task, 0) + 1
        if counts[sample.task] <= limit:
            kept.append(sample)
    return kept


def load_samples(benchmark, tokenizer, cfg: DictConfig) -> list[Sample]:
    """The run's samples: the drawn ``fraction`` of each data_dir's rows, then at most ``limit`` per task."""
    if cfg.fraction >= 1:
        return check_samples(benchmark.load(tokenizer, cfg.limit))
    # The draw needs every row of the frame kvpress would sample from; the limit applies to what was drawn.
    drawn = select_fraction(
        check_samples(benchmark.load(tokenizer, None)), cfg.fraction, cfg.seed, benchmark.fraction_by_task
    )
    return first_per_task(drawn, cfg.limit)


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
    source order.
    """

    spec: PointSpec
    benchmark: Any
    source: Any
    press: BasePress | None
    samples: tuple[Sample, ...]
    kept_rows: tuple[dict, ...]
    share: tuple[Sample, ...]
    todo: tuple[Sample, ...]
    context_tokens: Mapping[str, int]

    @property
    def cfg(self) -> DictConfig:
        return self.spec.cfg

    @property
    def out(self) -> Path:
        return self.spec.out

    def groups(self) -> list[list[Sample]]:
        """The samples answered together, in kvpress's order: row by row for decoding-time presses, else by
        context in ``groupby("context")``'s sorted order (which decides what a press drawing random numbers draws)."""
        if decodes_per_sample(self.press):
            return [[sample] for sample in self.todo]
        groups = group_by_context(list(self.todo), self.cfg.query_aware)
        return sorted(groups, key=lambda group: self.compressed_text(group[0]))

    @property
    def likelihood(self) -> bool:
        """Whether the rows get the likelihood fields (evaluate/engine/teacher_forcing.py)."""
        return self.cfg.likelihood and why_not_teacher_forced(self.press) is None

    def compressed_text(self, sample: Sample, context: str | None = None) -> str:
        """What the press compresses, as kvpress's runner builds it: the context (``context`` when cut), the press's
        suffix (Finch's delimiter), and the question in query-aware runs."""
        text = (sample.context if context is None else context) + compressed_suffix(self.press)
        return text + sample.question if self.cfg.query_aware else text

    def context(self, sample: Sample, tokenizer, max_context: int) -> str:
        """The sample's context as the pipeline receives it; only the harness's own policies cut it here."""
        if self.cfg.truncation == "pipeline" or self.context_tokens[sample.context] <= max_context:
            return sample.context
        return truncate(tokenizer, sample.context, max_context, self.cfg.truncation)


def previous_rows(spec: PointSpec) -> list[dict]:
    """The rows earlier sessions of this run left, a shard's included, that this session keeps; refuses another
    configuration's. Only this process's own file is repaired (its torn last line cut): another shard may be
    appending to its own."""
    out, cfg, run_fingerprint = spec.out, spec.cfg, spec.fingerprint
    if cfg.overwrite:
        return []
    recorded = rundir.read_yaml(out / rundir.CONFIG)
    if recorded is not None and recorded.get("fingerprint") != run_fingerprint:
        raise ConfigError(
            f"{out} holds predictions of a different configuration; pass overwrite=true to discard them "
            "or output_dir=... to keep both"
        )
    answered_with = (recorded or {}).get("sources") or {}
    sources = press_sources(cfg) if answered_with else {}
    changed = sorted(name for name in set(sources) | set(answered_with) if sources.get(name) != answered_with.get(name))
    if changed:
        name = changed[0]
        raise ConfigError(
            f"{out} was answered by other code of its press: {name} was {answered_with.get(name) or 'absent'}, is "
            f"{sources.get(name) or 'absent'} now (sha256); pass overwrite=true to redo the run with this code, "
            "output_dir=... to keep both, or restore the code it was answered with to resume"
        )
    own = out / rundir.PREDICTIONS if spec.shard.whole else rundir.shard_path(out, spec.shard.name, ".jsonl")
    rundir.read_predictions(own, repair=True)
    rows = rundir.read_all_predictions(out)
    return [row for row in rows if not row.get("error")] if cfg.retry_errors else rows


def make_plan(spec: PointSpec, tokenizer) -> Plan:
    """Plan a resolved point (``run_sweep`` checks every point before it locks any run directory), its run
    directory locked by the caller: the checks that need the tokenizer and the samples run here."""
    cfg, out = spec.cfg, spec.out
    benchmark = instantiate(cfg.benchmark)
    samples = load_samples(benchmark, tokenizer, cfg)
    context_tokens = {s.context: len(tokenizer.encode(s.context, add_special_tokens=False)) for s in samples}
    question_tokens = max(len(tokenizer.encode(s.question, add_special_tokens=False)) for s in samples)
    validate_context_lengths(cfg, min(context_tokens.values()) + (question_tokens if cfg.query_aware else 0))
    kept = previous_rows(spec)
    check_same_samples(out, kept, samples)
    done = {row["id"] for row in kept}
    contexts = spec.shard.contexts(sample.context for sample in samples)
    share = tuple(sample for sample in samples if sample.context in contexts)
    return Plan(
        spec=spec,
        benchmark=benchmark,
        source=instantiate(cfg.model.source),
        press=build_press(cfg),
        samples=tuple(samples),
        kept_rows=tuple(kept),
        share=share,
        todo=tuple(sample for sample in share if sample.id not in done),
        context_tokens=context_tokens,
    )
