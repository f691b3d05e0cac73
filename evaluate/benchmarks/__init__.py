"""Benchmarks: one module per benchmark, each declaring its loader, prompt format and metric.

A benchmark object (instantiated from ``conf/benchmark/<name>.yaml``) exposes:

- ``name``: the benchmark name used in run directories and metrics.json;
- ``load(tokenizer, limit) -> list[Sample]``: the samples to run, at most ``limit`` per task;
- ``score(rows) -> dict``: metrics.json content computed from prediction rows alone.
"""

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One question about one context, in the kvpress dataset schema.

    ``chat_template`` is False for prompts a protocol feeds raw (LongBench's official protocol does so for
    few-shot tasks). ``extra`` holds fields a metric needs besides the answers (e.g. LongBench's
    ``all_classes``); they are copied into the prediction row so that rescoring needs nothing else.
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
