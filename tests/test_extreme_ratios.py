"""16:1 and 32:1 (cr 0.9375 and 0.96875, kvpress issue #286): what each preset press keeps of a short context.

The tiny random Llama (2 layers, 2 KV heads, 4 query heads) prefills contexts of a few dozen tokens, so that each
head keeps 1 to 8 pairs; every count below is the press's own definition, worked out by hand.
"""

from functools import cache

import pytest
import torch
from hydra.utils import instantiate
from transformers import DynamicCache

from evaluate import rundir
from evaluate.errors import ConfigError
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import run_dir, validate_budget
from evaluate.points.resolve import resolve
from evaluate.run.entry import run
from tests.support import assert_kept, compose_config, with_shared_context

RATIOS = (0.9375, 0.96875)
# Context length -> pairs kept per head at 16:1 and 32:1: int(n * (1 - cr)), at least 1 (kvpress's compute_n_kept;
# presses/exact_budget.py uses the same rounding). 16 and 32 are the shortest contexts whose budget is not 0.
KEPT = {
    16: (1, 1),
    31: (1, 1),
    32: (2, 1),
    33: (2, 1),
    64: (4, 2),
    65: (4, 2),
    96: (6, 3),
    128: (8, 4),
    640: (40, 20),
}
# The shortest context each scorer runs on: more tokens than its observation window (conf/scorer/*.yaml).
WINDOW = {"knorm": 0, "keydiff": 0, "dropkv": 32, "snapkv": 64}


@pytest.fixture(scope="module")
def tiny_llama():
    return TinyRandomModel().load_model("cpu", "float32", "sdpa")


def input_ids(model, context_length: int) -> torch.Tensor:
    # Below 256, the padding token: its embedding is zero, so its key would be the same at every position.
    generator = torch.Generator().manual_seed(context_length)
    return torch.randint(0, 256, (1, context_length), generator=generator)


def prefill(model, press, context_length: int) -> DynamicCache:
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model(input_ids(model, context_length), past_key_values=cache)
    return cache


@cache
def full_keys(model, context_length: int) -> list[torch.Tensor]:
    """Each layer's keys of an uncompressed prefill (computed once per context length: the model is the module's)."""
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids(model, context_length), past_key_values=cache)
    return [layer.keys for layer in cache.layers]


def kept_positions(cache: DynamicCache, keys: list[torch.Tensor]) -> list[list[list[int]]]:
    """Per layer and KV head, the context positions whose keys the compressed cache holds (sorted).

    A press compresses after its layer's attention ran on the whole context, so each kept key equals, bit for bit,
    the key of its position in an uncompressed prefill of the same tokens.
    """
    positions = []
    for layer, full in zip(cache.layers, keys, strict=True):
        heads = []
        for head in range(full.shape[1]):
            matches = (layer.keys[0, head].unsqueeze(1) == full[0, head].unsqueeze(0)).all(dim=-1)
            assert (matches.sum(dim=1) == 1).all(), "every kept key is the key of exactly one position"
            heads.append(sorted(matches.int().argmax(dim=1).tolist()))
        positions.append(heads)
    return positions


def press_of(tmp_path, *overrides: str):
    return instantiate(compose_config(tmp_path, *overrides).press.press)


