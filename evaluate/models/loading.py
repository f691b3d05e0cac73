"""Loading a configuration's model and tokenizer: once per sweep, with attention masks fitted per layer."""

import json
import logging

import torch
from huggingface_hub.errors import HFValidationError

from evaluate.errors import ConfigError
from evaluate.models.layer_masks import fit_masks_to_layers
from evaluate.points.plan import Plan

logger = logging.getLogger(__name__)


def weights_bytes(model: torch.nn.Module) -> int:
    """The bytes the model's parameters hold as loaded (tied embeddings counted once), which serving capacity
    subtracts from a device's memory (evaluate/report/capacity.py)."""
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())


def warn_if_unpatched(model) -> None:
    from kvpress import SUPPORTED_MODELS

    if not isinstance(model, SUPPORTED_MODELS):
        supported = ", ".join(cls.__name__ for cls in SUPPORTED_MODELS)
        logger.warning(
            "%s is not an architecture kvpress patches and tests (%s): compression may be silently wrong",
            type(model).__name__,
            supported,
        )


class Models:
    """The tokenizer and model last loaded, so that a sweep loads each model once; one per sweep, not a global."""

    def __init__(self):
        self._loaded: dict[str, tuple[tuple, object]] = {}

    def _reuse(self, kind: str, key: tuple, load):
        if kind in self._loaded and self._loaded[kind][0] == key:
            return self._loaded[kind][1]
        self._loaded.pop(kind, None)
        if kind == "model" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        try:
            value = load()
        except (OSError, HFValidationError) as error:
            # transformers reports a missing directory or an unreachable hub id as a bare OSError, and a name that
            # is neither a directory nor a valid hub id as a validation error.
            raise ConfigError(
                f"the {kind} of {key[0]} could not be loaded ({str(error).splitlines()[0]}); point the model's "
                "name_or_path at a local directory holding config.json, or at a hub id this machine can download"
            ) from error
        self._loaded[kind] = (key, value)
        return value

    def tokenizer(self, source):
        return self._reuse("tokenizer", (repr(source),), source.load_tokenizer)

    def model(self, plan: Plan):
        """The plan's model, with attention masks fitted to each layer's cache (kvpress's ChunkKV leaves uneven
        layers)."""

        spec = plan.spec

        def load():
            model = plan.source.load_model(spec.device, plan.spec.dtype, spec.attention, spec.device_map)
            fit_masks_to_layers(model)
            return model

        placement = spec.device, json.dumps(spec.device_map, sort_keys=True)
        return self._reuse("model", (repr(plan.source), *placement, plan.spec.dtype, spec.attention), load)
