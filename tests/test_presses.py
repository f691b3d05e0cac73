"""Presses: EG-ChunkKV selects as kvpress does, every press x scorer keeps its exact budget, ChunkKV never crashes."""

import csv
import importlib.util
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from kvpress import EntropyGatedChunkKVPress as UpstreamEntropyGatedChunkKVPress
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept
from transformers import DynamicCache

from evaluate.engine.cost import measure_kept_ratio
from evaluate.models.layer_masks import fit_masks_to_layers
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import run_name
from presses.eg_chunkkv import EntropyGatedChunkKVPress
from tests.support import CONF_DIR, compose_config, kept_bounds

PRESSES = ["topk", "chunkkv", "chunkkv_exact", "eg_chunkkv", "adakv"]
# Every scorer in the config tree, so that a new one (dropkv) is proven as soon as its YAML exists.
SCORERS = sorted(path.stem for path in (CONF_DIR / "scorer").glob("*.yaml"))
# Tails of 7, 6 and 3 tokens after 10-token chunks; 97 at cr 0.9 keeps 9 tokens, less than one chunk.
CASES = {0.25: [97, 523], 0.5: [256], 0.9: [97, 523]}


@dataclass
class FixedScores(ScorerPress):
    """A scorer that returns the scores it is given, so that two presses can be compared on the same ones."""

    scores: torch.Tensor | None = None

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        return self.scores


def kept_positions(press, scores: torch.Tensor) -> list[int]:
    """Positions kept by ``press.compress`` when its inner scorer returns ``scores`` (batch, heads, kv_len)."""
    kv_len = scores.shape[-1]
    # Each key holds its own position, so the compressed keys say which positions survived.
    keys = torch.arange(kv_len, dtype=torch.float32).view(1, 1, kv_len, 1).expand(1, scores.shape[1], kv_len, 2)
    module = SimpleNamespace(head_dim=2)
    compressed, _ = press.compress(module, None, keys, keys.clone(), None, {})
    return compressed[0, 0, :, 0].long().tolist()


def random_scores(kind: str, kv_len: int, generator: torch.Generator) -> torch.Tensor:
    shape = (1, 2, kv_len)
    if kind == "ties":  # few distinct values: ties between chunk means and inside chunks
        return torch.randint(0, 3, shape, generator=generator).float()
    if kind == "sparse":  # mostly zero with a few spikes: spiky chunks and many tied zeros
        return torch.rand(shape, generator=generator).pow(8).mul(torch.rand(shape, generator=generator) < 0.2)
    if kind == "signed":  # negative scores, as KeyDiff gives
        return torch.randn(shape, generator=generator)
    return torch.rand(shape, generator=generator)


@pytest.mark.parametrize("kind", ["ties", "sparse", "signed", "uniform"])
@pytest.mark.parametrize("kv_len", [1, 4, 9, 10, 11, 21, 40, 97, 256, 523])
def test_eg_chunkkv_keeps_exactly_the_positions_upstream_keeps(kind, kv_len):
    # Lengths: shorter than a chunk, whole chunks only, tails of 1, 7 and 3 tokens. Ratios: 0.05 leaves budget
    # unspent after the spiky chunks (the top-up), 0.97 and 0.99 give budgets smaller than one chunk.
    generator = torch.Generator().manual_seed(kv_len)
    for cr in (0.05, 0.25, 0.5, 0.75, 0.9, 0.97, 0.99):
        for _ in range(4):
            scorer = FixedScores(compression_ratio=cr, scores=random_scores(kind, kv_len, generator))
            ours = EntropyGatedChunkKVPress(press=scorer, chunk_length=10, low_entropy_chunk_length=4)
            upstream = UpstreamEntropyGatedChunkKVPress(press=scorer, chunk_length=10, low_entropy_chunk_length=4)
            kept = kept_positions(ours, scorer.scores)
            assert kept == kept_positions(upstream, scorer.scores), (cr, scorer.scores)
            assert len(kept) == max(1, int(kv_len * (1 - cr)))


