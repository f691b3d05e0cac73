"""Which of a benchmark's rows a run answers, as kvpress's evaluate.py selects them: its ``fraction`` of each
data_dir's rows, at most ``limit`` per task, each checked and its text made valid Unicode where it enters.

A conversation (samples with turns, one row of SCBench's data) is one row here: drawn or left out whole."""

from dataclasses import replace

import pandas as pd

from evaluate.benchmarks import Sample
from evaluate.errors import ConfigError


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
    check_conversations(samples)
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


def _row(sample: Sample) -> str:
    """The source row a sample comes from: its conversation's, or its own."""
    return sample.conversation if sample.conversation is not None else sample.id


def check_conversations(samples: list[Sample]) -> None:
    """Refuse a conversation whose turns are not 0, 1, ... once each on one context: its turns could not be asked
    in order on one cache."""
    turns: dict[str, list[Sample]] = {}
    for sample in samples:
        if (sample.conversation is None) != (sample.turn is None):
            raise ConfigError(f"sample {sample.id!r} has a conversation or a turn, not both; give both or neither")
        if sample.conversation is not None:
            turns.setdefault(sample.conversation, []).append(sample)
    for conversation, members in turns.items():
        numbers = sorted(sample.turn for sample in members)
        if numbers != list(range(len(members))):
            raise ConfigError(f"conversation {conversation!r} has turns {numbers}; its turns are 0, 1, ... once each")
        if len({sample.context for sample in members}) > 1:
            raise ConfigError(f"conversation {conversation!r}'s turns have different contexts; they share one")


def select_fraction(samples: list[Sample], fraction: float, seed: int, by_task: bool) -> list[Sample]:
    """kvpress's ``fraction``: pandas ``sample(frac=fraction, random_state=seed)`` of each data_dir's rows.

    kvpress loads one data_dir at a time, one per task for LongBench and LOOGLE (``by_task``), the whole split
    for RULER; pandas draws the rows from the frame's length and the seed alone, so drawing positions from a frame
    of the same length in the same source order picks the same rows. Samples keep their source order.
    """
    if fraction >= 1:
        return samples
    frames: dict[str, list[str]] = {}
    for sample in samples:
        frame = frames.setdefault(sample.task if by_task else "", [])
        if _row(sample) not in frame[-1:]:  # a conversation's turns follow each other
            frame.append(_row(sample))
    chosen: set[str] = set()
    for frame in frames.values():
        positions = pd.DataFrame({"position": range(len(frame))}).sample(frac=fraction, random_state=seed)["position"]
        chosen.update(frame[position] for position in positions)
    return [sample for sample in samples if _row(sample) in chosen]


def first_per_task(samples: list[Sample], limit: int | None) -> list[Sample]:
    """At most ``limit`` samples (conversations) of each task, in source order."""
    if limit is None:
        return samples
    rows: dict[str, list[str]] = {}
    kept = []
    for sample in samples:
        task_rows = rows.setdefault(sample.task, [])
        if _row(sample) not in task_rows[-1:]:
            task_rows.append(_row(sample))
        if len(task_rows) <= limit:
            kept.append(sample)
    return kept


def load_samples(benchmark, tokenizer, fraction: float, limit: int | None, seed: int) -> list[Sample]:
    """The run's samples: the drawn ``fraction`` of each data_dir's rows, then at most ``limit`` per task."""
    if fraction >= 1:
        return check_samples(benchmark.load(tokenizer, limit))
    # The draw needs every row of the frame kvpress would sample from; the limit applies to what was drawn.
    drawn = select_fraction(check_samples(benchmark.load(tokenizer, None)), fraction, seed, benchmark.fraction_by_task)
    return first_per_task(drawn, limit)
