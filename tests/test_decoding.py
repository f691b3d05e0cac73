"""The decoding pool gives, row by row, the answers of kvpress's one-question-at-a-time pipeline.

One pool holds rows of every kind a sweep produces at once: caches of different lengths, layers of uneven length
(kvpress's ChunkKV), AdaKV's masked keys, questions of different lengths and answers of different budgets.
"""

import gc
import weakref

import pytest
import torch
from kvpress import AdaKVPress, ChunkKVPress, KnormPress, SnapKVPress
from transformers import DynamicCache

from evaluate.engine.context_budget import make_pipeline
from evaluate.engine.decoding_pool import DecodingPool, decode_all
from evaluate.engine.requests import DecodeRequest, hidden_keys
from evaluate.engine.slot_cache import SlotCache
from evaluate.models.layer_masks import fit_masks_to_layers
from evaluate.models.random_models import TinyRandomModel

CONTEXT = "Document 7. The grass is green and the sky is blue. The special magic number is 4242. " * 12
QUESTIONS = ["What is the magic number? ", "Which number is the magic one? ", "Q? "]
# ChunkKV keeps whole chunks per layer: its layers are uneven where a layer keeps the short trailing chunk and
# another does not. Which layer does is up to the random weights and the CPU's rounding (chunk length 13 made
# qwen3's layers uneven in earlier CI runs and even on a later machine), so the first of these lengths that makes
# them uneven on the model at hand is used.
CHUNK_LENGTHS = (13, 7, 11, 17, 5, 19, 23)
_uneven_chunkkv: dict[torch.nn.Module, ChunkKVPress] = {}  # keyed by the model itself: an id could be reused


def presses(model, pipe) -> list:
    """The five sweep points of every test here: no press, SnapKV, Knorm, ChunkKV with uneven layers, AdaKV."""
    if model not in _uneven_chunkkv:
        candidates = (ChunkKVPress(KnormPress(compression_ratio=0.5), chunk_length=n) for n in CHUNK_LENGTHS)
        uneven = (
            p for p in candidates if len({layer.keys.shape[2] for layer in compressed(model, pipe, p)[0].layers}) > 1
        )
        _uneven_chunkkv[model] = next(uneven)
    return [
        None,
        SnapKVPress(compression_ratio=0.5),
        KnormPress(compression_ratio=0.8),
        _uneven_chunkkv[model],
        AdaKVPress(SnapKVPress(compression_ratio=0.6)),
    ]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request):
    """A random model whose greedy answers depend on the cache."""
    source = TinyRandomModel(architecture=request.param, weight_scale=3.0)
    tokenizer = source.load_tokenizer()
    model = source.load_model("cpu", "float32", "sdpa")
    fit_masks_to_layers(model)
    return model, tokenizer, make_pipeline(model, tokenizer, "cpu")


def compressed(model, pipe, press) -> tuple[DynamicCache, list[torch.Tensor], int, tuple]:
    tokens = pipe.preprocess(CONTEXT, QUESTIONS, "Answer:", 10**6)
    cache = DynamicCache()
    with torch.no_grad(), press(model) if press is not None else torch.no_grad():
        model.model(input_ids=tokens["context_ids"].to(model.device), past_key_values=cache)
    modules = [layer.self_attn for layer in model.model.layers]
    hidden = hidden_keys(modules)
    for module in modules:
        module.masked_key_indices = None
    questions = [question.to(model.device) for question in tokens["questions_ids"]]  # the GPU check runs these on cuda
    return cache, questions, tokens["context_ids"].shape[1], hidden


def requests_over_points(model, pipe, max_new_tokens: list[int]) -> list[DecodeRequest]:
    """Every question on the caches of five sweep points."""
    requests = []
    for press in presses(model, pipe):
        cache, questions, context_length, hidden = compressed(model, pipe, press)
        for question, budget in zip(questions, max_new_tokens, strict=True):
            requests.append(DecodeRequest(cache, question, context_length, budget, hidden))
    return requests


def pipeline_tokens(model, pipe, request: DecodeRequest) -> list[int]:
    """kvpress's pipeline's greedy tokens for one request, with its AdaKV masks set as the press leaves them."""
    lengths = [layer.keys.shape[2] for layer in request.cache.layers]
    for module, masked in zip((layer.self_attn for layer in model.model.layers), request.hidden, strict=True):
        module.masked_key_indices = None if masked is None else (torch.zeros_like(masked[0]), *masked)
    tokenizer_decode = pipe.tokenizer.decode
    # The pipeline returns the decoded text: "decode" to the token ids themselves.
    pipe.tokenizer.decode = lambda ids, skip_special_tokens=False: " ".join(str(int(token)) for token in ids)
    try:
        with torch.no_grad():
            text = pipe.generate_answer(
                request.question_ids, request.cache, request.context_length, request.max_new_tokens
            )
    finally:
        pipe.tokenizer.decode = tokenizer_decode
        for module in (layer.self_attn for layer in model.model.layers):
            module.masked_key_indices = None
    pipe._remove_answer_from_cache(request.cache, lengths)
    return [int(token) for token in text.split()]


