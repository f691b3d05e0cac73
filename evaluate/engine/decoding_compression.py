"""Decoding-time compression in the pool: each row compresses its own cache on its own schedule, as kvpress's
``DecodingPress`` does for that row decoded alone.

kvpress's ``DecodingPress.forward_hook`` runs after each layer's attention in every forward pass that is not the
prefill (the question pass counts as a step: all its question tokens are buffered). Per layer it buffers the
attention's input hidden states, counts steps, and once ``compression_interval`` steps have passed (or the pass has
at least ``target_size`` tokens) calls its own ``compress`` on the layer's whole cache, which sets the base press's
ratio to reach ``target_size`` (``_find_target_compression_ratio``) and calls ``base_press.compress``; then the
buffer is cleared, and it is always trimmed to its last ``hidden_states_buffer_size`` entries.

A layer's compression changes only that layer's cache, and a later layer reads hidden states, never an earlier
layer's cache, so compressing every layer after the pool's forward pass leaves what compressing each right after its
attention leaves. :class:`RowCompression` keeps one row's buffers and counters (the state kvpress keeps on the press
object, which rows of one point share here), and calls the row's press's own ``compress`` with that row's tensors
alone: its real question columns (never the left-padded joiners' padding), its keys and values in its own order, and
the forward arguments its base press reads for a batch of one (``position_embeddings`` of the pass's tokens;
``cache_position`` as transformers numbers the pass after the row's cache). The presses the pool accepts here
(``press_profile.why_not_pooled_decoding``) read no other argument; one that did would fail loudly on the missing key.

AdaKV as the base press removes nothing: its ``compress`` names the pairs it prunes on the module
(``masked_key_indices``), and kvpress's attention patch, before each later pass's attention, overwrites those keys in
the cache with a fake key built from that pass's queries (``search_hyperplane``), whose attention weight underflows to
zero. The fake keys stay in the cache, where the next compression scores them, and a position the next compression no
longer names keeps its stale fake key. The pool does the same per row: :class:`RowCompression` keeps the row's masks
per layer, and :func:`write_fake_keys` writes the fake keys into the row's slot before each decoding step's attention.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np
import torch
from kvpress import DecodingPress
from kvpress.attention_patch import search_hyperplane

from evaluate.engine.kept_sets import key_fingerprints
from evaluate.press_profile import keeps_every_key


class RowStore(Protocol):
    """What a row's compression needs of the pool's slot cache (evaluate/engine/slot_cache.py:SlotCache, which
    imports the requests, which import this module: named by what it does, not imported)."""

    host_lengths: np.ndarray

    def row(self, layer_idx: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def replace_row(self, layer_idx: int, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None: ...


class CompressionPolicy(Protocol):
    """What a row does to its own cache after each of its pool passes (``DecodeRequest.compression``):
    :class:`DecodingCompression` or :class:`NoCompression`. ``start`` gives one row's running state, which the pool
    calls after each pass (``after_pass``), reads the masks of before a decoding step (``masked``) and asks what the
    row left when it finishes (``final_state``)."""

    reads_layer_inputs: ClassVar[bool]

    def start(self, layers: int): ...

    def slot_length(self, cache_length: int, question_length: int, max_new_tokens: int) -> int: ...


def removes_pairs(press: DecodingPress, keys: torch.Tensor) -> bool:
    """Whether a compression of a layer holding ``keys`` removes (AdaKV: masks) pairs: kvpress's ratio is 0, and the
    compression a no-op, while the layer holds at most ``target_size`` pairs."""
    return keys.shape[2] > press.target_size


@contextmanager
def counting_removals(press: DecodingPress | None) -> Iterator[list[int]]:
    """While the block runs, count the compressions of ``press`` (kvpress's own, on the pipeline's path) that remove
    pairs (:func:`removes_pairs`): yields a list whose one item is the count (nothing is counted without a press)."""
    count = [0]
    if press is None:
        yield count
        return

    def compress(module, hidden_states, keys, *args, **kwargs):
        count[0] += removes_pairs(press, keys)
        return type(press).compress(press, module, hidden_states, keys, *args, **kwargs)

    press.compress = compress  # kvpress's hook calls self.compress: this object's alone is counted
    try:
        yield count
    finally:
        del press.compress


class LayerInputs:
    """Hooks on every attention module that keep a pool pass's per-layer inputs a decoding press reads: the
    attention's input hidden states and the position embeddings (references, not copies: nothing writes into them)."""

    def __init__(self, modules):
        self.modules = modules
        self.hidden: list[torch.Tensor | None] = [None] * len(modules)
        self.position_embeddings: list[tuple | None] = [None] * len(modules)
        self.handles: list = []

    def _hook(self, module, args, kwargs, output) -> None:
        self.hidden[module.layer_idx] = kwargs["hidden_states"]
        self.position_embeddings[module.layer_idx] = kwargs.get("position_embeddings")

    def __enter__(self) -> "LayerInputs":
        self.handles = [module.register_forward_hook(self._hook, with_kwargs=True) for module in self.modules]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@dataclass
