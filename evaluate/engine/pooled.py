"""The pooled path: each context prefilled once, compressed at batch 1 for every point, decoded in one pool.

Prefill and compression stay at batch 1, where they are exact (evaluate/engine/prefill.py); every compressed cache
then joins one decoding pool (evaluate/engine/decoding_pool.py) with every other context's and point's, and each point's
answers on a context are given back as soon as its last question is answered.

Contexts are prefilled ahead only while the pool has room (``decode_batch_size`` waiting rows, ``decode_memory``
bytes), so memory does not grow with the dataset.
"""

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache

from evaluate.benchmarks import Sample
from evaluate.engine.cost import Cost, kv_bytes, measure_kept_ratio
from evaluate.engine.decoding_pool import DecodingPool
from evaluate.engine.devices import cuda_devices, input_device
from evaluate.engine.pipeline import chat_template_enabled, make_pipeline, pipeline_budget
from evaluate.engine.prefill import PrefillCapture, QuestionIds, RandomStream, clear_masks, compressed_cache
from evaluate.engine.requests import AnsweredGroup, DecodeRequest, Prefilled, RowCost, hidden_keys
from evaluate.engine.score_memo import ScoreMemo
from evaluate.engine.teacher_forcing import forcing_pool, likelihood_fields, reference_answer_ids, teacher_forced
from evaluate.points.plan import Plan


@dataclass
class GroupAnswers:
    """One point's questions on one context while the pool answers them: complete once every row has arrived."""

    result: AnsweredGroup
    tokenizer: object
    pending: int = 0

    def arrive(self, index: int, tokens: list[int], row_cost: RowCost) -> None:
        self.result.answers[index] = str(self.tokenizer.decode(tokens, skip_special_tokens=True))
        cost = self.result.cost
        cost.decode_seconds += row_cost.decode_seconds
        cost.forward_passes += row_cost.forward_passes
        cost.generated_tokens += row_cost.generated_tokens
        self.pending -= 1

    @property
    def complete(self) -> bool:
        return self.pending == 0


def _work_key(plan: Plan, group: list[Sample], tokenizer, max_context: int) -> tuple:
    """What a context's prefill depends on; points whose groups agree on it share one prefill."""
    sample = group[0]
    text = plan.compressed_text(sample, plan.context(sample, tokenizer, max_context))
    budget = pipeline_budget(plan, tokenizer, max_context)
    return text, sample.answer_prefix, sample.max_new_tokens, sample.chat_template, budget


def _reference_key(plan: Plan, group: list[Sample]) -> tuple:
    """What a group's uncompressed log-probabilities depend on, beside its context: its questions and answers."""
    return plan.cfg.query_aware, tuple(sample.id for sample in group)


def _references(
    members, pool: DecodingPool, tokenizer, full_cache: DynamicCache, question_ids: QuestionIds, context_length: int
) -> dict[tuple, tuple[list, Cost]]:
    """The uncompressed log-probabilities of the reference answers of each distinct group (:func:`_reference_key`)
    that the context's points teacher-force, from the shared prefill's cache, with each such point's share of their
    cost.

    Per group, not per sample: a group's rows share one pass (:func:`teacher_forced`), and a point run alone
    teacher-forces its own group, so every point must get the log-probabilities of its own group's pass."""
    wanting = [_reference_key(plan, group) for _, plan, group in members if plan.likelihood]
    references = {}
    for _, plan, group in members:
        key = _reference_key(plan, group)
        if not plan.likelihood or key in references:
            continue
        start = time.perf_counter()
        answers = [reference_answer_ids(plan.benchmark, sample, tokenizer) for sample in group]
        asked = question_ids(group, plan.cfg.query_aware)
        log_probs, passes = teacher_forced(pool, full_cache, (), asked, answers, context_length)
        sharing = wanting.count(key)
        share = Cost(likelihood_seconds=(time.perf_counter() - start) / sharing, forward_passes=passes / sharing)
        references[key] = log_probs, share
    return references


def _likelihood(
    plan: Plan, group: list[Sample], pool: DecodingPool, tokenizer, cache, hidden, ids, context_length, references
) -> tuple[list[dict] | None, Cost]:
    """A point's likelihood fields on one context (None when it has none), against its group's references; the
    cost is its teacher-forced pass and its share of the references'."""
    if not plan.likelihood:
        return None, Cost()
    start = time.perf_counter()
    answer_ids = [reference_answer_ids(plan.benchmark, sample, tokenizer) for sample in group]
    compressed, passes = teacher_forced(pool, cache, hidden, ids, answer_ids, context_length)
    uncompressed, reference_share = references[_reference_key(plan, group)]
    fields = [
        {} if mine is None else likelihood_fields(mine, theirs, answer)
        for mine, theirs, answer in zip(compressed, uncompressed, answer_ids, strict=True)
    ]
    return fields, reference_share + Cost(likelihood_seconds=time.perf_counter() - start, forward_passes=passes)


def _failed(point: int, group: list[Sample], failure: Exception, cost: Cost) -> AnsweredGroup:
    return AnsweredGroup(point, group, [None] * len(group), None, None, cost, failure=failure)


