"""Batched greedy decoding gives, row by row, the answers of kvpress's one-question-at-a-time pipeline."""

import pytest
import torch
from kvpress import AdaKVPress, KnormPress, SnapKVPress
from transformers import DynamicCache

from evaluate.decoding import DecodeRequest, greedy_answers, masks_keys_in_place
from evaluate.models import TinyRandomModel
from evaluate.runner import make_pipeline
from presses.chunkkv_exact import ExactChunkKVPress

CONTEXT = "Document 7. The grass is green and the sky is blue. The special magic number is 4242. " * 12
# The first two have the same length in tokens (the tokenizer is byte-level), so they batch with each other.
QUESTIONS = ["What is the magic number? ", "What number is the magic? ", "Q? "]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request):
    """A random model whose greedy answers depend on the cache, and a tokenizer that "decodes" to token ids."""
    source = TinyRandomModel(architecture=request.param, weight_scale=3.0)
    tokenizer = source.load_tokenizer()
    model = source.load_model("cpu", "float32", "sdpa")
    # The byte-level tokenizer decodes most random tokens to U+FFFD: compare the tokens themselves.
    tokenizer.decode = lambda ids, skip_special_tokens=False: " ".join(str(int(token)) for token in ids)
    return model, tokenizer, make_pipeline(model, tokenizer, "cpu")


def compressed(model, pipe, press) -> tuple[DynamicCache, list[torch.Tensor], int]:
    tokens = pipe.preprocess(CONTEXT, QUESTIONS, "Answer:", 10**6)
    cache = DynamicCache()
    with torch.no_grad(), press(model) if press is not None else torch.no_grad():
        model.model(input_ids=tokens["context_ids"], past_key_values=cache)
    return cache, tokens["questions_ids"], tokens["context_ids"].shape[1]


def pipeline_answers(pipe, requests: list[DecodeRequest]) -> list[str]:
    answers = []
    for request in requests:
        lengths = [layer.keys.shape[2] for layer in request.cache.layers]
        with torch.no_grad():
            answers.append(
                pipe.generate_answer(
                    request.question_ids, request.cache, request.context_length, request.max_new_tokens
                )
            )
        pipe._remove_answer_from_cache(request.cache, lengths)
    return answers


def requests_over_points(model, pipe, max_new_tokens: list[int]) -> list[DecodeRequest]:
    """Every question on the caches of six sweep points: three keep the same number of pairs, two others too."""
    presses = [
        None,
        SnapKVPress(compression_ratio=0.5),
        ExactChunkKVPress(SnapKVPress(compression_ratio=0.5), 8),
        KnormPress(compression_ratio=0.5),
        SnapKVPress(compression_ratio=0.8),
        ExactChunkKVPress(KnormPress(compression_ratio=0.8), 8),
    ]
    requests = []
    for press in presses:
        cache, questions, context_length = compressed(model, pipe, press)
        for question, budget in zip(questions, max_new_tokens, strict=True):
            requests.append(DecodeRequest(cache, question, context_length, budget))
    batches = {}
    for request in requests:
        batches[request.shape_key()] = batches.get(request.shape_key(), 0) + 1
    assert sorted(batches.values(), reverse=True)[:3] == [6, 4, 3], batches  # rows that really share batches
    return requests


@pytest.mark.parametrize("batch_size", [1, 5, 16])
def test_batched_answers_equal_the_pipelines_one_by_one(setup, batch_size):
    model, tokenizer, pipe = setup
    requests = requests_over_points(model, pipe, [40, 17, 1])
    expected = pipeline_answers(pipe, requests)
    assert len(set(expected)) >= 10  # the rows really differ
    assert greedy_answers(model, tokenizer, requests, batch_size) == expected


def test_rows_stop_at_their_own_end_token_as_the_pipeline_does(setup, monkeypatch):
    model, tokenizer, pipe = setup
    requests = requests_over_points(model, pipe, [30, 30, 30])
    free = [[int(token) for token in answer.split()] for answer in pipeline_answers(pipe, requests)]
    # The end token is the first token of one row (which the pipeline does not test, so that row goes on) and
    # the most frequent token in the other rows: rows leave their batch at different steps.
    later = [token for ids in free for token in ids[1:]]
    stop = max(set(later), key=later.count) if free[1][0] == free[1][1] else free[1][0]
    monkeypatch.setattr(model.generation_config, "eos_token_id", stop)
    expected = pipeline_answers(pipe, requests)
    assert len({len(answer) for answer in expected}) > 1
    assert greedy_answers(model, tokenizer, requests, 16) == expected


def test_decoding_leaves_every_cache_as_it_found_it(setup):
    model, tokenizer, pipe = setup
    requests = requests_over_points(model, pipe, [5, 5, 5])
    before = [[(layer.keys.clone(), layer.values.clone()) for layer in r.cache.layers] for r in requests]
    greedy_answers(model, tokenizer, requests, 16)
    for request, layers in zip(requests, before, strict=True):
        for layer, (keys, values) in zip(request.cache.layers, layers, strict=True):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_adakv_masks_are_detected(setup):
    model, _, pipe = setup
    modules = [layer.self_attn for layer in model.model.layers]
    compressed(model, pipe, SnapKVPress(compression_ratio=0.5))
    assert not masks_keys_in_place(modules)
    compressed(model, pipe, AdaKVPress(SnapKVPress(compression_ratio=0.5)))
    assert masks_keys_in_place(modules)
    for module in modules:
        module.masked_key_indices = None
