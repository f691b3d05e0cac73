"""kvpress's pipeline path: each context group of a planned run answered by ``KVPressTextGenerationPipeline``.

One loop for both kinds of group (:func:`answer_with_pipeline`), on one :class:`PipelineRun`. Samples that share a
context (and answer prefix and generation length) are answered from one compressed cache with ``questions=``, exactly
as kvpress's evaluation runs them (:func:`ask_questions`). Under ``turns=multi`` a group is one conversation, asked
turn by turn on one cache with the pipeline's own steps
(evaluate/engine/pipeline_conversations.py:``ask_conversation``).
"""

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from transformers import Cache, DynamicCache, QuantizedCache

from evaluate.benchmarks import Sample
from evaluate.engine.context_budget import (
    chat_template_enabled,
    pipeline_budget,
)
from evaluate.engine.cost import Cost, kv_bytes, measure_kept_ratio
from evaluate.engine.decoding_pool import DecodingPool
from evaluate.engine.devices import input_device
from evaluate.engine.kept_sets import kept_set, layer_fingerprints
from evaluate.engine.pipeline_conversations import ask_conversation
from evaluate.engine.pipeline_hooks import PipelineRun
from evaluate.engine.requests import AnsweredGroup, hidden_keys
from evaluate.engine.teacher_forcing import (
    likelihood_fields,
    reference_answer_ids,
    reference_log_probs,
    teacher_forced,
)
from evaluate.points.budget import apply_budget
from evaluate.points.plan import Plan

logger = logging.getLogger(__name__)


class PipelineEngine:
    """kvpress's pipeline path, an :class:`~evaluate.engine.engine.Engine` (the pooled one is
    :class:`evaluate.engine.pool_engine.PoolEngine`): each point after the other, one context group at a time."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def answer(self, plans: list[Plan], budgets: list[int]) -> Iterator[AnsweredGroup]:
        """Yields each point's answers on each context (each turn, under ``turns=multi``) as they are finished
        (``point`` indexes ``plans``)."""
        for point, (plan, budget) in enumerate(zip(plans, budgets, strict=True)):
            for result in answer_with_pipeline(plan, self.model, self.tokenizer, budget):
                yield replace(result, point=point)


def _pipeline_answers(
    pipe, plan: Plan, tokenizer, group: list[Sample], inputs: "_PipelineInputs", cache: Cache, length
) -> list[str]:
    """kvpress's pipeline called on one context group, the press hooked into its prefill; under a token budget the
    press first gets this context's own ratio, as the pipeline will cut the context (``length``: its templated
    token count)."""
    if plan.spec.budget is not None:
        prefilled = min(length(inputs.text, group[0].chat_template), inputs.max_context_length)
        apply_budget(plan.press, prefilled, plan.spec.budget)
    with chat_template_enabled(tokenizer, group[0].chat_template):
        return pipe(
            inputs.text,
            questions=inputs.questions,
            answer_prefix=inputs.answer_prefix,
            press=plan.press,
            # generate=false: the pipeline's one token per question is its shortest way to the cache.
            max_new_tokens=group[0].max_new_tokens if plan.spec.generate else 1,
            max_context_length=inputs.max_context_length,
            cache=cache,
        )["answers"]


def answer_with_pipeline(plan: Plan, model, tokenizer, budget: int) -> Iterator[AnsweredGroup]:
    """Each group of ``plan`` through kvpress's pipeline, asked as its turns say (``GROUP_ASKERS``); yields each
    group's answers (each turn's, under ``turns=multi``; point 0: the one plan) as they are finished, a failed
    group's with its failure."""
    run = PipelineRun.start(plan, model, tokenizer)
    ask = GROUP_ASKERS[plan.spec.turns]
    try:
        for group in plan.groups():
            run.reset()
            yield from ask(run, plan, group, budget)
    finally:
        run.close()


def ask_questions(run: PipelineRun, plan: Plan, group: list[Sample], budget: int) -> Iterator[AnsweredGroup]:
    """One context group's questions asked with kvpress's pipeline's ``questions=``, the press hooked into the
    prefill; with their likelihood fields where the point wants them."""
    model, tokenizer, probe = run.pipe.model, run.pipe.tokenizer, run.probe
    group_start = time.perf_counter()
    cache = run.new_cache()
    inputs = _PipelineInputs(
        text=plan.compressed_text(group[0], plan.context(group[0], tokenizer, budget)),
        questions=["" if plan.spec.query_aware else sample.question for sample in group],
        answer_prefix=group[0].answer_prefix,
        max_context_length=pipeline_budget(plan, tokenizer, budget),
    )
    result = AnsweredGroup(0, group, [None] * len(group), None, None, Cost())
    try:
        answers = _pipeline_answers(run.pipe, plan, tokenizer, group, inputs, cache, run.length)
        if plan.spec.generate:
            result.answers, result.generated = answers, run.tokens.answers
        result.kept_ratio = measure_kept_ratio(model, cache, probe.context_length)
        result.context_length = probe.context_length
        held, kept = kv_bytes(model, cache)
    except Exception as failure:
        result.failure = failure
        held = kept = 0
    # The press compresses inside the prefill pass: its time is the prefill's here.
    result.cost = Cost(
        prefill_seconds=probe.seconds,
        decode_seconds=time.perf_counter() - group_start - probe.seconds,
        generated_tokens=probe.generated_tokens,
        forward_passes=probe.forward_passes,
        prefills=1,
        kv_bytes_held=held,
        kv_bytes_kept=kept,
    )
    # The diagnostics first: the likelihood's uncompressed prefill clears AdaKV's masks, which they read.
    if run.keys is not None and result.failure is None:
        _add_diagnosis(result, run, plan, cache, inputs)
    if plan.likelihood and result.failure is None:
        _add_likelihood(result, run, plan, cache, inputs)
    yield result


