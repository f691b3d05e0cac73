"""Compression shared across points: exact stand-ins for kvpress's chunk presses, scores computed once per context,
and no copies for presses that write into nothing, each leaving every point's cache what its own press leaves."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from kvpress import ChunkKVPress, EntropyGatedChunkKVPress, SnapKVPress, ThinKPress

from evaluate.engine.exact_compress import compress
from evaluate.engine.prefill import compressed_cache, needs_copy
from evaluate.engine.score_memo import ScoreMemo
from evaluate.press_profile import members
from tests.support import captured_prefill, compose_config
from tests.test_presses import FixedScores

KINDS = ("uniform", "integers", "constant", "sparse", "signed", "bfloat16")
LENGTHS = (1, 2, 5, 9, 10, 11, 19, 20, 21, 33, 97, 128, 255, 523)
CHUNK_LENGTHS = (1, 2, 3, 7, 10, 16, 20)
RATIOS = (0.0, 0.05, 0.1, 0.25, 0.5, 0.7, 0.9, 0.99)


def scores_of(kind: str, kv_len: int, generator: torch.Generator) -> torch.Tensor:
    """Scores (1, 3 heads, kv_len): integer and constant ones tie between chunk means and within chunks."""
    shape = (1, 3, kv_len)
    if kind == "integers":
        return torch.randint(0, 3, shape, generator=generator).float()
    if kind == "constant":
        return torch.ones(shape)
    if kind == "sparse":
        return torch.rand(shape, generator=generator).pow(8).mul(torch.rand(shape, generator=generator) < 0.2)
    if kind == "signed":
        return torch.randn(shape, generator=generator)
    if kind == "bfloat16":  # SnapKV's scores are in the model's dtype: coarse, so many ties
        return torch.rand(shape, generator=generator).to(torch.bfloat16)
    return torch.rand(shape, generator=generator)


def kept(press, scores: torch.Tensor, through_stand_in: bool) -> torch.Tensor:
    """Keys and values ``press`` keeps from keys that hold their own positions (each head its own offset)."""
    heads, kv_len = scores.shape[1], scores.shape[2]
    positions = torch.arange(kv_len, dtype=torch.float32).view(1, 1, kv_len, 1)
    keys = (positions + 1000 * torch.arange(heads).view(1, heads, 1, 1)).expand(1, heads, kv_len, 2).contiguous()
    module = SimpleNamespace(head_dim=2, layer_idx=0)
    if through_stand_in:
        return torch.cat(compress(press, module, None, keys, -keys, {}), dim=-1)
    return torch.cat(press.compress(module, None, keys, -keys, None, {}), dim=-1)


def test_chunkkv_stand_in_keeps_kvpress_positions_ties_included():
    cases = 0
    for kind, kv_len in itertools.product(KINDS, LENGTHS):
        generator = torch.Generator().manual_seed(kv_len)
        for chunk_length, cr in itertools.product(CHUNK_LENGTHS, RATIOS):
            scorer = FixedScores(compression_ratio=cr, scores=scores_of(kind, kv_len, generator))
            press = ChunkKVPress(press=scorer, chunk_length=chunk_length)
            expected, got = kept(press, scorer.scores, False), kept(press, scorer.scores, True)
            assert torch.equal(expected, got), (kind, kv_len, chunk_length, cr, scorer.scores)
            cases += 1
    assert cases == len(KINDS) * len(LENGTHS) * len(CHUNK_LENGTHS) * len(RATIOS)


@pytest.mark.parametrize(("chunk_length", "low_entropy_chunk_length"), [(10, 4), (2, 1), (7, 3), (20, 5)])
def test_eg_chunkkv_stand_in_keeps_kvpress_positions(chunk_length, low_entropy_chunk_length):
    for kind, kv_len in itertools.product(KINDS, LENGTHS):
        generator = torch.Generator().manual_seed(kv_len)
        for cr in RATIOS:
            scorer = FixedScores(compression_ratio=cr, scores=scores_of(kind, kv_len, generator).float())
            press = EntropyGatedChunkKVPress(
                press=scorer, chunk_length=chunk_length, low_entropy_chunk_length=low_entropy_chunk_length
            )
            expected, got = kept(press, scorer.scores, False), kept(press, scorer.scores, True)
            assert torch.equal(expected, got), (kind, kv_len, cr, scorer.scores)


@pytest.fixture(scope="module")
def prefill():
    """The tiny model's layers and the captured inputs of one 300-token prefill."""
    model, _, captured = captured_prefill()
    return model.model.layers, captured


