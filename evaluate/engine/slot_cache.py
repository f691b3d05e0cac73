"""The pool's keys and values: one preallocated buffer of slots, each row's keys left-aligned, written in place.

A decoding step reads nothing back from the device. Every length the host plans with (each layer's attention width,
the width buckets) is mirrored on the host (``host_lengths``, ``host_live``), because the host alone decides who
joins and leaves; the device keeps its own copy (``lengths``, ``live``, ``tokens``, ``positions``), which the step
advances with arithmetic only.

The scheduler decides how many slots of how many positions the pool holds; the slot cache says what a slot costs
(:meth:`SlotCache.slot_bytes`, for the memory budget) and allocates the buffer, taking the rows that decode on from
the one it replaces (:meth:`SlotCache.allocate`).

Attention work follows each row's own length: the slots are cut into contiguous segments, each attended over its own
width, a rung of :data:`WIDTH_LADDER` (so that a step's shapes repeat and a compiled or captured graph is reused),
and the scheduler keeps rows of like length next to each other (:func:`arrangement`).

A model spread over several devices (a device map) gets each layer's keys, values, masks and lengths on that layer's
device, and the rows a pass serves on every device the layers use; the step's tokens and positions stay with the
input ids, on the embedding's device (evaluate/engine/devices.py).
"""

from functools import lru_cache

import numpy as np
import torch

from evaluate.engine.attention import HALF_PRECISION
from evaluate.engine.decoding_compression import write_fake_keys
from evaluate.engine.devices import input_device, layer_devices
from evaluate.engine.requests import DecodeRequest

