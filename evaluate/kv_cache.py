"""The cache a point holds its keys and values in: the config group ``cache`` (conf/cache/), one class per choice.

- ``dynamic`` (:class:`DynamicKVCache`, the default): transformers' ``DynamicCache``, every pair at the model's dtype,
  as every run recorded before the axis existed.
- ``quantized`` (:class:`QuantizedKVCache`): transformers' ``QuantizedCache`` (KIVI-style): the context quantized to
  ``nbits`` per channel in groups of ``q_group_size``, the newest ``residual_length`` tokens at full precision until
  they are quantized too. kvpress's pipeline takes it as ``cache=``, and its presses compress the dequantized pairs and
  quantize what they keep again (``BasePress.forward_hook``, ``DecodingPress``), so a point on it is kvpress's
  pipeline called with it. The pool's slots hold pairs at the model's dtype: such a point takes the pipeline's path.

Also here: what a cache layer physically holds (:func:`stored_pairs`, :func:`stored_bytes`: the quantized storage with
its scales and zero points, plus the full-precision residual), and an answer removed from a quantized cache
(:func:`remove_answer`). The report reads a run's cache (:func:`recorded_cache`) without torch: torch and transformers
are imported where a cache is made.
"""

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

from evaluate.errors import ConfigError

if TYPE_CHECKING:
    from transformers import DynamicCache, QuantizedCache

# The bits each backend of transformers' QuantizedCache quantizes to.
BACKEND_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}


@dataclass(frozen=True)
class DynamicKVCache:
    """Every pair at the model's dtype (transformers' ``DynamicCache``). It takes the quantized cache's knobs and
    reads none: they are null unless a sweep over ``cache=dynamic,quantized cache.nbits=2,4`` sets them, and its
    dynamic points are then one run (:meth:`unread_knobs`)."""

    backend: str | None = None
    nbits: int | None = None
    residual_length: int | None = None
    q_group_size: int | None = None
    axis_key: int | None = None
    axis_value: int | None = None

    run_name_part: ClassVar[str | None] = None
    label: ClassVar[str] = ""  # what the report's labels add: nothing, as for every run before the axis
    one_question_per_cache: ClassVar[bool] = False
    why_not_pooled: ClassVar[str | None] = None
    why_not_multi_turn: ClassVar[str | None] = None

    def unread_knobs(self) -> list[str]:
        """The knobs set on this cache that it does not read, as ``cache.<knob>=<value>``."""
        set_knobs = [each.name for each in fields(self) if getattr(self, each.name) is not None]
        return [f"cache.{knob}={getattr(self, knob)}" for knob in set_knobs]

    def make(self, model) -> "DynamicCache":
        from transformers import DynamicCache

        return DynamicCache()

    def prepare(self, pipe) -> None:
        """Nothing: kvpress's pipeline runs on a DynamicCache as it is."""


@dataclass(frozen=True)
class QuantizedKVCache:
    """transformers' ``QuantizedCache`` with these knobs (their defaults are transformers'): ``backend`` (quanto or
    hqq), ``nbits``, ``residual_length`` (tokens kept at full precision before they are quantized), ``q_group_size``,
    ``axis_key`` and ``axis_value`` (the axis each is quantized along)."""

    backend: str = "quanto"
    nbits: int = 4
    residual_length: int = 128
    q_group_size: int = 64
    axis_key: int = 0
    axis_value: int = 0

    why_not_pooled: ClassVar[str] = (
        "cache=quantized: the pool's slots hold keys and values at the model's dtype, so kvpress's pipeline answers "
        "on the QuantizedCache"
    )
    # kvpress 0.5.5's pipeline cannot ask several questions on one QuantizedCache: its _remove_answer_from_cache cuts
    # each layer's full-precision residual at the context's length, which leaves the question and answer there, and
    # the next question's attention mask, built from the cache's length, is shorter than its keys (a RuntimeError;
    # tests/test_quantized_cache.py). So each question is asked on its own cache, as kvpress's evaluate.py asks a
    # DecodingPress's rows one by one.
    one_question_per_cache: ClassVar[bool] = True
    why_not_multi_turn: ClassVar[str] = (
        "does not run on cache=quantized yet: a conversation's turns keep and drop answers on the cache's "
        "full-precision layers"
    )

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_BITS:
            raise ConfigError(f"cache.backend={self.backend} is not one of {', '.join(BACKEND_BITS)}")
        if self.nbits not in BACKEND_BITS[self.backend]:
            allowed = ", ".join(str(bits) for bits in BACKEND_BITS[self.backend])
            raise ConfigError(f"cache.nbits={self.nbits} is not one of {allowed} for cache.backend={self.backend}")
        if self.residual_length < 1 or self.q_group_size < 1:
            raise ConfigError("cache.residual_length and cache.q_group_size must be positive")

    @property
    def run_name_part(self) -> str:
        """What the run's directory name says of the cache: its backend and bits."""
        return f"{self.backend}{self.nbits}bit"

    @property
    def label(self) -> str:
        """What the report's labels say of the cache."""
        return f"{self.backend} {self.nbits}-bit"

    def unread_knobs(self) -> list[str]:
        return []

    def prepare(self, pipe) -> None:
        """kvpress's pipeline object made to remove an answer from a QuantizedCache (:func:`remove_answer`): its own
        ``_remove_answer_from_cache`` cuts each layer's full-precision residual at the context's length, which leaves
        the question and answer there, and fails (an IndexError) when the answer's last token flushed the residual into
        the quantized part. Each question has its own cache here, so nothing reads what it leaves but the kept ratio
        and the bytes measured after the answer, and the answer, generated before, is kvpress's either way."""
        pipe._remove_answer_from_cache = remove_answer

    def make(self, model) -> "QuantizedCache":
        from transformers import QuantizedCache

        if self.backend == "quanto":
            from evaluate.quanto_build import prepare_quanto

            prepare_quanto()
        return QuantizedCache(
            self.backend,
            model.config,
            nbits=self.nbits,
            axis_key=self.axis_key,
            axis_value=self.axis_value,
            q_group_size=self.q_group_size,
            residual_length=self.residual_length,
        )