@pytest.mark.parametrize(
    "entropy_threshold, cr, expected",
    [
        # Chunk entropies are 0.456, 0.946 and 0.979 (median 0.946); mean scores 2.78, 1 and 0.5 (median 1).
        # The median gate: A is spiky and keeps 2 tokens, B (entropy equal to the median, not below) is whole.
        (None, 0.5, [0, 1, 4, 5, 6, 7]),
        # No gate: A whole, and the budget runs out in B, which keeps its top 2.
        (0.0, 0.5, [0, 1, 2, 3, 4, 5]),
        # Both high-score chunks are spiky; C is below the median score, so it only takes the remaining 2.
        (1.0, 0.5, [0, 1, 4, 5, 9, 10]),
        # Budget 11: A keeps 2 tokens, B and C whole spend 8, and the last slot goes to the best token left.
        (None, 0.05, [0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]),
    ],
)
def test_eg_chunkkv_entropy_threshold_by_hand(entropy_threshold, cr, expected):
    scores = torch.tensor([[[8.0, 3.0, 0.1, 0.0, 1.2, 1.5, 0.5, 0.8, 0.4, 0.7, 0.5, 0.4]]])
    scorer = FixedScores(compression_ratio=cr, scores=scores)
    press = EntropyGatedChunkKVPress(
        press=scorer, chunk_length=4, low_entropy_chunk_length=2, entropy_threshold=entropy_threshold
    )
    assert kept_positions(press, scores) == expected


def test_eg_chunkkv_refuses_a_threshold_outside_the_entropy_range():
    with pytest.raises(ValueError, match="entropy_threshold=1.5"):
        EntropyGatedChunkKVPress(press=FixedScores(compression_ratio=0.5), entropy_threshold=1.5)


@pytest.fixture(scope="module")
def tiny_llama():
    return TinyRandomModel().load_model("cpu", "float32", "sdpa")


def prefill(model, press, context_length: int, seed: int = 0) -> DynamicCache:
    input_ids = torch.randint(
        0, model.config.vocab_size, (1, context_length), generator=torch.Generator().manual_seed(seed)
    )
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids, past_key_values=cache)
    return cache


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("press_name", PRESSES)
def test_every_press_and_scorer_keeps_its_exact_budget_in_every_layer(tmp_path, tiny_llama, press_name, scorer):
    kv_heads = tiny_llama.config.num_key_value_heads
    for cr, lengths in CASES.items():
        press = instantiate(compose_config(tmp_path, f"press={press_name}", f"scorer={scorer}", f"cr={cr}").press.press)
        for context_length in lengths:
            cache = prefill(tiny_llama, press, context_length)
            cache_lengths = [layer.keys.shape[2] for layer in cache.layers]
            if press_name in ("chunkkv_exact", "eg_chunkkv"):
                n_kept = max(1, int(context_length * (1 - cr)))
            else:
                n_kept = compute_n_kept(context_length, cr)
            case = (context_length, cr, cache_lengths)
            if press_name == "chunkkv":
                # kvpress's budget: whole chunks, so a layer keeps either bound (with or without the tail chunk).
                assert set(cache_lengths) <= set(kept_bounds(press_name, context_length, cr)), case
                measured = measure_kept_ratio(tiny_llama, cache, context_length) * context_length
                assert measured == pytest.approx(sum(cache_lengths) / len(cache_lengths), abs=1e-3), case
                continue
            if press_name == "adakv":
                assert cache_lengths == [context_length] * len(cache_lengths), case
                for layer in tiny_llama.model.layers:
                    batch_indices, _, _ = layer.self_attn.masked_key_indices
                    assert int((batch_indices == 0).sum()) == kv_heads * (context_length - n_kept), case
            else:
                assert cache_lengths == [n_kept] * len(cache_lengths), case
            measured = measure_kept_ratio(tiny_llama, cache, context_length)
            # fp32 averaging in measure_kept_ratio; any tolerance below 0.5 still pins an integer count.
            assert measured * context_length == pytest.approx(n_kept, abs=1e-3), case


