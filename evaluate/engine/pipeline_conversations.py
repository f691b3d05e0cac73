"""Conversations on kvpress's pipeline path (``turns=multi``): a group whose turns are a conversation, asked turn by
turn on one cache with the pipeline's own steps (evaluate/engine/turns.py says what each turn's input is and what
stays of its answer)."""

import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from transformers import Cache

from evaluate.benchmarks import Sample
from evaluate.engine.context_budget import chat_template_enabled, pipeline_budget
from evaluate.engine.conversation_inputs import conversation_of
from evaluate.engine.cost import Cost, kv_bytes, measure_kept_ratio
from evaluate.engine.decoding_compression import kept_after_answer
from evaluate.engine.diagnosis import ContextDiagnosis
from evaluate.engine.kept_sets import Diagnosed, KeptSet, kept_set, layer_fingerprints
from evaluate.engine.pipeline_hooks import GreedyTokens, PipelineRun, PrefillProbe
from evaluate.engine.requests import AnsweredGroup, hidden_keys
from evaluate.engine.turns import Conversation
from evaluate.points.budget import apply_budget
from evaluate.points.plan import Plan
from evaluate.press_profile import prefill_hook


def ask_conversation(run: PipelineRun, plan: Plan, turns: list[Sample], budget: int) -> Iterator[AnsweredGroup]:
    """One conversation turn by turn on one cache, with kvpress's pipeline's own steps: its tokenization, its prefill
    under the press, its ``generate_answer`` for each turn (a decoding-time press hooked the while) and its
    ``_remove_answer_from_cache`` (evaluate/engine/turns.py says what stays of each answer). Yields each turn's answer
    (point 0) as it is finished; a failure fails the turn and every later turn of its conversation."""
    pipe, tokens, probe, model, press = run.pipe, run.tokens, run.probe, run.pipe.model, plan.press
    asked = plan.asked(turns)
    answered = 0
    try:
        conversation, cache, context_length, inputs = _prefilled(run, plan, turns, budget)
        kept_ratio = measure_kept_ratio(model, cache, context_length)
        prefilled = [SimpleNamespace(keys=layer.keys) for layer in cache.layers]
        # The context's bytes are counted once per conversation, on its first answered turn, as on the pool's path.
        held, kept = kv_bytes(model, cache)
        cost = Cost(prefill_seconds=probe.seconds, forward_passes=probe.forward_passes, prefills=1)
        cost.kv_bytes_held, cost.kv_bytes_kept = held, kept
        diagnosis = _diagnosis(run, plan, turns, cache, inputs, cost)
        conversation.start(context_length)
        decoding = plan.profile.decoding is not None
        with press(model) if decoding else nullcontext(), torch.no_grad():
            for sample in turns:
                result, answer, turn_cost = _turn(pipe, tokens, probe, conversation, cache, sample)
                cost = cost + turn_cost  # a replayed turn's passes go to the next answered turn
                if result is not None:
                    result.kept_ratio, result.context_length = kept_ratio, context_length
                    masks = hidden_keys([layer.self_attn for layer in model.model.layers]) if decoding else None
                    if decoding:
                        lengths = tuple(layer.keys.shape[2] for layer in cache.layers)
                        result.kept_ratio, kept = kept_after_answer(
                            SimpleNamespace(layers=prefilled), lengths, masks, context_length
                        )
                        if cost.kv_bytes_held:
                            cost.kv_bytes_held = cost.kv_bytes_kept = kept
                    if diagnosis is not None:
                        result.diagnosis = diagnosis.turn(sample, cache, prefilled, masks, cost)
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


def _prefilled(
    run: PipelineRun, plan: Plan, turns: list[Sample], budget: int
) -> tuple[Conversation, Cache, int, tuple[str, str, int]]:
    """The conversation's context tokenized and prefilled as kvpress's pipeline does it (under the press, unless it
    only compresses while decoding); its turns, its cache, its context's length, and the pipeline's inputs (text,
    first question, ``max_context_length``)."""
    pipe, first = run.pipe, turns[0]
    model, tokenizer = pipe.model, pipe.tokenizer
    text = plan.compressed_text(first, plan.context(first, tokenizer, budget))
    question, max_context_length = (
        "" if plan.spec.query_aware else first.question,
        pipeline_budget(plan, tokenizer, budget),
    )
    with chat_template_enabled(tokenizer, first.chat_template):
        inputs = pipe.preprocess(text, [question], first.answer_prefix, max_context_length)
    conversation = conversation_of(plan, turns, inputs["questions_ids"][0], tokenizer, run.tokens.stop_ids)
    context_ids = inputs["context_ids"].to(model.device)
    if plan.spec.budget is not None:
        apply_budget(plan.press, context_ids.shape[1], plan.spec.budget)
    cache = run.new_cache()
    prefill_press = prefill_hook(plan.press)
    with prefill_press(model) if prefill_press is not None else nullcontext(), torch.no_grad():
        model.model(input_ids=context_ids, past_key_values=cache)
    return conversation, cache, context_ids.shape[1], (text, question, max_context_length)


@dataclass
class _ConversationDiagnosis:
    """A conversation's diagnostics (evaluate/engine/diagnosis.py): its context's, with the kept set its prefill
    left; attention recall on its first turn only (a later turn's question follows the earlier turns' history)."""

    context: ContextDiagnosis
    kept: KeptSet | None
    recall: bool

    def turn(self, sample: Sample, cache: Cache, prefilled: list, masks: tuple | None, cost: Cost) -> Diagnosed:
        """One answered turn's fields: a decoding-time press's (``masks``: the keys its last compression masked, per
        layer) on what this turn's answer left of the context, each layer cut back to its length after the prefill;
        any other press's (``masks`` None) on its prefill's kept set."""
        start = time.perf_counter()
        kept = self.kept
        if masks is not None:
            keys = layer_fingerprints(cache)
            lengths = [layer.keys.shape[2] for layer in prefilled]
            cut = None if keys is None else [layer[:, :length] for layer, length in zip(keys, lengths, strict=True)]
            kept = kept_set(self.context.fingerprints, cut, masks, new_keys=True)
        diagnosed = self.context.diagnose(kept, [sample], self.recall)
        cost.retention_seconds += time.perf_counter() - start
        return diagnosed


def _diagnosis(run: PipelineRun, plan: Plan, turns: list[Sample], cache: Cache, inputs, cost: Cost):
    """The conversation's diagnostics (None under ``diagnostics=none``), their cost added to ``cost``."""
    if run.keys is None:
        return None
    start = time.perf_counter()
    text, question, max_context_length = inputs
    context = run.diagnosis(plan, turns[:1], text, [question], turns[0].answer_prefix, max_context_length)
    hidden = hidden_keys([layer.self_attn for layer in run.pipe.model.model.layers])
    kept = kept_set(context.fingerprints, layer_fingerprints(cache), hidden)
    cost.attention_recall_seconds += context.recall_seconds
    cost.retention_seconds += time.perf_counter() - start - context.recall_seconds
    return _ConversationDiagnosis(context, kept, plan.spec.diagnostics == "attention")


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
