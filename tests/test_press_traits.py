"""What a press needs is read off the press object: prefill sharing, eager refusal, whether it compresses."""

import logging
from dataclasses import dataclass

import pytest
from hydra.utils import instantiate
from kvpress import KnormPress
from omegaconf import OmegaConf

from evaluate import rundir
from evaluate.points.config import ConfigError, compresses, run_dir
from evaluate.points.press_traits import needs_non_eager, why_not_shared_prefill
from evaluate.registry import PRESS_REGISTRY
from evaluate.run.entry import run, run_sweep
from tests.support import CONF_DIR, compose_config, with_shared_context

# Registry entries whose whole effect is the compress call after each layer's attention, and kvpress's own
# DecodingPress, whose decoding compression the pool runs row by row (evaluate/engine/decoding_compression.py).
SHARED = {
    "snapkv", "knorm", "tova", "adakv_snapkv", "chunkkv", "expected_attention", "pyramidkv", "think", "lagkv",
    "decoding_knorm",
}  # fmt: skip
# Entries that hook elsewhere: other decoding-time compression, extra forward passes, several presses in sequence.
PIPELINE = {"kvzip", "finch", "snap_think", "cam_tova", "kvcompose", "fastkvzip"}


@pytest.mark.parametrize("entry", sorted(SHARED | PIPELINE))
def test_prefill_sharing_is_derived_from_the_press_class(entry):
    reason = why_not_shared_prefill(PRESS_REGISTRY[entry](), "sdpa")
    assert (reason is None) == (entry in SHARED), reason
    if reason is not None:
        assert "overrides BasePress." in reason


def test_eager_attention_never_shares_and_no_press_always_does():
    assert why_not_shared_prefill(PRESS_REGISTRY["snapkv"](), "eager") is not None
    assert why_not_shared_prefill(None, "eager") is None


def test_eager_refusal_and_compression_come_from_the_press_objects(tmp_path):
    expected_non_eager = {"adakv", "chunkkv", "chunkkv_exact", "eg_chunkkv", "eg_chunkkv_upstream"}
    for path in sorted((CONF_DIR / "press").glob("*.yaml")):
        # press=registry is chosen through method=<entry>, which names the entry it builds.
        cfg = compose_config(tmp_path, "method=snapkv" if path.stem == "registry" else f"press={path.stem}")
        assert "compresses" not in cfg.press and "needs_non_eager" not in cfg.press  # nothing written by hand
        assert compresses(cfg) == (path.stem != "none")
        assert needs_non_eager(instantiate(cfg.press.press)) == (path.stem in expected_non_eager), path.stem


@dataclass
class HookedKnormPress(KnormPress):
    """A press the harness has never seen, that hooks the forward pass its own way (here: as BasePress does)."""

    def forward_hook(self, module, input, kwargs, output):
        return super().forward_hook(module, input, kwargs, output)


def test_an_unknown_press_takes_the_pipeline_path_with_a_logged_reason(tmp_path, caplog):
    def config(output_dir, press_target: str):
        cfg = with_shared_context(compose_config(output_dir, "press=topk", "scorer=knorm", "cr=0.5"))
        cfg.press.press = OmegaConf.create({"_target_": press_target, "compression_ratio": 0.5})
        cfg.press.method = "hooked_knorm"
        return cfg

    hooked = config(tmp_path / "sweep", f"{__name__}.HookedKnormPress")
    others = [with_shared_context(compose_config(tmp_path / "sweep", "press=none"))]
    with caplog.at_level(logging.INFO, logger="evaluate.run.entry"):
        run_sweep([hooked, *others])
    assert "HookedKnormPress overrides BasePress.forward_hook" in caplog.text
    alone = config(tmp_path / "alone", f"{__name__}.HookedKnormPress")
    run(alone)
    sweep_rows = rundir.read_predictions(run_dir(hooked) / rundir.PREDICTIONS)
    alone_rows = rundir.read_predictions(run_dir(alone) / rundir.PREDICTIONS)
    assert [row["prediction"] for row in sweep_rows] == [row["prediction"] for row in alone_rows]


def test_a_non_eager_press_is_refused_under_eager_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="attn_implementation=eager"):
        run(with_shared_context(compose_config(tmp_path, "press=chunkkv", "attn_implementation=eager")))


def test_every_trait_is_read_off_one_table_verified_traits_for_the_named_class_only():
    import kvpress

    from evaluate.points import press_traits
    from presses.chunkkv_exact import ExactChunkKVPress
    from presses.eg_chunkkv import EntropyGatedChunkKVPress
    from scorers.dropkv import DropKVPress

    classes = {
        cls
        for cls in (*vars(kvpress).values(), ExactChunkKVPress, EntropyGatedChunkKVPress, DropKVPress)
        if isinstance(cls, type) and issubclass(cls, kvpress.BasePress)
    }

    def having(trait: str) -> set[str]:
        return {cls.__qualname__ for cls in classes if getattr(press_traits.traits(cls), trait)}

    # What engine/prefill.py and engine/score_memo.py listed before the table, and press_traits's isinstance checks.
    assert having("shares_scores") == {
        "SnapKVPress", "TOVAPress", "ExpectedAttentionPress", "KnormPress", "KeyDiffPress", "DropKVPress"
    }  # fmt: skip
    assert having("read_only") == having("shares_scores") | {
        "AdaKVPress", "ChunkKVPress", "EntropyGatedChunkKVPress", "ExactChunkKVPress", "RandomPress",
        "StreamingLLMPress",
    }  # fmt: skip
    assert not press_traits.traits(kvpress.PyramidKVPress).read_only  # a SnapKV with its own compress
    non_eager = (kvpress.AdaKVPress, kvpress.ChunkKVPress, kvpress.EntropyGatedChunkKVPress)
    assert having("needs_non_eager") == {cls.__qualname__ for cls in classes if issubclass(cls, non_eager)}
    decoding = (kvpress.DecodingPress, kvpress.PrefillDecodingPress)
    assert having("decodes") == {cls.__qualname__ for cls in classes if issubclass(cls, decoding)}
    assert having("needs_eager") == {"ObservedAttentionPress"}
    assert having("needs_query_aware") == having("changes_model") == {"FinchPress"}
    assert having("downloads") == {
        "DuoAttentionPress", "KVzapPress", "QFilterPress", "FastKVzipPress", "RestoreKVPress", "LUKVPress"
    }  # fmt: skip