@pytest.mark.parametrize("scorer", SCORERS)
def test_eg_chunkkv_and_upstream_compress_a_real_prefill_identically(tmp_path, tiny_llama, scorer):
    caches = [
        prefill(tiny_llama, instantiate(compose_config(tmp_path, f"press={name}", f"scorer={scorer}").press.press), 523)
        for name in ("eg_chunkkv", "eg_chunkkv_upstream")
    ]
    for ours, upstream in zip(*(cache.layers for cache in caches), strict=True):
        assert torch.equal(ours.keys, upstream.keys) and torch.equal(ours.values, upstream.values)


def test_kvpress_chunkkv_leaves_uneven_layers_which_the_harness_model_decodes(tmp_path):
    # A random Qwen3, 523 tokens (52 chunks and a 3-token tail), cr 0.9, sdpa: kvpress keeps int(53 * 0.1) = 5
    # chunks per layer, and on this context one layer took the tail and the other did not.
    model = TinyRandomModel(architecture="qwen3").load_model("cpu", "float32", "sdpa")
    fit_masks_to_layers(model)
    question = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))

    def compose_press(name: str):
        return instantiate(compose_config(tmp_path, "model=tiny_random_qwen3", f"press={name}", "cr=0.9").press.press)

    cache = prefill(model, compose_press("chunkkv"), 523, seed=1)
    assert sorted(layer.keys.shape[2] for layer in cache.layers) == [43, 50]
    with torch.no_grad():
        logits = model(question, past_key_values=cache).logits
    assert logits.shape[1] == 7 and torch.isfinite(logits).all()

    cache = prefill(model, compose_press("chunkkv_exact"), 523, seed=1)
    assert [layer.keys.shape[2] for layer in cache.layers] == [52, 52]


def test_overhead_benchmark_writes_its_tables(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_presses", CONF_DIR.parent / "scripts" / "bench_presses.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--device", "cpu", "--tokens", "100", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    argv += [
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--presses",
        "topk",
        "chunkkv",
        "eg_chunkkv",
        "--out-dir",
        str(tmp_path),
    ]
    argv += ["--scorers", "snapkv", "knorm"]
    assert bench.main(argv) == 0

    with (tmp_path / "presses_cpu.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["press"], row["scorer"]) for row in rows] == [
        (press, scorer) for scorer in ("snapkv", "knorm") for press in ("topk", "chunkkv", "eg_chunkkv", "score")
    ]
    by_case = {(row["press"], row["scorer"]): row for row in rows}
    assert by_case["topk", "snapkv"]["vs_snapkv"] == by_case["chunkkv", "knorm"]["vs_chunkkv"] == "1.0000"
    assert by_case["score", "knorm"]["vs_chunkkv"] == "n/a"
    table = (tmp_path / "presses_cpu.md").read_text()
    assert "| eg_chunkkv / chunkkv compress, knorm |" in table and "100 tokens, 4 query heads" in table


def test_entropy_threshold_is_a_sweepable_setting_of_the_run(tmp_path):
    default = compose_config(tmp_path, "press=eg_chunkkv", "cr=0.9")
    swept = compose_config(tmp_path, "press=eg_chunkkv", "cr=0.9", "press.press.entropy_threshold=0.3")
    assert instantiate(default.press.press).entropy_threshold is None
    press = instantiate(swept.press.press)
    assert (press.entropy_threshold, press.chunk_length, press.low_entropy_chunk_length) == (0.3, 10, 4)
    # Same method name, different run directory: τ changes predictions, so it is part of the fingerprint.
    assert run_name(swept).rsplit("__", 1)[0] == run_name(default).rsplit("__", 1)[0]
    assert run_name(swept) != run_name(default)
