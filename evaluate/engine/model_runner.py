"""One forward pass of the decoding pool: the inputs of the rows it serves, the model over the slot cache, the logits.

Rows that join run their questions as one pass of their own, left-padded so that every row's last question token is
the last column; rows that decode run one token each. A pass's time and count are shared by the rows it served.
"""

import time

import torch

from evaluate.engine.requests import RunningRow
from evaluate.engine.slot_cache import SlotCache


class ModelRunner:
    """Runs ``model`` over a :class:`SlotCache` for the scheduler's rows, and counts its passes."""

    def __init__(self, model):
        self.model = model
        self.forward_passes = 0
        self.peak_rows = 0

    def ask_questions(self, cache: SlotCache, slots: list[int], rows: list[RunningRow]) -> torch.Tensor:
        """The joining rows' first pass: their questions (and teacher-forced answers), left-padded. Returns the logits
        of the last columns each row needs: its last question token's, and each answer token's but the last."""
        device = self.model.device
        lengths = [row.request.input_ids.shape[1] for row in rows]
        width = max(lengths)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        position_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for index, (row, length) in enumerate(zip(rows, lengths, strict=True)):
            input_ids[index, width - length :] = row.request.input_ids[0].to(device)
            start = row.request.context_length
            position_ids[index, width - length :] = torch.arange(start, start + length, device=device)
            row.next_position = start + length
        query_lengths = torch.tensor(lengths, device=device)
        answers = [row.request.answer_ids.shape[-1] for row in rows if row.request.answer_ids is not None]
        keep = max(answers, default=0) + 1
        return self._forward(
            cache, torch.tensor(slots, device=device), query_lengths, input_ids, position_ids, rows, keep
        )

    def decode(self, cache: SlotCache, rows: list[RunningRow | None]) -> list[int]:
        """One greedy token for every occupied slot (an empty slot runs a discarded token)."""
        device = self.model.device
        live = [row is not None for row in rows]
        input_ids = torch.tensor([[row.tokens[-1] if row else 0] for row in rows], device=device)
        position_ids = torch.tensor([[row.next_position if row else 0] for row in rows], device=device)
        query_lengths = torch.tensor(live, dtype=torch.long, device=device)
        served = [row for row in rows if row is not None]
        logits = self._forward(cache, None, query_lengths, input_ids, position_ids, served)
        return logits[:, -1].argmax(dim=-1).tolist()

    def _forward(
        self, cache: SlotCache, slots, query_lengths, input_ids, position_ids, served: list[RunningRow], keep: int = 1
    ) -> torch.Tensor:
        start = time.perf_counter()
        self.peak_rows = max(self.peak_rows, len(served))
        cache_position = torch.arange(input_ids.shape[1], device=input_ids.device)
        with cache.forward(slots, query_lengths, input_ids.shape[1]):
            logits = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                past_key_values=cache,
                cache_position=cache_position,
                logits_to_keep=keep,
                pool=cache,
            ).logits
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)  # the pass's time includes its kernels
        self.forward_passes += 1
        share = (time.perf_counter() - start) / len(served)
        for row in served:
            row.cost.decode_seconds += share
            row.cost.forward_passes += 1 / len(served)
        return logits
