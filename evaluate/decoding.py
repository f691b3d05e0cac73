"""Greedy decoding of many questions at once, each on its own compressed cache.

kvpress's pipeline answers one question at a time: it runs the question on the compressed cache, then
decodes token by token until an end-of-sequence token or ``max_new_tokens``. On a small model, and on a
GPU at any size, a decoding step costs about the same for one sequence as for a dozen, so a sweep that
answers every point's questions of a context together takes a fraction of the steps.

Each question still runs alone on its own cache (so its first token and its cache are exactly the
pipeline's); the caches are then left-padded to one length, with the padding masked out, and decoded as one
batch, each row at its own positions and stopping on the pipeline's rule. A row leaves the batch as soon as it
stops. Padding changes the length of the attention reductions and the batch changes the matrix shapes, so
the logits can differ from one-by-one decoding in the last bits; the greedy tokens are the same unless two
candidates tie to within that rounding (tests/test_decoding.py checks equality with the pipeline). Rows
whose cache cannot be batched (different lengths across layers, or keys masked on the attention modules as
AdaKV does) are decoded alone.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class DecodeRequest:
    """One question to answer greedily from ``cache``, which it leaves as it found it.

    ``context_length`` is the uncompressed context's length: the question's positions follow it, as in
    kvpress's pipeline, whatever the press removed.
    """

    cache: DynamicCache
    question_ids: torch.Tensor
    context_length: int
    max_new_tokens: int


def stop_token_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def batchable(cache: DynamicCache, attention_modules: Sequence[torch.nn.Module]) -> bool:
    """Whether a row on this cache can share a batch: one length in every layer, nothing masked in place."""
    if any(getattr(module, "masked_key_indices", None) is not None for module in attention_modules):
        return False
    return len({layer.keys.shape[2] for layer in cache.layers}) == 1


@dataclass
class _Row:
    index: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: list[int]
    next_position: int
    max_new_tokens: int

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]


def _answer_question(model, request: DecodeRequest, index: int) -> _Row:
    """Run the question on its cache as the pipeline does; keep the extended keys and values, restore the cache."""
    cache = request.cache
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    question_length = request.question_ids.shape[1]
    positions = torch.arange(request.context_length, request.context_length + question_length, device=model.device)
    logits = model(
        input_ids=request.question_ids.to(model.device),
        past_key_values=cache,
        position_ids=positions.unsqueeze(0),
        logits_to_keep=1,
    ).logits
    row = _Row(
        index=index,
        keys=[layer.keys for layer in cache.layers],
        values=[layer.values for layer in cache.layers],
        tokens=[int(logits[0, -1].argmax())],
        next_position=request.context_length + question_length,
        max_new_tokens=request.max_new_tokens,
    )
    for layer, length in zip(cache.layers, lengths, strict=True):
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]
    return row


def _finished(row: _Row, stop_ids: set[int]) -> bool:
    # The pipeline never tests its first token (the question's own output) against the stop tokens.
    return len(row.tokens) >= row.max_new_tokens or (len(row.tokens) > 1 and row.tokens[-1] in stop_ids)


def _left_padded(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    batch = tensors[0].new_zeros((len(tensors), tensors[0].shape[1], length, tensors[0].shape[3]))
    for row, tensor in enumerate(tensors):
        batch[row, :, length - tensor.shape[2] :] = tensor[0]
    return batch


def _decode_batch(model, rows: list[_Row], stop_ids: set[int]) -> None:
    """Greedy steps for ``rows`` together until every row has stopped; tokens are appended to each row."""
    rows = [row for row in rows if not _finished(row, stop_ids)]
    if not rows:
        return
    num_layers = len(rows[0].keys)
    length = max(row.length for row in rows)
    mask = torch.zeros((len(rows), length), dtype=torch.long, device=model.device)
    for position, row in enumerate(rows):
        mask[position, length - row.length :] = 1
    padded = not bool(mask.all())
    cache = DynamicCache()
    for layer_idx in range(num_layers):
        cache.update(
            _left_padded([row.keys[layer_idx] for row in rows], length),
            _left_padded([row.values[layer_idx] for row in rows], length),
            layer_idx,
        )
    for row in rows:
        row.keys = row.values = None  # the batched cache holds them now
    while rows:
        input_ids = torch.tensor([[row.tokens[-1]] for row in rows], device=model.device)
        positions = torch.tensor([[row.next_position] for row in rows], device=model.device)
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
        logits = model(
            input_ids=input_ids,
            past_key_values=cache,
            position_ids=positions,
            attention_mask=mask if padded else None,
        ).logits
        for row, token in zip(rows, logits[:, -1].argmax(dim=-1).tolist(), strict=True):
            row.tokens.append(token)
            row.next_position += 1
        going = [position for position, row in enumerate(rows) if not _finished(row, stop_ids)]
        if len(going) < len(rows):
            rows = [rows[position] for position in going]
            if rows:
                keep = torch.tensor(going, device=model.device)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[keep], layer.values[keep]
                mask = mask[keep]
                padded = not bool(mask.all())


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def greedy_answers(model, tokenizer, requests: list[DecodeRequest], batch_size: int) -> list[str]:
    """The answer kvpress's pipeline would give to each request, decoding up to ``batch_size`` rows at once.

    Requests whose caches cannot share a batch (see ``batchable``) must be passed alone, with batch_size 1.
    """
    stop_ids = stop_token_ids(model)
    answers: list[str] = [""] * len(requests)
    for chunk in _chunks(list(enumerate(requests)), max(1, batch_size)):
        with torch.no_grad():
            rows = [_answer_question(model, request, index) for index, request in chunk]
            _decode_batch(model, rows, stop_ids)
        for row in rows:
            answers[row.index] = str(tokenizer.decode(row.tokens, skip_special_tokens=True))
    return answers
