"""Random-weight models of a real model's shape, built directly on the target device: timing without weights.

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

from dataclasses import dataclass

import torch

from evaluate.models.sources import (
    TINY_ARCHITECTURES,
    DeviceMap,
    build_tiny_tokenizer,
    placed,
    random_model_config,
    redraw_weights,
)
from evaluate.spec.config import resolve_dtype


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