def test_the_pool_holds_every_kind_of_row(setup):
    model, _, pipe = setup
    requests = requests_over_points(model, pipe, [5, 5, 5])
    chunk_lengths = {layer.keys.shape[2] for layer in requests[9].cache.layers}
    assert len(chunk_lengths) > 1  # ChunkKV's layers are uneven (presses() picks its chunk length for that)
    assert any(masked is not None for masked in requests[12].hidden)  # AdaKV masks keys
    assert len({request.question_ids.shape[1] for request in requests}) == 3
    assert len({request.cache.layers[0].keys.shape[2] for request in requests}) >= 4


@pytest.mark.parametrize("batch_size", [1, 4, 16])
def test_pooled_answers_equal_the_pipelines_one_by_one(setup, batch_size):
    model, _, pipe = setup
    requests = requests_over_points(model, pipe, [40, 17, 1])
    expected = [pipeline_tokens(model, pipe, request) for request in requests]
    assert len({tuple(tokens) for tokens in expected}) >= 10  # the rows really differ
    assert decode_all(model, requests, batch_size) == expected


def test_rows_stop_at_their_own_end_token_as_the_pipeline_does(setup, monkeypatch):
    model, _, pipe = setup
    requests = requests_over_points(model, pipe, [30, 30, 30])
    free = [pipeline_tokens(model, pipe, request) for request in requests]
    # The end token is the most frequent later token: rows stop at different steps, some at their first token
    # (which the pipeline does not test, so those go on).
    later = [token for tokens in free for token in tokens[1:]]
    stop = max(set(later), key=later.count)
    monkeypatch.setattr(model.generation_config, "eos_token_id", stop)
    expected = [pipeline_tokens(model, pipe, request) for request in requests]
    assert len({len(tokens) for tokens in expected}) > 1
    assert decode_all(model, requests, 16) == expected


def test_a_row_that_finishes_leaves_and_a_waiting_row_takes_its_slot(setup):
    model, _, pipe = setup
    cache, questions, context_length, hidden = compressed(model, pipe, SnapKVPress(compression_ratio=0.5))
    budgets = [40, 10, 10, 10, 10]
    requests = [DecodeRequest(cache, questions[0], context_length, budget, hidden) for budget in budgets]
    pool = DecodingPool(model, 2, 2**30)
    for request in requests:
        pool.submit(request)
    while pool.busy():
        pool.step()
    # Continuous: the long row decodes while the four short ones pass through the other slot, 40 steps in all
    # plus one question pass per admission. Batches of two waiting on their longest row would take 60 steps.
    assert pool.peak_rows == 2
    assert pool.forward_passes <= 40 + len(budgets)


def test_the_memory_budget_bounds_the_slots_and_not_the_answers(setup):
    model, _, pipe = setup
    requests = requests_over_points(model, pipe, [12, 6, 3])
    pool = DecodingPool(model, 16, memory_bytes=1)
    for request in requests:
        pool.submit(request)
    while pool.busy():
        pool.step()
    assert pool.peak_rows == 1
    assert decode_all(model, requests, 16, memory_bytes=1) == decode_all(model, requests, 16)


def test_decoding_leaves_every_cache_as_it_found_it(setup):
    model, _, pipe = setup
    requests = requests_over_points(model, pipe, [5, 5, 5])
    before = [[(layer.keys.clone(), layer.values.clone()) for layer in r.cache.layers] for r in requests]
    decode_all(model, requests, 16)
    for request, layers in zip(requests, before, strict=True):
        for layer, (keys, values) in zip(request.cache.layers, layers, strict=True):
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_a_cache_is_freed_once_its_rows_hold_it_in_slots(setup):
    """The pool copies a row's cache into its slot; the row then lets go of it, so a cache no caller holds is freed
    while its rows decode, not when they leave (it would otherwise be held twice: issue 36, a sweep's memory)."""
    model, _, pipe = setup
    cache, questions, context_length, hidden = compressed(model, pipe, SnapKVPress(compression_ratio=0.5))
    alive = weakref.ref(cache)
    pool = DecodingPool(model, 4, 2**30)
    lengths = set()
    for question in questions:
        request = DecodeRequest(cache, question, context_length, 8, hidden)
        lengths.add(request.slot_length())
        pool.submit(request)
    del cache, request
    pool.step()
    gc.collect()
    assert alive() is None
    assert sum(row is not None for row in pool.rows) == len(questions)
    assert all(row.request.cache is None for row in pool.rows if row)
    assert {row.slot_length for row in pool.rows if row} == lengths
    while pool.busy():
        pool.step()


def test_a_question_pass_holds_one_layers_copies_of_the_keys_at_a_time(setup, monkeypatch):
    """Joining rows attend copies of their slots' keys; each layer's copies are freed after its attention, not at
    the end of the pass (issue 36: 32 joiners of 4k-token contexts held 3.2 GB of them at once)."""
    model, _, pipe = setup
    live = []
    question = SlotCache._question

    def watched(self, layer_idx, *args):
        part = question(self, layer_idx, *args)
        # Every earlier layer's copies are gone by the time this layer's are made.
        assert all(copy() is None for copy in live)
        live.append(weakref.ref(part[1]))
        return part

    monkeypatch.setattr(SlotCache, "_question", watched)
    requests = requests_over_points(model, pipe, [3, 3, 3])
    assert decode_all(model, requests, 16) == [pipeline_tokens(model, pipe, request) for request in requests]
    assert len(live) >= len(model.model.layers)
