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
from evaluate.engine.context_budget import chat_template_enabled, make_pipeline, pipeline_budget
from evaluate.engine.conversation_inputs import conversation_of
from evaluate.engine.cost import Cost, kv_bytes, measure_kept_ratio
from evaluate.engine.decoding_compression import compression_policy, kept_after_answer
from evaluate.engine.decoding_pool import DecodingPool
from evaluate.engine.devices import cuda_devices, input_device
from evaluate.engine.diagnosis import ContextDiagnosis
from evaluate.engine.kept_sets import Diagnosed, kept_set, key_fingerprints, layer_fingerprints
from evaluate.engine.prefill import PrefillCapture, QuestionIds, RandomStream, clear_masks, compressed_cache
from evaluate.engine.requests import (
    AnsweredGroup,
    DecodeRequest,
    FinishedRow,
    GeneratedAnswer,
    Prefilled,
    RowCost,
    hidden_keys,
)
from evaluate.engine.score_memo import ScoreMemo
from evaluate.engine.teacher_forcing import forcing_pool, likelihood_fields, reference_answer_ids, teacher_forced
from evaluate.engine.turns import Conversation
from evaluate.points.budget import apply_budget
from evaluate.points.plan import Plan


@dataclass
class GroupAnswers:
    """One point's questions on one context while the pool answers them: complete once every row has arrived."""

    result: AnsweredGroup
    tokenizer: object
    pending: int = 0
    prefill_cache: DynamicCache | None = None
    diagnosis: ContextDiagnosis | None = None  # a decoding-time press's rows, measured on what each answer left
    recall: bool = False

    def arrive(
        self, index: int, answer: GeneratedAnswer, row_cost: RowCost, kept: tuple[float, int] | None = None
    ) -> None:
        """A row's answer and cost; for a row compressed while decoding, ``kept``: the kept ratio and bytes of the cache
        it left (:func:`evaluate.engine.decoding_compression.kept_after_answer`), which replace the prefill's."""
        self.result.answers[index] = str(self.tokenizer.decode(list(answer.token_ids), skip_special_tokens=True))
        if self.result.generated is None:
            self.result.generated = [None] * len(self.result.answers)
        self.result.generated[index] = answer
        cost = self.result.cost
        if kept is not None:
            self.result.kept_ratio = kept[0]
            if cost.kv_bytes_held:  # a conversation's later turns carry none: its context's bytes count once
                cost.kv_bytes_held = cost.kv_bytes_kept = kept[1]
        cost.decode_seconds += row_cost.decode_seconds
        cost.forward_passes += row_cost.forward_passes
        cost.generated_tokens += row_cost.generated_tokens
        self.pending -= 1

    def diagnose_row(self, index: int, row: FinishedRow) -> None:
        """A decoding-time press's row measured on the keys its answer's last compression left, each layer cut back
        to its length before the question, as the kept ratio counts it (``kept_after_answer``)."""
        start = time.perf_counter()
        before = [layer.keys.shape[2] for layer in self.prefill_cache.layers]
        layers = zip(row.final_keys, row.final_lengths, before, strict=True)
        kept_keys = [keys[:, : min(final, length)] for keys, final, length in layers]
        kept = kept_set(self.diagnosis.fingerprints, kept_keys, row.final_masks, new_keys=True)
        sample = self.result.group[index]
        self.result.diagnosis.replace_row(index, self.diagnosis.diagnose(kept, [sample], self.recall))
        self.result.cost.retention_seconds += time.perf_counter() - start

    def fail(self, failure: Exception) -> None:
        """A row of the group failed on its own (its press raised): the group is recorded with that failure once
        its other rows have arrived."""
        self.result.failure = self.result.failure or failure
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
    return plan.spec.query_aware, tuple(sample.id for sample in group)


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
        asked = question_ids(group, plan.spec.query_aware)
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


