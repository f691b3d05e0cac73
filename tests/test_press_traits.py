"""What a press needs is read off the press object: prefill sharing, eager refusal, whether it compresses."""

import ast
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra.utils import instantiate
from kvpress import KnormPress
from omegaconf import OmegaConf

from evaluate import rundir
from evaluate.points.config import ConfigError, compresses, run_dir
from evaluate.press_profile import needs_non_eager, why_not_shared_prefill
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

    from evaluate import press_profile as press_traits
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


def press_class_tests(path: Path) -> list[str]:
    """Where ``path`` tests a press object's class: ``isinstance``/``issubclass`` against a class of kvpress, presses/
    or scorers/, or ``type(x)`` compared with one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("kvpress", "presses", "scorers")
        for alias in node.names
        if "Press" in alias.name or "Selection" in alias.name  # not kvpress's SUPPORTED_MODELS, a model check
    }

    def named(node: ast.AST) -> bool:
        names = node.elts if isinstance(node, ast.Tuple) else [node]
        return any(isinstance(name, ast.Name) and name.id in classes for name in names)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
            if len(node.args) == 2 and named(node.args[1]):
                found.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Compare) and any(getattr(n.func, "id", None) == "type" for n in ast.walk(node)
                                                   if isinstance(n, ast.Call)):  # fmt: skip
            if any(named(side) for side in (node.left, *node.comparators)):
                found.append(f"{path.name}:{node.lineno}")
    return found


def test_press_classes_are_tested_in_the_press_profile_alone():
    """evaluate/press_profile.py is the one module that asks what class a press is; the engine, the registry, the
    loader and the budget code read its answers (a point's plan carries them as its PressProfile)."""
    repo = Path(__file__).resolve().parent.parent
    paths = [*(repo / "evaluate").rglob("*.py"), *(repo / "hydra_plugins").rglob("*.py")]
    assert press_class_tests(repo / "evaluate" / "press_profile.py")  # the checker finds the profile's own
    assert not [where for path in paths if path.name != "press_profile.py" for where in press_class_tests(path)]
