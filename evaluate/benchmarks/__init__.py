"""Benchmarks: one module per benchmark, each declaring its loader, prompt format and metric.

A benchmark object (instantiated from ``conf/benchmark/<name>.yaml``) exposes:

- ``name``: the benchmark name used in run directories and metrics.json;
- ``load(tokenizer, limit) -> list[Sample]``: the samples to run, at most ``limit`` per task;
- ``score(rows) -> dict``: metrics.json content computed from prediction rows alone.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One question about one context, in the kvpress dataset schema."""

    id: str
    task: str
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    max_new_tokens: int
