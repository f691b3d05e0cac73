"""Why a press fails, measured where it compresses (``diagnostics=``, docs/metrics.md): what a context's points share,
computed once per context (:class:`ContextDiagnosis`), and each point's row fields from its own kept set.

- ``answer_retention``: the share of the answer's context positions the compressed cache kept (evaluate/engine/
  kept_sets.py, evaluate/engine/answer_span.py), averaged over layers and KV heads, and ``answer_retention_by_layer``;
- ``attention_recall`` (``diagnostics=attention``): the share of the uncompressed model's attention on the context,
  while it reads the reference answer, that falls on kept positions (evaluate/engine/attention_recall.py), and
  ``attention_recall_by_layer``.

Each is null where it cannot be measured: the answer is not in the prefilled context, or the kept set is unknown
(a press that writes new keys, a quantized cache, a decoding-time press).
"""

import time
from dataclasses import dataclass, field

import torch

from evaluate.benchmarks import Sample
from evaluate.engine.answer_span import PrefilledText
from evaluate.engine.attention_recall import attention_mass
from evaluate.engine.kept_sets import Diagnosed, KeptSet

RETENTION_FIELDS = ("answer_retention", "answer_retention_by_layer")
RECALL_FIELDS = ("attention_recall", "attention_recall_by_layer")


@dataclass
class ContextDiagnosis:
    """One prefilled context's share of the diagnostics: its keys' fingerprints, its prefilled text, and under
    ``diagnostics=attention`` each question's attention mass on it (by sample id); with the seconds each took."""

    fingerprints: list[torch.Tensor]
    text: PrefilledText | None
    masses: dict[str, torch.Tensor | None] = field(default_factory=dict)
    retention_seconds: float = 0.0
    recall_seconds: float = 0.0

    @classmethod
    def of(
        cls, fingerprints: list[torch.Tensor], tokenizer, text: str, chat_template: bool, budget: int
    ) -> "ContextDiagnosis":
        """From the fingerprints of each layer's uncompressed keys (:func:`key_fingerprints`) and the context's text
        as the pipeline prefills it (``budget``: the pipeline's ``max_context_length``)."""
        start = time.perf_counter()
        prefilled = PrefilledText.of(tokenizer, text, chat_template, budget)
        return cls(fingerprints, prefilled, retention_seconds=time.perf_counter() - start)

    def add_masses(self, model, cache, group: list[Sample], question_ids: list, answer_ids: list) -> None:
        """Each of ``group``'s questions' attention mass on the uncompressed ``cache`` while it reads its reference
        answer (``answer_ids``, as the likelihood fields teacher-force it), once per sample."""
        start = time.perf_counter()
        length = self.fingerprints[0].shape[1]
        for sample, question, answer in zip(group, question_ids, answer_ids, strict=True):
            if sample.id in self.masses:
                continue
            self.masses[sample.id] = None if answer is None else attention_mass(model, cache, question, answer, length)
        self.recall_seconds += time.perf_counter() - start

    def answer_positions(self, sample: Sample) -> torch.Tensor | None:
        return None if self.text is None else self.text.answer_positions(sample.answers)

    def diagnose(self, kept: KeptSet | None, group: list[Sample], recall: bool) -> Diagnosed:
        """Each row's diagnostic fields against a point's ``kept`` set (None: unknown); ``recall``: with attention
        recall (``diagnostics=attention``)."""
        rows, spans = [], []
        for sample in group:
            row = dict.fromkeys(RETENTION_FIELDS + (RECALL_FIELDS if recall else ()))
            positions = self.answer_positions(sample)
            if kept is not None and positions is not None:
                row["answer_retention"], row["answer_retention_by_layer"] = kept.retention(positions)
            mass = self.masses.get(sample.id) if recall else None
            if kept is not None and mass is not None:
                row["attention_recall"], row["attention_recall_by_layer"] = kept.recall(mass)
            rows.append(row)
            spans.append(positions)
        return Diagnosed(rows, [kept] * len(group), spans)
