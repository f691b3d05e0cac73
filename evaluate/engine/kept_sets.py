"""Which context positions a compressed cache kept, per layer and KV head, whatever the press (docs/metrics.md's
"Why a press fails").

A press keeps a pair by copying its key (``gather``), never by computing a new one, so each key a compressed cache
holds is bit for bit a key of the uncompressed prefill; keys at two positions never agree (rotary embeddings put the
position in them). So each kept key is found among the prefill's by an exact fingerprint of its bits
(:func:`key_fingerprints`: two independent integer hashes, 48 bits of collision resistance each), with no hook in
any press. The pairs a masking press (AdaKV) hides count as dropped. A press that writes new keys (KeyRerotation,
ThinK's pruned channels) or a quantized cache leaves keys the prefill never had: its kept set is unknown (None),
and so are the diagnostics that need it.
"""

from dataclasses import dataclass

import torch

# Two fixed weight vectors over a key's bits read as 16-bit integers (one per bfloat16 or float16 number, two per
# float32, four per float64): below 2**24, so that each product is below 2**39 and a sum over up to 1024 of them
# below 2**49, which float64 holds exactly: the hash is exact integer arithmetic done by a float64 matrix product.
_WEIGHT_BOUND = 2**24
# A head's hashes are shifted apart by this, so that one sorted list serves every head (heads < 2**11).
_HEAD_SHIFT = 2**51


def _weights(count: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(46)
    weights = torch.randint(1, _WEIGHT_BOUND, (count, 2), generator=generator, dtype=torch.int64)
    return weights.to(device=device, dtype=torch.float64)


def key_fingerprints(keys: torch.Tensor) -> torch.Tensor:
    """Each key's fingerprint ([KV heads, positions, 2] int64) from a layer's floating-point keys ([1, KV heads,
    positions, head dim]): two integer hashes of its bits, equal for equal keys and, for distinct keys, different
    but with probability 2**-48."""
    bits = keys[0].contiguous().view(torch.int16)
    return (bits.to(torch.float64) @ _weights(bits.shape[-1], keys.device)).to(torch.int64)


@dataclass
class KeptSet:
    """The context positions a compressed cache kept: ``mask`` [layers, KV heads, context positions], True where
    the position's pair is in the cache and not masked."""

    mask: torch.Tensor

    @property
    def context_length(self) -> int:
        return self.mask.shape[-1]

    def retention(self, positions: torch.Tensor) -> tuple[float, list[float]]:
        """The share of ``positions`` kept, averaged over KV heads: per layer, and over layers."""
        by_layer = self.mask[:, :, positions].float().mean(dim=(1, 2))
        return round(float(by_layer.mean()), 6), [round(float(share), 4) for share in by_layer]

    def recall(self, mass: torch.Tensor) -> tuple[float, list[float]]:
        """The share of the attention ``mass`` ([layers, KV heads, context positions], each head's summing to 1)
        that falls on kept positions, averaged over KV heads: per layer, and over layers."""
        by_layer = (mass * self.mask).sum(dim=-1).mean(dim=-1)
        return round(float(by_layer.mean()), 6), [round(float(share), 4) for share in by_layer]


# What :func:`kept_set` marks where a cache position holds no context position: a key the prefill never had, or a
# key a masking press hides.
_NEW, _HIDDEN = -1, -2


def _matched_positions(original: torch.Tensor, kept: torch.Tensor) -> torch.Tensor | None:
    """For each kept key's fingerprint ([heads, m, 2]), the position of the original key with that fingerprint
    ([heads, m]), ``_NEW`` for a key that is no original's; None when two original keys of a head share their first
    hash (never seen: the odds are about positions² / 2**49)."""
    heads, length, _ = original.shape
    shift = torch.arange(heads, device=original.device)[:, None] * _HEAD_SHIFT
    first = (original[..., 0] + shift).flatten()
    order = torch.argsort(first)
    ordered = first[order]
    if bool((ordered[1:] == ordered[:-1]).any()):
        return None
    wanted = (kept[..., 0] + shift).flatten()
    slot = torch.searchsorted(ordered, wanted).clamp(max=len(ordered) - 1)
    index = order[slot]  # the original (head, position) whose first hash is the kept key's, if any
    same = (first[index] == wanted) & (original.reshape(-1, 2)[index, 1] == kept.reshape(-1, 2)[:, 1])
    positions = torch.where(same, index % length, torch.full_like(index, _NEW))
    return positions.reshape(heads, -1)


def layer_fingerprints(cache) -> list[torch.Tensor] | None:
    """Each layer's key fingerprints of a compressed ``cache``; None where its keys are not plain tensors of a
    floating type the fingerprints read (a quantized cache's are not the prefill's)."""
    fingerprints = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if getattr(layer, "_quantized_keys", None) is not None or not isinstance(keys, torch.Tensor):
            return None
        if keys.dim() != 4 or not keys.is_floating_point():
            return None
        fingerprints.append(key_fingerprints(keys))
    return fingerprints


def kept_set(
    original: list[torch.Tensor], kept: list[torch.Tensor] | None, hidden: tuple = (), new_keys: bool = False
) -> KeptSet | None:
    """The kept set of a compressed cache whose layers' keys have the ``kept`` fingerprints
    (:func:`layer_fingerprints`), against the ``original`` fingerprints of each layer's uncompressed keys, the keys
    ``hidden`` masks (per layer, (heads, cache positions) or None) counted as dropped. ``new_keys``: the cache may
    hold keys the prefill never had (a decoding-time press's, from its question and answer), which are no context
    position; otherwise such a key makes the kept set unknown (None), as it does when ``kept`` is None (module
    docstring)."""
    if kept is None:
        return None
    masks = []
    for index, (fingerprints, layer) in enumerate(zip(original, kept, strict=True)):
        heads, length = fingerprints.shape[:2]
        mask = torch.zeros(heads, length, dtype=torch.bool, device=fingerprints.device)
        positions = _matched_positions(fingerprints, layer) if layer.shape[1] else torch.zeros(heads, 0).long()
        if positions is None:
            return None
        masked = hidden[index] if index < len(hidden) else None
        if masked is not None:  # hidden from every query: dropped (kvpress writes fake keys there while decoding)
            head_indices, cache_positions = masked
            inside = cache_positions < positions.shape[1]
            positions[head_indices[inside], cache_positions[inside]] = _HIDDEN
        if not new_keys and bool((positions == _NEW).any()):
            return None
        found = positions >= 0
        mask[torch.arange(heads, device=found.device).repeat_interleave(found.sum(dim=1)), positions[found]] = True
        masks.append(mask.cpu())
    return KeptSet(torch.stack(masks))


@dataclass
class Diagnosed:
    """A group's diagnostics (evaluate/engine/diagnosis.py): each row's fields, the kept set they were measured on
    (None: unknown; a decoding-time press's rows each have their own) and the row's answer positions in it (None:
    not in the context), which ``save_kept`` stores."""

    fields: list[dict]
    kept: list[KeptSet | None]
    answer_positions: list[torch.Tensor | None]

    def turn(self, index: int) -> "Diagnosed":
        """One row's: a conversation's turn, recorded as a group of its own."""
        return Diagnosed([self.fields[index]], [self.kept[index]], [self.answer_positions[index]])

    def replace_row(self, index: int, row: "Diagnosed") -> None:
        """Row ``index`` measured again (``row``, of one row): on the kept set its answer left."""
        self.fields[index], self.kept[index], self.answer_positions[index] = (
            row.fields[0],
            row.kept[0],
            row.answer_positions[0],
        )