# How a group is asked on the pipeline's path, by its turns (the pool's rows carry theirs: evaluate/engine/turns.py).
GROUP_ASKERS: dict[str, Callable[[PipelineRun, Plan, list[Sample], int], Iterator[AnsweredGroup]]] = {
    "independent": ask_questions,
    "multi": ask_conversation,
}


@dataclass(frozen=True)
class _PipelineInputs:
    """What one call of kvpress's pipeline is given for a context group."""

    text: str
    questions: list[str]
    answer_prefix: str
    max_context_length: int


def _add_likelihood(result: AnsweredGroup, run: PipelineRun, plan: Plan, cache: Cache, inputs: _PipelineInputs) -> None:
    """The group's likelihood fields on the cache the pipeline left, their time and passes added to its cost."""
    pipe, probe, tokenizer = run.pipe, run.probe, run.pipe.tokenizer
    start, passes = time.perf_counter(), probe.forward_passes
    group = result.group
    try:
        with chat_template_enabled(tokenizer, group[0].chat_template):
            tokens = pipe.preprocess(inputs.text, inputs.questions, inputs.answer_prefix, inputs.max_context_length)
        result.likelihood = pipeline_likelihood(run.forcing, pipe.model, plan, tokenizer, group, cache, tokens)
    except Exception as failure:  # as on the pool's path: the group fails, named, and the run goes on
        result.failure = failure
    result.cost.likelihood_seconds = time.perf_counter() - start
    result.cost.forward_passes += probe.forward_passes - passes


def _add_diagnosis(result: AnsweredGroup, run: PipelineRun, plan: Plan, cache: Cache, inputs: _PipelineInputs) -> None:
    """The group's diagnostics on the cache the pipeline left (:meth:`PipelineRun.diagnosis`). A decoding-time
    press's cache, as the pipeline cut it back, is the last answer's last compression's: it may hold keys of that
    question and answer, which are no context position."""
    start = time.perf_counter()
    group = result.group
    try:
        diagnosis = run.diagnosis(
            plan, group, inputs.text, inputs.questions, inputs.answer_prefix, inputs.max_context_length
        )
        layers = run.pipe.model.model.layers
        hidden = hidden_keys([layer.self_attn for layer in layers])
        decoding = plan.profile.decoding is not None
        kept = kept_set(diagnosis.fingerprints, layer_fingerprints(cache), hidden, new_keys=decoding)
        result.diagnosis = diagnosis.diagnose(kept, group, recall=plan.spec.diagnostics == "attention")
        recall_seconds = diagnosis.recall_seconds
    except Exception as failure:  # as the likelihood fields: the group fails, named, and the run goes on
        result.failure = failure
        recall_seconds = 0.0
    result.cost.retention_seconds = time.perf_counter() - start - recall_seconds
    result.cost.attention_recall_seconds = recall_seconds


def pipeline_likelihood(
    pool: DecodingPool, model, plan: Plan, tokenizer, group: list[Sample], cache: Cache, inputs: dict
) -> list[dict]:
    """Each sample's likelihood fields on the cache kvpress's pipeline left (AdaKV's masks are still on the
    modules), against one more prefill of the context without the press; teacher-forced by the run's ``pool``
    (:func:`forcing_pool`) in the passes the pooled path makes for the same group."""
    context_ids = inputs["context_ids"].to(input_device(model))
    questions = inputs["questions_ids"]
    answers = [reference_answer_ids(plan.benchmark, sample, tokenizer) for sample in group]
    hidden = hidden_keys([layer.self_attn for layer in model.model.layers])
    compressed, _ = teacher_forced(pool, _as_read(cache), hidden, questions, answers, context_ids.shape[1])
    reference, _ = reference_log_probs(pool, model.model, context_ids, questions, answers)
    return [
        {} if answer is None else likelihood_fields(mine, theirs, answer)
        for mine, theirs, answer in zip(compressed, reference, answers, strict=True)
    ]


def _as_read(cache: Cache) -> Cache:
    """``cache`` as the model reads it: a quantized cache's layers dequantized (with their residual) into a
    ``DynamicCache``, which the likelihood fields teacher-force on; any other cache as it is."""
    if not isinstance(cache, QuantizedCache):
        return cache
    plain = DynamicCache()
    for index, layer in enumerate(cache.layers):
        keys, values = layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
        if layer.keys.dim() == 4:
            keys, values = torch.cat([keys, layer.keys], dim=-2), torch.cat([values, layer.values], dim=-2)
        plain.update(keys, values, index)
    return plain
