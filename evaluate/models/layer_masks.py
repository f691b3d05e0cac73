"""Attention masks fitted to each layer's cache, so that layers may hold different numbers of KV pairs.

transformers builds one attention mask per forward pass, sized from layer 0's cache. kvpress's ChunkKVPress keeps
``int(n_chunks * (1 - compression_ratio))`` whole chunks per layer, and whether the short trailing chunk is among
them can change from layer to layer, so a compressed cache can be longer or shorter in some layers than in layer
0. A question of several tokens then fails under sdpa and eager attention (the mask's key dimension does not match
the layer's keys). kvpress's own evaluation ran such caches only where every layer kept the trailing chunk.

The fix changes the decoding, never the selection: before each attention layer runs, the mask is rebuilt for that
layer's key length. The compressed past is visible to every question token and the question part is causal, so
the fitted mask is "past all visible" for the layer's own past length followed by the mask's question columns.
When the lengths already agree the hook does nothing, so caches of equal lengths decode exactly as before.
Flash attention needs no mask for this: its causal alignment is bottom-right, whatever the key length.
"""

import torch
from torch import nn


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """The mask value that lets a query see a key: True for boolean masks, 0 for additive ones."""
    return torch.ones((), dtype=torch.bool) if mask.dtype == torch.bool else torch.zeros((), dtype=mask.dtype)


def fit_mask_to_layer(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of an attention module: resize ``attention_mask`` to this layer's cache length."""
    mask = kwargs.get("attention_mask")
    cache = kwargs.get("past_key_values")
    if mask is None or cache is None or mask.dim() != 4 or module.layer_idx >= len(cache.layers):
        return None
    query_length = kwargs["hidden_states"].shape[1]
    # The hook runs before the layer appends the new tokens, so this is the layer's past alone.
    past_length = cache.layers[module.layer_idx].get_seq_length()
    if mask.shape[-1] == past_length + query_length:
        return None
    visible = _visible(mask).to(mask.device)
    mask_past_length = mask.shape[-1] - query_length
    if not bool((mask[..., :mask_past_length] == visible).all()):
        # Padding or a sliding window inside the past: no single mask fits every past length.
        raise ValueError(
            f"layer {module.layer_idx} holds {past_length} cached pairs but the attention mask covers "
            f"{mask_past_length} and hides some of them; per-layer masks need a fully visible past"
        )
    past = visible.expand(*mask.shape[:-1], past_length)
    kwargs["attention_mask"] = torch.cat([past, mask[..., mask_past_length:]], dim=-1)
    return args, kwargs


def fit_masks_to_layers(model: nn.Module) -> None:
    """Hook every attention layer of ``model`` so that each attends with a mask fitted to its own cache."""
    for layer in model.model.layers:
        attention = layer.self_attn
        if not getattr(attention, "_pressbench_fits_masks", False):
            attention.register_forward_pre_hook(fit_mask_to_layer, with_kwargs=True)
            attention._pressbench_fits_masks = True
