"""Where the uncompressed model looks while it reads a reference answer: the attention mass each layer's KV heads
put on each context position, teacher-forcing the answer after its question on the uncompressed cache
(``diagnostics=attention``, docs/metrics.md).

The mass is computed once per context and question; each point then reduces it against its own kept set
(:meth:`evaluate.engine.kept_sets.KeptSet.recall`). Attention weights exist only in eager attention, so this one
pass runs eager and the model's own attention is restored after it; the cache it extends is cut back to the
context, as it was.
"""

from contextlib import contextmanager

import torch

from evaluate.engine.devices import input_device


@contextmanager
def eager_attention(model):
    """The model's attention switched to eager (which returns its weights) while the block runs."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(implementation)


@contextmanager
def masks_set_aside(layers):
    """AdaKV's masks, which a press left on the attention modules, set aside while the block prefills without it."""
    masks = [getattr(layer.self_attn, "masked_key_indices", None) for layer in layers]
    for layer in layers:
        layer.self_attn.masked_key_indices = None
    try:
        yield
    finally:
        for layer, masked in zip(layers, masks, strict=True):
            layer.self_attn.masked_key_indices = masked


def attention_mass(
    model, cache, question_ids: torch.Tensor, answer_ids: torch.Tensor, context_length: int
) -> torch.Tensor:
    """[layers, KV heads, context positions] float32: the attention of the queries that predict the answer's tokens
    (the question's last position to the answer's second to last), summed over them and over the query heads that
    share a KV head, on each context position, as a share of all their attention on the context.

    ``cache`` is the context's uncompressed cache (``context_length`` positions); it is left as it was."""
    inputs = torch.cat([question_ids, answer_ids.to(question_ids.device)], dim=-1)
    first, last = question_ids.shape[1] - 1, inputs.shape[1] - 1
    layers = model.model.layers
    masses: list[torch.Tensor | None] = [None] * len(layers)

    def keep(module, args, output):
        weights = output[1][0, :, first:last, :context_length].sum(dim=1).float()  # [query heads, context]
        kv_heads = model.config.num_key_value_heads
        mass = weights.reshape(kv_heads, -1, context_length).sum(dim=1)
        masses[module.layer_idx] = (mass / mass.sum(dim=-1, keepdim=True).clamp(min=1e-30)).cpu()

    handles = [layer.self_attn.register_forward_hook(keep) for layer in layers]
    try:
        with torch.no_grad(), eager_attention(model), masks_set_aside(layers):
            model.model(input_ids=inputs.to(input_device(model)), past_key_values=cache)
    finally:
        for handle in handles:
            handle.remove()
        cache.crop(context_length)
    return torch.stack(masses)
