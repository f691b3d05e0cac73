"""Models: where a model and its tokenizer come from (the hub, the embedded GGUF, random weights), and loading them.

The source classes are named here because configurations name them as ``_target_: evaluate.models.<Class>``, and
that path is part of every run's fingerprint.
"""

from evaluate.models.random_models import TinyRandomModel
from evaluate.models.sources import EmbeddedGGUFModel, HubModel

__all__ = ["EmbeddedGGUFModel", "HubModel", "TinyRandomModel"]
