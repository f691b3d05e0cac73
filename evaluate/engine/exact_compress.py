"""Tensor-only stand-ins for kvpress presses whose selection loops in Python, on the shared-prefill path.

kvpress's ``ChunkKVPress`` builds its kept positions chunk by chunk in a Python loop (a comparison, an ``arange``
and their ``.item()`` synchronisations per kept chunk: about 300 per layer at 4,096 tokens), and its
``EntropyGatedChunkKVPress`` visits chunks in a Python loop too. On the shared-prefill path every point runs its
press's compression on every layer of every context, so :func:`compress` gives these two classes (exactly these
classes, not subclasses, which may select otherwise) a stand-in made of tensor operations that keeps kvpress's
exact positions, ties included (tests/test_shared_compression.py checks them against kvpress's classes on
thousands of score vectors). kvpress's classes stay the reference, and the pipeline path runs them as they are.
"""

import torch
from kvpress import BasePress, ChunkKVPress
from kvpress import EntropyGatedChunkKVPress as UpstreamEntropyGatedChunkKVPress
from torch import nn

from evaluate.press_profile import stand_in
from presses.eg_chunkkv import EntropyGatedChunkKVPress


def chunkkv_kept(scores: torch.Tensor, chunk_length: int, compression_ratio: float) -> torch.Tensor:
    """The positions kvpress's ``ChunkKVPress`` keeps, ascending, from its inner scores (batch, heads, kv_len).

    kvpress's operations, in its order, up to the choice of chunks: chunk scores are the mean over each chunk of
    the scores summed over heads, the shorter last chunk scored apart; ``topk`` over batch element 0 keeps
    ``max(1, int(n_chunks * (1 - compression_ratio)))`` chunks. Only the last step differs: instead of one
    ``arange`` per kept chunk, concatenated and sorted, every position whose chunk was kept is read from one mask,
    which gives the same positions in the same (ascending) order. Needs at least one whole chunk, as kvpress
    delegates shorter contexts to the inner scorer.
    """
    kv_len = scores.shape[-1]
    n_complete, tail = divmod(kv_len, chunk_length)
    main = scores[..., : n_complete * chunk_length].sum(dim=1).view(-1, n_complete, chunk_length)
    chunk_scores = main.mean(dim=-1)
    if tail:
        chunk_scores = torch.cat([chunk_scores, scores[..., -tail:].sum(dim=1).mean(dim=-1, keepdim=True)], dim=-1)
    n_kept = max(1, int((n_complete + (tail > 0)) * (1 - compression_ratio)))
    top_chunks = chunk_scores.topk(n_kept, dim=-1).indices[0]
    kept_chunks = torch.zeros(chunk_scores.shape[-1], dtype=torch.bool, device=scores.device)
    kept_chunks[top_chunks] = True
    chunk_of_position = torch.arange(kv_len, device=scores.device) // chunk_length
    return kept_chunks[chunk_of_position].nonzero().squeeze(-1)


def _chunkkv(
    press: ChunkKVPress,
    module: nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ChunkKVPress.compress`` with :func:`chunkkv_kept`'s selection: same calls to the inner scorer, in the same
    order (a scorer that draws random numbers draws what it draws under kvpress), same keys and values."""
    if press.press.compression_ratio == 0:
        return keys, values
    scores = press.press.score(module, hidden_states, keys, values, None, kwargs)
    if keys.shape[2] < press.chunk_length:
        return press.press.compress(module, hidden_states, keys, values, None, kwargs)
    kept = chunkkv_kept(scores, press.chunk_length, press.press.compression_ratio)
    # index_select copies whole rows: the same tensors as kvpress's gather with an expanded index.
    return keys.index_select(2, kept), values.index_select(2, kept)


def _entropy_gated_chunkkv(
    press: UpstreamEntropyGatedChunkKVPress,
    module: nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kvpress's EG-ChunkKV through PressBench's (presses/eg_chunkkv.py), which at ``entropy_threshold=None``
    selects kvpress's tokens with a fixed number of kernels per layer; its scorer is called once, as kvpress's."""
    stand_in = EntropyGatedChunkKVPress(
        press=press.press, chunk_length=press.chunk_length, low_entropy_chunk_length=press.low_entropy_chunk_length
    )
    return stand_in.compress(module, hidden_states, keys, values, None, kwargs)


# By evaluate/press_profile.py's stand_in name.
STAND_INS = {"chunkkv": _chunkkv, "entropy_gated_chunkkv": _entropy_gated_chunkkv}


def compress(
    press: BasePress, module: nn.Module, hidden_states: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """``press.compress`` of one layer without attention weights, through its class's stand-in where it has one."""
    name = stand_in(press)
    if name is None:
        return press.compress(module, hidden_states, keys, values, None, kwargs)
    return STAND_INS[name](press, module, hidden_states, keys, values, kwargs)