def recorded_cache(recorded: dict | None) -> DynamicKVCache | QuantizedKVCache:
    """The cache a run's config.yaml records (its ``cache`` group, resolved): none for a run from before the axis,
    whose cache was the model's own."""
    if not recorded:
        return DynamicKVCache()
    kinds = {f"{kind.__module__}.{kind.__qualname__}": kind for kind in (DynamicKVCache, QuantizedKVCache)}
    return kinds[recorded["_target_"]](**{key: value for key, value in recorded.items() if key != "_target_"})


def remove_answer(cache: "QuantizedCache", cache_seq_lengths: list[int]) -> None:
    """Each layer of ``cache`` cut back to its length before the question (``cache_seq_lengths``), as kvpress's
    ``_remove_answer_from_cache`` does for a DynamicCache: the quantized part past that length (where the answer
    flushed the residual) and the full-precision residual past it dropped, the layer's length set back."""
    for layer, length in zip(cache.layers, cache_seq_lengths, strict=True):
        quantized = _quantized_length(layer._quantized_keys)
        if quantized > length:  # quantized again, cut (hqq's packed storage cannot be sliced)
            keys, values = layer._dequantize(layer._quantized_keys), layer._dequantize(layer._quantized_values)
            layer._quantized_keys = layer._quantize(keys[:, :, :length].contiguous(), axis=layer.axis_key)
            layer._quantized_values = layer._quantize(values[:, :, :length].contiguous(), axis=layer.axis_value)
        if layer.keys.dim() == 4:
            kept = max(0, length - quantized)
            layer.keys, layer.values = layer.keys[:, :, :kept], layer.values[:, :, :kept]
        layer.cumulative_length = length


def _quantized_length(quantized) -> int:
    """Positions a layer's quantized part holds: quanto's tensor keeps its shape, hqq's its metadata."""
    if isinstance(quantized, tuple):
        return int(quantized[1]["shape"][2])
    return int(quantized.shape[2])


def _tensor_bytes(tensor) -> int:
    """Bytes a (possibly quantized) tensor stores: a quanto tensor's inner tensors (packed data, scales, shifts),
    an hqq pair's packed tensor and its scales and zero points."""
    if isinstance(tensor, tuple):
        packed, meta = tensor
        return packed.nbytes + meta["scale"].nbytes + meta["zero"].nbytes
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.nbytes


def _is_quantized(layer) -> bool:
    """Whether a cache layer is a quantized one that holds pairs (transformers' ``QuantizedLayer``)."""
    return hasattr(layer, "_quantized_keys")


def stored_pairs(layer) -> tuple[int, int]:
    """(KV heads, positions) a cache layer holds: a quantized layer's quantized part (the context, as kvpress's
    presses leave it) and its full-precision residual."""
    if not _is_quantized(layer):
        return layer.keys.shape[1], layer.keys.shape[2]
    quantized = layer._quantized_keys
    heads = quantized[1]["shape"][1] if isinstance(quantized, tuple) else quantized.shape[1]
    residual = layer.keys.shape[2] if layer.keys.dim() == 4 else 0
    return int(heads), _quantized_length(quantized) + residual


def stored_bytes(layer) -> int:
    """Bytes a cache layer holds: its keys and values, quantized storage (scales and zero points included) plus the
    full-precision residual for a quantized layer."""
    held = layer.keys.nbytes + layer.values.nbytes
    if _is_quantized(layer):
        held += _tensor_bytes(layer._quantized_keys) + _tensor_bytes(layer._quantized_values)
    return held
