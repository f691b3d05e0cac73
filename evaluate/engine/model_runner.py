"""One forward pass of the decoding pool: the inputs of the rows it serves, the model over the slot cache, and what
each row gets out of it (the scheduler sees tokens and log-probabilities, never logits).

Rows that join run their questions as one pass of their own, left-padded so that every row's last question token is
the last column, and get their first greedy token, or, teacher-forced, their answer's log-probabilities; rows that
decode run one token each and get the next. A pass's time and count are shared by the rows it served.
"""

import time

import torch

from evaluate.engine.devices import synchronizer
from evaluate.engine.requests import RunningRow
from evaluate.engine.slot_cache import SlotCache


class ModelRunner:
    """Runs ``model`` over a :class:`SlotCache` for the scheduler's rows, and counts its passes."""

    def __init__(self, model):
        self.model = model
        self.synchronize = synchronizer(model)
        self.forward_passes = 0
        self.peak_rows = 0

    def ask_questions(self, cache: SlotCache, slots: list[int], rows: list[RunningRow]) -> list[int | torch.Tensor]:
        """The joining rows' first pass: their questions (and teacher-forced answers), left-padded. Returns each row's
        output: its first greedy token, or, teacher-forced, its answer's float32 log-probabilities ([answer tokens,
        vocabulary]). Leaves each slot's first token and its next position on the device for :meth:`decode_step`."""
        input_ids, position_ids, lengths = self._question_inputs(cache.input_device, rows)
        answers = [row.request.answer_ids.shape[-1] for row in rows if row.request.answer_ids is not None]
        keep = max(answers, default=0) + 1
        start = time.perf_counter()
        cache.plan(slots, lengths, input_ids.shape[1])
        logits = self._forward(cache, input_ids, position_ids, keep)
        index = torch.tensor(slots, device=cache.input_device)
        # The logits come back to the input ids' device (accelerate's hook on the whole model moves them there).
        tokens = logits[:, -1].argmax(dim=-1)
        cache.tokens[index] = tokens
        cache.positions[index] = position_ids[:, -1] + 1
        self._count(logits, rows, start)
        return self._question_outputs(logits, tokens, rows)

    @staticmethod
    def _question_inputs(device: torch.device, rows: list[RunningRow]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The joining rows' input ids and positions, left-padded to the longest, and each row's real length (a
        conversation's row runs its current turn's input, where its previous turn ended)."""
        lengths = [row.input_ids.shape[1] for row in rows]
        width = max(lengths)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        position_ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for index, (row, length) in enumerate(zip(rows, lengths, strict=True)):
            input_ids[index, width - length :] = row.input_ids[0].to(device)
            start = row.start_position
            position_ids[index, width - length :] = torch.arange(start, start + length, device=device)
        return input_ids, position_ids, lengths

    @staticmethod
    def _question_outputs(
        logits: torch.Tensor, tokens: torch.Tensor, rows: list[RunningRow]
    ) -> list[int | torch.Tensor]:
        """Each row's greedy token (``tokens``, the last column's argmax), or a teacher-forced row's log-probabilities
        of its answer tokens, read from the columns that predict them: the last question token's and each answer
        token's but the last."""
        outputs: list[int | torch.Tensor] = []
        for row, row_logits, token in zip(rows, logits, tokens.tolist(), strict=True):
            answer = row.request.answer_ids
            if answer is None:
                outputs.append(token)
            else:
                outputs.append(torch.log_softmax(row_logits[-answer.shape[-1] - 1 : -1].float(), dim=-1))
        return outputs

    def decode(self, cache: SlotCache, rows: list[RunningRow | None]) -> list[int]:
        """One greedy token for every occupied slot (an empty slot runs a discarded token).

        The step itself (:meth:`decode_step`) reads nothing back; the tokens come to the host here, in one transfer
        per step, because the scheduler must know which rows stopped to give their slots to waiting rows.
        """
        start = time.perf_counter()
        cache.plan(None, None, 1)
        tokens = self.decode_step(cache).tolist()
        self._count(None, [row for row in rows if row is not None], start)
        return tokens

    def decode_step(self, cache: SlotCache) -> torch.Tensor:
        """One token for every slot, from the tokens and positions the slot cache holds, which it advances: device
        work only, of shapes fixed by the planned segments (compilable with ``fullgraph=True``, capturable)."""
        logits = self._forward(cache, cache.tokens[:, None], cache.positions[:, None], 1)
        tokens = logits[:, -1].argmax(dim=-1)
        cache.tokens.copy_(tokens)
        cache.positions.add_(cache.live)
        return tokens

    def _forward(self, cache: SlotCache, input_ids, position_ids, keep: int) -> torch.Tensor:
        cache_position = torch.arange(input_ids.shape[1], device=input_ids.device)
        logits = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            past_key_values=cache,
            cache_position=cache_position,
            logits_to_keep=keep,
            pool=cache,
        ).logits
        cache.end_pass()
        return logits

    def _count(self, logits: torch.Tensor | None, served: list[RunningRow], start: float) -> None:
        """Share the pass's time (its kernels included) and count among the rows it served."""
        if logits is not None:
            self.synchronize()
        self.peak_rows = max(self.peak_rows, len(served))
        self.forward_passes += 1
        share = (time.perf_counter() - start) / len(served)
        for row in served:
            row.cost.decode_seconds += share
            row.cost.forward_passes += 1 / len(served)
