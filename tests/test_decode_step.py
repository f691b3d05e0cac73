"""A decoding step of the pool reads nothing back from the device, compiles as one graph, and attends each segment
of slots over its own width; the slot layout and the segments are what the step's shapes are made of."""

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from kvpress import KnormPress
from torch.utils._python_dispatch import TorchDispatchMode

from evaluate.engine.attention import pool_attention_active
from evaluate.engine.decoding_pool import DecodingPool
from evaluate.engine.requests import DecodeRequest
from evaluate.engine.slot_cache import SEGMENT_COST, arrangement, segments, width_bucket
from evaluate.models.layer_masks import fit_masks_to_layers
from evaluate.models.random_models import TinyRandomModel
from tests.test_decoding import compressed


class HostSyncs(TorchDispatchMode):
    """Counts the operators that make the host wait for a tensor's values: those PyTorch tags as having a
    data-dependent output (``_local_scalar_dense``, behind ``.item()``, ``int()``, ``bool()`` and python branching on
    a tensor) or a data-dependent shape (``nonzero``, ``masked_select``, ``unique``), plus ``aten.nonzero`` and
    ``aten.item`` by name. Indexing is tagged as data-dependent too, but only indexing with a boolean mask is (it
    runs ``nonzero``): indexing with integer tensors, as the step's writes do, is counted only with a mask."""

    NAMED = {torch.ops.aten.nonzero.default, torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default}
    TAGS = {torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape}

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        indexing = func in (
            torch.ops.aten.index.Tensor,
            torch.ops.aten.index_put_.default,
            torch.ops.aten.index_put.default,
        )
        if indexing:
            masks = [index for index in args[1] if index is not None and index.dtype in (torch.bool, torch.uint8)]
            if masks:
                self.seen.append(f"{func} with a mask")
        elif func in self.NAMED or self.TAGS & set(func.tags):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def host_syncs() -> Iterator[list[str]]:
    """The host syncs of the block: :class:`HostSyncs`'s operators and every ``Tensor.tolist()`` (which copies the
    values out without dispatching an operator)."""
    mode = HostSyncs()
    tolist = torch.Tensor.tolist

    def counted(tensor):
        mode.seen.append("Tensor.tolist")
        return tolist(tensor)

    torch.Tensor.tolist = counted
    try:
        with mode:
            yield mode.seen
    finally:
        torch.Tensor.tolist = tolist


@pytest.fixture(scope="module")
def decoding_pool():
    """A pool of four rows of different cache lengths, mid-answer (admitted, one step decoded)."""
    source = TinyRandomModel(architecture="llama", weight_scale=3.0)
    tokenizer = source.load_tokenizer()
    model = source.load_model("cpu", "float32", "sdpa")
    fit_masks_to_layers(model)
    from evaluate.engine.context_budget import make_pipeline

    pipe = make_pipeline(model, tokenizer, "cpu")
    pool = DecodingPool(model, 4, 2**30)
    for ratio in (0.0, 0.3, 0.6, 0.9):
        cache, questions, context_length, hidden = compressed(model, pipe, KnormPress(compression_ratio=ratio))
        pool.submit(DecodeRequest(cache, questions[0], context_length, 20, hidden))
    pool.step()
    assert sum(row is not None for row in pool.rows) == 4
    return pool


def test_a_decoding_step_makes_no_host_sync(decoding_pool):
    pool = decoding_pool
    state = copy.deepcopy(pool.cache)
    state.plan(None, None, 1)
    with torch.no_grad(), pool_attention_active(pool.model), host_syncs() as seen:
        pool.runner.decode_step(state)
    assert seen == []
    # The counter does see what the step used to do.
    with host_syncs() as seen:
        torch.tensor([True, False]).nonzero()
        torch.ones(2).max().item()
        torch.ones(2).tolist()
        torch.ones(2)[torch.tensor([True, False])]
    assert len(seen) >= 4


def test_the_decoding_step_compiles_as_one_graph_and_gives_the_eager_tokens(decoding_pool):
    pool = decoding_pool
    eager, compiled = copy.deepcopy(pool.cache), copy.deepcopy(pool.cache)
    step = torch.compile(pool.runner.decode_step, fullgraph=True, backend="eager")
    with torch.no_grad(), pool_attention_active(pool.model):
        for _ in range(2):
            eager.plan(None, None, 1)
            compiled.plan(None, None, 1)
            assert torch.equal(step(compiled), pool.runner.decode_step(eager))
    assert torch.equal(torch.stack(compiled.lengths), torch.stack(eager.lengths))
    assert torch.equal(compiled.positions, eager.positions)


def test_segments_follow_each_rows_width():
    long, short = width_bucket(2046), width_bucket(396)
    assert (long, short) == (2048, 512)
    # 16 long rows then 16 short ones: two segments, not 32 rows of the long width.
    assert segments((long,) * 16 + (short,) * 16) == ((0, 16, long), (16, 32, short))
    # A lone row a rung shorter between wider ones saves less than the two more attention calls cost; a run does not.
    assert 256 < 2 * SEGMENT_COST < 3 * 256
    assert segments((512, 256, 512)) == ((0, 3, 512),)
    assert segments((512, 256, 256, 256, 512)) == ((0, 1, 512), (1, 4, 256), (4, 5, 512))


def test_the_arrangement_groups_rows_and_moves_only_those_out_of_place():
    # Old slots: a long row, a free slot, a short row, a long row that joined into the free run's place.
    needs = [2000, None, 300, 1900]
    order = arrangement(needs)
    assert [needs[source] for source in order] == [2000, 1900, 300, None]
    assert sorted(order) == [0, 1, 2, 3] and order[0] == 0 and order[2] == 2  # rows in place stay
