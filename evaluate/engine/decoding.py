"""One decoding pool: the greedy answer of every compressed cache of a run or sweep, many rows per forward pass.

kvpress's pipeline answers one question at a time: it runs the question on the compressed cache, then decodes
token by token until an end-of-sequence token or ``max_new_tokens``. On a GPU a decoding step costs about the same
for one row as for dozens, so the pool keeps the prefill and the compression at batch 1 (where they are exact) and
batches everything after them:

- every compressed cache, of any context, sweep point or ratio, joins one queue (:meth:`DecodingPool.submit`);
- up to ``batch_size`` rows decode together, one forward pass per step; a row that stops leaves at once and a
  waiting row takes its slot (continuous batching), so no row waits on another's longer answer;
- rows differ in cache length, in each layer's length (kvpress's ChunkKV, pyramidkv, kvcompose), in question
  length and in positions. Each slot holds its row's keys left-aligned in a preallocated buffer that new tokens are
  written into in place (transformers' ``DynamicCache`` copies the whole cache at every step), and a boolean mask
  per layer, slot and KV head says which keys the row attends: its own kept keys, minus those AdaKV masks, plus its
  question and answer so far. Each row therefore attends exactly the keys one-by-one decoding attends;
- joiners run their questions as one forward pass of their own (left-padded, so that every row's last question
  token is the last column), then decode with the others.

The attention of a pool step is a function registered with transformers' ``AttentionInterface``: on CUDA
``scaled_dot_product_attention`` with the mask, on the CPU a grouped-query matrix product that does not repeat the
KV heads (measured 3.9 ms against sdpa's 6.8 ms for 32 rows over 1,100 keys; sdpa without ``enable_gqa`` copies
every key three times and took 76 ms). Only the rounding of the batched matrix products can differ from one-by-one
decoding, so a row's greedy tokens are the pipeline's unless two candidates tie to within that rounding
(tests/test_decoding.py, tests/test_kvpress_equivalence.py).
"""

import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
from torch.nn import functional
from transformers import AttentionInterface, DynamicCache

POOL_ATTENTION = "pressbench_pool"


@dataclass
class RowCost:
    """One row's share of the pool's work: each forward pass's time and count split over the rows it served."""

    decode_seconds: float = 0.0
    forward_passes: float = 0.0
    generated_tokens: int = 0


@dataclass
class DecodeRequest:
    """One question to answer greedily from ``cache``, which the pool only reads.

    ``context_length`` is the uncompressed context's length: the question's positions follow it, as in kvpress's
    pipeline, whatever the press removed. ``hidden`` holds, per layer, the (head, position) pairs AdaKV masks in
    the cache (None where nothing is masked). ``on_answer`` receives the greedy tokens and the row's cost.

    With ``answer_ids`` the row is teacher-forced instead (evaluate/engine/likelihood.py): the answer follows the question
    in the row's one forward pass, and ``on_answer`` receives the float32 log-probabilities ([answer tokens,
    vocabulary]) of the tokens at the answer's positions; the row then leaves, having generated nothing.
    """

    cache: DynamicCache
    question_ids: torch.Tensor
    context_length: int
    max_new_tokens: int
    on_answer: Callable[[list[int], RowCost], None]
    hidden: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...] = ()
    answer_ids: torch.Tensor | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        """The row's first forward pass: its question, then the teacher-forced answer if any."""
        if self.answer_ids is None:
            return self.question_ids
        return torch.cat([self.question_ids, self.answer_ids.to(self.question_ids.device)], dim=-1)

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers)

    def slot_length(self) -> int:
        """Positions a slot needs for this row: its longest layer, its question and its whole answer."""
        # A teacher-forced row generates nothing, but keeps one spare position: the slot's last one, which padding
        # columns write into (SlotCache.update).
        answer = self.max_new_tokens if self.answer_ids is None else 1
        return max(layer.keys.shape[2] for layer in self.cache.layers) + self.input_ids.shape[1] + answer


