"""kvpress's pipeline path: each context group of a planned run answered by ``KVPressTextGenerationPipeline``.

Samples that share a context (and answer prefix and generation length) are answered from one compressed cache
with ``questions=``, exactly as kvpress's evaluation runs them. Under ``turns=multi`` each conversation is asked
turn by turn on one cache with the pipeline's own steps (:func:`answer_conversations`). Also here: the context
budget both engines apply, and a conversation's turns as both engines ask them (:func:`conversation_of`).
"""

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from functools import partial
from types import SimpleNamespace

import torch
from kvpress import DecodingPress
from transformers import DynamicCache

from evaluate.benchmarks import Sample
from evaluate.engine.cost import Cost, kv_bytes, measure_kept_ratio
from evaluate.engine.decoding_compression import counting_removals, kept_after_answer
from evaluate.engine.decoding_pool import DecodingPool, stop_token_ids
from evaluate.engine.devices import input_device, synchronizer
from evaluate.engine.requests import AnsweredGroup, GeneratedAnswer, hidden_keys
from evaluate.engine.teacher_forcing import (
    forcing_pool,
    likelihood_fields,
    reference_answer_ids,
    reference_log_probs,
    teacher_forced,
)
from evaluate.engine.turns import Conversation, follow_up_ids
from evaluate.errors import ConfigError
from evaluate.points.budget import apply_budget
from evaluate.points.plan import Plan
from evaluate.points.press_traits import decoding_part

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


class PrefillProbe:
    """Times the prefill pass, records the context length the pipeline actually fed the model, and counts passes.

    kvpress's pipeline runs the prefill as one call of the bare decoder (``model.model``) before any decoding step,
    so the first such call after ``reset`` is the prefill. Every call of the bare decoder is a forward pass (KVzip's
    reconstruction passes included); every call of the language-model head's forward generates one token.
    """

    def __init__(self, model: torch.nn.Module):
        self._synchronize = synchronizer(model)
        self._handles = [
            model.model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.model.register_forward_hook(self._after, with_kwargs=True),
            model.register_forward_pre_hook(self._generates),
        ]
        self.reset()

    def reset(self) -> None:
        self.context_length: int | None = None
        self.seconds = 0.0
        self.forward_passes = 0
        self.generated_tokens = 0
        self._start: float | None = None

    def _before(self, module, args, kwargs):
        self.forward_passes += 1
        if self.context_length is None:
            self.context_length = kwargs["input_ids"].shape[1]
            self._synchronize()
            self._start = time.perf_counter()

    def _after(self, module, args, kwargs, output):
        if self._start is not None:
            self._synchronize()
            self.seconds = time.perf_counter() - self._start
            self._start = None

    def _generates(self, module, args):
        self.generated_tokens += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class GreedyTokens:
    """The token ids kvpress's pipeline generates for each question, exactly as it generates them.

    ``KVPressTextGenerationPipeline.generate_answer`` keeps its greedy ids in a local list and returns their text
    only, and text decoded with ``skip_special_tokens`` does not tokenize back to the same ids. So this wraps the
    pipeline's ``generate_answer`` (an attribute of this pipeline object only) and, while a call runs, a forward hook
    on the language model takes each pass's token the way the pipeline does: the argmax of the last position's
    logits, on the very tensor the pipeline reads. ``answers`` holds each call's answer since ``reset``.
    """

    def __init__(self, pipe, decoding: DecodingPress | None = None):
        self.stop_ids = stop_token_ids(pipe.model)
        self._model, self._generate = pipe.model, pipe.generate_answer
        pipe.generate_answer = self._generate_answer
        self.answers: list[GeneratedAnswer] = []
        self._tokens: list[int] = []
        # A decoding-time press's compressions that removed pairs of the cache (GeneratedAnswer.compressed): counted
        # from the cache's prefill on, so that a conversation's later turn counts its earlier turns' too.
        self._decoding = decoding
        self.removals = 0

    def reset(self) -> None:
        self.answers = []

    def _take(self, module, args, output) -> None:
        # Reading the token back waits for the device, as the pipeline's own stop test (``new_id.item()``) does.
        self._tokens.append(int(output.logits[0, -1].argmax()))

    def _generate_answer(self, *args, **kwargs) -> str:
        self._tokens = []
        handle = self._model.register_forward_hook(self._take)
        try:
            with counting_removals(self._decoding) as removals:
                answer = self._generate(*args, **kwargs)
        finally:
            handle.remove()
        self.removals += removals[0]
        compressed = None if self._decoding is None else self.removals > 0
        self.answers.append(GeneratedAnswer.of(self._tokens, self.stop_ids, compressed))
        return answer


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


