"""DropKV: score each KV pair by how much evicting it would move the attention outputs of the last queries."""

from dataclasses import dataclass

import torch
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import get_prerope_query_states
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import rotate_half


def window_queries(
    module: nn.Module, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """The attention module's own post-RoPE queries for ``hidden_states``, in fp32.

    ``position_embeddings`` are the (cos, sin) of the whole forward pass; the queries take the last positions.
    Projection and query norm (Qwen3, Gemma3) come from kvpress's ``get_prerope_query_states``, as in SnapKV.
    """
    n_queries = hidden_states.shape[1]
    queries = get_prerope_query_states(module, hidden_states).float()
    cos, sin = (embedding[:, -n_queries:].float().unsqueeze(1) for embedding in position_embeddings)
    return queries * cos + rotate_half(queries) * sin


def dropkv_scores(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, epsilon: float = 1e-6
) -> torch.Tensor:
    """Unsmoothed DropKV scores of every key position, per query head, in fp32.

    Parameters
    ----------
    queries : torch.Tensor
        (batch, heads, window, head_dim): queries of the last ``window`` positions of the sequence.
    keys, values : torch.Tensor
        (batch, kv_heads, seq, head_dim); query head h reads KV head ``h // (heads // kv_heads)``.
    scaling : float
        Factor applied to q·k before the softmax (the attention module's ``scaling``).
    epsilon : float
        Added to ``1 - p`` in the denominator, for keys that take all of a query's attention.

    Returns
    -------
    torch.Tensor
        (batch, heads, seq): s_j = Σ_i (p_ij / (1 - p_ij + ε))² · ‖v_j - o_i‖² over the window queries i.
        Window query i attends causally, to keys up to its own position: p_ij is its real attention
        probability, 0 on the keys after it, and o_i is its real attention output.
    """
    batch, heads, window, head_dim = queries.shape
    kv_heads, seq = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    # Query heads sharing a KV head become rows of one matrix, so no key or value is repeated per group.
    queries = queries.float().reshape(batch, kv_heads, groups * window, head_dim)
    keys = keys.float()
    # ‖v_j - o_i‖² is unchanged when all values shift together (o_i shifts with them, Σ_k p_ik = 1); centring
    # shrinks the norms whose difference the expansion below takes, and with them its cancellation error.
    values = values.float()
    values = values - values.mean(dim=2, keepdim=True)

    logits = torch.matmul(queries, keys.transpose(2, 3)).mul_(scaling)
    causal = torch.ones(window, window, dtype=torch.bool, device=logits.device).triu_(1)
    logits.view(batch, kv_heads, groups, window, seq)[..., seq - window :].masked_fill_(causal, float("-inf"))
    probs = logits.softmax(dim=-1)
    del logits
    outputs = torch.matmul(probs, values)

    # ‖v_j - o_i‖² = ‖v_j‖² - 2 v_j·o_i + ‖o_i‖²: window × seq numbers, never window × seq × head_dim.
    distances = torch.matmul(outputs, values.transpose(2, 3)).mul_(-2)
    distances.add_(outputs.square().sum(dim=-1, keepdim=True)).add_(values.square().sum(dim=-1).unsqueeze(2))
    # The expansion cancels where v_j ≈ o_i, i.e. where p_ij ≈ 1, exactly where the weight (p / (1 - p))² is
    # largest. Only a query's most attended key can have p > 1/2, so its distance is taken directly (window ×
    # head_dim numbers); every other weight is at most 1 and leaves the rounding at fp32 level.
    top_keys = probs.argmax(dim=-1, keepdim=True)
    top_values = values.gather(2, top_keys.expand(-1, -1, -1, head_dim))
    distances.scatter_(-1, top_keys, (top_values - outputs).square().sum(dim=-1, keepdim=True))
    distances.clamp_(min=0)
    weights = probs.div_(torch.rsub(probs, 1 + epsilon)).square_()
    scores = distances.mul_(weights).view(batch, kv_heads, groups, window, seq).sum(dim=3)
    return scores.view(batch, heads, seq)


@dataclass
class DropKVPress(ScorerPress):
    """DropKV: keep the KV pairs whose eviction would change the recent attention outputs most.

    For the last ``window_size`` queries, with attention probabilities p_ij and outputs o_i = Σ_k p_ik v_k,
    evicting position j renormalises the softmax over the remaining keys and moves each output by
    o_i^(-j) - o_i = p_ij / (1 - p_ij) · (o_i - v_j). The score of j is the total squared displacement,
    s_j = Σ_i (p_ij / (1 - p_ij + ε))² · ‖v_j - o_i‖² (higher means keep).

    The queries are the model's own post-RoPE queries of the window, obtained as in kvpress's SnapKV; each
    window query attends causally, so its probabilities and outputs are those the model computed. Scores are
    computed in fp32, averaged over the query heads sharing a KV head, smoothed along the sequence with an
    average pool, and the window itself is always kept. Attention weights handed over by eager attention are
    not used: they are in the model dtype, too coarse for 1 - p near 1, and the outputs o_i need the
    probabilities again anyway.

    Parameters
    ----------
    compression_ratio : float, default=0.0
        Fraction of key-value pairs to remove during compression.
    window_size : int, default=32
        Number of most recent queries whose outputs the score protects; these positions are always kept.
    kernel_size : int, default=7
        Odd width of the average pool that smooths scores along the sequence; 1 disables smoothing.
    epsilon : float, default=1e-6
        Added to 1 - p_ij in the denominator.
    """

    compression_ratio: float = 0.0
    window_size: int = 32
    kernel_size: int = 7
    epsilon: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.window_size < 1:
            raise ValueError(f"window_size={self.window_size} must be at least 1")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            # An even kernel with symmetric padding would shift the scores by half a position.
            raise ValueError(f"kernel_size={self.kernel_size} must be odd and positive (1 disables smoothing)")

    def score(
        self,
        module: nn.Module,
        hidden_states: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attentions: torch.Tensor,
        kwargs: dict,
    ) -> torch.Tensor:
        batch, kv_heads, k_len, _ = keys.shape
        if min(hidden_states.shape[1], k_len) <= self.window_size:
            raise ValueError(
                f"DropKV needs more than window_size={self.window_size} tokens, got {hidden_states.shape[1]}"
            )
        # As in SnapKV, the window queries are the last positions of the cache.
        queries = window_queries(module, hidden_states[:, -self.window_size :], kwargs["position_embeddings"])
        scores = dropkv_scores(queries, keys, values, module.scaling, self.epsilon)
        scores = scores.view(batch, kv_heads, -1, k_len).mean(dim=2)[..., : -self.window_size]
        if self.kernel_size > 1:
            scores = F.avg_pool1d(scores, kernel_size=self.kernel_size, padding=self.kernel_size // 2, stride=1)
        # Scores are non-negative and can exceed 2**24, where max + 1 rounds back to max; 2 * max + 1 stays above
        # every score of every head, so AdaKV's selection across heads keeps the window too. No .item(): no sync.
        keep = (2 * scores.amax() + 1).expand(batch, kv_heads, self.window_size)
        return torch.cat([scores, keep], dim=-1)