class PoolLoop:
    """The engine's loop over the decoding pool: submit a group's rows, then step (schedule, execute, update) until
    groups complete; each step gives back the groups it completed. A row whose own press raised fails its group
    alone (and a conversation's turns it had left), while the step's other rows go on; a pass that raised as a
    whole gives back every unanswered group with the failure (it leaves the rows it served in an unknown state)."""

    def __init__(self, pool: DecodingPool):
        self.pool = pool
        self.outstanding: list[GroupAnswers] = []

    def submit(self, answers: list[GroupAnswers], requests: list[DecodeRequest]) -> None:
        self.outstanding += answers
        for request in requests:
            self.pool.submit(request)

    def full(self) -> bool:
        """Whether the pool must step before it takes more (it has rows and no room)."""
        return self.pool.busy() and not self.pool.has_room()

    def busy(self) -> bool:
        return self.pool.busy()

    def step(self) -> list[AnsweredGroup]:
        try:
            finished = self.pool.step()
        except Exception as failure:
            self.pool.abandon()
            failed = [replace(answers.result, failure=failure) for answers in self.outstanding]
            self.outstanding.clear()
            return failed
        for row in finished:
            if row.failure is not None:
                # A conversation's turns after the failed one will never be asked: they fail with it.
                tags = [row.tag] if row.turn is None else [tag for tag in row.tag[row.turn :] if tag is not None]
                for answers, _ in tags:
                    answers.fail(row.failure)
                continue
            answers, index = row.tag if row.turn is None else row.tag[row.turn]
            kept = None
            if row.final_lengths is not None:
                kept = kept_after_answer(
                    answers.prefill_cache, row.final_lengths, row.final_masks, answers.result.context_length
                )
            answer = GeneratedAnswer.of(row.output, self.pool.stop_ids, row.compressed)
            answers.arrive(index, answer, row.cost, kept)
            if row.final_keys is not None and answers.diagnosis is not None:
                answers.diagnose_row(index, row)
        complete = [answers.result for answers in self.outstanding if answers.complete]
        self.outstanding[:] = [answers for answers in self.outstanding if not answers.complete]
        return complete


@dataclass
class PrefilledContext:
    """One context prefilled once for the points that share it: its layers' captured inputs, its question ids,
    its length, the uncompressed references its points teacher-force, and each point's share of the prefill."""

    capture: PrefillCapture
    question_ids: QuestionIds
    length: int
    references: dict[tuple, tuple[list, Cost]]
    prefill_share: float
    sharing: int
    diagnosis: ContextDiagnosis | None = None

    def cost(self, **stages: float) -> Cost:
        """A point's share of the prefill (its time and its one forward pass), with the point's own stages."""
        return Cost(
            prefill_seconds=self.prefill_share, forward_passes=1 / self.sharing, prefills=1 / self.sharing, **stages
        )

    def diagnose(self, plan: Plan, group: list[Sample], cache, hidden) -> tuple[Diagnosed | None, Cost]:
        """A point's diagnostics on its compressed ``cache`` (with AdaKV's ``hidden`` keys), and their cost with
        its share of the context's; a decoding-time press's rows are measured again on what their answers left
        (:meth:`GroupAnswers.diagnose_row`)."""
        if self.diagnosis is None or plan.spec.diagnostics == "none":
            return None, Cost()
        start = time.perf_counter()
        kept = kept_set(self.diagnosis.fingerprints, layer_fingerprints(cache), hidden)
        diagnosed = self.diagnosis.diagnose(kept, group, recall=plan.spec.diagnostics == "attention")
        own = time.perf_counter() - start
        return diagnosed, Cost(
            retention_seconds=self.diagnosis.retention_seconds / self.sharing + own,
            attention_recall_seconds=self.diagnosis.recall_seconds / self.sharing,
        )


