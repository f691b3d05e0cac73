"""The compress step shared by the presses that keep an exact budget of positions in every layer."""

import torch
from torch import nn


class ExactBudgetSelection:
    """Keeps exactly ``max(1, floor((1 - compression_ratio) * kv_len))`` positions, one selection for all heads.

    The inner scorer's token scores are summed over heads (batch element 0, the convention of kvpress's ChunkKV);
    the subclass's ``select(scores, budget)`` returns the boolean mask of the positions to keep. Mixed in before a
    kvpress press dataclass that holds the inner scorer as ``press``.
    """

    def compress(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.press.compression_ratio == 0:
            return keys, values
        assert attentions is None, f"{type(self).__name__} does not support attentions."
        budget = max(1, int(keys.shape[2] * (1 - self.press.compression_ratio)))
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs).sum(dim=1)[0].float()
        indices = self.select(scores, budget).nonzero().squeeze(-1)
        # index_select copies whole rows: the same tensors as upstream's gather with an expanded index, faster.
        return keys.index_select(2, indices), values.index_select(2, indices)

    def select(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Boolean mask over the ``kv_len`` positions of ``scores``, with exactly ``budget`` positions set."""
        raise NotImplementedError
