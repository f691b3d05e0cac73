"""A context's prefill at batch 1, kept for every point: the inputs each layer's compression receives, the compressed
cache a point's press builds from them, and each point's own random stream.

For presses that act only after each layer's attention (the ScorerPress family, ChunkKV, EG-ChunkKV, AdaKV, and no
press at all), the prefill forward pass does not depend on the press, the scorer or the compression ratio: a press
compresses a layer's cache after that layer has run, and later layers read hidden states, not the compressed cache.
So the prefill runs once per context with hooks that keep what each layer's compression needs (its input hidden
states, keys, values and forward arguments such as the position embeddings), and every point builds its compressed
cache from that by calling its press's own ``compress`` (or its exact stand-in), the work no point changes (inner
scores) done once per context.
"""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from kvpress import BasePress
from kvpress.utils import extract_keys_and_values
from transformers import DynamicCache

from evaluate.benchmarks import Sample
from evaluate.engine.context_budget import chat_template_enabled
from evaluate.engine.devices import onloaded
from evaluate.engine.exact_compress import compress
from evaluate.engine.score_memo import ScoreMemo
from evaluate.press_profile import members, traits


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


def needs_copy(press: BasePress | None) -> bool:
    """Whether ``press`` must compress copies of the captured keys and values, which serve every other point:
    unless it and every press it holds are known to write into nothing they are given (their ``read_only`` trait)."""
    return not all(traits(type(member)).read_only for member in members(press))


def compressed_cache(
    press: BasePress | None, layers, captured: list[tuple], scores: ScoreMemo | None = None
) -> DynamicCache:
    """The cache a prefill under ``press`` would have left, built from the captured layer inputs.

    Each layer is compressed by the press's own ``compress`` or its exact stand-in (evaluate/engine/exact_compress.py),
    on the captured tensors themselves unless the press needs copies (:func:`needs_copy`); with ``scores``, the
    context's memo, shared scorers compute their scores once for every point (evaluate/engine/score_memo.py). Each
    layer is compressed on its own device (the captured tensors are there), its offloaded weights brought for it.
    """
    cache = DynamicCache()
    copy = needs_copy(press)
    with scores.sharing(press) if scores is not None else nullcontext():
        for layer_idx, (layer, (hidden_states, keys, values, kwargs)) in enumerate(zip(layers, captured, strict=True)):
            # AdaKV leaves its masks on the module; a fresh prefill clears them, so must a rebuilt cache.
            layer.self_attn.masked_key_indices = None
            if press is not None:
                if copy:
                    keys, values = keys.clone(), values.clone()
                with onloaded(layer):  # presses that read the layer's projections need its weights
                    keys, values = compress(press, layer.self_attn, hidden_states, keys, values, kwargs)
            cache.update(keys, values, layer_idx)
    return cache


class RandomStream:
    """A point's own random numbers, seeded as a run alone seeds them: its compressions draw what they would draw
    in that run whatever the other points of the sweep draw in between; on every CUDA device of ``devices`` (a
    model spread over several GPUs compresses each layer on its own)."""

    def __init__(self, seed: int, devices: list[torch.device]):
        self.devices = [device for device in devices if device.type == "cuda"]
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