# Every press x scorer of the config tree at two ratios, as the points of one sweep on one context.
POINTS = [
    (f"press={press}", f"scorer={scorer}", f"cr={cr}")
    for press in ("topk", "chunkkv", "chunkkv_exact", "eg_chunkkv", "eg_chunkkv_upstream", "adakv")
    for scorer in ("snapkv", "dropkv", "expected_attention", "tova", "knorm", "keydiff", "streaming_llm", "random")
    for cr in (0.3, 0.8)
]


def own_compression(press, layers, captured) -> list[tuple]:
    """Each layer's keys, values and AdaKV mask from the press's own ``compress`` on copies of the inputs."""
    compressed = []
    for layer, (hidden_states, keys, values, kwargs) in zip(layers, captured, strict=True):
        layer.self_attn.masked_key_indices = None
        keys, values = press.compress(layer.self_attn, hidden_states, keys.clone(), values.clone(), None, kwargs)
        compressed.append((keys, values, layer.self_attn.masked_key_indices))
    return compressed


def test_a_context_shared_by_every_point_gives_each_the_cache_its_own_press_gives(tmp_path, prefill, monkeypatch):
    layers, captured = prefill
    before = [tuple(tensor.clone() for tensor in inputs[:3]) for inputs in captured]
    computed = []
    snapkv_score = SnapKVPress.score
    monkeypatch.setattr(SnapKVPress, "score", lambda *args: computed.append(args[1].layer_idx) or snapkv_score(*args))
    memo = ScoreMemo(captured)
    presses = []
    for point in POINTS:
        # A random scorer without a seed draws from the point's stream, which must draw what it draws alone.
        unseeded = ("scorer.press.seed=null",) if "scorer=random" in point else ()
        press = instantiate(compose_config(tmp_path, *point, *unseeded).press.press)
        presses.append(press)
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(3)
            expected = own_compression(press, layers, captured)
            own_draws = torch.rand(1)
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(3)
            cache = compressed_cache(press, layers, captured, memo)
            # Random scorers drew what they draw alone: the stream is where their own compression left it.
            assert torch.equal(torch.rand(1), own_draws), point
        for layer, (keys, values, mask), got in zip(layers, expected, cache.layers, strict=True):
            assert torch.equal(keys, got.keys) and torch.equal(values, got.values), point
            got_mask = layer.self_attn.masked_key_indices
            assert (mask is None) == (got_mask is None), point
            assert mask is None or all(torch.equal(a, b) for a, b in zip(mask, got_mask, strict=True)), point
        for inputs, kept_inputs in zip(captured, before, strict=True):
            assert all(torch.equal(now, then) for now, then in zip(inputs[:3], kept_inputs, strict=True)), point
    # Alone, each SnapKV point scored every layer; through the memo, SnapKV scored each layer once for the sweep.
    snapkv_points = sum("scorer=snapkv" in point for point in POINTS)
    assert len(computed) == len(layers) * (snapkv_points + 1)
    # One entry per layer and configuration: the six shared scorers; StreamingLLM and Random are computed anew.
    assert len(memo.scores) == len(layers) * 6
    # Outside compressed_cache every scorer is back to its class's score.
    assert all("score" not in vars(member) for press in presses for member in members(press))


def test_a_press_that_writes_into_its_inputs_gets_copies(prefill):
    layers, captured = prefill
    before = [inputs[1].clone() for inputs in captured]
    think = ThinKPress(key_channel_compression_ratio=0.5)
    assert needs_copy(think) and not needs_copy(ChunkKVPress(SnapKVPress())) and not needs_copy(None)
    with torch.no_grad():
        cache = compressed_cache(think, layers, captured, ScoreMemo(captured))
        # On the captured tensors themselves ThinK would zero their channels: the copies took it.
        assert any((layer.keys == 0).any() for layer in cache.layers)
    assert all(torch.equal(inputs[1], kept) for inputs, kept in zip(captured, before, strict=True))
