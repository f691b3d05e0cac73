"""kvpress's method names: the names the leaderboard and every paper table use, and the presses they mean.

``PRESS_REGISTRY`` lists the entries of kvpress 0.5.5's ``evaluation/evaluate_registry.py``, in its order, with its
constructor arguments (tests/test_registry.py compares them with the release's own file); each builds kvpress's
own objects. ``python -m evaluate method=<name>`` runs an entry: :func:`build` makes it and sets the knobs kvpress's
runner sets (``conf/press/registry.yaml``); each name is an option of the ``method`` config group, stored below.

A PressBench configuration carries a registry name exactly when its press equals that entry: same classes all the
way down and the same constructor arguments, except the knobs kvpress's runner sets itself (the compression ratio
and its relatives, evaluate/settings.py's ``RUNNER_KNOBS``). A configuration whose own name is a registry name
but whose press differs (``press=topk scorer=expected_attention`` is not the registry's ``expected_attention``, which is
``AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))``) is renamed with the ``_variant`` suffix, so that no table or
export can mistake it for the entry.
"""

import logging
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from functools import cache

import torch
from hydra.core.config_store import ConfigStore
from kvpress import (
    AdaKVPress,
    BasePress,
    BlockPress,
    CAMPress,
    ChunkKVPress,
    CompactorPress,
    ComposedPress,
    CriticalAdaKVPress,
    CriticalKVPress,
    CURPress,
    DecodingPress,
    DMSPress,
    DuoAttentionPress,
    EntropyGatedChunkKVPress,
    ExpectedAttentionPress,
    FastKVzipPress,
    FinchPress,
    KeyDiffPress,
    KnormPress,
    KVComposePress,
    KVgradPress,
    KVzapPress,
    KVzipPress,
    LagKVPress,
    LUKVPress,
    MergingPress,
    ObservedAttentionPress,
    PyramidKVPress,
    QFilterPress,
    RandomPress,
    RestoreKVPress,
    SnapKVPress,
    StreamingLLMPress,
    ThinKPress,
    TOVAPress,
)

from evaluate.errors import ConfigError
from evaluate.press_profile import knobs_read, runner_family
from evaluate.settings import RUNNER_KNOBS

VARIANT_SUFFIX = "_variant"