class PipelineEngine:
    """kvpress's pipeline path behind the engine interface the run asks both paths through (the pooled one is
    :class:`evaluate.engine.pool_engine.PoolEngine`): each point after the other, one context group at a time."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def answer(self, plans: list[Plan], budgets: list[int]) -> Iterator[AnsweredGroup]:
        """Yields each point's answers on each context (each turn, under ``turns=multi``) as they are finished
        (``point`` indexes ``plans``)."""
        for point, (plan, budget) in enumerate(zip(plans, budgets, strict=True)):
            answer = answer_conversations if plan.spec.turns == "multi" else answer_with_pipeline
            for result in answer(plan, self.model, self.tokenizer, budget):
                yield replace(result, point=point)


def answer_with_pipeline(plan: Plan, model, tokenizer, budget: int) -> Iterator[AnsweredGroup]:
    """Each context group of ``plan`` through kvpress's pipeline, the press hooked into the prefill; yields each
    group's answers (point 0: the one plan) as they are finished, a failed group's with its failure."""
    pipe = make_pipeline(model, tokenizer, plan.spec.device)
    tokens = GreedyTokens(pipe, decoding_part(plan.press))
    probe = PrefillProbe(model)
    # kvpress's runner seeds once before its run: a press drawing random numbers (RandomPress, Compactor's sketch)
    # draws the same ones here.
    torch.manual_seed(plan.spec.seed)
    forcing = forcing_pool(model) if plan.likelihood else None
    length = templated_context_length(pipe, tokenizer)
    try:
        for group in plan.groups():
            probe.reset()
            tokens.reset()
            tokens.removals = 0
            group_start = time.perf_counter()
            cache = DynamicCache()
            inputs = _PipelineInputs(
                text=plan.compressed_text(group[0], plan.context(group[0], tokenizer, budget)),
                questions=["" if plan.spec.query_aware else sample.question for sample in group],
                answer_prefix=group[0].answer_prefix,
                max_context_length=pipeline_budget(plan, tokenizer, budget),
            )
            result = AnsweredGroup(0, group, [None] * len(group), None, None, Cost())
            try:
                if plan.spec.budget is not None:  # this context's own ratio, as the pipeline will cut the context
                    prefilled = min(length(inputs.text, group[0].chat_template), inputs.max_context_length)
                    apply_budget(plan.press, prefilled, plan.spec.budget)
                with chat_template_enabled(tokenizer, group[0].chat_template):
                    answers = pipe(
                        inputs.text,
                        questions=inputs.questions,
                        answer_prefix=inputs.answer_prefix,
                        press=plan.press,
                        # generate=false: the pipeline's one token per question is its shortest way to the cache.
                        max_new_tokens=group[0].max_new_tokens if plan.spec.generate else 1,
                        max_context_length=inputs.max_context_length,
                        cache=cache,
                    )["answers"]
                if plan.spec.generate:
                    result.answers, result.generated = answers, tokens.answers
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
            if plan.likelihood and result.failure is None:
                _add_likelihood(result, forcing, pipe, probe, plan, tokenizer, cache, inputs)
            yield result
    finally:
        probe.close()


@dataclass(frozen=True)
class _PipelineInputs:
    """What one call of kvpress's pipeline is given for a context group."""

    text: str
    questions: list[str]
    answer_prefix: str
    max_context_length: int


def _add_likelihood(
    result: AnsweredGroup,
    forcing: DecodingPool,
    pipe,
    probe: PrefillProbe,
    plan: Plan,
    tokenizer,
    cache: DynamicCache,
    inputs: _PipelineInputs,
) -> None:
    """The group's likelihood fields on the cache the pipeline left, their time and passes added to its cost."""
    start, passes = time.perf_counter(), probe.forward_passes
    group = result.group
    try:
        with chat_template_enabled(tokenizer, group[0].chat_template):
            tokens = pipe.preprocess(inputs.text, inputs.questions, inputs.answer_prefix, inputs.max_context_length)
        result.likelihood = pipeline_likelihood(forcing, pipe.model, plan, tokenizer, group, cache, tokens)
    except Exception as failure:  # as on the pool's path: the group fails, named, and the run goes on
        result.failure = failure
    result.cost.likelihood_seconds = time.perf_counter() - start
    result.cost.forward_passes += probe.forward_passes - passes


