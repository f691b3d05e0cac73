"""Greedy decoding of many questions at once, each on its own compressed cache.

kvpress's pipeline answers one question at a time: it runs the question on the compressed cache, then
decodes token by token until an end-of-sequence token or ``max_new_tokens``. Questions whose caches have the
same length in every layer, asked with the same question length, are stacked into one batch instead: one
forward pass per step for all of them, no padding and no attention mask, each row at the pipeline's positions
and stopping on the pipeline's rule, leaving the batch as soon as it stops.

Only equal lengths are batched because padding would need an attention mask, and a mask costs more than it
saves: on the 2-core CPU, a SmolLM2 decoding step over 2048 cached tokens takes 46 ms for one row, 141 ms for
six equal rows and 380 ms for six rows with a padding mask (transformers expands grouped KV heads and falls
back to the math kernel when given a mask). In a sweep the equal lengths come from the points that differ only
in press or scorer at one compression ratio (ChunkKV and EG-ChunkKV keep exactly the same number of pairs), and
from a point's questions of equal token length.

Each row attends over exactly its own keys; only the matrix shapes of the projections change with the batch,
so a row's logits can differ from one-by-one decoding in the last bits at most, and its greedy tokens are the
same unless two candidates tie to within that rounding (tests/test_decoding.py checks equality with the
pipeline).
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class DecodeRequest:
    """One question to answer greedily from ``cache``, which is left as it was found.

    ``context_length`` is the uncompressed context's length: the question's positions follow it, as in
    kvpress's pipeline, whatever the press removed.
    """

    cache: DynamicCache
    question_ids: torch.Tensor
    context_length: int
    max_new_tokens: int

    def shape_key(self) -> tuple:
        """Requests with equal keys can be stacked into one batch."""
        lengths = tuple(layer.keys.shape[2] for layer in self.cache.layers)
        return lengths, self.question_ids.shape[1], self.context_length


def stop_token_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def masks_keys_in_place(attention_modules) -> bool:
    """Whether the last compression left masked keys on the attention modules (AdaKV does).

    Those masks hold for one cache only, so questions on such a cache are decoded before the next point
    compresses, and alone.
    """
    return any(getattr(module, "masked_key_indices", None) is not None for module in attention_modules)


def _finished(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    # The pipeline never tests its first token (the question's own output) against the stop tokens.
    return len(tokens) >= max_new_tokens or (len(tokens) > 1 and tokens[-1] in stop_ids)


def _stacked_cache(requests: list[DecodeRequest]) -> DynamicCache:
    cache = DynamicCache()
    for layer_idx, layers in enumerate(zip(*(request.cache.layers for request in requests), strict=True)):
        cache.update(
            torch.cat([layer.keys for layer in layers]), torch.cat([layer.values for layer in layers]), layer_idx
        )
    return cache


def _decode_together(model, requests: list[DecodeRequest], stop_ids: set[int]) -> list[list[int]]:
    """Greedy tokens for requests of one shape key, as one batch."""
    cache = _stacked_cache(requests)
    question_ids = torch.cat([request.question_ids for request in requests]).to(model.device)
    start = requests[0].context_length
    positions = torch.arange(start, start + question_ids.shape[1], device=model.device).expand(len(requests), -1)
    logits = model(input_ids=question_ids, past_key_values=cache, position_ids=positions, logits_to_keep=1).logits
    tokens = [[token] for token in logits[:, -1].argmax(dim=-1).tolist()]
    active = [
        row for row, request in enumerate(requests) if not _finished(tokens[row], request.max_new_tokens, stop_ids)
    ]
    cache_rows = list(range(len(requests)))  # the cache's batch row of each request
    next_position = start + question_ids.shape[1]
    while active:
        if len(active) < len(cache_rows):
            keep = torch.tensor([cache_rows.index(row) for row in active], device=model.device)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[keep], layer.values[keep]
            cache_rows = list(active)
        input_ids = torch.tensor([[tokens[row][-1]] for row in active], device=model.device)
        positions = torch.full((len(active), 1), next_position, device=model.device)
        logits = model(input_ids=input_ids, past_key_values=cache, position_ids=positions).logits
        for row, token in zip(active, logits[:, -1].argmax(dim=-1).tolist(), strict=True):
            tokens[row].append(token)
        next_position += 1
        active = [row for row in active if not _finished(tokens[row], requests[row].max_new_tokens, stop_ids)]
    return tokens


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def greedy_answers(model, tokenizer, requests: list[DecodeRequest], batch_size: int) -> list[str]:
    """The answer kvpress's pipeline gives to each request, decoding up to ``batch_size`` equal-shaped rows at once."""
    stop_ids = stop_token_ids(model)
    by_shape: dict[tuple, list[int]] = {}
    for index, request in enumerate(requests):
        by_shape.setdefault(request.shape_key(), []).append(index)
    answers = [""] * len(requests)
    with torch.no_grad():
        for indices in by_shape.values():
            for chunk in _chunks(indices, max(1, batch_size)):
                tokens_of_chunk = _decode_together(model, [requests[index] for index in chunk], stop_ids)
                for index, tokens in zip(chunk, tokens_of_chunk, strict=True):
                    answers[index] = str(tokenizer.decode(tokens, skip_special_tokens=True))
    return answers