def answer_pooled(
    plans: list[Plan], model, tokenizer, max_contexts: list[int], batch_size: int, memory_bytes: int
) -> Iterator[AnsweredGroup | Prefilled]:
    """Prefill each distinct context once, compress it for every point that needs it, and decode in one pool;
    yields each point's answers on each context as they are finished (a failed context's with its failure), and
    after each context's prefill and compression, how many are done."""
    pipe = make_pipeline(model, tokenizer, plans[0].spec.device)
    ids_device = input_device(model)
    language_model = model.model
    layers = language_model.layers
    for layer in layers:
        # What kvpress's press context manager sets up before compressing.
        layer.self_attn.rotary_emb = language_model.rotary_emb
    for plan in plans:
        if plan.press is not None:
            plan.press.post_init_from_model(model)

    work: dict[tuple, list[tuple[int, Plan, list[Sample]]]] = {}
    for point, (plan, max_context) in enumerate(zip(plans, max_contexts, strict=True)):
        for group in plan.groups():
            work.setdefault(_work_key(plan, group, tokenizer, max_context), []).append((point, plan, group))
    # Contexts in kvpress's order (Plan.groups sorts by the compressed text), each point drawing from its own stream.
    work = dict(sorted(work.items(), key=lambda item: item[0][0]))
    streams = [RandomStream(plan.cfg.seed, cuda_devices(model)) for plan in plans]

    pool = DecodingPool(model, batch_size, memory_bytes)
    forcing = forcing_pool(model)
    outstanding: list[GroupAnswers] = []

    def step() -> list[AnsweredGroup]:
        """One pool step; the groups it completed, or, when the pass failed, every unanswered group with the
        failure (a failed pass leaves the rows it served in an unknown state)."""
        try:
            finished = pool.step()
        except Exception as failure:
            pool.abandon()
            failed = [replace(answers.result, failure=failure) for answers in outstanding]
            outstanding.clear()
            return failed
        for row in finished:
            answers, index = row.tag
            answers.arrive(index, row.output, row.cost)
        complete = [answers.result for answers in outstanding if answers.complete]
        outstanding[:] = [answers for answers in outstanding if not answers.complete]
        return complete

    for done, ((text, answer_prefix, max_new_tokens, chat_template, budget), members) in enumerate(work.items()):
        yield Prefilled(done, len(work))
        while pool.busy() and not pool.has_room():
            yield from step()
        start = time.perf_counter()
        try:
            with chat_template_enabled(tokenizer, chat_template):
                context_ids = pipe.preprocess(text, [""], answer_prefix, budget)["context_ids"].to(ids_device)
            capture = PrefillCapture(layers)
            full_cache = DynamicCache()
            with torch.no_grad(), capture:
                language_model(input_ids=context_ids, past_key_values=full_cache)
            question_ids = QuestionIds(pipe, tokenizer, text, answer_prefix, budget, chat_template)
            prefill_share = (time.perf_counter() - start) / len(members)
            length = context_ids.shape[1]
            # Timed apart from the prefill: each second of a run's cost is in one stage only.
            references = _references(members, forcing, tokenizer, full_cache, question_ids, length)
            del full_cache
        except Exception as failure:
            for point, _, group in members:
                yield _failed(point, group, failure, Cost(prefill_seconds=(time.perf_counter() - start) / len(members)))
            continue
        # Scores every point of this context shares; the first point to ask pays for them.
        scores = ScoreMemo(capture.captured)
        for point, plan, group in members:
            while pool.busy() and not pool.has_room():
                yield from step()
            point_start = time.perf_counter()
            try:
                ids = question_ids(group, plan.cfg.query_aware)
                with torch.no_grad(), streams[point].active():
                    cache = compressed_cache(plan.press, layers, capture.captured, scores)
                kept_ratio = measure_kept_ratio(model, cache, length)
                held, kept = kv_bytes(model, cache)
                # AdaKV's masks belong to this cache alone: they travel with its rows, and leave the modules.
                hidden = hidden_keys([layer.self_attn for layer in layers])
                compress_seconds = time.perf_counter() - point_start
                likelihood, likelihood_cost = _likelihood(
                    plan, group, forcing, tokenizer, cache, hidden, ids, length, references
                )
            except Exception as failure:
                elapsed = time.perf_counter() - point_start
                cost = Cost(prefill_seconds=prefill_share, compress_seconds=elapsed, forward_passes=1 / len(members))
                yield _failed(point, group, failure, cost)
                continue
            finally:
                clear_masks(layers)
            cost = Cost(
                prefill_seconds=prefill_share,
                compress_seconds=compress_seconds,
                forward_passes=1 / len(members),
                kv_bytes_held=held,
                kv_bytes_kept=kept,
            )
            cost = cost + likelihood_cost
            result = AnsweredGroup(point, group, [None] * len(group), kept_ratio, length, cost, likelihood)
            if not plan.cfg.generate:
                yield result
                continue
            answers = GroupAnswers(result, tokenizer, pending=len(ids))
            outstanding.append(answers)
            for index, question in enumerate(ids):
                pool.submit(DecodeRequest(cache, question, length, max_new_tokens, hidden, tag=(answers, index)))
    yield Prefilled(len(work), len(work))
    while pool.busy():
        yield from step()
