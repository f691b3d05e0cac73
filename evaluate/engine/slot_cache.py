"""The pool's keys and values: one preallocated buffer of slots, each row's keys left-aligned, written in place."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from evaluate.engine.requests import DecodeRequest


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
        index = torch.tensor(slots, dtype=torch.long, device=self.lengths.device)  # an empty list is long too
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
