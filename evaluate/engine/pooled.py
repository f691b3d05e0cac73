"""The pooled path: each context prefilled once, compressed at batch 1 for every point, decoded in one pool.

For presses that act only after each layer's attention (the ScorerPress family, ChunkKV, EG-ChunkKV, AdaKV, and no
press at all), the prefill forward pass does not depend on the press, the scorer or the compression ratio: a press
compresses a layer's cache after that layer has run, and later layers read hidden states, not the compressed cache.
So the prefill runs once per context with hooks that keep what each layer's compression needs (its input hidden
states, keys, values and forward arguments such as the position embeddings), and every point builds its
compressed cache from that by calling its press's own ``compress``. Prefill and compression stay at batch 1, where
they are exact; every compressed cache then joins one decoding pool (evaluate/engine/decoding.py) with every other
context's and point's, and each context's answers are recorded as soon as its last question is answered.

Contexts are prefilled ahead only while the pool has room (``decode_batch_size`` waiting rows, ``decode_memory``
bytes), so memory does not grow with the dataset.
"""

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from kvpress import BasePress
from kvpress.utils import extract_keys_and_values
from tqdm.auto import tqdm
from transformers import DynamicCache

from evaluate.benchmarks import Sample
from evaluate.engine.cost import Cost, kv_bytes, measure_kept_ratio
from evaluate.engine.decoding import DecodeRequest, DecodingPool, RowCost, hidden_keys
from evaluate.engine.likelihood import likelihood_fields, teacher_forced
from evaluate.engine.pipeline import chat_template_enabled, make_pipeline, pipeline_budget
from evaluate.run.recorder import Recorder

logger = logging.getLogger(__name__)


class PrefillCapture:
    """Hooks on every attention layer that keep the inputs each layer's compression would receive."""

    def __init__(self, layers):
        self.layers = layers
        self.captured: list[tuple] = [None] * len(layers)

    def _hook(self, module, args, kwargs, output):
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        self.captured[module.layer_idx] = (kwargs["hidden_states"], keys, values, dict(kwargs))

    def __enter__(self):
        self.handles = [layer.self_attn.register_forward_hook(self._hook, with_kwargs=True) for layer in self.layers]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def clear_masks(layers) -> None:
    for layer in layers:
        layer.self_attn.masked_key_indices = None


def compressed_cache(press: BasePress | None, layers, captured: list[tuple]) -> DynamicCache:
    """The cache a prefill under ``press`` would have left, built from the captured layer inputs."""
    cache = DynamicCache()
    for layer_idx, (layer, (hidden_states, keys, values, kwargs)) in enumerate(zip(layers, captured, strict=True)):
        # AdaKV leaves its masks on the module; a fresh prefill clears them, so must a rebuilt cache.
        layer.self_attn.masked_key_indices = None
        if press is not None:
            # Copies: some presses write into the keys they are given (ThinK zeroes pruned channels in place), and
            # the captured keys serve every other point of the sweep.
            keys, values = press.compress(layer.self_attn, hidden_states, keys.clone(), values.clone(), None, kwargs)
        cache.update(keys, values, layer_idx)
    return cache


class RandomStream:
    """A point's own random numbers, seeded as a run alone seeds them: its compressions draw what they would draw
    in that run whatever the other points of the sweep draw in between."""

    def __init__(self, seed: int, device: torch.device):
        self.devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=self.devices):
            torch.manual_seed(seed)
            self.state = self._get()

    def _get(self) -> tuple:
        return torch.get_rng_state(), *(torch.cuda.get_rng_state(device) for device in self.devices)

    @contextmanager
    def active(self):
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.state[0])
            for device, state in zip(self.devices, self.state[1:], strict=True):
                torch.cuda.set_rng_state(state, device)
            yield
            self.state = self._get()


