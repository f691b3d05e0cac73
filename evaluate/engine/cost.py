"""What answering a context cost, beside what it scored: time by phase, forward passes, tokens and KV bytes.

A compression ratio is not the saving a press delivers: masking presses (AdaKV) keep the whole cache and hide
entries, and some presses (KVzip) run extra passes. So every answered context records the bytes its compressed
cache physically holds next to the bytes the press counts as kept, and the forward passes that produced it.
"""

from dataclasses import dataclass, fields

import torch
from transformers import Cache

from evaluate.kv_cache import stored_bytes, stored_pairs


@dataclass
class Cost:
    """The cost of one context's answers (or a run's total, summed over its contexts)."""

    prefill_seconds: float = 0.0
    compress_seconds: float = 0.0
    decode_seconds: float = 0.0
    likelihood_seconds: float = (
        0.0  # the teacher-forced passes of the likelihood fields (evaluate/engine/teacher_forcing.py)
    )
    retention_seconds: float = 0.0  # the kept sets and answer spans of answer retention (evaluate/engine/diagnosis.py)
    attention_recall_seconds: float = 0.0  # attention recall's eager passes and reductions (diagnostics=attention)
    generated_tokens: int = 0
    forward_passes: float = 0.0
    prefills: float = 0.0  # a context's prefill passes (a point's share of one its sweep shares)
    kv_bytes_held: int = 0
    kv_bytes_kept: int = 0

    @property
    def seconds(self) -> float:
        return (
            self.prefill_seconds
            + self.compress_seconds
            + self.decode_seconds
            + self.likelihood_seconds
            + self.retention_seconds
            + self.attention_recall_seconds
        )

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def _kept_per_head(model: torch.nn.Module, cache: Cache) -> list[torch.Tensor]:
    """Per layer, the pairs each KV head keeps: its cache length minus what AdaKV masked on the attention module
    there (AdaKV under a DecodingPress leaves masks past the cache that the pipeline cut back to the context)."""
    kept = []
    for layer, cache_layer in zip(model.model.layers, cache.layers, strict=True):
        num_heads, length = stored_pairs(cache_layer)
        per_head = torch.full((num_heads,), float(length), dtype=torch.float64)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            batch_indices, head_indices, positions = masked
            inside = (batch_indices == 0) & (positions < length)
            per_head -= torch.bincount(head_indices[inside].cpu(), minlength=num_heads)
        kept.append(per_head)
    return kept


def measure_kept_ratio(model: torch.nn.Module, cache: Cache, context_length: int) -> float:
    """KV pairs kept over context length, averaged over layers and KV heads (AdaKV's masked pairs subtracted)."""
    return float(torch.cat(_kept_per_head(model, cache)).mean() / context_length)


def kv_bytes(model: torch.nn.Module, cache: Cache) -> tuple[int, int]:
    """Bytes the cache holds, and bytes of the pairs the press counts as kept (fewer where it masks): a quantized
    cache's quantized storage (scales and zero points included) and full-precision residual, its kept bytes the
    held bytes' share of the pairs kept."""
    held, kept = 0, 0
    for per_head, layer in zip(_kept_per_head(model, cache), cache.layers, strict=True):
        heads, length = stored_pairs(layer)
        layer_bytes = stored_bytes(layer)
        held += layer_bytes
        kept += round(layer_bytes * float(per_head.sum()) / (heads * length)) if length else 0
    return held, kept
