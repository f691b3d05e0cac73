"""Several configurations in one process: each model loaded once, each context prefilled once.

For presses that act only after each layer's attention (the ScorerPress family, ChunkKV, EG-ChunkKV, AdaKV,
and no press at all), the prefill forward pass does not depend on the press, the scorer or the compression
ratio: a press compresses a layer's cache after that layer has run, and later layers read hidden states, not
the compressed cache. So the prefill runs once per context with hooks that keep what each layer's
compression needs (its input hidden states, keys, values and forward arguments such as the position
embeddings), every sweep point builds its compressed cache from that by calling its press's own ``compress``,
and the questions of all points on that context are decoded together where their shapes allow
(evaluate/decoding.py), each answer the one kvpress's pipeline gives. Points that cannot share (other presses,
eager attention, a lone point) take the normal pipeline path.
"""

import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from kvpress import AdaKVPress, BasePress, ChunkKVPress, EntropyGatedChunkKVPress, ScorerPress
from kvpress.utils import extract_keys_and_values
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging as transformers_logging

from evaluate import rundir
from evaluate.benchmarks import Sample
from evaluate.config import attention_implementation
from evaluate.decoding import DecodeRequest, greedy_answers, masks_keys_in_place
from evaluate.runner import (
    Point,
    answer_with_pipeline,
    chat_template_enabled,
    load_model,
    load_tokenizer,
    make_pipeline,
    measure_kept_ratio,
    warn_if_unpatched,
)

# Presses whose whole effect is their compress() call in the post-attention hook.
POST_ATTENTION_PRESSES = (ScorerPress, ChunkKVPress, EntropyGatedChunkKVPress, AdaKVPress)


def shares_prefill(point: Point) -> bool:
    press = point.press
    if attention_implementation(point.cfg) == "eager":
        # Under eager attention presses may read the attention weights, which the shared path does not keep.
        return False
    if press is None:
        return True
    return isinstance(press, POST_ATTENTION_PRESSES) and type(press).forward_hook is BasePress.forward_hook


def _model_key(cfg: DictConfig) -> str:
    model = OmegaConf.to_container(cfg.model.source, resolve=True)
    return repr((model, cfg.device, cfg.dtype, attention_implementation(cfg), cfg.seed))


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
            keys, values = press.compress(layer.self_attn, hidden_states, keys, values, None, kwargs)
        cache.update(keys, values, layer_idx)
    return cache


@dataclass
class Pending:
    """A point's questions on one context, compressed and waiting to be decoded."""

    point: Point
    group: list[Sample]
    requests: list[DecodeRequest]
    kept_ratio: float
    context_length: int
    prefill_seconds: float
    compress_seconds: float


class DecodeBatch:
    """Collects points' questions and decodes them together once ``batch_size`` questions are waiting."""

    def __init__(self, model, tokenizer, batch_size: int, progress: tqdm):
        self.model, self.tokenizer, self.batch_size, self.progress = model, tokenizer, batch_size, progress
        self.pending: list[Pending] = []

    def add(self, pending: Pending) -> "DecodeBatch":
        self.pending.append(pending)
        if sum(len(p.requests) for p in self.pending) >= self.batch_size:
            self.flush()
        return self

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        requests = [request for p in pending for request in p.requests]
        if not requests:
            return
        start = time.perf_counter()
        try:
            answers = iter(greedy_answers(self.model, self.tokenizer, requests, self.batch_size))
            failure = None
        except Exception as error:
            failure = error
        decode_share = (time.perf_counter() - start) / len(requests)
        for p in pending:
            seconds = p.prefill_seconds + p.compress_seconds + decode_share * len(p.requests)
            if failure is None:
                outcome = [next(answers) for _ in p.requests], p.kept_ratio, p.context_length, None
            else:
                outcome = p.point.fail(p.group, failure)
            p.point.record(p.group, *outcome, p.prefill_seconds, seconds)
            self.progress.update(len(p.group))


def _group_key(point: Point, group: list[Sample], tokenizer, max_context: int) -> tuple:
    sample = group[0]
    context = point.context(sample, tokenizer, max_context)
    question = sample.question if point.cfg.query_aware else None
    budget = point.pipeline_budget(tokenizer, max_context)
    return context, question, sample.answer_prefix, sample.max_new_tokens, sample.chat_template, budget