def pipeline_likelihood(
    pool: DecodingPool, model, plan: Plan, tokenizer, group: list[Sample], cache: DynamicCache, inputs: dict
) -> list[dict]:
    """Each sample's likelihood fields on the cache kvpress's pipeline left (AdaKV's masks are still on the
    modules), against one more prefill of the context without the press; teacher-forced by the run's ``pool``
    (:func:`forcing_pool`) in the passes the pooled path makes for the same group."""
    context_ids = inputs["context_ids"].to(input_device(model))
    questions = inputs["questions_ids"]
    answers = [reference_answer_ids(plan.benchmark, sample, tokenizer) for sample in group]
    hidden = hidden_keys([layer.self_attn for layer in model.model.layers])
    compressed, _ = teacher_forced(pool, cache, hidden, questions, answers, context_ids.shape[1])
    reference, _ = reference_log_probs(pool, model.model, context_ids, questions, answers)
    return [
        {} if answer is None else likelihood_fields(mine, theirs, answer)
        for mine, theirs, answer in zip(compressed, reference, answers, strict=True)
    ]


def conversation_of(plan: Plan, turns: list[Sample], first_input: torch.Tensor, tokenizer, stop_ids: set[int]):
    """A conversation's turns as both engines ask them (evaluate/engine/turns.py): the first turn's input as kvpress's
    pipeline tokenizes it (``first_input``), each later turn's follow-up, each turn's reference answer as the
    likelihood fields teacher-force it, and the answers recorded for the turns before the first one left to answer.
    A ``ValueError`` where such a turn cannot be replayed: it failed, and ``history=model`` needs its answer."""
    first_asked = turns.index(plan.asked(turns)[0])
    keep_answers = plan.spec.history == "model"
    recorded: list[tuple[int, ...] | None] = [None] * len(turns)
    for turn, sample in enumerate(turns[:first_asked]):
        answer = plan.answered_tokens.get(sample.id)
        if answer is None and keep_answers:
            raise ValueError(
                f"turn {turn} of conversation {sample.conversation} failed in an earlier session, and history=model "
                "needs its answer; rerun with retry_errors=true"
            )
        # Under history=reference the answer is dropped: the turn's question pass alone is replayed.
        recorded[turn] = answer or (0,)
    return Conversation(
        inputs=[first_input]
        + [follow_up_ids(tokenizer, s.chat_template, s.question, s.answer_prefix) for s in turns[1:]],
        references=[reference_answer_ids(plan.benchmark, sample, tokenizer) for sample in turns],
        max_new_tokens=[sample.max_new_tokens for sample in turns],
        keep_answers=keep_answers,
        stop_ids=stop_ids,
        recorded=recorded,
    )


def answer_conversations(plan: Plan, model, tokenizer, budget: int) -> Iterator[AnsweredGroup]:
    """Each conversation of ``plan`` turn by turn on one cache, with kvpress's pipeline's own steps: its tokenization,
    its prefill under the press, its ``generate_answer`` for each turn (a decoding-time press hooked the while) and
    its ``_remove_answer_from_cache`` (evaluate/engine/turns.py says what stays of each answer). Yields each turn's
    answer (point 0) as it is finished; a failure fails the turn and every later turn of its conversation."""
    pipe = make_pipeline(model, tokenizer, plan.spec.device)
    tokens = GreedyTokens(pipe, decoding_part(plan.press))
    probe = PrefillProbe(model)
    torch.manual_seed(plan.spec.seed)  # as answer_with_pipeline: kvpress's runner seeds once before its run
    try:
        for turns in plan.groups():
            yield from _conversation(plan, pipe, tokens, probe, turns, budget)
    finally:
        probe.close()