PRESS_REGISTRY: dict[str, Callable[[], BasePress | None]] = {
    "adakv_snapkv": lambda: AdaKVPress(SnapKVPress()),
    "block_keydiff": lambda: BlockPress(press=KeyDiffPress(), block_size=128),
    "chunkkv": lambda: ChunkKVPress(press=SnapKVPress(), chunk_length=20),
    "critical_adakv_expected_attention": lambda: CriticalAdaKVPress(ExpectedAttentionPress(use_vnorm=False)),
    "critical_adakv_snapkv": lambda: CriticalAdaKVPress(SnapKVPress()),
    "critical_expected_attention": lambda: CriticalKVPress(ExpectedAttentionPress(use_vnorm=False)),
    "critical_snapkv": lambda: CriticalKVPress(SnapKVPress()),
    "cur": lambda: CURPress(),
    "duo_attention": lambda: DuoAttentionPress(),
    "duo_attention_on_the_fly": lambda: DuoAttentionPress(on_the_fly_scoring=True),
    "entropy_gated_chunkkv": lambda: EntropyGatedChunkKVPress(press=SnapKVPress()),
    "expected_attention": lambda: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)),
    "fastkvzip": lambda: FastKVzipPress(),
    "finch": lambda: FinchPress(),
    "keydiff": lambda: KeyDiffPress(),
    "kvcompose": lambda: KVComposePress(),
    "kvcompose_unstructured": lambda: KVComposePress(structured=False),
    "kvgrad": lambda: KVgradPress(),
    "kvzip": lambda: KVzipPress(),
    "kvzip_plus": lambda: KVzipPress(kvzip_plus_normalization=True),
    "kvzap_linear": lambda: DMSPress(press=KVzapPress(model_type="linear")),
    "kvzap_mlp": lambda: DMSPress(press=KVzapPress(model_type="mlp")),
    "kvzap_mlp_head": lambda: KVzapPress(model_type="mlp"),
    "kvzap_mlp_layer": lambda: AdaKVPress(KVzapPress(model_type="mlp")),
    "lagkv": lambda: LagKVPress(),
    "lukv": lambda: LUKVPress(ExpectedAttentionPress(epsilon=2e-2), sink=4, window=1),
    "knorm": lambda: KnormPress(),
    "observed_attention": lambda: ObservedAttentionPress(),
    "pyramidkv": lambda: PyramidKVPress(),
    "qfilter": lambda: QFilterPress(),
    "random": lambda: RandomPress(),
    "RestoreKV": lambda: RestoreKVPress(),
    "RestoreKV_plus": lambda: RestoreKVPress(kvzip_plus_normalization=True),
    "snap_think": lambda: ComposedPress([SnapKVPress(), ThinKPress()]),
    "snapkv": lambda: SnapKVPress(),
    "streaming_llm": lambda: StreamingLLMPress(),
    "think": lambda: ThinKPress(),
    "tova": lambda: TOVAPress(),
    "compactor": lambda: CompactorPress(),
    "adakv_compactor": lambda: AdaKVPress(CompactorPress()),
    "no_press": lambda: None,
    "cam_streaming_llm": lambda: CAMPress(base_press=StreamingLLMPress()),
    "cam_knorm": lambda: CAMPress(base_press=KnormPress()),
    "cam_adakv_snapkv": lambda: CAMPress(base_press=AdaKVPress(SnapKVPress())),
    "cam_tova": lambda: CAMPress(base_press=TOVAPress()),
    "decoding_knorm": lambda: DecodingPress(base_press=KnormPress()),
    "decoding_streaming_llm": lambda: DecodingPress(base_press=StreamingLLMPress()),
    "decoding_tova": lambda: DecodingPress(base_press=TOVAPress()),
    "decoding_qfilter": lambda: DecodingPress(base_press=QFilterPress()),
    "decoding_adakv_expected_attention_e2": lambda: DecodingPress(
        base_press=AdaKVPress(ExpectedAttentionPress(epsilon=1e-2))
    ),
    "decoding_adakv_snapkv": lambda: DecodingPress(base_press=AdaKVPress(SnapKVPress())),
    "decoding_keydiff": lambda: DecodingPress(base_press=KeyDiffPress()),
    "merging_knorm": lambda: MergingPress(KnormPress()),
    "merging_snapkv": lambda: MergingPress(SnapKVPress()),
    "merging_expected_attention": lambda: MergingPress(ExpectedAttentionPress(epsilon=1e-2)),
    "merging_kvzap_mlp": lambda: MergingPress(KVzapPress(model_type="mlp")),
}


def unread_knobs(name: str, given: Mapping[str, object]) -> list[str]:
    """The runner knobs set in ``given`` that entry ``name`` does not read (none for a name the registry lacks)."""
    if name not in PRESS_REGISTRY:
        return []
    read = knobs_read(PRESS_REGISTRY[name]()) | {"compression_ratio"}
    return sorted(knob for knob in RUNNER_KNOBS & set(given) if given[knob] is not None and knob not in read)


def _required(value: float | None, knob: str, name: str, family: str) -> float:
    if value is None:
        raise ConfigError(f"method={name} needs {knob}=... (kvpress's runner requires it for {family})")
    return value


def _set_ratio(press: BasePress | None, knobs: Mapping[str, object], name: str) -> None:
    if press is not None and hasattr(press, "compression_ratio"):
        press.compression_ratio = knobs["compression_ratio"]


def _set_think(press: ThinKPress, knobs: Mapping[str, object], name: str) -> None:
    ratio = _required(knobs["key_channel_compression_ratio"], "key_channel_compression_ratio", name, "ThinK")
    press.key_channel_compression_ratio = ratio


def _set_composed(press: ComposedPress, knobs: Mapping[str, object], name: str) -> None:
    for member in press.presses:
        (_set_think if runner_family(member) == "think" else _set_ratio)(member, knobs, name)


def _set_duo_attention(press: DuoAttentionPress, knobs: Mapping[str, object], name: str) -> None:
    ratio = _required(knobs["head_compression_ratio"], "head_compression_ratio", name, "DuoAttention")
    press.head_compression_ratio = ratio


def _set_dms(press: DMSPress, knobs: Mapping[str, object], name: str) -> None:
    press.threshold = _required(knobs["threshold"], "threshold", name, "DMSPress")


def _set_decoding(press: DecodingPress, knobs: Mapping[str, object], name: str) -> None:
    # Where given; the press keeps its defaults elsewhere.
    for knob in ("compression_interval", "target_size", "hidden_states_buffer_size"):
        setattr(press, knob, knobs[knob] or getattr(press, knob))


