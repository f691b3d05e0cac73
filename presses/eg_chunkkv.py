"""EG-ChunkKV with a sweepable entropy threshold, selecting without a Python loop over chunks."""

import math
from dataclasses import dataclass

import torch
from kvpress import EntropyGatedChunkKVPress as UpstreamEntropyGatedChunkKVPress

from presses.exact_budget import ExactBudgetSelection

# The constant of kvpress's entropy; the gate compares entropies, so it must be the same to select the same chunks.
EPSILON = 1e-8


def normalized_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Entropy of the scores along the last dimension, divided by log(n): 0 for one spike, 1 for uniform.

    Negative scores are first shifted so that the minimum is 0, as kvpress does; non-negative ones are left as
    they are. The operations are kvpress's, in kvpress's order, so the values agree bit for bit.
    """
    shifted = scores - scores.amin(dim=-1, keepdim=True).clamp(max=0.0)
    p = shifted / (shifted.sum(dim=-1, keepdim=True) + EPSILON)
    h = -(p * (p + EPSILON).log()).sum(dim=-1)
    return (h / math.log(scores.shape[-1])).clamp(0.0, 1.0)


@dataclass
class EntropyGatedChunkKVPress(ExactBudgetSelection, UpstreamEntropyGatedChunkKVPress):
    """EG-ChunkKV: ChunkKV whose important but spiky chunks keep only their top tokens.

    Token scores from the inner scorer are summed over heads (batch element 0, one selection shared by all
    heads). The sequence is cut into chunks of ``chunk_length`` tokens, the last one possibly shorter; a chunk's
    score is the mean of its token scores and its entropy the normalized entropy of those scores (a chunk of one
    token has entropy 0). Chunks are visited in decreasing score order, spending the budget
    ``max(1, floor((1 - compression_ratio) * kv_len))``: a chunk is *spiky* when its score is at least the
    median chunk score and its entropy is strictly below the entropy threshold. A spiky chunk keeps only its top
    ``low_entropy_chunk_length`` tokens and any other chunk is kept whole, except the chunk at which the budget
    runs out, which keeps only its top tokens up to what is left. Budget left unspent because of spiky chunks
    goes to the highest-scored tokens not yet kept, so every layer keeps exactly the budget.

    With ``entropy_threshold=None`` this selects exactly the tokens of kvpress 0.5.5's
    ``EntropyGatedChunkKVPress``: same operations and same tie-breaking (``torch.argsort`` of the chunk scores,
    ``torch.topk`` within a chunk), checked on CPU by tests/test_presses.py, ties included. Only the how differs:
    the greedy pass over chunks becomes a cumulative sum over the chunks in score order, the top tokens of all
    spiky chunks come from one batched ``topk``, and keys and values are copied with ``index_select``. Upstream
    launches a few kernels per chunk from a Python loop; this press launches a fixed number per layer and
    synchronises with the device at most three times per layer, however many chunks there are.

    Parameters
    ----------
    press : ScorerPress
        Inner scorer giving per-token importance scores.
    chunk_length : int, default=10
        Tokens per chunk (the EG-ChunkKV PR's setting).
    low_entropy_chunk_length : int, default=4
        Tokens kept from a spiky chunk (the PR's ``rescue_size``); must be below ``chunk_length``.
    entropy_threshold : float or None, default=None
        The PR's τ, in [0, 1]: a chunk is low-entropy when its normalized entropy is strictly below τ (compared in
        fp32). ``None`` uses the median of the layer's chunk entropies (the lower median for an even number of
        chunks, ``torch.median``), as kvpress ships it. ``0`` turns the gate off (no chunk is spiky): whole chunks
        in score order, the last one trimmed to the budget.
    """

    entropy_threshold: float | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.entropy_threshold is not None and not 0.0 <= self.entropy_threshold <= 1.0:
            raise ValueError(f"entropy_threshold={self.entropy_threshold} must be in [0, 1] (or None for the median)")

    def select(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Boolean mask over the ``kv_len`` positions of ``scores``, with exactly ``budget`` positions set."""
        chunk_len, rescue = self.chunk_length, self.low_entropy_chunk_length
        kv_len = scores.shape[0]
        n_complete, tail = divmod(kv_len, chunk_len)
        device = scores.device

        # Complete chunks and the shorter tail are scored separately, as upstream does, so that every reduction
        # runs over the same elements in the same layout and gives the same bits.
        complete = scores[: n_complete * chunk_len].view(n_complete, chunk_len)
        chunk_scores = complete.mean(dim=1)
        chunk_entropy = normalized_entropy(complete)
        sizes = torch.full((n_complete + (tail > 0),), chunk_len, device=device)
        if tail:
            sizes[-1] = tail
            tail_scores = scores[n_complete * chunk_len :]
            tail_entropy = normalized_entropy(tail_scores) if tail > 1 else torch.zeros((), device=device)
            chunk_scores = torch.cat([chunk_scores, tail_scores.mean().view(1)])
            chunk_entropy = torch.cat([chunk_entropy, tail_entropy.view(1)])

        threshold = chunk_entropy.median() if self.entropy_threshold is None else self.entropy_threshold
        spiky = (chunk_scores >= chunk_scores.median()) & (chunk_entropy < threshold)
        caps = torch.where(spiky, sizes.clamp(max=rescue), sizes)

        # Upstream's greedy pass, closed form: in score order a chunk gets its cap or whatever budget is left.
        order = torch.argsort(chunk_scores, descending=True)
        ordered_caps = caps[order]
        left_before = budget - (ordered_caps.cumsum(0) - ordered_caps)
        n_kept = torch.empty_like(caps).scatter_(0, order, left_before.clamp(min=0).minimum(ordered_caps))

        whole = n_kept == sizes
        # Chunks trimmed to `rescue` tokens: upstream calls topk(k=rescue) on each; a batched topk over the rows
        # returns the same indices, ties included.
        top_rescue = torch.zeros_like(complete, dtype=torch.bool).scatter_(
            1, complete.topk(rescue, dim=1).indices, True
        )
        keep = whole[:n_complete].unsqueeze(1) | (top_rescue & (n_kept[:n_complete] == rescue).unsqueeze(1))
        keep = keep.flatten()
        if tail:
            keep_tail = whole[-1].expand(tail)
            if tail > rescue:
                top_tail = torch.zeros(tail, dtype=torch.bool, device=device).scatter_(
                    0, tail_scores.topk(rescue).indices, True
                )
                keep_tail = keep_tail | (top_tail & (n_kept[-1] == rescue))
            keep = torch.cat([keep, keep_tail])

        # Left: at most one chunk where the budget ran out mid-chunk with another count than `rescue`, or, when
        # spiky chunks left budget unspent, the top-up. They exclude each other, and one sync fetches both.
        cut = (n_kept > 0) & (n_kept < sizes) & (n_kept != rescue)
        has_cut, cut_chunk, cut_kept, unspent = torch.stack(
            [cut.any(), cut.int().argmax(), torch.where(cut, n_kept, 0).sum(), budget - n_kept.sum()]
        ).tolist()
        if has_cut:
            start = cut_chunk * chunk_len
            keep[start + scores[start : start + chunk_len].topk(cut_kept).indices] = True
        if unspent > 0:
            # Exactly `unspent` positions are not kept yet at least, since kv_len >= budget.
            leftover = (~keep).nonzero().squeeze(-1)
            keep[leftover[scores[leftover].topk(unspent).indices]] = True
        return keep