def answer_with_shared_prefill(points: list[Point], model, tokenizer, max_contexts: list[int]) -> None:
    """Prefill each distinct context once and answer it for every point that needs it."""
    pipe = make_pipeline(model, tokenizer, points[0].device)
    language_model = model.model
    layers = language_model.layers
    for layer in layers:
        # What kvpress's press context manager sets up before compressing.
        layer.self_attn.rotary_emb = language_model.rotary_emb
    for point in points:
        if point.press is not None:
            point.press.post_init_from_model(model)

    work: dict[tuple, list[tuple[Point, list[Sample]]]] = {}
    for point, max_context in zip(points, max_contexts, strict=True):
        for group in point.groups():
            work.setdefault(_group_key(point, group, tokenizer, max_context), []).append((point, group))

    batch_size = min(point.cfg.decode_batch_size for point in points)
    progress = tqdm(total=sum(len(p.todo) for p in points), unit="sample", desc="sweep", dynamic_ncols=True)
    try:
        for (context, question, answer_prefix, max_new_tokens, chat_template, budget), members in work.items():
            press_text = context + question if question is not None else context
            start = time.perf_counter()
            try:
                with chat_template_enabled(tokenizer, chat_template):
                    context_ids = pipe.preprocess(press_text, [""], answer_prefix, budget)["context_ids"].to(
                        model.device
                    )
                capture = PrefillCapture(layers)
                with torch.no_grad(), capture:
                    language_model(input_ids=context_ids, past_key_values=DynamicCache())
            except Exception as failure:
                for point, group in members:
                    point.record(group, *point.fail(group, failure), 0.0, time.perf_counter() - start)
                    progress.update(len(group))
                continue
            shared_prefill = (time.perf_counter() - start) / len(members)
            # Points usually ask the same questions of a context: tokenize each question list once.
            question_ids_for: dict[tuple[str, ...], list] = {}
            batch = DecodeBatch(model, tokenizer, batch_size, progress)
            for point, group in members:
                point_start = time.perf_counter()
                try:
                    questions = ("",) if question is not None else tuple(sample.question for sample in group)
                    if questions not in question_ids_for:
                        with chat_template_enabled(tokenizer, chat_template):
                            question_ids_for[questions] = pipe.preprocess(
                                press_text, list(questions), answer_prefix, budget
                            )["questions_ids"]
                    with torch.no_grad():
                        cache = compressed_cache(point.press, layers, capture.captured)
                        kept_ratio = measure_kept_ratio(model, cache, context_ids.shape[1])
                    requests = [
                        DecodeRequest(cache, ids, context_ids.shape[1], max_new_tokens)
                        for ids in question_ids_for[questions]
                    ]
                except Exception as failure:
                    # A compression that failed part-way may have left masks on some layers.
                    clear_masks(layers)
                    elapsed = time.perf_counter() - point_start
                    point.record(group, *point.fail(group, failure), shared_prefill, shared_prefill + elapsed)
                    progress.update(len(group))
                    continue
                compress_seconds = time.perf_counter() - point_start
                pending = Pending(
                    point, group, requests, kept_ratio, context_ids.shape[1], shared_prefill, compress_seconds
                )
                if masks_keys_in_place([layer.self_attn for layer in layers]):
                    # The masks on the attention modules belong to this point's cache alone: decode it now, and
                    # clear them so that they cannot reach the questions decoded later.
                    DecodeBatch(model, tokenizer, 1, progress).add(pending)
                    clear_masks(layers)
                else:
                    batch.add(pending)
            batch.flush()
    finally:
        progress.close()


def run_sweep(cfgs: Sequence[DictConfig]) -> list[dict]:
    """Run (or resume) every configuration; return their metrics in order.

    All configurations are checked before anything loads. Points on the same model share one model load;
    among those, the ones whose press acts only after attention share each context's prefill.
    """
    started = time.perf_counter()
    transformers_logging.disable_progress_bar()
    points = [Point(cfg) for cfg in cfgs]
    directories = [point.out for point in points]
    duplicates = {str(path) for path in directories if directories.count(path) > 1}
    if duplicates:
        raise ValueError(f"the sweep runs the same configuration twice: {', '.join(sorted(duplicates))}")
    by_model: dict[str, list[Point]] = {}
    for point in points:
        by_model.setdefault(_model_key(point.cfg), []).append(point)
    with ExitStack() as held:
        for point in points:
            held.enter_context(rundir.locked(point.out))
        for members in by_model.values():
            _run_on_one_model(members, started)
        return [point.close() for point in points]


def _run_on_one_model(points: list[Point], started: float) -> None:
    first = points[0]
    tokenizer = load_tokenizer(first.source)
    for point in points:
        point.open(tokenizer, started)
    pending = [point for point in points if point.todo]
    if not pending:
        return
    torch.manual_seed(first.cfg.seed)
    model = load_model(first.source, first.device, first.cfg.dtype, attention_implementation(first.cfg))
    warn_if_unpatched(model)
    max_contexts = {id(point): point.max_context(model, tokenizer) for point in pending}
    shared = [point for point in pending if shares_prefill(point)]
    if len(shared) < 2:
        shared = []
    try:
        for point in pending:
            if point not in shared:
                answer_with_pipeline(point, model, tokenizer, max_contexts[id(point)])
        if shared:
            answer_with_shared_prefill(shared, model, tokenizer, [max_contexts[id(point)] for point in shared])
    except BaseException:
        for point in pending:
            point.interrupted()
        raise
