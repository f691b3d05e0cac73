"""One point of a run or sweep, resolved once (evaluate/points/resolve.py): every setting and everything derived
from it that the later stages read, typed.

:class:`PointSpec` derives from evaluate/settings.py's :class:`~evaluate.settings.Settings`, so it carries every
setting under its conf/config.yaml name, as resolved: the device and the device map each point runs on, the
``max_new_tokens`` it applies, its token budget and its shard. Beside them: the run directory, the fingerprint,
the method's name, the compression ratio applied, the attention, the model key, and what the run builds and
records (the press, benchmark and model source to instantiate, config.yaml's configuration, the tracking's
settings). Every later stage (the planner, the model loader, the engine, the recorder, the closing lines) reads
the spec; none reads the composed config.
"""

from dataclasses import dataclass, field
from pathlib import Path

from evaluate.kv_cache import DynamicKVCache, QuantizedKVCache
from evaluate.points.shard import Shard
from evaluate.settings import Settings


@dataclass(frozen=True, kw_only=True)
class PointSpec(Settings):
    """A typed and validated configuration with what is derived from it (see the module docstring)."""

    out: Path
    fingerprint: str
    method: str
    # None under a token budget, which gives each context its own ratio (evaluate/points/budget.py), and for a
    # decoding-time press, whose target decides.
    effective_cr: float | None
    # ``(target_size, compression_interval)`` of a press that compresses only while decoding, else None.
    decoding_target: tuple[int, int] | None
    # How much it keeps, as its lines print it: budget=N, a decoding-time press's target, or the ratio.
    kept_text: str
    attention: str
    model_key: str
    benchmark_name: str
    model_name: str
    # What the run instantiates (Hydra's ``_target_`` trees, resolved): its benchmark, its model source, its press
    # (None: press=none); a press's facts are read off the press this describes (evaluate/points/config.py).
    benchmark: dict
    model_source: dict
    press: dict | None
    # The scorer the press is built from (press=topk, adakv, ...; None for none and the registry entries), its
    # observation window (None without one), and the context length it needs.
    scorer_name: str | None
    scorer_window: int | None
    scorer_min_context: int
    # The cache its keys and values are held in (the ``cache`` group, evaluate/kv_cache.py).
    kv_cache: DynamicKVCache | QuantizedKVCache
    # The code of a press defined outside kvpress and PressBench (evaluate/points/config.py:press_sources).
    press_sources: dict[str, str]
    # The configuration as config.yaml records it, and the ``wandb`` group's settings ({}: not tracked).
    recorded: dict
    tracking: dict
    # Resolved from ``shard=`` or torchrun's ranks (evaluate/points/shard.py).
    shard: Shard = field(default=Shard())
