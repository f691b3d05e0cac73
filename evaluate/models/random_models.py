"""Random-weight models: the tiny one the tests and `make test` run on (``TinyRandomModel``, with its byte-level
tokenizer built in code), and models of a real model's shape built directly on the target device (``RandomModel``):
timing without weights.

``RandomModel`` defaults to Llama-3.1-8B's shape (32 layers, hidden 4096, 32 query / 8 KV heads, MLP 14336,
vocabulary 128256): in bf16 its 16 GB of weights are drawn on the GPU in seconds, where real weights need a
download and ``TinyRandomModel`` (built on the CPU in fp32, then moved) would need 32 GB of host memory and minutes
of CPU time per process. Timing needs the shapes, not trained weights. Every field can be overridden, so the same
class also gives a scaled-down model for smoke tests on a CPU.

Weights are drawn from a generator seeded with ``seed`` on the target device, in the target dtype and in a fixed
order, so two processes on the same kind of device build identical models: ``scripts/bench_sweep.py`` compares a
sweep's predictions with those of separate processes.

Use it from the command line through the tiny_random config group, e.g.
``model=tiny_random model.name=random-llama-8b model.source._target_=evaluate.models.random_models.RandomModel``
(``scripts/bench_sweep.py --random-model`` does this).
"""

import itertools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from evaluate.models.sources import CACHE_DIR, DeviceMap, placed
from evaluate.points.config import resolve_dtype

# bos (also unk and pad), eos and ChatML's turn start: appended after the regular vocabulary.
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
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


@dataclass
class RandomModel:
    """A random-weight causal LM of a given shape (default: Llama-3.1-8B's), built on the device it runs on.

    Parameters
    ----------
    architecture : str
        ``llama`` or ``qwen3``.
    seed : int
        Seed of the generator the weights are drawn from (on the target device).
    hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size : int
        Shape; head_dim is ``hidden_size // num_attention_heads``. Defaults: Llama-3.1-8B.
    rope_theta : float
        RoPE base (Llama-3.1's 500000).
    max_position_embeddings : int
        Also the tokenizer's ``model_max_length``.
    weight_scale : float
        Embeddings are drawn from N(0, 1), every other matrix from N(0, weight_scale² / fan_in), norms are 1.

    ``dtype="auto"`` builds in bfloat16, the dtype of the real checkpoint.
    """

    architecture: str = "llama"
    seed: int = 0
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    intermediate_size: int = 14336
    vocab_size: int = 128256
    rope_theta: float = 500000.0
    max_position_embeddings: int = 8192
    weight_scale: float = 1.0

    def load_tokenizer(self):
        return build_tiny_tokenizer(self.vocab_size, self.max_position_embeddings)

    def load_model(self, device: str, dtype: str, attn_implementation: str, device_map: DeviceMap = None):
        # Spread by a device map, it is drawn on the CPU and dispatched from there: no one device need hold it (its
        # weights are then the CPU generator's, not those of the same model drawn on a GPU).
        built_on = device if device_map is None else "cpu"
        return placed(lambda _: self._build(built_on, dtype, attn_implementation), device, device_map)

    def _build(self, device: str, dtype: str, attn_implementation: str) -> torch.nn.Module:
        config = random_model_config(
            self, self.load_tokenizer(), attn_implementation, rope_theta=self.rope_theta, tie_word_embeddings=False
        )
        torch_dtype = resolve_dtype(dtype)
        torch_dtype = torch.bfloat16 if torch_dtype == "auto" else torch_dtype
        with torch.device(device):
            model = TINY_ARCHITECTURES[self.architecture][1]._from_config(config, dtype=torch_dtype)
        with torch.no_grad():
            for weight in model.parameters():
                if weight.dim() != 2:
                    weight.fill_(1.0)  # norms
        redraw_weights(model, self.weight_scale, torch.Generator(device=device).manual_seed(self.seed))
        model.generation_config.eos_token_id = config.eos_token_id
        return model

    def parameter_count(self, embeddings: bool = True) -> int:
        """Parameters of the model this source builds (without building it); without embeddings and output layer
        when ``embeddings=False``."""
        head_dim = self.hidden_size // self.num_attention_heads
        attention = self.hidden_size * head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size + (2 * head_dim if self.architecture == "qwen3" else 0)
        layers = self.num_hidden_layers * (attention + mlp + norms)
        if not embeddings:
            return layers
        return layers + 2 * self.vocab_size * self.hidden_size + self.hidden_size