# Widths a segment of rows attends over (a row needs its longest layer plus the step's token): 64, 128, multiples of
# 256 up to 4,096, then eight rungs per doubling, so that a row wastes at most 256 keys or an eighth. Against powers
# of two (scripts/bench_widths.py): the same attention time on the CPU and 7 % less work on the decode-bound sweep's
# lengths; powers of two would give fewer shapes to capture.
WIDTH_LADDER = (
    64,
    128,
    *range(256, 4096, 256),
    *(2**power * (8 + step) // 8 for power in range(12, 21) for step in range(8)),
)
# What one more attention call costs, in row × key units of attention work (about 50 µs of operator overhead against
# 0.15 µs per row and key on the development CPU): segments are split only where they save more than this.
SEGMENT_COST = 256


def width_bucket(length: int) -> int:
    """The smallest rung of :data:`WIDTH_LADDER` that holds ``length`` keys."""
    return next(rung for rung in WIDTH_LADDER if rung >= length)


@lru_cache(maxsize=4096)
def segments(widths: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """Cut slots with bucketed ``widths`` into contiguous (start, stop, width) segments of least attention work.

    Dynamic programming over cut points: a segment costs its rows × its widest row's width plus
    :data:`SEGMENT_COST`. Memoised: the widths change only when a row crosses a rung, joins or leaves.
    """
    count = len(widths)
    best = [0] + [None] * count
    cut = [0] * (count + 1)
    for stop in range(1, count + 1):
        widest = 0
        for start in range(stop - 1, -1, -1):
            widest = max(widest, widths[start])
            cost = best[start] + (stop - start) * widest + SEGMENT_COST
            if best[stop] is None or cost < best[stop]:
                best[stop], cut[stop] = cost, start
    parts, stop = [], count
    while stop:
        start = cut[stop]
        parts.append((start, stop, max(widths[start:stop])))
        stop = start
    return tuple(reversed(parts))


def arrangement(needs: list[int | None]) -> list[int]:
    """A slot order (new slot i takes old slot ``order[i]``) that puts rows of like need next to each other, widest
    first and free slots (None) last, moving as few rows as possible: a row already inside its need's run stays."""
    keys = [-1 if need is None else width_bucket(need) for need in needs]
    ranked = sorted(range(len(keys)), key=lambda slot: -keys[slot])
    # The run of slots each key occupies once sorted.
    runs: dict[int, range] = {}
    for position, slot in enumerate(ranked):
        first = runs[keys[slot]].start if keys[slot] in runs else position
        runs[keys[slot]] = range(first, position + 1)
    order: list[int | None] = [None] * len(keys)
    movers = []
    for slot, key in enumerate(keys):
        if slot in runs[key]:
            order[slot] = slot
        else:
            movers.append(slot)
    for slot in movers:
        target = next(position for position in runs[keys[slot]] if order[position] is None)
        order[target] = slot
    return order


def _kv_shape(model) -> tuple[int, int, int]:
    """The model's layers, key-value heads and head dimension: the shape of one position's keys (or values)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


class SlotCache:
    """Preallocated keys and values of ``slots`` rows, left-aligned, with each row's length per layer.

    It stands in for transformers' cache during a pool forward pass: :meth:`plan` sets up the pass on the host,
    ``update`` writes the pass's new keys at each row's own positions, in place, and leaves in ``parts`` the
    (rows, keys, values, mask) groups that :func:`pool_attention` attends, one per segment of a decoding step.
    """

    def __init__(self, model, slots: int, capacity: int, buffers: bool = True):
        layers, heads, head_dim = _kv_shape(model)
        self.devices = layer_devices(model)
        self.input_device = input_device(model)
        self.slots, self.capacity = slots, capacity
        self.shape, self.dtype = (slots, heads, capacity, head_dim), model.dtype
        # Each layer's keys, values and visible positions; ``buffers=False`` leaves them to :meth:`_layer_buffers`,
        # one layer at a time (:meth:`allocate`).
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.visible: list[torch.Tensor | None] = [None] * layers
        for layer_idx in range(layers if buffers else 0):
            self._layer_buffers(layer_idx)
        # Each layer's length per slot, on the layer's device.
        self.lengths = [torch.zeros(slots, dtype=torch.long, device=d) for d in self.devices]
        # The decoding step's inputs: each slot's next token and position, and 1 where a row decodes. ``live`` is
        # kept on every device a layer uses too (``live_on``), so that no layer's step copies it from another.
        placement = list(dict.fromkeys([self.input_device, *self.devices]))
        self.live_on = {device: torch.zeros(slots, dtype=torch.long, device=device) for device in placement}
        self.live = self.live_on[self.input_device]
        self.tokens = torch.zeros(slots, dtype=torch.long, device=self.input_device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=self.input_device)
        self.host_lengths = np.zeros((layers, slots), dtype=np.int64)
        self.host_live = np.zeros(slots, dtype=np.int64)
        every_slot = {device: torch.arange(slots, device=device) for device in placement}
        # A decoding step's rows and query lengths as each layer reads them (per layer, indexed like the buffers).
        self.step_rows = [every_slot[device] for device in self.devices]
        self.step_query_lengths = [self.live_on[device] for device in self.devices]
        self.parts: list[list | None] = [None] * layers
        # A decoding step's rows whose decoding press masks keys (AdaKV): slot -> its masks per layer (the scheduler
        # sets them for the step; evaluate/engine/decoding_compression.py).
        self.masked: dict[int, list] = {}
        # The slots whose fake keys could not be built in this step, with the error: the scheduler fails them alone.
        self.failed: dict[int, Exception] = {}

    @staticmethod
    def slot_bytes(model, capacity: int) -> int:
        """What one slot of ``capacity`` positions takes in keys and values (:attr:`nbytes` per slot)."""
        layers, heads, head_dim = _kv_shape(model)
        return 2 * layers * heads * head_dim * model.dtype.itemsize * capacity

    def _layer_buffers(self, layer_idx: int) -> None:
        device = self.devices[layer_idx]
        self.keys[layer_idx] = torch.zeros(self.shape, dtype=self.dtype, device=device)
        self.values[layer_idx] = torch.zeros(self.shape, dtype=self.dtype, device=device)
        self.visible[layer_idx] = torch.zeros(self.shape[:3], dtype=torch.bool, device=device)

    @classmethod
    def allocate(cls, model, slots: int, capacity: int, source: "SlotCache | None", keep: list[int]) -> "SlotCache":
        """A buffer of ``slots`` rows of ``capacity`` positions whose first slots take ``source``'s rows ``keep``
        (to grow or compact the pool; an idle pool, teacher forcing's between groups, keeps none), the rest free.

        ``source`` is spent: its buffers are let go of layer by layer as their rows are copied, so that growing the
        pool never holds two whole buffers at once (measured: the prefill-bound sweep's peak was the old and the
        new buffer side by side)."""
        cache = cls(model, slots, capacity, buffers=not keep)
        if keep:
            cache._take(source, list(range(len(keep))), keep, min(capacity, source.capacity), spend=True)
        for slot in range(len(keep), slots):
            cache.free(slot)
        return cache

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
            self.lengths[layer_idx][slot] = length
            self.host_lengths[layer_idx, slot] = length
        self.set_live(slot, 1)

    def free(self, slot: int) -> None:
        """An empty slot still decodes (its output is discarded) and must see one key to keep its softmax finite."""
        for visible, lengths in zip(self.visible, self.lengths, strict=True):
            visible[slot].fill_(False)
            visible[slot, :, 0] = True
            lengths[slot] = 0
        self.host_lengths[:, slot] = 0
        self.set_live(slot, 0)

    def crop(self, slot: int, count: int) -> None:
        """Drop a row's last ``count`` positions on every layer (a conversation's answer, under history=reference)."""
        if not count:
            return
        for layer_idx, (visible, lengths) in enumerate(zip(self.visible, self.lengths, strict=True)):
            length = int(self.host_lengths[layer_idx, slot]) - count
            visible[slot, :, length:] = False
            lengths[slot] = length
            self.host_lengths[layer_idx, slot] = length

    def set_live(self, slot: int, live: int) -> None:
        """Whether a slot's row decodes in the next step (0: free, or waiting for its question pass)."""
        for copy in self.live_on.values():
            copy[slot] = live
        self.host_live[slot] = live

    def permute(self, order: list[int]) -> None:
        """New slot i takes old slot ``order[i]``; only the rows that move are copied, up to their longest layer."""
        moved = [slot for slot, source in enumerate(order) if source != slot]
        if moved:
            sources = [order[slot] for slot in moved]
            self._take(self, moved, sources, int(self.host_lengths[:, sources].max()) + 1)

    def _take(self, other: "SlotCache", mine: list[int], theirs: list[int], width: int, spend: bool = False) -> None:
        """Slots ``mine`` take ``other``'s slots ``theirs``: keys and values up to ``width``, all else whole. With
        ``spend``, each of this cache's layers is allocated just before its rows are copied, and ``other``'s let go
        of just after."""
        # The slot indices on each device (an empty list is long too).
        targets = {device: torch.tensor(mine, dtype=torch.long, device=device) for device in self.live_on}
        sources = {device: torch.tensor(theirs, dtype=torch.long, device=device) for device in self.live_on}
        for layer_idx, device in enumerate(self.devices):
            target, source = targets[device], sources[device]
            if spend:
                self._layer_buffers(layer_idx)
            self.keys[layer_idx][target, :, :width] = other.keys[layer_idx][source, :, :width]
            self.values[layer_idx][target, :, :width] = other.values[layer_idx][source, :, :width]
            taken = other.visible[layer_idx][source, :, :width]  # read before writing: other may be self
            self.visible[layer_idx][target] = False
            self.visible[layer_idx][target, :, :width] = taken
            self.lengths[layer_idx][target] = other.lengths[layer_idx][source]
            if spend:
                other.keys[layer_idx] = other.values[layer_idx] = other.visible[layer_idx] = None
        for device, live in self.live_on.items():
            live[targets[device]] = other.live_on[device][sources[device]]
        target, source = targets[self.input_device], sources[self.input_device]
        for state in ("tokens", "positions"):
            getattr(self, state)[target] = getattr(other, state)[source]
        self.host_lengths[:, mine] = other.host_lengths[:, theirs]
        self.host_live[mine] = other.host_live[theirs]

    def plan(self, rows: list[int] | None, query_lengths: list[int] | None, width: int) -> None:
        """Set up one forward pass on the host, reading nothing from the device.

        ``rows`` None is a decoding step: every slot, one token each where a row is live, attended in width
        segments. Otherwise the joining ``rows`` run ``query_lengths`` real tokens right-aligned in ``width``
        columns, each layer attended up to the widest of them.
        """
        self.width = width
        if rows is None:
            self.rows, self.query_lengths = self.step_rows, self.step_query_lengths
            needs = self.host_lengths.max(axis=0) + self.host_live
            self.segments = segments(tuple(min(width_bucket(int(need)), self.capacity) for need in needs))
            self.host_lengths += self.host_live
        else:
            on = {
                device: (torch.tensor(rows, device=device), torch.tensor(query_lengths, device=device))
                for device in self.live_on
            }
            self.rows = [on[device][0] for device in self.devices]
            self.query_lengths = [on[device][1] for device in self.devices]
            self.segments = None
            self.host_lengths[:, rows] += np.array(query_lengths)
            self.ends = self.host_lengths[:, rows].max(axis=1).clip(min=1).tolist()

    def end_pass(self) -> None:
        """Let go of the pass's attention groups (the question pass's are copies)."""
        self.parts = [None] * len(self.keys)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs: dict | None = None):
        """Write the pass's keys at each row's own positions and leave the layer's attention groups in ``parts``."""
        rows, query_lengths = self.rows[layer_idx], self.query_lengths[layer_idx]
        starts = self.lengths[layer_idx][rows]
        pad = self.width - query_lengths
        columns = torch.arange(self.width, device=key_states.device)
        # Column i of row r is its token i - pad[r], written at start + i - pad[r]; padding columns (and an idle
        # slot's token) write into the slot's last position, hidden, which no real token reaches before the row's
        # answer is complete.
        offsets = columns[None, :] - pad[:, None]
        real = offsets >= 0
        positions = torch.where(real, starts[:, None] + offsets, self.capacity - 1)
        self.keys[layer_idx][rows[:, None], :, positions] = key_states.transpose(1, 2)
        self.values[layer_idx][rows[:, None], :, positions] = value_states.transpose(1, 2)
        self.visible[layer_idx][rows[:, None], :, positions] = real[:, :, None]
        self.lengths[layer_idx][rows] = starts + query_lengths
        if self.segments is not None:
            self.parts[layer_idx] = [self._segment(layer_idx, *segment) for segment in self.segments]
        else:
            self.parts[layer_idx] = [self._question(layer_idx, starts, offsets, real)]
        return self.keys[layer_idx], self.values[layer_idx]

    def write_fake_keys(self, layer_idx: int, query: torch.Tensor) -> None:
        """Before a decoding step's attention on one layer: the masked keys of :attr:`masked`'s rows become fake keys
        built from the step's ``query`` (the attention groups are views of the buffer, so they see them)."""
        on_layer = {slot: masks[layer_idx] for slot, masks in self.masked.items() if masks[layer_idx] is not None}
        on_layer = {slot: masks for slot, masks in on_layer.items() if slot not in self.failed}
        if on_layer:
            self.failed.update(write_fake_keys(self.keys[layer_idx], query, on_layer))

    def _segment(self, layer_idx: int, start: int, stop: int, width: int) -> tuple:
        """Slots ``start:stop`` of a decoding step over their first ``width`` keys: views, nothing copied."""
        if stop - start == 1 and self.dtype in HALF_PRECISION:
            # A row alone in half precision attends its layer's own keys, as kvpress's pipeline does: sdpa sums a
            # longer row of keys, masked or not, in other blocks, which rounds otherwise (test_dtype_agreement.py).
            width = max(1, int(self.host_lengths[layer_idx, start]))
        rows = slice(start, stop)
        keys, values = self.keys[layer_idx][rows, :, :width], self.values[layer_idx][rows, :, :width]
        return rows, keys, values, self.visible[layer_idx][rows, :, None, :width]

    def _question(self, layer_idx: int, starts, offsets, real) -> tuple:
        """The joining rows over the keys up to the widest of them, each question column causal."""
        end, rows = self.ends[layer_idx], self.rows[layer_idx]
        keys, values = self.keys[layer_idx][rows, :, :end], self.values[layer_idx][rows, :, :end]
        visible = self.visible[layer_idx][rows, :, :end]
        # Column i sees the keys up to its own position.
        last_seen = torch.where(real, starts[:, None] + offsets, starts[:, None])
        causal = torch.arange(end, device=keys.device)[None, None, :] <= last_seen[:, :, None]
        return slice(None), keys, values, visible[:, :, None, :] & causal[:, None, :, :]

    def row(self, layer_idx: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of one row's keys and values on one layer, [1, heads, length, head_dim], contiguous as a batch-1
        ``DynamicCache`` holds them (a decoding press compresses them: evaluate/engine/decoding_compression.py)."""
        length = int(self.host_lengths[layer_idx, slot])
        keys = self.keys[layer_idx][slot : slot + 1, :, :length].clone()
        return keys, self.values[layer_idx][slot : slot + 1, :, :length].clone()

    def replace_row(self, layer_idx: int, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """One row's layer replaced by ``keys`` and ``values`` (shorter, after a decoding compression), left-aligned
        and all visible; the positions after them hidden."""
        length = keys.shape[2]
        self.keys[layer_idx][slot, :, :length] = keys[0]
        self.values[layer_idx][slot, :, :length] = values[0]
        visible = self.visible[layer_idx][slot]
        visible.fill_(False)
        visible[:, :length] = True
        self.lengths[layer_idx][slot] = length
        self.host_lengths[layer_idx, slot] = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.host_lengths[layer_idx].max())
