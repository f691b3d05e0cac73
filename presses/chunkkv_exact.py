"""ChunkKV with EG-ChunkKV's exact budget in every layer (``press=chunkkv_exact``)."""

from dataclasses import dataclass

import torch
from kvpress import ChunkKVPress as UpstreamChunkKVPress

from presses.exact_budget import ExactBudgetSelection


@dataclass
class ExactChunkKVPress(ExactBudgetSelection, UpstreamChunkKVPress):
    """ChunkKV (https://arxiv.org/abs/2502.00299) that keeps the same number of tokens in every layer.

    Token scores from the inner scorer are summed over heads; each chunk of ``chunk_length`` consecutive
    tokens is scored by its mean token score, and chunks are kept whole in decreasing score order. The chunk
    that would overflow the budget keeps only its top-scored tokens, so every layer keeps exactly
    ``max(1, floor((1 - compression_ratio) * kv_len))`` tokens: the budget of EntropyGatedChunkKVPress, which
    makes the two directly comparable.

    Differences from kvpress's ``ChunkKVPress`` (``press=chunkkv``, the press behind published numbers): upstream
    keeps ``int(n_chunks * (1 - compression_ratio))`` whole chunks, so it keeps up to a chunk more or less than
    this budget, and whether the shorter trailing chunk is among them changes from layer to layer. Upstream also
    falls back to the bare scorer when the context is shorter than one chunk; here such a context is one
    (partial) chunk like any other. EG-ChunkKV minus this press is the entropy gate alone at an equal budget.

    Parameters
    ----------
    press : ScorerPress
        Inner scorer giving per-token importance scores.
    chunk_length : int, default=10
        Tokens per chunk (the EG-ChunkKV PR's setting).
    """

    chunk_length: int = 10

    def select(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        kv_len = scores.shape[0]
        chunk_of_token = torch.arange(kv_len, device=scores.device) // self.chunk_length
        n_chunks = int(chunk_of_token[-1]) + 1
        chunk_sizes = torch.bincount(chunk_of_token, minlength=n_chunks)
        chunk_scores = torch.zeros(n_chunks, device=scores.device).index_add_(0, chunk_of_token, scores) / chunk_sizes

        order = torch.argsort(chunk_scores, descending=True, stable=True)
        kept_before = torch.cumsum(chunk_sizes[order], dim=0)
        n_whole = int((kept_before <= budget).sum())
        keep = torch.isin(chunk_of_token, order[:n_whole])
        leftover = budget - (int(kept_before[n_whole - 1]) if n_whole else 0)
        if leftover > 0:
            partial = int(order[n_whole])
            start = partial * self.chunk_length
            end = start + int(chunk_sizes[partial])
            keep[start + torch.topk(scores[start:end], leftover).indices] = True

        return keep
