"""The attention of a pool step: each row over the keys its slot's mask shows, registered with transformers'
``AttentionInterface``.

On CUDA ``scaled_dot_product_attention`` with the mask; on the CPU in float32 and float64 a grouped-query matrix
product that does not repeat the KV heads (measured 3.9 ms against sdpa's 6.8 ms for 32 rows over 1,100 keys; sdpa
without ``enable_gqa`` copies every key three times and took 76 ms). In bfloat16 and float16 the CPU takes sdpa too:
the matrix product rounds the scores and the weights to the half-precision type before the values are summed,
where sdpa's CPU kernel (the one kvpress's pipeline runs) keeps them in float32, so a pool of one row parted from
the pipeline (6 of 15 rows of tests/test_decoding.py's in bfloat16, 1 in float16) and with sdpa it does not
(tests/test_dtype_agreement.py).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import kvpress  # noqa: F401  (imported first: see the registration below)
import torch
from torch.nn import functional
from transformers import AttentionInterface

POOL_ATTENTION = "pressbench_pool"
# Where the CPU attends as kvpress's pipeline does, in sdpa (the module docstring says why).
HALF_PRECISION = (torch.bfloat16, torch.float16)


def pool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, pool=None, **kwargs):
    """Attention of a pool pass: each group of rows the slot cache left (a segment of a decoding step, or the joining
    rows) over its own keys and mask; ``key`` and ``value`` (the whole buffer) are not read. Rows whose decoding press
    masks keys (AdaKV) get kvpress's fake keys first."""
    pool.write_fake_keys(module.layer_idx, query)
    # Taken from the slot cache, so that a question pass's copies of each layer's keys are freed after the layer's
    # attention instead of the whole pass (measured: 32 joiners over 2,144 keys held 3.2 GB at the pass's end).
    parts, pool.parts[module.layer_idx] = pool.parts[module.layer_idx], None
    outputs = [_attend(query[rows], keys, values, mask, scaling) for rows, keys, values, mask in parts]
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return output.transpose(1, 2).contiguous(), None


def _attend(query, key, value, mask, scaling) -> torch.Tensor:
    """One group's attention (see the module docstring): [rows, heads, width, head_dim]."""
    batch, heads, width, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if query.device.type == "cuda" or query.dtype in HALF_PRECISION:
        return functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask.repeat_interleave(groups, dim=1), scale=scaling, enable_gqa=True
        )
    # Query heads h * groups ... h * groups + groups - 1 share KV head h: one matrix product per KV head.
    grouped = query.reshape(batch, kv_heads, groups * width, head_dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)) * scaling
    if width > 1:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, kv_heads, groups * width, -1)
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).reshape(batch, heads, width, head_dim)


# kvpress wraps every attention function registered when it is imported (for AdaKV's fake keys, with another
# signature); the pool hides AdaKV's keys with its own mask, so it registers after that import, unwrapped.
AttentionInterface.register(POOL_ATTENTION, pool_attention)


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