class RowCompression:
    """One row's decoding-compression state: per layer, its hidden-state buffer and its steps since the last
    compression (what kvpress's ``DecodingPress`` keeps on itself for the one row it decodes), and the keys its last
    compression masked (AdaKV), as (heads, positions), which kvpress keeps on the attention module."""

    press: DecodingPress
    layers: int
    buffers: list[list[torch.Tensor]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    masked: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    compressions: int = 0
    removals: int = 0  # compressions that removed (or, AdaKV, masked) pairs: the layer held more than its target
    fingerprinted: bool = False  # its final state gives its keys' fingerprints (the diagnostics want them)

    def __post_init__(self) -> None:
        self.buffers = [[] for _ in range(self.layers)]
        self.steps = [0] * self.layers
        self.masked = [None] * self.layers

    def final_state(self, cache: RowStore, slot: int) -> tuple[tuple[int, ...], tuple, bool, tuple]:
        """What a finished row records of its compression: each layer's length as it left, the keys its last
        compression masked on each layer, whether any compression removed pairs, and, where ``fingerprinted``, the
        fingerprints of each layer's keys as it left (evaluate/engine/kept_sets.py: which context positions its
        answer's last compression kept; None otherwise)."""
        layers = range(self.layers)
        fingerprints = (
            tuple(key_fingerprints(cache.row(layer, slot)[0]) for layer in layers) if self.fingerprinted else None
        )
        return tuple(cache.host_lengths[:, slot].tolist()), tuple(self.masked), self.removals > 0, fingerprints

    def after_pass(
        self, cache: RowStore, slot: int, modules, inputs: LayerInputs, batch_index: int, query_length: int
    ) -> None:
        """What kvpress's hook does after each layer's attention in one of this row's passes: buffer the row's
        ``query_length`` real columns (the last ones of its line ``batch_index`` in the pass), count the step,
        compress the layer's cache when due, trim the buffer."""
        # transformers numbers the pass's tokens after the row's cache as its first layer held it before the pass.
        start = int(cache.host_lengths[0, slot]) - query_length
        for layer_idx, module in enumerate(modules):
            hidden = inputs.hidden[layer_idx][batch_index : batch_index + 1, -query_length:]
            self.buffers[layer_idx].append(hidden.detach().clone())
            self.steps[layer_idx] += 1
            if self.steps[layer_idx] >= self.press.compression_interval or query_length >= self.press.target_size:
                kwargs = self._kwargs(inputs.position_embeddings[layer_idx], batch_index, query_length, start)
                self._compress(cache, slot, layer_idx, module, kwargs)
            size = self.press.hidden_states_buffer_size
            self.buffers[layer_idx] = self.buffers[layer_idx][-size:] if size > 0 else []

    @staticmethod
    def _kwargs(position_embeddings, batch_index: int, query_length: int, start: int) -> dict:
        """The forward arguments kvpress's hook would have passed the press for this row alone."""
        rows = slice(batch_index, batch_index + 1)
        cos, sin = position_embeddings
        device = cos.device
        return {
            "position_embeddings": (cos[rows, -query_length:], sin[rows, -query_length:]),
            "cache_position": torch.arange(start, start + query_length, device=device),
        }

    def _compress(self, cache: RowStore, slot: int, layer_idx: int, module, kwargs: dict) -> None:
        """The layer's compression by the row's press's own ``compress`` on the row's own keys and values, the result
        written back into its slot; the layer's counter reset and its buffer cleared, as kvpress's hook does."""
        keys, values = cache.row(layer_idx, slot)
        self.removals += removes_pairs(self.press, keys)
        hidden = torch.cat(self.buffers[layer_idx], dim=1)
        # AdaKV reads and leaves its masks on the module, which rows share here: set to the row's own, read back,
        # cleared (a ratio of 0 returns early and leaves them as they were, as for a row alone).
        module.masked_key_indices = self._module_masks(layer_idx)
        try:
            compressed = self.press.compress(module, hidden, keys, values, None, kwargs)
            masked = module.masked_key_indices
        finally:
            module.masked_key_indices = None
        if masked is not None:
            self.masked[layer_idx] = (masked[1], masked[2])  # its batch indices are all 0: one row
        if compressed[0] is not keys:  # a ratio of 0 (a cache within its target) gives the same tensors back
            cache.replace_row(layer_idx, slot, *compressed)
        self.steps[layer_idx] = 0
        self.buffers[layer_idx] = []
        self.compressions += 1

    def _module_masks(self, layer_idx: int) -> tuple[torch.Tensor, ...] | None:
        """The row's masks on one layer as kvpress keeps them on the module: (batch, heads, positions)."""
        if self.masked[layer_idx] is None:
            return None
        heads, positions = self.masked[layer_idx]
        return torch.zeros_like(heads), heads, positions


def write_fake_keys(
    keys: torch.Tensor, query: torch.Tensor, masked: dict[int, tuple[torch.Tensor, torch.Tensor]]
) -> dict[int, Exception]:
    """kvpress's attention patch for the rows whose decoding press masked keys (AdaKV), on one layer of a decoding
    step, before its attention: slot ``s``'s masked (heads, positions) in ``keys`` (the layer's slot buffer) become a
    fake key per KV head, built by kvpress's ``search_hyperplane`` from ``s``'s queries of this step (``query``, one
    line per slot), that no query of its group attends. kvpress builds one row's fake keys per call; a KV head's
    search is independent of the others' (a head already found adds zero while the others search), so all rows
    search in one call. Returns the slots whose search raised (kvpress's "Could not find fake keys"), with the
    exception: their keys are left as they were, and the pool fails those rows alone after the pass."""
    slots = list(masked)
    failures = {}
    try:
        fake = _fake_keys(query, slots, keys.shape[1])
    except Exception:
        # One row's search failed: search each row alone (a KV head's search is its own, so the others' keys are
        # those the joint search gives) and hand back the rows that fail, so that theirs alone fail.
        fake = torch.zeros(len(slots), keys.shape[1], keys.shape[3], dtype=keys.dtype, device=keys.device)
        for line, slot in enumerate(slots):
            try:
                fake[line] = _fake_keys(query, [slot], keys.shape[1])[0]
            except Exception as failure:
                failures[slot] = failure
    for line, slot in enumerate(slots):
        if slot not in failures:
            head_indices, positions = masked[slot]
            keys[slot, head_indices, positions] = fake[line, head_indices]
    return failures


def _fake_keys(query: torch.Tensor, slots: list[int], kv_heads: int) -> torch.Tensor:
    """kvpress's fake key per KV head of each of ``slots`` ([slots, KV heads, head_dim]) from their ``query``."""
    rows = query[slots]
    count, heads, width, head_dim = rows.shape
    # Query heads h * groups ... h * groups + groups - 1 share KV head h, as in kvpress's view of the queries.
    grouped = rows.reshape(count, kv_heads, heads // kv_heads, width, head_dim).reshape(count * kv_heads, -1, head_dim)
    return search_hyperplane(grouped).view(count, kv_heads, head_dim)


@dataclass(frozen=True)
class DecodingCompression:
    """The compression policy of a row whose press compresses while decoding (kvpress's ``DecodingPress``): after
    each of its passes the row compresses its own cache (:class:`RowCompression`, started once per row, holds the
    state). A row carries its policy (``DecodeRequest.compression``), so the pool runs every policy the same way: a
    new one is a class with these members."""

    press: DecodingPress
    fingerprinted: bool = False  # each finished row gives its keys' fingerprints (diagnostics=retention or attention)
    reads_layer_inputs: ClassVar[bool] = True  # the pool keeps each pass's attention inputs for it (LayerInputs)

    def start(self, layers: int) -> RowCompression:
        """The policy's state for one row of ``layers`` layers, fresh for each row that runs."""
        return RowCompression(self.press, layers, fingerprinted=self.fingerprinted)

    def slot_length(self, cache_length: int, question_length: int, max_new_tokens: int) -> int:
        """Positions the row's slot needs: its longest moment, plus the spare last position padding writes to.

        A row writes its question and ``max_new_tokens - 1`` answer tokens (the last token is never fed back). Until
        its first compression, after ``compression_interval`` steps (the question pass being the first), it holds its
        cache, question and ``compression_interval - 1`` tokens; after each compression at most ``target_size``, and
        ``compression_interval`` tokens more before the next. A press that masks instead (AdaKV) holds them all.
        """
        press = self.press
        written = cache_length + question_length + max_new_tokens - 1
        if keeps_every_key(press):
            return written + 1
        before_first = cache_length + question_length + press.compression_interval - 1
        return min(written, max(before_first, press.target_size + press.compression_interval)) + 1


@dataclass(frozen=True)
class NoCompression:
    """The compression policy of a row that does not compress while decoding (every row but a decoding-time
    press's, and a teacher-forced one): it masks nothing, does nothing after a pass, and records no final state. It
    holds no state, so each row's is the policy itself."""

    masked: tuple = ()
    reads_layer_inputs: ClassVar[bool] = False

    def start(self, layers: int) -> "NoCompression":
        return self

    def slot_length(self, cache_length: int, question_length: int, max_new_tokens: int) -> int:
        """Its cache, its question, the ``max_new_tokens - 1`` answer tokens fed back and the spare last position
        padding writes to (a teacher-forced row, which generates nothing, keeps that one)."""
        return cache_length + question_length + max(max_new_tokens, 1)

    def final_state(self, cache: RowStore, slot: int) -> tuple[None, None, None, None]:
        return None, None, None, None

    def after_pass(self, *args) -> None:
        return None


def compression_policy(decoding: DecodingPress | None, fingerprinted: bool = False) -> CompressionPolicy:
    """What each row of a point does to its own cache after its passes, given its press's decoding part: compress it
    on the press's schedule (``fingerprinted``: and give its keys' fingerprints as it leaves), or nothing."""
    return NoCompression() if decoding is None else DecodingCompression(decoding, fingerprinted)


def compress_after_pass(
    cache: RowStore, modules, inputs: LayerInputs | None, served: list[tuple[int, object, int, int]]
) -> dict[int, Exception]:
    """Run each served row's compression policy after a pool pass: ``served`` lists (slot, row, line of the row in
    the pass, real query length) for the rows the pass served (a row that does not compress does nothing);
    ``inputs``, the pass's attention inputs, None unless a served row's policy reads them. Returns
    the slots whose press raised, with its exception: a row's compression touches its own slot alone, so the other
    rows go on as if the failing row had never been in the pool (its point's failure stays its own)."""
    failures = {}
    for slot, row, batch_index, query_length in served:
        try:
            row.compression.after_pass(cache, slot, modules, inputs, batch_index, query_length)
        except Exception as failure:
            failures[slot] = failure
    return failures


def kept_after_answer(cache, final_lengths: tuple[int, ...], final_masks: tuple, context_length: int):
    """The kept ratio and bytes kvpress's pipeline path records for a row compressed while decoding: it measures the
    cache the row's answer left, cut back to each layer's length before the question (``_remove_answer_from_cache``),
    so each layer counts ``min(final, before)`` pairs per KV head, less those its last compression masked there
    (AdaKV: evaluate/engine/cost.py counts the same).

    ``cache`` is the row's cache before its question (the prefill's, compressed by the press's prefill part).
    """
    kept_pairs, kept_bytes, heads = 0, 0, 0
    for layer, final, masks in zip(cache.layers, final_lengths, final_masks, strict=True):
        length = min(final, layer.keys.shape[2])
        pairs = length * layer.keys.shape[1]
        if masks is not None:
            pairs -= int((masks[1] < length).sum())
        kept_pairs += pairs
        heads += layer.keys.shape[1]
        kept_bytes += pairs * (layer.keys.shape[3] * layer.keys.element_size()) * 2
    return kept_pairs / heads / context_length, kept_bytes