# How kvpress's runner sets each family of presses (evaluate/press_profile.py's RUNNER_FAMILIES names them).
_SET_UP = {
    "duo_attention": _set_duo_attention,
    "dms": _set_dms,
    "composed": _set_composed,
    "think": _set_think,
    "decoding": _set_decoding,
    "ratio": _set_ratio,
}


def build(
    name: str,
    compression_ratio: float,
    key_channel_compression_ratio: float | None = None,
    threshold: float | None = None,
    head_compression_ratio: float | None = None,
    compression_interval: int | None = None,
    target_size: int | None = None,
    hidden_states_buffer_size: int | None = None,
) -> BasePress | None:
    """Registry entry ``name`` with the knobs set as kvpress's runner (``EvaluationRunner._setup_press``) sets them.

    DuoAttention takes ``head_compression_ratio``, DMS ``threshold`` and ThinK ``key_channel_compression_ratio``,
    each required; a ComposedPress gives ThinK members the key-channel ratio and the others ``compression_ratio``;
    a DecodingPress takes the interval, target size and buffer size where given and keeps its defaults elsewhere;
    every other press gets ``compression_ratio`` when it has one.
    """
    if name not in PRESS_REGISTRY:
        raise ConfigError(f"method={name} is not a kvpress 0.5.5 registry entry; see docs/registry.md for the names")
    press = PRESS_REGISTRY[name]()
    knobs = {
        "compression_ratio": compression_ratio,
        "key_channel_compression_ratio": key_channel_compression_ratio,
        "threshold": threshold,
        "head_compression_ratio": head_compression_ratio,
        "compression_interval": compression_interval,
        "target_size": target_size,
        "hidden_states_buffer_size": hidden_states_buffer_size,
    }
    _SET_UP[runner_family(press)](press, knobs, name)
    return press


# conf/press/registry.yaml's _target_: what tells a registry entry's configuration from the axes' presses.
BUILD_TARGET = f"{__name__}.build"


def store_method_configs() -> None:
    """One option of the ``method`` config group per entry: ``method=<name>`` selects ``press=registry`` with it."""
    store = ConfigStore.instance()
    for name in PRESS_REGISTRY:
        node = {"defaults": [{"override /press": "registry"}, "_self_"], "press": {"method": name}}
        store.store(group="method", name=name, node=node, package="_global_")


# Hydra reads the config store when it composes; every entry point (python -m evaluate, the tests' compose) imports
# this module first, through evaluate.points.config.
store_method_configs()


def same_press(first: object, second: object) -> bool:
    """Whether two presses (or constructor values) are built alike: same classes, same arguments but the knobs."""
    if type(first) is not type(second):
        return False
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(map(same_press, first, second))
    if is_dataclass(first):
        return all(
            same_press(getattr(first, field.name), getattr(second, field.name))
            for field in fields(first)
            if field.init and field.name not in RUNNER_KNOBS
        )
    if isinstance(first, torch.Tensor):
        return torch.equal(first, second)
    return first == second


@cache
def _entries() -> tuple[tuple[str, BasePress | None], ...]:
    # Built once: the entries are only compared with, never run, so the warnings some constructors log about
    # running them (KVzip's cost) would only mislead.
    logging.disable(logging.WARNING)
    try:
        return tuple((name, build()) for name, build in PRESS_REGISTRY.items())
    finally:
        logging.disable(logging.NOTSET)


def registry_name(press: BasePress | None) -> str | None:
    """The registry entry ``press`` equals, if any."""
    return next((name for name, entry in _entries() if same_press(press, entry)), None)


def method_name(harness_name: str, press: BasePress | None) -> str:
    """The name a run is known by: the registry's where the press is an entry, never an entry's name otherwise."""
    if harness_name in PRESS_REGISTRY and same_press(press, dict(_entries())[harness_name]):
        return harness_name
    entry = registry_name(press)
    if entry is not None:
        return entry
    if harness_name in PRESS_REGISTRY:
        return harness_name + VARIANT_SUFFIX
    return harness_name


def is_variant(method: str) -> bool:
    """A run named after a registry entry whose press is not that entry."""
    return method.endswith(VARIANT_SUFFIX) and method.removesuffix(VARIANT_SUFFIX) in PRESS_REGISTRY
