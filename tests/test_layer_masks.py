"""Decoding on caches whose layers hold different numbers of KV pairs (kvpress's ChunkKVPress leaves such caches).

The reference paths need no multi-token mask from transformers: feeding the question one token at a time, and a
brute-force attention that builds each layer's causal mask from that layer's own key count.
"""

import pytest
import torch
from kvpress import ChunkKVPress, KnormPress, SnapKVPress
from transformers import AttentionInterface, DynamicCache

from evaluate.engine.context_budget import make_pipeline
from evaluate.models.layer_masks import fit_masks_to_layers
from evaluate.models.random_models import TinyRandomModel


def brute_force_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Softmax attention written out, with the causal rule taken from this layer's shapes alone."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query.double() @ key.double().transpose(-1, -2) * (scaling or query.shape[-1] ** -0.5)
    query_length, key_length = query.shape[2], key.shape[2]
    # Query i is the (key_length - query_length + i)-th token: it sees every key up to itself.
    allowed = torch.arange(key_length)[None, :] <= torch.arange(key_length - query_length, key_length)[:, None]
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return (weights @ value.double()).to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("brute_force", brute_force_attention)

CONTEXT_LENGTH = 523  # 52 chunks of 10 and a tail of 3
QUESTION_LENGTH = 7


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    source = TinyRandomModel(architecture=request.param, weight_scale=3.0)
    model = source.load_model("cpu", "float32", "sdpa")
    fit_masks_to_layers(model)
    return model


def uneven_cache(model) -> tuple[DynamicCache, torch.Tensor]:
    """A kvpress ChunkKVPress cache whose layers disagree on the trailing chunk, and a question to ask of it."""
    for seed in range(20):
        generator = torch.Generator().manual_seed(seed)
        context = torch.randint(0, model.config.vocab_size, (1, CONTEXT_LENGTH), generator=generator)
        cache = DynamicCache()
        press = ChunkKVPress(KnormPress(compression_ratio=0.9), chunk_length=10)
        with torch.no_grad(), press(model):
            model.model(input_ids=context, past_key_values=cache)
        lengths = {layer.keys.shape[2] for layer in cache.layers}
        if len(lengths) > 1:
            question = torch.randint(0, model.config.vocab_size, (1, QUESTION_LENGTH), generator=generator)
            return cache, question
    raise AssertionError("no seed gave layers of different lengths")


def copy_of(cache: DynamicCache) -> DynamicCache:
    copy = DynamicCache()
    for layer_idx, layer in enumerate(cache.layers):
        copy.update(layer.keys.clone(), layer.values.clone(), layer_idx)
    return copy


def question_logits(model, cache: DynamicCache, question: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(CONTEXT_LENGTH, CONTEXT_LENGTH + question.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=question, past_key_values=copy_of(cache), position_ids=positions).logits[0]


def token_by_token_logits(model, cache: DynamicCache, question: torch.Tensor) -> torch.Tensor:
    cache = copy_of(cache)
    rows = []
    with torch.no_grad():
        for i in range(question.shape[1]):
            position = torch.tensor([[CONTEXT_LENGTH + i]])
            rows.append(model(input_ids=question[:, i : i + 1], past_key_values=cache, position_ids=position).logits)
    return torch.cat(rows, dim=1)[0]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_multi_token_question_on_uneven_layers_equals_token_by_token_and_brute_force(model, attention):
    cache, question = uneven_cache(model)
    model.set_attn_implementation(attention)
    try:
        logits = question_logits(model, cache, question)
        stepwise = token_by_token_logits(model, cache, question)
        model.set_attn_implementation("brute_force")
        brute = question_logits(model, cache, question)
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits, stepwise, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, brute, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits.argmax(-1), brute.argmax(-1))


def test_without_the_fitted_masks_the_same_question_fails():
    # The failure the fit repairs: transformers sizes one mask from layer 0 for every layer.
    model = TinyRandomModel(architecture="qwen3", weight_scale=3.0).load_model("cpu", "float32", "sdpa")
    cache, question = uneven_cache(model)
    with pytest.raises(RuntimeError, match="size of tensor"):
        question_logits(model, cache, question)


def test_greedy_answers_of_the_pipeline_on_uneven_layers_equal_token_by_token_decoding(model):
    tokenizer = TinyRandomModel().load_tokenizer()
    pipe = make_pipeline(model, tokenizer, "cpu")
    cache, question = uneven_cache(model)
    lengths = [layer.keys.shape[2] for layer in cache.layers]
    with torch.no_grad():
        answer = pipe.generate_answer(question, cache, CONTEXT_LENGTH, max_new_tokens=12)
    # The pipeline leaves the cache as it found it once the answer is removed, layer by layer.
    pipe._remove_answer_from_cache(cache, lengths)
    assert [layer.keys.shape[2] for layer in cache.layers] == lengths

    steps = copy_of(cache)
    tokens = []
    with torch.no_grad():
        for i in range(QUESTION_LENGTH):
            logits = model(
                input_ids=question[:, i : i + 1],
                past_key_values=steps,
                position_ids=torch.tensor([[CONTEXT_LENGTH + i]]),
            ).logits
        for step in range(12):
            tokens.append(int(logits[0, -1].argmax()))
            if step == 11 or (step > 0 and tokens[-1] == model.generation_config.eos_token_id):
                break
            position = torch.tensor([[CONTEXT_LENGTH + QUESTION_LENGTH + step]])
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=steps, position_ids=position).logits
    assert answer == tokenizer.decode(tokens, skip_special_tokens=True)


def test_equal_layers_are_left_alone(model):
    # SnapKV keeps the same count in every layer: the hook must not touch the mask transformers built.
    cache = DynamicCache()
    context = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), SnapKVPress(compression_ratio=0.5)(model):
        model.model(input_ids=context, past_key_values=cache)
    assert len({layer.keys.shape[2] for layer in cache.layers}) == 1
    before, after = [], []
    attention = model.model.layers[1].self_attn
    handles = [
        attention.register_forward_pre_hook(
            lambda m, a, kw: before.append(kw["attention_mask"]), with_kwargs=True, prepend=True
        ),
        attention.register_forward_pre_hook(lambda m, a, kw: after.append(kw["attention_mask"]), with_kwargs=True),
    ]
    try:
        question = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model(input_ids=question, past_key_values=cache)
    finally:
        for handle in handles:
            handle.remove()
    assert before[0] is not None and after[0] is before[0]