def hidden_keys(attention_modules) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]:
    """The keys the last compression masked on each attention module (AdaKV does), as (heads, positions) of row 0.

    kvpress hides them from every query with a fake key whose attention weight underflows to zero; the pool hides
    them with its mask, which gives the same weights.
    """
    hidden = []
    for module in attention_modules:
        masked = getattr(module, "masked_key_indices", None)
        if masked is None:
            hidden.append(None)
            continue
        batch, heads, positions = masked
        hidden.append((heads[batch == 0], positions[batch == 0]))
    return tuple(hidden)


def stop_token_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def _finished(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    # The pipeline never tests its first token (the question's own output) against the stop tokens.
    return len(tokens) >= max_new_tokens or (len(tokens) > 1 and tokens[-1] in stop_ids)


class SlotCache:
    """Preallocated keys and values of ``slots`` rows, left-aligned, with each row's length per layer.

    It stands in for transformers' cache during a pool forward pass: ``update`` writes the step's new keys at each
    row's own positions, in place, and leaves the attention mask of that layer in ``masks`` for
    :func:`pool_attention`.
    """

    def __init__(self, model, slots: int, capacity: int):
        config = model.config
        layers = config.num_hidden_layers
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        options = {"dtype": model.dtype, "device": model.device}
        self.slots, self.capacity = slots, capacity
        self.keys = [torch.zeros(slots, heads, capacity, head_dim, **options) for _ in range(layers)]
        self.values = [torch.zeros(slots, heads, capacity, head_dim, **options) for _ in range(layers)]
        self.visible = [
            torch.zeros(slots, heads, capacity, dtype=torch.bool, device=model.device) for _ in range(layers)
        ]
        self.lengths = torch.zeros(layers, slots, dtype=torch.long, device=model.device)
        self.masks: list[torch.Tensor | None] = [None] * layers

    @property
    def nbytes(self) -> int:
        return sum(keys.nbytes + values.nbytes for keys, values in zip(self.keys, self.values, strict=True))

    def load(self, slot: int, request: DecodeRequest) -> None:
        """Copy a request's compressed cache into ``slot``, visible except for the keys AdaKV masked."""
        hidden = request.hidden or (None,) * len(self.keys)
        for layer_idx, (layer, masked) in enumerate(zip(request.cache.layers, hidden, strict=True)):
            length = layer.keys.shape[2]
            self.keys[layer_idx][slot, :, :length] = layer.keys[0]
            self.values[layer_idx][slot, :, :length] = layer.values[0]
            visible = self.visible[layer_idx][slot]
            visible.fill_(False)
            visible[:, :length] = True
            if masked is not None:
                visible[masked] = False
            self.lengths[layer_idx, slot] = length

    def free(self, slot: int) -> None:
        """An empty slot still decodes (its output is discarded) and must see one key to keep its softmax finite."""
        for visible in self.visible:
            visible[slot].fill_(False)
            visible[slot, :, 0] = True
        self.lengths[:, slot] = 0

    def copy_from(self, other: "SlotCache", slots: list[int]) -> None:
        """Take ``other``'s rows ``slots`` into this cache's first slots (to grow or compact the pool)."""
        index = torch.tensor(slots, device=self.lengths.device)
        rows = len(slots)
        width = min(self.capacity, other.capacity)
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values), (self.visible, other.visible)):
            for layer_idx, tensor in enumerate(theirs):
                mine[layer_idx][:rows, :, :width] = tensor[index, :, :width]
        self.lengths[:, :rows] = other.lengths[:, index]
        for slot in range(rows, self.slots):
            self.free(slot)

    @contextmanager
    def forward(self, rows: torch.Tensor | None, query_lengths: torch.Tensor, width: int) -> Iterator[None]:
        """Set up one forward pass over slots ``rows`` (None: every slot), each with ``query_lengths`` real tokens
        right-aligned in ``width`` columns (a slot with 0 real tokens is idle)."""
        self.rows, self.query_lengths, self.width = rows, query_lengths, width
        starts = self.lengths if rows is None else self.lengths[:, rows]
        # One host transfer per pass for every layer's attention width.
        self.ends = (starts + query_lengths).amax(dim=1).clamp(min=1).tolist()
        try:
            yield
        finally:
            self.masks = [None] * len(self.keys)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs: dict | None = None):
        rows = torch.arange(self.slots, device=key_states.device) if self.rows is None else self.rows
        starts = self.lengths[layer_idx, rows]
        pad = self.width - self.query_lengths
        columns = torch.arange(self.width, device=key_states.device)
        # Column i of row r is its question token i - pad[r], written at start + i - pad[r]; padding columns write
        # into the slot's last position, which no real token reaches before the row's answer is complete.
        offsets = columns[None, :] - pad[:, None]
        real = offsets >= 0
        positions = torch.where(real, starts[:, None] + offsets, self.capacity - 1)
        self.keys[layer_idx][rows[:, None], :, positions] = key_states.transpose(1, 2)
        self.values[layer_idx][rows[:, None], :, positions] = value_states.transpose(1, 2)
        written_rows, written_columns = real.nonzero(as_tuple=True)
        self.visible[layer_idx][rows[written_rows], :, positions[written_rows, written_columns]] = True
        self.lengths[layer_idx, rows] = starts + self.query_lengths
        end = self.ends[layer_idx]
        if self.rows is None:
            keys, values = self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]
            visible = self.visible[layer_idx][:, :, :end]
        else:
            keys, values = self.keys[layer_idx][rows, :, :end], self.values[layer_idx][rows, :, :end]
            visible = self.visible[layer_idx][rows, :, :end]
        if self.width == 1:
            mask = visible[:, :, None, :]
        else:
            # The question is causal: column i sees the keys up to its own position.
            last_seen = torch.where(real, starts[:, None] + offsets, starts[:, None])
            causal = torch.arange(end, device=key_states.device)[None, None, :] <= last_seen[:, :, None]
            mask = visible[:, :, None, :] & causal[:, None, :, :]
        self.masks[layer_idx] = mask
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths[layer_idx].max())