class PoolEngine:
    """The pooled path (docs/layout.md's engine): each distinct context prefilled once, compressed at batch 1 for
    every point that needs it, and every point's questions decoded in one pool; an
    :class:`~evaluate.engine.engine.Engine`, as :class:`evaluate.engine.pipeline_engine.PipelineEngine` is."""

    def __init__(self, model, tokenizer, batch_size: int, memory_bytes: int):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.memory_bytes = batch_size, memory_bytes
        self.layers = model.model.layers

    def answer(self, plans: list[Plan], budgets: list[int]) -> Iterator[AnsweredGroup | Prefilled]:
        """Yields each point's answers on each context as they are finished (a failed context's with its failure;
        ``point`` indexes ``plans``), and after each context's prefill and compression, how many are done."""
        self._set_up(plans)
        pipe = make_pipeline(self.model, self.tokenizer, plans[0].spec.device)
        work = self._work(plans, budgets)
        streams = [RandomStream(plan.spec.seed, cuda_devices(self.model)) for plan in plans]
        loop = PoolLoop(DecodingPool(self.model, self.batch_size, self.memory_bytes))
        forcing = forcing_pool(self.model)
        for done, (key, members) in enumerate(work.items()):
            yield Prefilled(done, len(work))
            while loop.full():
                yield from loop.step()
            start = time.perf_counter()
            try:
                context = self._prefill(pipe, forcing, key, members)
            except Exception as failure:
                share = Cost(prefill_seconds=(time.perf_counter() - start) / len(members))
                yield from (_failed(point, plan.asked(group), failure, share) for point, plan, group in members)
                continue
            # Scores every point of this context shares; the first point to ask pays for them.
            scores = ScoreMemo(context.capture.captured)
            for point, plan, group in members:
                while loop.full():
                    yield from loop.step()
                yield from self._compress(loop, forcing, context, scores, streams[point], key, (point, plan, group))
        yield Prefilled(len(work), len(work))
        while loop.busy():
            yield from loop.step()

    def _set_up(self, plans: list[Plan]) -> None:
        """What kvpress's press context manager sets up before compressing, and each press's model hook."""
        for layer in self.layers:
            layer.self_attn.rotary_emb = self.model.model.rotary_emb
        for plan in plans:
            if plan.press is not None:
                plan.press.post_init_from_model(self.model)

    def _work(self, plans: list[Plan], budgets: list[int]) -> dict[tuple, list[tuple[int, Plan, list[Sample]]]]:
        """Each distinct prefill (:func:`_work_key`) with the (point, plan, group) that share it, in kvpress's order
        (Plan.groups sorts by the compressed text)."""
        work: dict[tuple, list[tuple[int, Plan, list[Sample]]]] = {}
        for point, (plan, max_context) in enumerate(zip(plans, budgets, strict=True)):
            for group in plan.groups():
                work.setdefault(_work_key(plan, group, self.tokenizer, max_context), []).append((point, plan, group))
        return dict(sorted(work.items(), key=lambda item: item[0][0]))

    def _prefill(self, pipe, forcing: DecodingPool, key: tuple, members) -> PrefilledContext:
        """The context's one prefill, its layer inputs captured, and the references its points teacher-force."""
        text, answer_prefix, _, chat_template, budget = key
        start = time.perf_counter()
        with chat_template_enabled(self.tokenizer, chat_template):
            context_ids = pipe.preprocess(text, [""], answer_prefix, budget)["context_ids"]
        context_ids = context_ids.to(input_device(self.model))
        capture = PrefillCapture(self.layers)
        full_cache = DynamicCache()
        with torch.no_grad(), capture:
            self.model.model(input_ids=context_ids, past_key_values=full_cache)
        question_ids = QuestionIds(pipe, self.tokenizer, text, answer_prefix, budget, chat_template)
        prefill_share = (time.perf_counter() - start) / len(members)
        length = context_ids.shape[1]
        # Timed apart from the prefill: each second of a run's cost is in one stage only.
        references = _references(members, forcing, self.tokenizer, full_cache, question_ids, length)
        diagnosis = self._diagnosis(capture, full_cache, question_ids, key, members)
        return PrefilledContext(capture, question_ids, length, references, prefill_share, len(members), diagnosis)

    def _diagnosis(
        self, capture: PrefillCapture, full_cache: DynamicCache, question_ids: QuestionIds, key: tuple, members: list
    ) -> ContextDiagnosis | None:
        """What the context's points share of their diagnostics (None where none wants any): its keys' fingerprints
        and prefilled text, and each question's attention mass for those under ``diagnostics=attention``."""
        wanting = [(plan, group) for _, plan, group in members if plan.spec.diagnostics != "none"]
        if not wanting:
            return None
        start = time.perf_counter()
        text, _, _, chat_template, budget = key
        fingerprints = [key_fingerprints(keys) for _, keys, _, _ in capture.captured]
        diagnosis = ContextDiagnosis.of(fingerprints, self.tokenizer, text, chat_template, budget)
        diagnosis.retention_seconds = time.perf_counter() - start
        for plan, group in wanting:
            if plan.spec.diagnostics == "attention":
                asked = group[:1] if plan.spec.turns == "multi" else group  # a conversation's later turns: its history
                answers = [reference_answer_ids(plan.benchmark, sample, self.tokenizer) for sample in asked]
                questions = question_ids(asked, plan.spec.query_aware)
                diagnosis.add_masses(self.model, full_cache, asked, questions, answers)
        return diagnosis

    def _compress(
        self, loop: PoolLoop, forcing: DecodingPool, context: PrefilledContext, scores: ScoreMemo, stream, key, member
    ) -> Iterator[AnsweredGroup]:
        """One point's cache of the context, its likelihood fields, and its questions submitted to the pool (or its
        group given back at once: failed, or generate=false)."""
        point, plan, group = member
        start = time.perf_counter()
        multi = plan.spec.turns == "multi"
        try:
            # A conversation's first turn asks as kvpress's pipeline asks; its later turns follow (turns.py).
            ids = context.question_ids(group[:1] if multi else group, plan.spec.query_aware)
            if plan.spec.budget is not None:  # this context's own ratio (decoding-time presses take no budget)
                apply_budget(plan.press, context.length, plan.spec.budget)
            with torch.no_grad(), stream.active():
                # A decoding-time press's prefill part here; its decoding part compresses each row in the pool.
                cache = compressed_cache(plan.profile.prefill, self.layers, context.capture.captured, scores)
            kept_ratio = measure_kept_ratio(self.model, cache, context.length)
            held, kept = kv_bytes(self.model, cache)
            # AdaKV's masks belong to this cache alone: they travel with its rows, and leave the modules.
            hidden = hidden_keys([layer.self_attn for layer in self.layers])
            compress_seconds = time.perf_counter() - start
            likelihood, likelihood_cost = _likelihood(
                plan, group, forcing, self.tokenizer, cache, hidden, ids, context.length, context.references
            )
            diagnosed, diagnosis_cost = context.diagnose(plan, group, cache, hidden)
        except Exception as failure:
            elapsed = time.perf_counter() - start
            yield _failed(point, plan.asked(group), failure, context.cost(compress_seconds=elapsed))
            return
        finally:
            clear_masks(self.layers)
        cost = context.cost(compress_seconds=compress_seconds, kv_bytes_held=held, kv_bytes_kept=kept)
        cost = cost + likelihood_cost + diagnosis_cost
        result = AnsweredGroup(
            point, group, [None] * len(group), kept_ratio, context.length, cost, likelihood, diagnosis=diagnosed
        )
        if not plan.spec.generate:
            yield result
            return
        yield from self._submit(loop, context, member, result, (cache, hidden, ids), key[2])

    def _submit(
        self,
        loop: PoolLoop,
        context: PrefilledContext,
        member: tuple[int, Plan, list[Sample]],
        result: AnsweredGroup,
        compressed: tuple,
        max_new_tokens: int,
    ) -> Iterator[AnsweredGroup]:
        """A point's questions on its ``compressed`` cache (with its hidden keys and question ids) submitted to the
        pool: a group's rows, or a conversation's one row (yields its turns given back at once where it cannot be
        asked)."""
        point, plan, group = member
        cache, hidden, ids = compressed
        decoding = plan.profile.decoding
        # A row compressed while decoding measures what its answer left against this cache (GroupAnswers.arrive),
        # and its diagnostics again (GroupAnswers.diagnose_row), from its keys' fingerprints as it leaves.
        prefill_cache = cache if decoding is not None else None
        row_diagnosis = context.diagnosis if decoding is not None and result.diagnosis is not None else None
        compression = compression_policy(decoding, fingerprinted=row_diagnosis is not None)
        answers = GroupAnswers(
            result, self.tokenizer, len(ids), prefill_cache, row_diagnosis, plan.spec.diagnostics == "attention"
        )
        if plan.spec.turns == "multi":
            try:
                conversation = conversation_of(plan, group, ids[0], self.tokenizer, loop.pool.stop_ids)
            except ValueError as failure:
                yield from (_failed(point, [sample], failure, Cost()) for sample in plan.asked(group))
                return
            first_turn = conversation.max_new_tokens[0]
            request = DecodeRequest(cache, ids[0], context.length, first_turn, hidden, compression=compression)
            loop.submit(*self._turns(result, conversation, request, replace(answers, pending=1)))
            return
        requests = [
            DecodeRequest(
                cache, question, context.length, max_new_tokens, hidden, tag=(answers, index), compression=compression
            )
            for index, question in enumerate(ids)
        ]
        loop.submit([answers], requests)

    def _turns(
        self, result: AnsweredGroup, conversation: Conversation, request: DecodeRequest, turn_answers: GroupAnswers
    ) -> tuple[list[GroupAnswers], list[DecodeRequest]]:
        """A conversation's row (evaluate/engine/turns.py), and each turn it answers as a group of its own, recorded
        as soon as the turn is answered; the first answered turn carries the context's cost. ``turn_answers`` is
        what each turn's group is made like (its prefill cache and diagnosis)."""
        answers, tags, cost = [], [], result.cost
        for turn, sample in enumerate(result.group):
            if conversation.recorded[turn] is not None:  # replayed from an earlier session's record
                tags.append(None)
                continue
            # The context's cost and bytes, once per conversation: on its first answered turn.
            contexts = 0 if answers else 1
            diagnosis = result.diagnosis.turn(turn) if result.diagnosis is not None else None
            group = AnsweredGroup(
                result.point,
                [sample],
                [None],
                result.kept_ratio,
                result.context_length,
                cost,
                contexts=contexts,
                diagnosis=diagnosis,
            )
            cost = Cost()
            answers.append(replace(turn_answers, result=group))
            tags.append((answers[-1], 0))
        return answers, [replace(request, tag=tags, conversation=conversation)]
