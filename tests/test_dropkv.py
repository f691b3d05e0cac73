"""DropKV: the closed form against brute-force eviction, the model's own queries, smoothing, window, real runs."""

import pytest
import torch
from kvpress import AdaKVPress
from kvpress.utils import compute_n_kept
from transformers import DynamicCache

from evaluate import rundir
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import run_dir
from evaluate.run.entry import run
from scorers.dropkv import DropKVPress, dropkv_scores
from tests.support import assert_kept, compose_config, with_shared_context


def brute_force_scores(queries, keys, values, scaling):
    """Σ_i ‖o_i^(-j) - o_i‖² for every j, by evicting j and recomputing the causal window outputs in float64."""
    queries, keys, values = queries.double(), keys.double(), values.double()
    heads, window = queries.shape[1], queries.shape[2]
    seq = keys.shape[2]
    groups = heads // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    logits = queries @ keys.transpose(2, 3) * scaling
    visible = torch.arange(seq)[None, :] <= torch.arange(seq - window, seq)[:, None]

    def outputs(visible):
        return logits.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ values

    full = outputs(visible)
    scores = torch.empty(queries.shape[0], heads, seq, dtype=torch.float64)
    for j in range(seq):
        without_j = visible.clone()
        without_j[:, j] = False
        scores[..., j] = (outputs(without_j) - full).square().sum(dim=(-1, -2))
    return scores


