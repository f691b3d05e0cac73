"""Which of a benchmark's rows a run answers, as kvpress's evaluate.py selects them: its ``fraction`` of each
data_dir's rows, at most ``limit`` per task, each checked and its text made valid Unicode where it enters."""

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


def load_samples(benchmark, tokenizer, fraction: float, limit: int | None, seed: int) -> list[Sample]:
    """The run's samples: the drawn ``fraction`` of each data_dir's rows, then at most ``limit`` per task."""
    if fraction >= 1:
        return check_samples(benchmark.load(tokenizer, limit))
    # The draw needs every row of the frame kvpress would sample from; the limit applies to what was drawn.
    drawn = select_fraction(check_samples(benchmark.load(tokenizer, None)), fraction, seed, benchmark.fraction_by_task)
    return first_per_task(drawn, limit)