@dataclass
class GroupAnswers:
    """One point's questions on one context: collects the pool's answers and records them, with their likelihood
    fields, once all are in."""

    point: Recorder
    group: list[Sample]
    kept_ratio: float
    context_length: int
    cost: Cost
    tokenizer: object
    progress: tqdm
    answers: list[str | None] = field(default_factory=list)
    likelihood: list[dict] = field(default_factory=list)
    pending: int = 0

    def __post_init__(self):
        self.answers = [None] * len(self.group)
        self.likelihood = self.likelihood or [{} for _ in self.group]

    def receiver(self, index: int):
        """The callback of the greedy row of question ``index``."""
        self.pending += 1

        def on_answer(tokens: list[int], row_cost: RowCost) -> None:
            self.answers[index] = str(self.tokenizer.decode(tokens, skip_special_tokens=True))
            self.cost.decode_seconds += row_cost.decode_seconds
            self.cost.forward_passes += row_cost.forward_passes
            self.cost.generated_tokens += row_cost.generated_tokens
            self._arrived()

        return on_answer

    def _arrived(self) -> None:
        self.pending -= 1
        if self.complete:
            self.record()

    def record(self) -> None:
        self.point.record(
            self.group, self.answers, self.kept_ratio, self.context_length, None, self.cost, self.likelihood
        )
        self.progress.update(len(self.group))

    @property
    def complete(self) -> bool:
        return self.pending == 0

    def fail(self, failure: Exception) -> None:
        self.point.record(self.group, *self.point.fail(self.group, failure), self.cost)
        self.progress.update(len(self.group))


@dataclass
class QuestionIds:
    """The tokenized questions of one context, as the pipeline makes them: points usually ask the same questions of
    a context, so each question list is tokenized once."""

    pipe: object
    tokenizer: object
    text: str
    answer_prefix: str
    budget: int
    chat_template: bool
    known: dict[tuple[str, ...], list] = field(default_factory=dict)

    def __call__(self, group: list[Sample], query_aware: bool) -> list:
        # Query-aware: the question is in the compressed text, and every row of the group asks "" of it (two rows
        # asking the same question of one context are one group, answered twice, as kvpress answers them).
        questions = tuple("" if query_aware else sample.question for sample in group)
        if questions not in self.known:
            with chat_template_enabled(self.tokenizer, self.chat_template):
                inputs = self.pipe.preprocess(self.text, list(questions), self.answer_prefix, self.budget)
            self.known[questions] = inputs["questions_ids"]
        return self.known[questions]


def _work_key(point: Recorder, group: list[Sample], tokenizer, max_context: int) -> tuple:
    """What a context's prefill depends on; points whose groups agree on it share one prefill."""
    plan, sample = point.plan, group[0]
    text = plan.compressed_text(sample, plan.context(sample, tokenizer, max_context))
    budget = pipeline_budget(plan, tokenizer, max_context)
    return text, sample.answer_prefix, sample.max_new_tokens, sample.chat_template, budget


def _references(
    members, model, tokenizer, full_cache: DynamicCache, question_ids: QuestionIds, context_ids: torch.Tensor
) -> tuple[dict, Cost]:
    """The uncompressed log-probabilities of each sample's reference answer (by sample id) for the points of one
    context that want the likelihood fields, from the shared prefill's cache; and each such point's share of their
    cost."""
    wanting = [(point, group) for point, group in members if point.plan.likelihood]
    references: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    passes = 0
    for point, group in wanting:
        todo = [sample for sample in group if sample.id not in references]
        if not todo:
            continue
        answers = [point.plan.answer_ids(sample, tokenizer) for sample in todo]
        asked = question_ids(todo, point.plan.cfg.query_aware)
        log_probs, made = teacher_forced(model, full_cache, (), asked, answers, context_ids.shape[1])
        references.update(zip((sample.id for sample in todo), log_probs, strict=True))
        passes += made
    if not wanting:
        return references, Cost()
    share = Cost(likelihood_seconds=(time.perf_counter() - start) / len(wanting), forward_passes=passes / len(wanting))
    return references, share


def _likelihood(
    point: Recorder, group: list[Sample], model, tokenizer, cache, hidden, ids, context_length: int, references: dict
) -> tuple[list[dict] | None, Cost]:
    """A point's likelihood fields on one context (None when it has none), against the context's references."""
    if not point.plan.likelihood:
        return None, Cost()
    start = time.perf_counter()
    answer_ids = [point.plan.answer_ids(sample, tokenizer) for sample in group]
    compressed, passes = teacher_forced(model, cache, hidden, ids, answer_ids, context_length)
    fields = [
        {} if mine is None else likelihood_fields(mine, references[sample.id], answer)
        for sample, mine, answer in zip(group, compressed, answer_ids, strict=True)
    ]
    return fields, Cost(likelihood_seconds=time.perf_counter() - start, forward_passes=passes)


