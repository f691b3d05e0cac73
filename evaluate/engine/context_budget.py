"""How kvpress's pipeline turns a context into tokens, and the context budget both engines apply with it.

The pipeline object (:func:`make_pipeline`), its chat-template switch and its preprocessing before a model exists;
the budget a context is cut at (``truncation=pipeline``: kvpress's pipeline cuts the templated context;
``head``/``middle``: the harness cuts the raw one), how many samples it cuts, and the checks that need the tokenizer
or the model: an answer that cannot fit the model's positions, a token budget that keeps every context whole.
"""

import logging
import sys
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace

import torch

from evaluate.benchmarks import Sample
from evaluate.errors import ConfigError
from evaluate.points.plan import Plan

logger = logging.getLogger(__name__)


@contextmanager
def chat_template_enabled(tokenizer, enabled: bool):
    """kvpress's pipeline applies the tokenizer's chat template whenever it has one; a raw prompt hides it."""
    if enabled:
        yield
        return
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        yield
    finally:
        tokenizer.chat_template = template


def pipeline_max_context_length(tokenizer) -> int:
    """kvpress's pipeline's budget when none is given."""
    return min(tokenizer.model_max_length, int(1e10))


def templated_context_length(pipe, tokenizer):
    """Token count of a text as the pipeline's context (chat template applied or not), memoized per text."""
    lengths: dict[tuple[str, bool], int] = {}

    def length(text: str, chat_template: bool) -> int:
        if (text, chat_template) not in lengths:
            with chat_template_enabled(tokenizer, chat_template):
                context_ids = pipe.preprocess(text, [""], "", int(1e10))["context_ids"]
            lengths[text, chat_template] = context_ids.shape[1]
        return lengths[text, chat_template]

    return length


def context_cap(spec, tokenizer, model=None) -> int | None:
    """The context budget in tokens (:func:`context_budget`); None where it is the model's and no ``model`` is
    given (``head``/``middle`` without ``max_context_length``)."""
    if spec.max_context_length or spec.truncation == "pipeline":
        return spec.max_context_length or pipeline_max_context_length(tokenizer)
    return model.config.max_position_embeddings if model is not None else None


def context_budget(plan: Plan, model, tokenizer) -> tuple[int, int]:
    """The context budget in tokens, and how many of the plan's samples exceed it (logged).

    ``truncation=pipeline`` (kvpress's rule): the pipeline cuts the chat-templated context (with the question
    appended in query-aware runs) at ``max_context_length``, else at the tokenizer's ``model_max_length``.
    ``head``/``middle``: the harness cuts the raw context at ``max_context_length``, else at the model's
    ``max_position_embeddings``, before the pipeline sees it.
    """
    spec = plan.spec
    budget = context_cap(spec, tokenizer, model)
    if spec.truncation == "pipeline":
        length = templated_context_length(make_pipeline(model, tokenizer, plan.spec.device), tokenizer)

        def may_exceed(sample: Sample) -> bool:
            # Counting exactly tokenizes a context again; only one that cannot fit with room to spare needs it: its
            # raw tokens, the template's, its question's UTF-8 bytes (no token is shorter than a byte) and a slack
            # for merges across the joins.
            question = len(sample.question.encode("utf-8")) if spec.query_aware else 0
            return plan.context_tokens[sample.context] + length("", sample.chat_template) + question + 16 > budget

        truncated = sum(
            may_exceed(sample) and length(plan.compressed_text(sample), sample.chat_template) > budget
            for sample in plan.samples
        )
    else:
        truncated = sum(plan.context_tokens[sample.context] > budget for sample in plan.samples)
    if truncated:
        logger.warning(
            "%d of %d samples have contexts longer than %d tokens and are truncated (truncation=%s)",
            truncated,
            len(plan.samples),
            budget,
            spec.truncation,
        )
    return budget, truncated


