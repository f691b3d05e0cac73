"""Method names follow kvpress's registry: a configuration equal to an entry carries its name, no other does."""

from itertools import product

import pytest
from hydra.utils import instantiate
from kvpress import AdaKVPress, ExpectedAttentionPress, SnapKVPress

from evaluate.points.config import method_name, run_name
from evaluate.registry import PRESS_REGISTRY, is_variant, registry_name, same_press
from tests.support import CONF_DIR, compose_config

# The axes' presses; press=registry is the method= group's (tests/test_registry_entries.py), not an axis of its own.
PRESSES = sorted(path.stem for path in (CONF_DIR / "press").glob("*.yaml") if path.stem != "registry")
SCORERS = sorted(path.stem for path in (CONF_DIR / "scorer").glob("*.yaml"))
# The overrides under which a press x scorer of the harness becomes a registry entry.
REGISTRY_OVERRIDES = {
    ("adakv", "expected_attention"): ("scorer.press.epsilon=0.01",),
    ("chunkkv", "snapkv"): ("press.press.chunk_length=20",),
}
# Every registry entry the harness's press x scorer axes can build, and the configuration that builds it.
BUILDABLE = {
    "no_press": ("none", "snapkv"),
    "snapkv": ("topk", "snapkv"),
    "knorm": ("topk", "knorm"),
    "tova": ("topk", "tova"),
    "keydiff": ("topk", "keydiff"),
    "streaming_llm": ("topk", "streaming_llm"),
    "adakv_snapkv": ("adakv", "snapkv"),
    "expected_attention": ("adakv", "expected_attention"),
    "chunkkv": ("chunkkv", "snapkv"),
    "entropy_gated_chunkkv": ("eg_chunkkv_upstream", "snapkv"),
}


def name_of(tmp_path, press: str, scorer: str, *overrides: str) -> str:
    return method_name(compose_config(tmp_path, f"press={press}", f"scorer={scorer}", *overrides))


@pytest.mark.parametrize("entry", sorted(BUILDABLE))
def test_every_buildable_registry_entry_carries_its_name(tmp_path, entry):
    press, scorer = BUILDABLE[entry]
    cfg = compose_config(tmp_path, f"press={press}", f"scorer={scorer}", *REGISTRY_OVERRIDES.get((press, scorer), ()))
    assert method_name(cfg) == entry
    built = instantiate(cfg.press.press)
    assert same_press(built, PRESS_REGISTRY[entry]())
    assert f"__{entry}__" in run_name(cfg)


def test_no_other_configuration_carries_a_registry_name(tmp_path):
    reached = {}
    for press, scorer in product(PRESSES, SCORERS):
        for overrides in {(), REGISTRY_OVERRIDES.get((press, scorer), ())}:
            name = name_of(tmp_path, press, scorer, *overrides)
            if name in PRESS_REGISTRY:
                reached.setdefault(name, set()).add((press, scorer, overrides))
    assert set(reached) == set(BUILDABLE)
    # no_press is every scorer under press=none; every other entry is reached by exactly one configuration.
    assert all(len(configurations) == 1 for name, configurations in reached.items() if name != "no_press")


@pytest.mark.parametrize(
    ("press", "scorer", "overrides", "expected"),
    [
        # The registry's expected_attention is AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)).
        ("topk", "expected_attention", (), "expected_attention_variant"),
        ("adakv", "expected_attention", (), "adakv_expected_attention"),
        # The registry's RandomPress() draws from the global generator; the harness seeds it.
        ("topk", "random", (), "random_variant"),
        ("topk", "snapkv", ("scorer.press.window_size=32",), "snapkv_variant"),
        # The EG-ChunkKV PR's chunk length is 10, the registry's chunkkv uses 20.
        ("chunkkv", "snapkv", (), "chunkkv_snapkv"),
        ("chunkkv_exact", "snapkv", ("press.press.chunk_length=20",), "chunkkv_exact_snapkv"),
        ("eg_chunkkv", "snapkv", (), "eg_chunkkv_snapkv"),
        ("topk", "dropkv", (), "dropkv"),
    ],
)
def test_configurations_that_are_not_entries_keep_or_lose_their_harness_name(
    tmp_path, press, scorer, overrides, expected
):
    name = name_of(tmp_path, press, scorer, *overrides)
    assert name == expected
    assert is_variant(name) == name.endswith("_variant")


def test_equality_compares_constructor_arguments_not_the_ratio():
    assert (
        registry_name(AdaKVPress(ExpectedAttentionPress(compression_ratio=0.7, epsilon=0.01))) == "expected_attention"
    )
    assert registry_name(AdaKVPress(ExpectedAttentionPress(epsilon=0.02))) is None
    assert registry_name(AdaKVPress(SnapKVPress(), alpha_safeguard=0.3)) is None
    assert registry_name(SnapKVPress(compression_ratio=0.9)) == "snapkv"
    assert registry_name(None) == "no_press"