def _conversation(plan: Plan, pipe, tokens: GreedyTokens, probe: PrefillProbe, turns, budget) -> Iterator:
    model, tokenizer, press = pipe.model, pipe.tokenizer, plan.press
    asked = plan.asked(turns)
    probe.reset()
    tokens.removals = 0
    answered = 0
    try:
        first = turns[0]
        text = plan.compressed_text(first, plan.context(first, tokenizer, budget))
        with chat_template_enabled(tokenizer, first.chat_template):
            question = "" if plan.spec.query_aware else first.question
            inputs = pipe.preprocess(text, [question], first.answer_prefix, pipeline_budget(plan, tokenizer, budget))
        conversation = conversation_of(plan, turns, inputs["questions_ids"][0], tokenizer, tokens.stop_ids)
        context_ids = inputs["context_ids"].to(model.device)
        context_length = context_ids.shape[1]
        if plan.spec.budget is not None:
            apply_budget(press, context_length, plan.spec.budget)
        cache = DynamicCache()
        # kvpress's pipeline: the prefill under the press unless it only compresses while decoding.
        prefill_press = press if press is not None and not isinstance(press, DecodingPress) else None
        with prefill_press(model) if prefill_press is not None else nullcontext(), torch.no_grad():
            model.model(input_ids=context_ids, past_key_values=cache)
        kept_ratio = measure_kept_ratio(model, cache, context_length)
        prefilled = [SimpleNamespace(keys=layer.keys) for layer in cache.layers]
        # The context's bytes are counted once per conversation, on its first answered turn, as on the pool's path.
        held, kept = kv_bytes(model, cache)
        cost = Cost(prefill_seconds=probe.seconds, forward_passes=probe.forward_passes, prefills=1)
        cost.kv_bytes_held, cost.kv_bytes_kept = held, kept
        conversation.start(context_length)
        decoding = decoding_part(press) is not None
        with press(model) if decoding else nullcontext(), torch.no_grad():
            for sample in turns:
                result, answer, turn_cost = _turn(pipe, tokens, probe, conversation, cache, sample)
                cost = cost + turn_cost  # a replayed turn's passes go to the next answered turn
                if result is not None:
                    result.kept_ratio, result.context_length = kept_ratio, context_length
                    if decoding:
                        lengths = tuple(layer.keys.shape[2] for layer in cache.layers)
                        masks = hidden_keys([layer.self_attn for layer in model.model.layers])
                        result.kept_ratio, kept = kept_after_answer(
                            SimpleNamespace(layers=prefilled), lengths, masks, context_length
                        )
                        if cost.kv_bytes_held:
                            cost.kv_bytes_held = cost.kv_bytes_kept = kept
                    result.cost, cost = cost, Cost()
                    result.contexts = 1 if answered == 0 else 0  # the context's cost, once per conversation
                    answered += 1
                    yield result
                if not conversation.last_turn:
                    dropped = conversation.next_turn(answer)
                    if dropped:
                        pipe._remove_answer_from_cache(cache, [layer.keys.shape[2] - dropped for layer in cache.layers])
    except Exception as failure:
        for sample in asked[answered:]:
            yield AnsweredGroup(0, [sample], [None], None, None, Cost(), failure=failure)
    finally:
        for layer in model.model.layers:  # AdaKV's masks belong to this conversation's cache alone
            layer.self_attn.masked_key_indices = None


def _turn(pipe, tokens: GreedyTokens, probe: PrefillProbe, conversation: Conversation, cache, sample):
    """One turn on the conversation's cache: answered with kvpress's ``generate_answer`` (its result), or replayed
    from its record in the passes its generation made (no result); with the answer's tokens and the turn's cost."""
    forced = conversation.forced()
    start, passes, generated = time.perf_counter(), probe.forward_passes, probe.generated_tokens
    result = None
    if forced is not None:
        _replay(pipe.model, cache, conversation.input_ids, conversation.position, forced)
        answer = list(forced)
    else:
        tokens.reset()
        text = pipe.generate_answer(conversation.input_ids, cache, conversation.position, sample.max_new_tokens)
        result = AnsweredGroup(0, [sample], [text], None, None, Cost(), generated=[tokens.answers[0]])
        answer = list(tokens.answers[0].token_ids)
    cost = Cost(
        decode_seconds=time.perf_counter() - start,
        forward_passes=probe.forward_passes - passes,
        generated_tokens=0 if forced is not None else probe.generated_tokens - generated,
    )
    return result, answer, cost


def _replay(model, cache, input_ids: torch.Tensor, position: int, forced: tuple[int, ...]) -> None:
    """A recorded turn's passes as ``generate_answer`` made them: its input, then each answer token but the last fed
    back one at a time, at the positions they had."""
    device = model.device
    positions = torch.arange(position, position + input_ids.shape[1], device=device)[None]
    model(input_ids=input_ids.to(device), past_key_values=cache, position_ids=positions, logits_to_keep=1)
    for offset, token in enumerate(forced[:-1]):
        position_ids = positions[:, -1:] + 1 + offset
        model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, position_ids=position_ids)