def check_generation_fits(plan: Plan, model, tokenizer) -> None:
    """Refuse samples whose answer cannot fit in the model's positions whatever the context is cut to: its
    ``max_new_tokens``, plus its question and answer prefix where they follow the compressed context (no truncation
    shortens those). Such a row would decode for minutes past the positions the model was trained on; a long context
    beside them is kvpress's to cut (:func:`context_budget`), and runs."""
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is None:
        return

    def following(sample: Sample) -> str:
        return sample.answer_prefix if plan.spec.query_aware else sample.question + sample.answer_prefix

    # No token is shorter than a byte, so only a sample whose bytes (and a slack for a tokenizer's added prefix)
    # could overflow needs counting.
    candidates = [s for s in plan.todo if s.max_new_tokens + len(following(s).encode("utf-8")) + 16 > positions]
    counted = [(s, len(tokenizer(following(s), add_special_tokens=False).input_ids)) for s in candidates]
    misfits = [(sample, tokens) for sample, tokens in counted if sample.max_new_tokens + tokens > positions]
    if misfits:
        sample, tokens = misfits[0]
        raise ConfigError(
            f"{len(misfits)} samples of {plan.out.name} cannot fit in the model's {positions} positions, e.g. "
            f"{sample.id}: {sample.max_new_tokens} new tokens after {tokens} tokens of question and answer prefix; "
            "lower the rows' max_new_tokens (or cap them with max_new_tokens=N) or shorten their questions in "
            "benchmark.path, or leave those tasks out with benchmark.tasks=[...]"
        )


def check_budget_fits(plan: Plan, tokenizer, model=None) -> None:
    """Refuse a token budget (``budget=N``) that keeps every context whole as the model receives it (chat template,
    Finch's suffix and a query-aware question in; truncation applied): such a run is the uncompressed one. The
    tokenizer alone counts that, so the run checks before the model loads; where the contexts are cut at the model's
    positions (``head``/``middle`` without ``max_context_length``), once more with the ``model``. A context of N
    tokens or fewer among longer ones is kept whole (ratio 0), which the run's kept ratios show."""
    budget, cap = plan.spec.budget, context_cap(plan.spec, tokenizer, model)
    if budget is None or not plan.todo:
        return
    length = templated_context_length(preprocessor(tokenizer), tokenizer)
    uncut = cap if cap is not None else sys.maxsize  # uncut, every context is as long as cut or longer
    # Longest raw context first: where some context exceeds the budget, as usual, one count settles it.
    longest = 0
    for sample in sorted(plan.todo, key=lambda sample: -plan.context_tokens[sample.context]):
        text = plan.compressed_text(sample, plan.context(sample, tokenizer, uncut))
        longest = max(longest, min(length(text, sample.chat_template), pipeline_budget(plan, tokenizer, uncut)))
        if longest > budget:
            return
    raise ConfigError(
        f"budget={budget} keeps every context of {plan.out.name} whole: the longest has {longest} tokens as the "
        f"model receives it (chat template included); give a budget below {longest}, or press=none for the "
        "uncompressed run"
    )


def preprocessor(tokenizer) -> SimpleNamespace:
    """kvpress's pipeline's ``preprocess`` (chat template, tokenization, truncation) before a model exists: it reads
    nothing of its pipeline but the tokenizer."""
    from kvpress import KVPressTextGenerationPipeline  # imported late: kvpress patches attention globally

    holder = SimpleNamespace(tokenizer=tokenizer)
    holder.preprocess = partial(KVPressTextGenerationPipeline.preprocess, holder)
    return holder


def pipeline_budget(plan: Plan, tokenizer, budget: int) -> int:
    """The ``max_context_length`` handed to kvpress's pipeline (its default when the harness cut the context)."""
    return budget if plan.spec.truncation == "pipeline" else pipeline_max_context_length(tokenizer)


def make_pipeline(model, tokenizer, device: str):
    """kvpress's pipeline over ``model`` on ``device``; over a model spread by a device map, with no device, as
    kvpress's evaluate.py builds it with ``device_map="auto"`` (transformers refuses a device for a dispatched model,
    and kvpress's pipeline sends its inputs to ``model.device`` either way)."""
    from kvpress import KVPressTextGenerationPipeline  # imported late: kvpress patches attention globally

    placement = None if hasattr(model, "hf_device_map") else torch.device(device)
    return KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=placement)