def sink_inputs(heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Queries, keys, values and scaling with a sink key every query leans towards, and values sharing an offset,
    as in real models."""
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    batch, window, seq, head_dim = 2, 6, 40, 16
    queries = torch.randn(batch, heads, window, head_dim, generator=generator)
    keys = torch.randn(batch, kv_heads, seq, head_dim, generator=generator)
    sink = torch.nn.functional.normalize(torch.randn(head_dim, generator=generator), dim=0)
    queries += 2 * sink
    keys[:, :, 3] = 8 * sink
    values = torch.randn(batch, kv_heads, seq, head_dim, generator=generator) + 5
    return queries, keys, values, head_dim**-0.5


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (3, 3), (4, 1)])
def test_closed_form_equals_brute_force_eviction(heads, kv_heads):
    queries, keys, values, scaling = sink_inputs(heads, kv_heads)

    sink_probs = (queries @ keys.repeat_interleave(heads // kv_heads, dim=1).transpose(2, 3) * scaling).softmax(-1)
    # Where p -> 1 the weight (p / (1 - p))² is large and the expansion of ‖v_j - o_i‖² cancels most.
    assert 0.9 < sink_probs[..., 3].max() < 0.999

    expected = brute_force_scores(queries, keys, values, scaling)
    actual = dropkv_scores(queries, keys, values, scaling, epsilon=0.0)

    assert actual.dtype == torch.float32
    assert actual.shape == (keys.shape[0], heads, keys.shape[2])
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-6 * expected.max().item())


def test_hand_computed_score_with_epsilon():
    # One window query with q = 0 attends uniformly to the two keys: p = 1/2, o = (v_0 + v_1) / 2.
    queries = torch.zeros(1, 1, 1, 4)
    keys = torch.zeros(1, 1, 2, 4)
    values = torch.tensor([[[[1.0, 0, 0, 0], [0, 2.0, 0, 0]]]])
    scores = dropkv_scores(queries, keys, values, scaling=1.0, epsilon=0.5)
    # Both keys get p = 1/2 and ‖v_j - o‖² = (1/4 + 1) = 5/4: s = (0.5 / (1 - 0.5 + 0.5))² · 5/4.
    torch.testing.assert_close(scores, torch.full((1, 1, 2), 0.25 * 1.25))


def capture_attention(architecture: str, attn_implementation: str, seq: int = 96, layer: int = 1):
    """Run a tiny random model and capture one attention layer's inputs, cache, probabilities and outputs."""
    model = TinyRandomModel(architecture=architecture).load_model("cpu", "float32", attn_implementation)
    attention = model.model.layers[layer].self_attn
    captured = {}

    def keep_inputs(module, args, kwargs, output):
        captured["kwargs"] = kwargs
        captured["attentions"] = output[1]

    def keep_outputs(module, args):
        captured["outputs"] = args[0]

    hooks = [
        attention.register_forward_hook(keep_inputs, with_kwargs=True),
        attention.o_proj.register_forward_pre_hook(keep_outputs),
    ]
    cache = DynamicCache()
    input_ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids, past_key_values=cache, use_cache=True)
    for hook in hooks:
        hook.remove()
    keys, values = cache.layers[layer].keys, cache.layers[layer].values
    return attention, captured, keys, values


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_score_uses_the_modules_own_post_rope_queries(architecture):
    window = 16
    attention, captured, keys, values = capture_attention(architecture, "eager")
    kwargs = captured["kwargs"]
    batch, kv_heads, seq, head_dim = keys.shape
    heads = attention.config.num_attention_heads

    # Reference from what the model itself computed: eager attention probabilities, and the attention output
    # entering o_proj, for the last `window` queries.
    probs = captured["attentions"][:, :, -window:].double()
    outputs = captured["outputs"][:, -window:].view(batch, window, heads, head_dim).transpose(1, 2).double()
    grouped_values = values.double().repeat_interleave(heads // kv_heads, dim=1)
    distances = (grouped_values[:, :, None] - outputs[:, :, :, None]).square().sum(dim=-1)
    reference = ((probs / (1 - probs + 1e-6)).square() * distances).sum(dim=2)
    reference = reference.view(batch, kv_heads, -1, seq).mean(dim=2)[..., :-window]

    press = DropKVPress(compression_ratio=0.5, window_size=window, kernel_size=1)
    with torch.no_grad():
        scores = press.score(attention, kwargs["hidden_states"], keys, values, None, kwargs)

    assert scores.shape == (batch, kv_heads, seq)
    torch.testing.assert_close(scores[..., :-window].double(), reference, rtol=1e-4, atol=1e-6 * reference.max().item())
    # The reference discriminates: the same queries without RoPE give visibly different scores.
    cos, sin = kwargs["position_embeddings"]
    unrotated = dict(kwargs, position_embeddings=(torch.ones_like(cos), torch.zeros_like(sin)))
    with torch.no_grad():
        wrong = press.score(attention, kwargs["hidden_states"], keys, values, None, unrotated)[..., :-window]
    assert not torch.allclose(wrong.double(), reference, rtol=1e-2)
    prefix_max = scores[..., :-window].max()
    assert torch.equal(scores[..., -window:], torch.full_like(scores[..., -window:], 2 * prefix_max + 1))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def sdpa_layer(request):
    return capture_attention(request.param, "sdpa")


def test_smoothing_is_an_average_pool_of_the_unsmoothed_scores(sdpa_layer):
    attention, captured, keys, values = sdpa_layer
    kwargs, window = captured["kwargs"], 8
    with torch.no_grad():
        raw = DropKVPress(window_size=window, kernel_size=1).score(
            attention, kwargs["hidden_states"], keys, values, None, kwargs
        )
        smooth = DropKVPress(window_size=window, kernel_size=7).score(
            attention, kwargs["hidden_states"], keys, values, None, kwargs
        )
    prefix = raw[..., :-window]
    # Mean over the 7 positions centred on j, counting positions outside the prefix as 0 (SnapKV's pooling).
    padded = torch.nn.functional.pad(prefix, (3, 3))
    expected = torch.stack([padded[..., j : j + 7].sum(dim=-1) / 7 for j in range(prefix.shape[-1])], dim=-1)
    torch.testing.assert_close(smooth[..., :-window], expected)
    assert torch.equal(smooth[..., -window:], torch.full_like(smooth[..., -window:], 2 * expected.max() + 1))


def kept_positions(keys: torch.Tensor, kept_keys: torch.Tensor) -> list[set[int]]:
    """For each (batch, head), the positions of ``keys`` whose rows survive in ``kept_keys``."""
    matches = (kept_keys[:, :, :, None] == keys[:, :, None]).all(dim=-1).any(dim=2)
    return [set(row.nonzero().flatten().tolist()) for row in matches.flatten(0, 1)]


@pytest.mark.parametrize("kernel_size", [1, 7])
def test_topk_keeps_the_window_at_high_compression(sdpa_layer, kernel_size):
    attention, captured, keys, values = sdpa_layer
    kwargs, window, seq = captured["kwargs"], 8, keys.shape[2]
    press = DropKVPress(compression_ratio=0.9, window_size=window, kernel_size=kernel_size)
    n_kept = compute_n_kept(seq, 0.9)
    assert window < n_kept < 2 * window
    with torch.no_grad():
        kept_keys, kept_values = press.compress(attention, kwargs["hidden_states"], keys, values, None, kwargs)
    assert kept_keys.shape[2] == kept_values.shape[2] == n_kept
    for positions in kept_positions(keys, kept_keys):
        assert len(positions) == n_kept
        assert set(range(seq - window, seq)) <= positions


def test_adakv_keeps_the_window_of_every_head(sdpa_layer):
    attention, captured, keys, values = sdpa_layer
    kwargs, window, seq = captured["kwargs"], 8, keys.shape[2]
    press = AdaKVPress(DropKVPress(compression_ratio=0.9, window_size=window))
    with torch.no_grad():
        press.compress(attention, kwargs["hidden_states"], keys, values, None, kwargs)
    _, _, positions = attention.masked_key_indices
    del attention.masked_key_indices
    # AdaKV selects across heads: the window must outscore every head's scores, not only its own head's.
    assert len(positions) == keys.shape[1] * (seq - compute_n_kept(seq, 0.9))
    assert positions.max() < seq - window


def test_contexts_no_longer_than_the_window_and_even_kernels_are_refused(sdpa_layer):
    attention, captured, keys, values = sdpa_layer
    kwargs, seq = captured["kwargs"], keys.shape[2]
    with pytest.raises(ValueError, match="more than window_size"):
        DropKVPress(window_size=seq).score(attention, kwargs["hidden_states"], keys, values, None, kwargs)
    with pytest.raises(ValueError, match="must be odd"):
        DropKVPress(kernel_size=4)


@pytest.mark.parametrize("query_aware", [False, True])
@pytest.mark.parametrize("model", ["tiny_random", "tiny_random_qwen3"])
@pytest.mark.parametrize("press", ["topk", "adakv", "chunkkv", "eg_chunkkv"])
def test_dropkv_runs_end_to_end(tmp_path, press, model, query_aware):
    # limit=1: one context with two questions, so the compressed cache answers a second question too.
    overrides = (f"model={model}", "scorer=dropkv", f"press={press}", "cr=0.5", f"query_aware={query_aware}", "limit=1")
    cfg = with_shared_context(compose_config(tmp_path, *overrides))
    metrics = run(cfg)

    method = "dropkv" if press == "topk" else f"{press}_dropkv"
    out = run_dir(cfg)
    assert out.name.startswith(f"shared_context__{cfg.model.name}__{method}__cr0.50__")
    assert ("__query_aware__" in out.name) == query_aware
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert len(rows) == sum(task["n"] for task in metrics["tasks"].values()) == 2
    for row in rows:
        assert row["compression_ratio"] == 0.5
        assert_kept(press, row, 0.5)
    assert rundir.read_json(out / rundir.RUN)["status"] == "complete"