def decodes_finite_logits(model, cache: DynamicCache) -> bool:
    question = torch.randint(0, model.config.vocab_size, (1, 3), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return bool(torch.isfinite(model(question, past_key_values=cache).logits).all())


def cases(scorer: str) -> list[tuple[int, float, int]]:
    return [
        (n, cr, kept)
        for n, per_ratio in KEPT.items()
        if n > WINDOW[scorer]
        for cr, kept in zip(RATIOS, per_ratio, strict=True)
    ]


@pytest.mark.parametrize("scorer", ["knorm", "keydiff", "dropkv", "snapkv"])
def test_topk_keeps_exactly_its_budget_per_head(tmp_path, tiny_llama, scorer):
    # press=topk with scorer=dropkv is the DropKV method: kvpress's ScorerPress.compress on DropKV's scores.
    for n, cr, kept in cases(scorer):
        press = press_of(tmp_path, "press=topk", f"scorer={scorer}", f"cr={cr}")
        cache = prefill(tiny_llama, press, n)
        assert [layer.keys.shape[2] for layer in cache.layers] == [kept, kept], (n, cr)
        assert decodes_finite_logits(tiny_llama, cache), (n, cr)


@pytest.mark.parametrize("scorer", ["dropkv", "snapkv"])
def test_a_budget_below_the_window_keeps_only_window_positions(tmp_path, tiny_llama, scorer):
    # 128 tokens at 32:1 keep 4 pairs per head; DropKV's window is 32, SnapKV's 64, and both score the window
    # above every other position: the budget goes to window positions only, tied, and the context outside the
    # window is dropped whatever its scores (docs/configuration.md, "Extreme ratios").
    window = WINDOW[scorer]
    for n, cr, kept in cases(scorer):
        cache = prefill(tiny_llama, press_of(tmp_path, "press=topk", f"scorer={scorer}", f"cr={cr}"), n)
        for heads in kept_positions(cache, full_keys(tiny_llama, n)):
            for positions in heads:
                assert len(positions) == kept
                if kept <= window:
                    assert all(position >= n - window for position in positions), (n, cr, positions)


@pytest.mark.parametrize("scorer", ["knorm", "dropkv", "snapkv"])
def test_adakv_keeps_the_same_total_with_every_head_above_its_safeguard(tmp_path, tiny_llama, scorer):
    kv_heads = tiny_llama.config.num_key_value_heads
    for n, cr, kept in cases(scorer):
        press = press_of(tmp_path, "press=adakv", f"scorer={scorer}", f"cr={cr}")
        # AdaKV's floor per head: int(kept * alpha_safeguard) pairs, at least 1: below 10 pairs (every context
        # here but 640 tokens) int() gives 0 or 1, so the floor is 1 pair per head; 640 tokens keep 40 and 20 pairs,
        # floors of 8 and 4.
        assert press.alpha_safeguard == 0.2
        floor = max(1, int(kept * 0.2))
        assert floor == (1 if kept < 10 else kept // 5)
        cache = prefill(tiny_llama, press, n)
        # Evicted pairs are masked, not removed.
        assert [layer.keys.shape[2] for layer in cache.layers] == [n, n]
        for layer in tiny_llama.model.layers:
            _, head_indices, _ = layer.self_attn.masked_key_indices
            masked = torch.bincount(head_indices, minlength=kv_heads)
            kept_per_head = (n - masked).tolist()
            assert sum(kept_per_head) == kv_heads * kept, (n, cr, kept_per_head)
            assert min(kept_per_head) >= floor, (n, cr, kept_per_head)
        assert decodes_finite_logits(tiny_llama, cache), (n, cr)


@pytest.mark.slow  # prefills of up to 640 tokens, or whole runs, on the tiny model: seconds each
@pytest.mark.parametrize("chunk_length", [10, 20])
@pytest.mark.parametrize("scorer", ["knorm", "snapkv"])
def test_kvpress_chunkkv_keeps_whole_chunks(tmp_path, tiny_llama, scorer, chunk_length):
    # 640 tokens: 64 chunks of 10 or 32 of 20. int(n_chunks * (1 - cr)) whole chunks: 4 and 2 chunks of 10, 2 and
    # 1 of 20, which is the exact budget here (40 and 20 pairs) since no chunk is short.
    n = 640
    expected_chunks = {(10, 0.9375): 4, (10, 0.96875): 2, (20, 0.9375): 2, (20, 0.96875): 1}
    keys = full_keys(tiny_llama, n)
    for cr in RATIOS:
        overrides = ("press=chunkkv", f"scorer={scorer}", f"cr={cr}", f"press.press.chunk_length={chunk_length}")
        cache = prefill(tiny_llama, press_of(tmp_path, *overrides), n)
        n_chunks = expected_chunks[chunk_length, cr]
        assert [layer.keys.shape[2] for layer in cache.layers] == [KEPT[n][RATIOS.index(cr)]] * 2
        for heads in kept_positions(cache, keys):
            # One selection for all heads of a layer, made of whole chunks.
            assert all(positions == heads[0] for positions in heads)
            chunks = {position // chunk_length for position in heads[0]}
            assert len(chunks) == n_chunks
            assert heads[0] == [
                p for chunk in sorted(chunks) for p in range(chunk * chunk_length, (chunk + 1) * chunk_length)
            ]
        assert decodes_finite_logits(tiny_llama, cache)


def test_kvpress_chunkkv_keeps_a_whole_chunk_when_its_budget_is_no_chunk(tmp_path, tiny_llama):
    # 128 tokens at 32:1: 13 chunks of 10 (the last of 8), int(13 * 0.03125) = 0 chunks, which kvpress raises to
    # one: each layer keeps 10 or 8 pairs where the budget is 4. The harness refuses such a point (below).
    press = press_of(tmp_path, "press=chunkkv", "scorer=knorm", "cr=0.96875")
    cache = prefill(tiny_llama, press, 128)
    assert all(layer.keys.shape[2] in (8, 10) for layer in cache.layers)
    assert all(layer.keys.shape[2] > KEPT[128][1] for layer in cache.layers)


@pytest.mark.slow  # prefills of up to 640 tokens, or whole runs, on the tiny model: seconds each
@pytest.mark.parametrize("press_name", ["chunkkv_exact", "eg_chunkkv"])
@pytest.mark.parametrize("scorer", ["knorm", "dropkv", "snapkv"])
def test_exact_budget_presses_keep_exactly_their_budget(tmp_path, tiny_llama, press_name, scorer):
    # max(1, int(n * (1 - cr))) pairs in every layer, one selection for all heads (presses/exact_budget.py).
    for n, cr, kept in cases(scorer):
        press = press_of(tmp_path, f"press={press_name}", f"scorer={scorer}", f"cr={cr}")
        cache = prefill(tiny_llama, press, n)
        assert [layer.keys.shape[2] for layer in cache.layers] == [kept, kept], (n, cr)
        for heads in kept_positions(cache, full_keys(tiny_llama, n)):
            assert all(positions == heads[0] for positions in heads)
            if press_name == "chunkkv_exact" and kept <= 10:
                # The budget runs out in the best chunk, which keeps its top `kept` tokens: one chunk of 10.
                assert len({position // 10 for position in heads[0]}) == 1, (n, cr, heads[0])
        assert decodes_finite_logits(tiny_llama, cache), (n, cr)


def refusal(tmp_path, shortest_context: int, *overrides: str) -> str | None:
    cfg = compose_config(tmp_path, *overrides)
    try:
        validate_budget(resolve(cfg), shortest_context)
    except ConfigError as error:
        return str(error)
    return None


def test_a_budget_of_no_pair_is_refused(tmp_path):
    assert refusal(tmp_path, 31, "press=topk", "scorer=knorm", "cr=0.96875") == (
        "cr=0.96875 keeps int(31 * (1 - cr)) = 0 pairs of the shortest context (31 tokens), and the press would "
        "keep 1 anyway; use contexts of at least 32 tokens or a lower cr"
    )
    assert refusal(tmp_path, 15, "press=eg_chunkkv", "scorer=knorm", "cr=0.9375") == (
        "cr=0.9375 keeps int(15 * (1 - cr)) = 0 pairs of the shortest context (15 tokens), and the press would "
        "keep 1 anyway; use contexts of at least 16 tokens or a lower cr"
    )
    # 1 - 0.9 is 0.09999999999999998 in floating point: 10 tokens keep int(0.999...) = 0, 11 the first pair.
    assert refusal(tmp_path, 10, "press=adakv", "scorer=knorm", "cr=0.9").endswith("at least 11 tokens or a lower cr")
    for press in ("topk", "adakv", "chunkkv_exact", "eg_chunkkv"):
        assert refusal(tmp_path, 32, f"press={press}", "scorer=knorm", "cr=0.96875") is None
        assert refusal(tmp_path, 16, f"press={press}", "scorer=knorm", "cr=0.9375") is None


def test_kvpress_chunkkv_with_no_chunk_in_its_budget_is_refused(tmp_path):
    assert refusal(tmp_path, 128, "press=chunkkv", "scorer=knorm", "cr=0.96875") == (
        "kvpress's ChunkKVPress at cr=0.96875 keeps int(13 chunks * (1 - cr)) = 0 chunks of 10 tokens of the "
        "shortest context (128 tokens), and keeps one whole chunk anyway, more than the budget; use contexts of at "
        "least 311 tokens, a chunk_length of at most 4, or press=chunkkv_exact (an exact budget)"
    )
    # 311 tokens: 32 chunks, one kept. The exact-budget ChunkKV is never refused for its chunks.
    assert refusal(tmp_path, 311, "press=chunkkv", "scorer=knorm", "cr=0.96875") is None
    assert refusal(tmp_path, 310, "press=chunkkv", "scorer=knorm", "cr=0.96875") is not None
    assert refusal(tmp_path, 128, "press=chunkkv_exact", "scorer=knorm", "cr=0.96875") is None
    assert refusal(tmp_path, 128, "press=chunkkv", "scorer=knorm", "cr=0.96875", "press.press.chunk_length=4") is None
    # The leaderboard's chunkkv (chunk_length 20) at 16:1 on a 4,096-token RULER context: 205 chunks keep 12.
    leaderboard = ("press=chunkkv", "scorer=snapkv", "press.press.chunk_length=20")
    assert refusal(tmp_path, 4096, *leaderboard, "cr=0.96875") is None
    assert refusal(tmp_path, 4096, *leaderboard, "cr=0.9375") is None
    # kvpress's registry entry is the same class and is refused the same way.
    assert refusal(tmp_path, 420, "method=chunkkv", "cr=0.96875").startswith(
        "kvpress's ChunkKVPress at cr=0.96875 keeps int(21 chunks * (1 - cr)) = 0 chunks of 20 tokens"
    )


# Every preset press at 32:1 through the harness: 420-token contexts (4-token questions) keep int(420 / 32) = 13
# pairs per head, below SnapKV's window of 64 and DropKV's of 32; kvpress's ChunkKV keeps int(42 / 32) = 1 chunk.
END_TO_END = [
    ("topk", "dropkv"),
    ("topk", "snapkv"),
    ("adakv", "dropkv"),
    ("adakv", "snapkv"),
    ("chunkkv", "snapkv"),
    ("chunkkv_exact", "snapkv"),
    ("eg_chunkkv", "dropkv"),
]


@pytest.mark.slow  # prefills of up to 640 tokens, or whole runs, on the tiny model: seconds each
@pytest.mark.parametrize("press, scorer", END_TO_END)
def test_every_preset_press_runs_at_32_to_1(tmp_path, press, scorer):
    cfg = with_shared_context(compose_config(tmp_path, f"press={press}", f"scorer={scorer}", "cr=0.96875", "limit=1"))
    metrics = run(cfg)
    out = run_dir(cfg)
    assert "__cr0.96875__" in out.name
    rows = rundir.read_predictions(out / rundir.PREDICTIONS)
    assert len(rows) == sum(task["n"] for task in metrics["tasks"].values()) == 2
    for row in rows:
        assert not row.get("error"), row
        assert row["compression_ratio"] == 0.96875
        assert_kept(press, row, 0.96875)
    assert rundir.read_json(out / rundir.RUN)["status"] == "complete"


def test_the_harness_refuses_a_chunkkv_point_with_no_chunk_in_its_budget(tmp_path):
    overrides = ("press=chunkkv", "scorer=snapkv", "cr=0.96875", "press.press.chunk_length=20", "limit=1")
    cfg = with_shared_context(compose_config(tmp_path / "runs", *overrides))
    with pytest.raises(ConfigError) as refused:
        run(cfg)
    assert str(refused.value) == (
        "kvpress's ChunkKVPress at cr=0.96875 keeps int(21 chunks * (1 - cr)) = 0 chunks of 20 tokens of the "
        "shortest context (420 tokens), and keeps one whole chunk anyway, more than the budget; use contexts of at "
        "least 621 tokens, a chunk_length of at most 13, or press=chunkkv_exact (an exact budget)"
    )


def test_a_budget_below_the_window_is_run_with_one_warning(tmp_path, caplog):
    # 1,024 tokens at 32:1 keep 32 pairs per head: SnapKV's window is 64, DropKV's 32 (not below it).
    assert refusal(tmp_path, 1024, "press=topk", "scorer=snapkv", "cr=0.96875") is None
    assert refusal(tmp_path, 1024, "press=adakv", "scorer=dropkv", "cr=0.96875") is None
    assert refusal(tmp_path, 4096, "press=topk", "scorer=snapkv", "cr=0.96875") is None
    warnings = [record.getMessage() for record in caplog.records if "fewer than its window" in record.getMessage()]
    assert warnings == [
        "scorer snapkv keeps 32 pairs per head of the shortest context (1024 tokens) at cr=0.96875, fewer than its "
        "window of 64, which it scores above every other position: the pairs kept are window positions picked among "
        "equal scores by torch.topk; use contexts of at least 2048 tokens or a smaller scorer.press.window_size for "
        "a selection the scores decide"
    ]