def pool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, pool=None, **kwargs):
    """Attention of a pool step: each row over the keys its slot's mask shows (see the module docstring)."""
    mask = pool.masks[module.layer_idx]
    batch, heads, width, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if query.device.type == "cuda":
        output = functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask.repeat_interleave(groups, dim=1), scale=scaling, enable_gqa=True
        )
        return output.transpose(1, 2).contiguous(), None
    # Query heads h * groups ... h * groups + groups - 1 share KV head h: one matrix product per KV head.
    grouped = query.reshape(batch, kv_heads, groups * width, head_dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scaling
    if width > 1:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, kv_heads, groups * width, -1)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(weights, value).reshape(batch, heads, width, head_dim)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(POOL_ATTENTION, pool_attention)


def decode_memory_bytes(gib: float | None, model) -> int:
    """The pool's memory budget: ``decode_memory`` GiB, else half the GPU memory free now, else a quarter of RAM."""
    if gib is not None:
        return int(gib * 2**30)
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        return free // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def why_not_pooled(model) -> str | None:
    """Why ``model``'s answers cannot come from the pool, if they cannot: the pool's mask has no sliding window."""
    layer_types = getattr(model.config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return "the model has sliding-window layers, which the decoding pool's mask does not model"
    return None


@contextmanager
def pool_attention_active(model) -> Iterator[None]:
    previous = model.config._attn_implementation
    model.config._attn_implementation = POOL_ATTENTION
    try:
        yield
    finally:
        model.config._attn_implementation = previous


@dataclass
class _Row:
    request: DecodeRequest
    tokens: list[int] = field(default_factory=list)
    cost: RowCost = field(default_factory=RowCost)
    next_position: int = 0


class DecodingPool:
    """Greedy answers of every submitted request, ``batch_size`` rows per forward pass, in ``memory_bytes``.

    ``memory_bytes`` bounds what the pool holds: the slot buffer plus the waiting requests' caches. The engine
    submits while :meth:`has_room` and calls :meth:`step` otherwise, so contexts are prefilled ahead only while
    there is room, and steps while :meth:`busy` at the end.
    """

    def __init__(self, model, batch_size: int, memory_bytes: int):
        self.model, self.batch_size, self.memory_bytes = model, max(1, batch_size), memory_bytes
        self.stop_ids = stop_token_ids(model)
        self.waiting: deque[DecodeRequest] = deque()
        self.waiting_bytes = 0
        self.rows: list[_Row | None] = []
        self.cache: SlotCache | None = None
        self.forward_passes = 0
        self.peak_rows = 0

    @property
    def held_bytes(self) -> int:
        return self.waiting_bytes + (self.cache.nbytes if self.cache is not None else 0)

    def has_room(self) -> bool:
        """Whether another context may be compressed into the queue now."""
        return len(self.waiting) < self.batch_size and self.held_bytes < self.memory_bytes

    def submit(self, request: DecodeRequest) -> None:
        self.waiting.append(request)
        self.waiting_bytes += request.nbytes

    def busy(self) -> bool:
        return bool(self.waiting) or any(row is not None for row in self.rows)

    def abandon(self) -> None:
        """Drop every row, waiting or decoding, and the slot buffer (after a failed pass)."""
        self.waiting.clear()
        self.waiting_bytes = 0
        self.rows, self.cache = [], None

    def step(self) -> None:
        """Admit waiting rows into free slots (their questions in one pass), then decode one token for every row."""
        with torch.no_grad(), pool_attention_active(self.model):
            self._admit()
            if any(row is not None for row in self.rows):
                self._decode_step()
            self._compact()

    # Slots

    def _slot_bytes(self, capacity: int) -> int:
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * self.model.dtype.itemsize
        return per_position * capacity

    def _resize(self, slots: int, capacity: int) -> None:
        """A new slot buffer of ``slots`` rows of ``capacity`` positions, keeping the rows decoding now."""
        occupied = [slot for slot, row in enumerate(self.rows) if row is not None]
        cache = SlotCache(self.model, slots, capacity)
        if self.cache is not None:
            cache.copy_from(self.cache, occupied)
        else:
            for slot in range(slots):
                cache.free(slot)
        self.rows = [self.rows[slot] for slot in occupied] + [None] * (slots - len(occupied))
        self.cache = cache

    def _admit(self) -> None:
        if not self.waiting:
            return
        active = sum(row is not None for row in self.rows)
        capacity = max([self.cache.capacity if self.cache is not None else 0] + [r.slot_length() for r in self.waiting])
        # As many slots as the batch size, the work at hand and the memory budget allow (at least one).
        affordable = max(1, (self.memory_bytes - self.waiting_bytes) // self._slot_bytes(capacity))
        slots = max(len(self.rows), min(self.batch_size, active + len(self.waiting), affordable))
        if self.cache is None or slots > self.cache.slots or capacity > self.cache.capacity:
            # Grown in steps, so that a slowly rising need does not copy the buffer at every admission.
            self._resize(slots, capacity if self.cache is None else max(capacity, self.cache.capacity * 5 // 4))
        free = [slot for slot, row in enumerate(self.rows) if row is None]
        joining = []
        for slot in free:
            if not self.waiting:
                break
            request = self.waiting.popleft()
            self.waiting_bytes -= request.nbytes
            self.cache.load(slot, request)
            self.rows[slot] = _Row(request)
            joining.append(slot)
        if joining:
            self._ask_questions(joining)

    def _ask_questions(self, slots: list[int]) -> None:
        rows = [self.rows[slot] for slot in slots]
        device = self.model.device
        lengths = [row.request.input_ids.shape[1] for row in rows]
        width = max(lengths)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        position_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for index, (row, length) in enumerate(zip(rows, lengths, strict=True)):
            # Left-padded: every row's last question token is the last column, whose logits give its first token.
            input_ids[index, width - length :] = row.request.input_ids[0].to(device)
            start = row.request.context_length
            position_ids[index, width - length :] = torch.arange(start, start + length, device=device)
            row.next_position = start + length
        query_lengths = torch.tensor(lengths, device=device)
        # A teacher-forced row needs the logits of its last question token and of each answer token but the last.
        answers = [row.request.answer_ids.shape[-1] for row in rows if row.request.answer_ids is not None]
        keep = max(answers, default=0) + 1
        logits = self._forward(torch.tensor(slots, device=device), query_lengths, input_ids, position_ids, rows, keep)
        for slot, row, row_logits in zip(slots, rows, logits, strict=True):
            if row.request.answer_ids is None:
                self._append(slot, row, int(row_logits[-1].argmax()))
                continue
            answer_length = row.request.answer_ids.shape[-1]
            log_probs = torch.log_softmax(row_logits[-answer_length - 1 : -1].float(), dim=-1)
            self.rows[slot] = None
            self.cache.free(slot)
            row.request.on_answer(log_probs, row.cost)

    def _decode_step(self) -> None:
        device = self.model.device
        live = [row is not None for row in self.rows]
        input_ids = torch.tensor([[row.tokens[-1] if row else 0] for row in self.rows], device=device)
        position_ids = torch.tensor([[row.next_position if row else 0] for row in self.rows], device=device)
        query_lengths = torch.tensor(live, dtype=torch.long, device=device)
        served = [row for row in self.rows if row is not None]
        tokens = self._forward(None, query_lengths, input_ids, position_ids, served)[:, -1].argmax(dim=-1).tolist()
        for slot, (row, token) in enumerate(zip(self.rows, tokens, strict=True)):
            if row is not None:
                row.next_position += 1
                self._append(slot, row, token)

    def _forward(self, rows, query_lengths, input_ids, position_ids, served: list[_Row], keep: int = 1) -> torch.Tensor:
        """One forward pass, returning the logits of its last ``keep`` columns; its time and count are shared by
        the rows it served."""
        start = time.perf_counter()
        self.peak_rows = max(self.peak_rows, len(served))
        cache_position = torch.arange(input_ids.shape[1], device=input_ids.device)
        with self.cache.forward(rows, query_lengths, input_ids.shape[1]):
            logits = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                past_key_values=self.cache,
                cache_position=cache_position,
                logits_to_keep=keep,
                pool=self.cache,
            ).logits
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)  # the pass's time includes its kernels
        self.forward_passes += 1
        share = (time.perf_counter() - start) / len(served)
        for row in served:
            row.cost.decode_seconds += share
            row.cost.forward_passes += 1 / len(served)
        return logits

    def _append(self, slot: int, row: _Row, token: int) -> None:
        row.tokens.append(token)
        row.cost.generated_tokens += 1
        if _finished(row.tokens, row.request.max_new_tokens, self.stop_ids):
            self.rows[slot] = None
            self.cache.free(slot)
            row.request.on_answer(row.tokens, row.cost)

    def _compact(self) -> None:
        """Once no row waits and most slots are idle, decode the remaining rows in a smaller buffer."""
        active = sum(row is not None for row in self.rows)
        if self.waiting or self.cache is None or active == 0 or active > len(self.rows) // 2:
            return
        self._resize(active, self.cache.capacity)


def decode_all(model, requests: list[DecodeRequest], batch_size: int, memory_bytes: int = 2**40) -> list[list[int]]:
    """The greedy tokens of every request (its ``on_answer`` is not called), decoded in one pool."""
    tokens: list[list[int] | None] = [None] * len(requests)

    def receiver(index: int):
        return lambda answer, cost: tokens.__setitem__(index, answer)

    pool = DecodingPool(model, batch_size, memory_bytes)
    for index, request in enumerate(requests):
        pool.submit(replace(request, on_answer=receiver(index)))
    while pool.busy():
        pool.step()
    return tokens
