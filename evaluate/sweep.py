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

import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from hydra.utils import instantiate
from kvpress import BasePress
from kvpress.utils import extract_keys_and_values
from omegaconf import DictConfig
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging as transformers_logging

from evaluate import rundir
from evaluate.benchmarks import Sample
from evaluate.config import described_press, model_key, run_dir, validate
from evaluate.decoding import DecodeRequest, greedy_answers, masks_keys_in_place
from evaluate.plan import Plan, make_plan
from evaluate.press_traits import changes_the_model, prepare_model, why_not_shared_prefill
from evaluate.recorder import Recorder
from evaluate.runner import (
    Models,
    answer_with_pipeline,
    chat_template_enabled,
    context_budget,
    make_pipeline,
    measure_kept_ratio,
    pipeline_budget,
    warn_if_unpatched,
)

logger = logging.getLogger(__name__)


def shares_prefill(plan: Plan) -> bool:
    reason = why_not_shared_prefill(plan.press, plan.attention)
    if reason is not None:
        logger.info("%s takes kvpress's pipeline path: %s", plan.out.name, reason)
    return reason is None


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


@dataclass
class Pending:
    """A point's questions on one context, compressed and waiting to be decoded."""

    point: Recorder
    group: list[Sample]
    requests: list[DecodeRequest]
    kept_ratio: float
    context_length: int
    prefill_seconds: float
    compress_seconds: float


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


def _group_key(plan: Plan, group: list[Sample], tokenizer, max_context: int) -> tuple:
    sample = group[0]
    context = plan.context(sample, tokenizer, max_context)
    question = sample.question if plan.cfg.query_aware else None
    budget = pipeline_budget(plan, tokenizer, max_context)
    return context, question, sample.answer_prefix, sample.max_new_tokens, sample.chat_template, budget


def answer_with_shared_prefill(points: list[Recorder], model, tokenizer, max_contexts: list[int]) -> None:
    """Prefill each distinct context once and answer it for every point that needs it."""
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
            work.setdefault(_group_key(point.plan, group, tokenizer, max_context), []).append((point, group))
    # Contexts in kvpress's order (plan.groups), each point drawing from its own stream.
    work = dict(sorted(work.items(), key=lambda item: item[0][0] + (item[0][1] or "")))
    streams = {id(point): RandomStream(point.plan.cfg.seed, model.device) for point in points}

    batch_size = min(point.plan.cfg.decode_batch_size for point in points)
    progress = tqdm(total=sum(len(p.plan.todo) for p in points), unit="sample", desc="sweep", dynamic_ncols=True)
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
                    with torch.no_grad(), streams[id(point)].active():
                        cache = compressed_cache(point.plan.press, layers, capture.captured)
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


def run_sweep(cfgs: Sequence[DictConfig], single: bool = False) -> list[dict | None]:
    """Run (or resume) every configuration; return their metrics in order (None for a point left to another).

    Every configuration is checked before anything loads. A point whose run directory another process holds is
    left to it (or waited for, with ``wait_for_locks=true``) and listed at the end; a ``single`` run refuses it.
    Points on the same model share one model load; among those, the ones whose press acts only after attention
    share each context's prefill.
    """
    started = time.perf_counter()
    # Our own bars track the runs; per-tensor loading bars would bury them.
    transformers_logging.disable_progress_bar()
    for cfg in cfgs:
        validate(cfg)
    directories = [run_dir(cfg) for cfg in cfgs]
    duplicates = {str(path) for path in directories if directories.count(path) > 1}
    if duplicates:
        raise ValueError(f"the sweep runs the same configuration twice: {', '.join(sorted(duplicates))}")
    models = Models()
    metrics: dict[int, dict] = {}
    skipped: list[str] = []
    with ExitStack() as held:
        by_model: dict[str, list[int]] = {}
        for index, (cfg, out) in enumerate(zip(cfgs, directories, strict=True)):
            try:
                held.enter_context(rundir.locked(out, wait=cfg.wait_for_locks))
            except rundir.RunLocked as locked:
                if single:
                    raise
                skipped.append(f"{out} (held by {locked.holder})")
                continue
            by_model.setdefault(model_key(cfg), []).append(index)
        for indices in by_model.values():
            recorders = _run_on_one_model([cfgs[index] for index in indices], models, started)
            metrics.update(zip(indices, (recorder.close() for recorder in recorders), strict=True))
    if skipped:
        print(f"{len(skipped)} of {len(cfgs)} points were left to the processes holding them; rerun to resume them:")
        print("\n".join(f"  {point}" for point in skipped))
    return [metrics.get(index) for index in range(len(cfgs))]


def run(cfg: DictConfig) -> dict:
    """Run (or resume) one configuration: the sweep of one point, which takes kvpress's pipeline path."""
    return run_sweep([cfg], single=True)[0]


def _run_on_one_model(cfgs: list[DictConfig], models: Models, started: float) -> list[Recorder]:
    if any(changes_the_model(described_press(cfg)) for cfg in cfgs):
        models = Models()  # its own model and tokenizer, changed for this configuration alone (config.model_key)
    tokenizer = models.tokenizer(instantiate(cfgs[0].model.source))
    recorders = [Recorder(make_plan(cfg, tokenizer)) for cfg in cfgs]
    for recorder in recorders:
        recorder.start(started)
    pending = [recorder for recorder in recorders if recorder.plan.todo]
    if not pending:
        return recorders
    torch.manual_seed(cfgs[0].seed)
    model = models.model(pending[0].plan)
    warn_if_unpatched(model)
    for recorder in pending:
        prepare_model(recorder.plan.press, model, tokenizer, recorder.plan.cfg.seed)
    budgets = []
    for recorder in pending:
        budget, truncated = context_budget(recorder.plan, model, tokenizer)
        recorder.note_truncated(truncated)
        budgets.append(budget)
    shared = [recorder for recorder in pending if shares_prefill(recorder.plan)]
    if len(shared) < 2:
        shared = []
    try:
        for recorder, budget in zip(pending, budgets, strict=True):
            if recorder not in shared:
                answer_with_pipeline(recorder, model, tokenizer, budget)
        if shared:
            answer_with_shared_prefill(shared, model, tokenizer, [budgets[pending.index(r)] for r in shared])
    except BaseException:
        for recorder in pending:
            recorder.interrupted()
        raise
    return recorders