def answer_pooled(
    points: list[Recorder], model, tokenizer, max_contexts: list[int], batch_size: int, memory_bytes: int
) -> None:
    """Prefill each distinct context once, compress it for every point that needs it, and decode in one pool."""
    pipe = make_pipeline(model, tokenizer, points[0].plan.device)
    language_model = model.model
    layers = language_model.layers
    for layer in layers:
        # What kvpress's press context manager sets up before compressing.
        layer.self_attn.rotary_emb = language_model.rotary_emb
    for point in points:
        if point.plan.press is not None:
            point.plan.press.post_init_from_model(model)

    work: dict[tuple, list[tuple[Recorder, list[Sample]]]] = {}
    for point, max_context in zip(points, max_contexts, strict=True):
        for group in point.plan.groups():
            work.setdefault(_work_key(point, group, tokenizer, max_context), []).append((point, group))
    # Contexts in kvpress's order (Plan.groups sorts by the compressed text), each point drawing from its own stream.
    work = dict(sorted(work.items(), key=lambda item: item[0][0]))
    streams = {id(point): RandomStream(point.plan.cfg.seed, model.device) for point in points}

    pool = DecodingPool(model, batch_size, memory_bytes)
    outstanding: list[GroupAnswers] = []
    progress = tqdm(total=sum(len(p.plan.todo) for p in points), unit="sample", desc="answering", dynamic_ncols=True)

    def step() -> None:
        try:
            pool.step()
        except Exception as failure:
            # A failed pass leaves the rows it served in an unknown state: every unanswered context fails with it.
            pool.abandon()
            for answers in outstanding:
                if not answers.complete:
                    answers.fail(failure)
            outstanding.clear()
        outstanding[:] = [answers for answers in outstanding if not answers.complete]

    try:
        for (text, answer_prefix, max_new_tokens, chat_template, budget), members in work.items():
            while not pool.has_room():
                step()
            start = time.perf_counter()
            try:
                with chat_template_enabled(tokenizer, chat_template):
                    context_ids = pipe.preprocess(text, [""], answer_prefix, budget)["context_ids"].to(model.device)
                capture = PrefillCapture(layers)
                full_cache = DynamicCache()
                with torch.no_grad(), capture:
                    language_model(input_ids=context_ids, past_key_values=full_cache)
                question_ids = QuestionIds(pipe, tokenizer, text, answer_prefix, budget, chat_template)
                references, reference_share = _references(
                    members, model, tokenizer, full_cache, question_ids, context_ids
                )
                del full_cache
            except Exception as failure:
                for point, group in members:
                    cost = Cost(prefill_seconds=(time.perf_counter() - start) / len(members))
                    point.record(group, *point.fail(group, failure), cost)
                    progress.update(len(group))
                continue
            prefill_share = (time.perf_counter() - start) / len(members)
            for point, group in members:
                while not pool.has_room():
                    step()
                point_start = time.perf_counter()
                try:
                    ids = question_ids(group, point.plan.cfg.query_aware)
                    with torch.no_grad(), streams[id(point)].active():
                        cache = compressed_cache(point.plan.press, layers, capture.captured)
                    kept_ratio = measure_kept_ratio(model, cache, context_ids.shape[1])
                    held, kept = kv_bytes(model, cache)
                    # AdaKV's masks belong to this cache alone: they travel with its rows, and leave the modules.
                    hidden = hidden_keys([layer.self_attn for layer in layers])
                    compress_seconds = time.perf_counter() - point_start
                    likelihood, likelihood_cost = _likelihood(
                        point, group, model, tokenizer, cache, hidden, ids, context_ids.shape[1], references
                    )
                except Exception as failure:
                    elapsed = time.perf_counter() - point_start
                    cost = Cost(
                        prefill_seconds=prefill_share, compress_seconds=elapsed, forward_passes=1 / len(members)
                    )
                    point.record(group, *point.fail(group, failure), cost)
                    progress.update(len(group))
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
                if point.plan.likelihood:
                    cost = cost + reference_share + likelihood_cost
                length = context_ids.shape[1]
                answers = GroupAnswers(
                    point, group, kept_ratio, length, cost, tokenizer, progress, likelihood=likelihood
                )
                outstanding.append(answers)
                if not point.plan.cfg.generate:
                    answers.record()
                    continue
                for index, question in enumerate(ids):
                    on_answer = answers.receiver(index)
                    pool.submit(DecodeRequest(cache, question, length, max_new_tokens, on_answer, hidden))
        while pool.busy():
            step()
    finally:
        progress.close()
