"""One decoding pool: the greedy answer of every compressed cache of a run or sweep, many rows per forward pass.

kvpress's pipeline answers one question at a time: it runs the question on the compressed cache, then decodes
token by token until an end-of-sequence token or ``max_new_tokens``. On a GPU a decoding step costs about the same
for one row as for dozens, so the pool keeps the prefill and the compression at batch 1 (where they are exact) and
batches everything after them:

- every compressed cache, of any context, sweep point or ratio, joins one queue (:meth:`DecodingPool.submit`);
- up to ``batch_size`` rows decode together, one forward pass per step; a row that stops leaves at once and a
  waiting row takes its slot (continuous batching), so no row waits on another's longer answer;
- rows differ in cache length, in each layer's length (kvpress's ChunkKV, pyramidkv, kvcompose), in question
  length and in positions. Each slot holds its row's keys left-aligned in a preallocated buffer that new tokens are
  written into in place (transformers' ``DynamicCache`` copies the whole cache at every step), and a boolean mask
  per layer, slot and KV head says which keys the row attends: its own kept keys, minus those AdaKV masks, plus its
  question and answer so far. Each row therefore attends exactly the keys one-by-one decoding attends;
- joiners run their questions as one forward pass of their own (left-padded, so that every row's last question
  token is the last column), then decode with the others.
- a row whose request has a decoding press (kvpress's ``DecodingPress``) compresses its own cache after each pass
  it takes part in, on its own schedule, as that press compresses a row decoded alone
  (evaluate/engine/decoding_compression.py); the other rows are untouched by it.

The pool is three pieces, in the manner of vLLM's v1 engine: this scheduler (admission, continuous batching, the
memory budget: how many slots, when to grow or compact them), the slot cache (evaluate/engine/slot_cache.py: what a
slot costs, the buffer allocated with the rows it keeps, each row's keys and values) and the model runner
(evaluate/engine/model_runner.py: the forward passes, which give the scheduler tokens or a teacher-forced answer's
log-probabilities, never logits), with the attention of a pool step in evaluate/engine/attention.py. A step returns
the rows it finished; the pool calls nothing of its caller's. Only the rounding of the batched matrix products can
differ from one-by-one decoding, so a row's greedy tokens are the pipeline's unless two candidates tie to within that
rounding (tests/test_decoding.py, tests/test_kvpress_equivalence.py).
"""

import logging
import os
from collections import Counter, deque
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from evaluate.engine.attention import pool_attention_active
from evaluate.engine.decoding_compression import LayerInputs, compress_after_pass
from evaluate.engine.devices import layer_devices
from evaluate.engine.model_runner import ModelRunner
from evaluate.engine.requests import DecodeRequest, FinishedRow, RunningRow
from evaluate.engine.slot_cache import SlotCache, arrangement

logger = logging.getLogger(__name__)


def stop_token_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def decode_memory_bytes(gib: float | None, model) -> int:
    """The pool's memory budget: ``decode_memory`` GiB, else half the GPU memory free now, else a quarter of RAM.

    A model spread over several GPUs holds each layer's share of the pool's caches on that layer's GPU, so the budget
    is what the tightest GPU allows: its free memory over its share of the layers. Neither the sum of the free memory
    (it would overfill a GPU that holds more layers or has less free) nor the least free alone (it would leave the
    others idle) bounds every GPU.
    """
    if gib is not None:
        return int(gib * 2**30)
    devices = layer_devices(model)
    if all(device.type == "cuda" for device in devices):
        layers = Counter(devices)
        return min(torch.cuda.mem_get_info(device)[0] * len(devices) // count for device, count in layers.items()) // 2
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


@dataclass(frozen=True)
class StepPlan:
    """One pass of a pool step, as :meth:`DecodingPool.schedule` plans it: ``questions`` (the question pass) or
    ``decode`` (one token each), and the slots that take part with their rows."""

    kind: str
    slots: list[int]
    rows: list[RunningRow]


@dataclass(frozen=True)
class PassOutputs:
    """What a pass gave each row of its plan, in the plan's order: a greedy token, or a teacher-forced answer's
    log-probabilities; and the slots whose own work (their press's compression, their attention) raised."""

    outputs: list
    failed: dict[int, Exception]


class DecodingPool:
    """The scheduler: greedy answers of every submitted request, ``batch_size`` rows per forward pass, in
    ``memory_bytes``.

    ``memory_bytes`` bounds what the pool holds: the slot buffer plus the waiting requests' caches. The engine
    submits while :meth:`has_room` and calls :meth:`step` otherwise, so contexts are prefilled ahead only while
    there is room, and steps while :meth:`busy` at the end. Each step returns the rows it finished.
    """

    def __init__(self, model, batch_size: int, memory_bytes: int):
        self.model, self.batch_size, self.memory_bytes = model, max(1, batch_size), memory_bytes
        self.runner = ModelRunner(model)
        self.stop_ids = stop_token_ids(model)
        self.waiting: deque[DecodeRequest] = deque()
        self.waiting_bytes = 0
        self.rows: list[RunningRow | None] = []
        self.cache: SlotCache | None = None
        self.warned_budget = False
        self.attention_modules = [layer.self_attn for layer in model.model.layers]

    @property
    def forward_passes(self) -> int:
        return self.runner.forward_passes

    @property
    def peak_rows(self) -> int:
        return self.runner.peak_rows

    @property
    def held_bytes(self) -> int:
        return self.waiting_bytes + (self.cache.nbytes if self.cache is not None else 0)

    def has_room(self) -> bool:
        """Whether another context may be compressed into the queue now. An idle pool always has room, so that a
        budget too small for one row decodes rows one at a time (with a warning, see ``_affordable``) instead of
        waiting forever for room that no step can make."""
        if not self.busy():
            return True
        return len(self.waiting) < self.batch_size and self.held_bytes < self.memory_bytes

    def submit(self, request: DecodeRequest) -> None:
        self.waiting.append(request)
        self.waiting_bytes += request.nbytes

    def busy(self) -> bool:
        return bool(self.waiting) or any(row is not None for row in self.rows)

    def abandon(self) -> list[DecodeRequest]:
        """Drop every row, waiting or decoding, and the slot buffer (after a failed pass); returns their requests."""
        dropped = [*(row.request for row in self.rows if row is not None), *self.waiting]
        self.waiting.clear()
        self.waiting_bytes = 0
        self.rows, self.cache = [], None
        return dropped

    def step(self) -> list[FinishedRow]:
        """One step of the pool, in the manner of vLLM v1's ``EngineCore.step``: each of its two passes is scheduled
        (:meth:`schedule`: which slots run, rows admitted first), executed (:meth:`execute`: the model runner's pass
        and each row's decoding compression) and its outputs turned into finished rows (:meth:`update`). The question
        pass runs the questions of every row that asks (rows just admitted, and conversations' rows at their next
        turn); the decoding pass then gives one token to every other row, joiners included. Returns the rows that
        finished (a conversation's: each turn it answered), and those whose own press raised, with it."""
        finished: list[FinishedRow] = []
        with torch.no_grad(), pool_attention_active(self.model), self._layer_inputs() as inputs:
            for kind in ("questions", "decode"):
                plan = self.schedule(kind)
                if plan is not None:
                    finished += self.update(plan, self.execute(plan, inputs))
            self._compact()
        return finished

    def schedule(self, kind: str) -> "StepPlan | None":
        """The plan of one pass, or None when no row takes part. ``questions``: waiting rows admitted into free
        slots first, then every row that asks. ``decode``: every row that does not ask (a conversation's row that
        finished a turn waits, paused, for its next question pass), with the keys its decoding press masks."""
        if kind == "questions":
            if self.waiting:
                self._load_arrivals()
            slots = [slot for slot, row in enumerate(self.rows) if row is not None and row.asking]
            for slot in slots:
                self.cache.set_live(slot, 1)
        else:
            slots = [slot for slot, row in enumerate(self.rows) if row is not None and not row.asking]
        if not slots:
            return None
        return StepPlan(kind, slots, [self.rows[slot] for slot in slots])

    def execute(self, plan: "StepPlan", inputs: LayerInputs | None) -> "PassOutputs":
        """Run the plan's pass on the model runner, then each served row's decoding compression; the rows whose own
        work raised are in ``failed``."""
        if plan.kind == "questions":
            outputs = self.runner.ask_questions(self.cache, plan.slots, plan.rows)
            pairs = enumerate(zip(plan.slots, plan.rows, strict=True))
            served = [(slot, row, line, row.input_ids.shape[1]) for line, (slot, row) in pairs]
            return PassOutputs(outputs, self._compress(inputs, served))
        self.cache.masked = {
            slot: row.compression.masked
            for slot, row in zip(plan.slots, plan.rows, strict=True)
            if any(row.compression.masked)
        }
        tokens = self.runner.decode(self.cache, plan.rows)
        self.cache.masked, failed, self.cache.failed = {}, self.cache.failed, {}
        served = [(slot, row, slot, 1) for slot, row in zip(plan.slots, plan.rows, strict=True) if slot not in failed]
        failed.update(self._compress(inputs, served))
        return PassOutputs([tokens[slot] for slot in plan.slots], failed)

    def update(self, plan: "StepPlan", outputs: "PassOutputs") -> list[FinishedRow]:
        """Each served row's output appended (or its failure recorded): the rows that finished, and after a question
        pass the rows rearranged by width."""
        finished = []
        for slot, row, output in zip(plan.slots, plan.rows, outputs.outputs, strict=True):
            if plan.kind == "questions":
                row.asking = False
            if slot in outputs.failed:
                finished.append(self._fail(slot, row, outputs.failed[slot]))
            elif plan.kind == "questions" and row.request.answer_ids is not None:
                finished.append(self._leave(slot, row, output))  # teacher-forced: its log-probabilities
            else:
                finished += self._append(slot, row, output)
        if plan.kind == "questions":
            self._arrange()
        return finished

    def _layer_inputs(self):
        """The attention inputs of this step's passes, kept only while a row's compression policy reads them."""
        requests = [*self.waiting, *(row.request for row in self.rows if row is not None)]
        if any(request.compression.reads_layer_inputs for request in requests):
            return LayerInputs(self.attention_modules)
        return nullcontext()

    def _compress(self, inputs: LayerInputs | None, served: list[tuple]) -> dict[int, Exception]:
        """Each served row's compression policy after a pass (evaluate/engine/decoding_compression.py); returns the
        slots whose policy raised, which fail alone (:meth:`_fail`)."""
        return compress_after_pass(self.cache, self.attention_modules, inputs, served)

    # Slots

    def _resize(self, slots: int, capacity: int) -> None:
        """A new slot buffer of ``slots`` rows of ``capacity`` positions, keeping the rows decoding now."""
        occupied = [slot for slot, row in enumerate(self.rows) if row is not None]
        self.cache = SlotCache.allocate(self.model, slots, capacity, self.cache, occupied)
        self.rows = [self.rows[slot] for slot in occupied] + [None] * (slots - len(occupied))

    def _load_arrivals(self) -> None:
        active = sum(row is not None for row in self.rows)
        capacity = max([self.cache.capacity if self.cache is not None else 0] + [r.slot_length() for r in self.waiting])
        # As many slots as the batch size, the work at hand and the memory budget allow.
        slots = max(len(self.rows), min(self.batch_size, active + len(self.waiting), self._affordable(capacity)))
        if self.cache is None or slots > self.cache.slots or capacity > self.cache.capacity:
            # Grown in steps, so that a slowly rising need does not copy the buffer at every admission.
            self._resize(slots, capacity if self.cache is None else max(capacity, self.cache.capacity * 5 // 4))
        free = [slot for slot, row in enumerate(self.rows) if row is None]
        arrivals = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        # Widest first, the order _arrange keeps: a pool filled at once moves no row.
        for slot, request in zip(free, sorted(arrivals, key=lambda request: -request.slot_length()), strict=False):
            self.waiting_bytes -= request.nbytes
            self.cache.load(slot, request)
            self.rows[slot] = RunningRow(request)

    def _affordable(self, capacity: int) -> int:
        """How many slots of ``capacity`` positions the memory budget holds beside the waiting rows (at least one)."""
        slot_bytes = SlotCache.slot_bytes(self.model, capacity)
        affordable = (self.memory_bytes - self.waiting_bytes) // slot_bytes
        if affordable < 1 and not self.warned_budget:
            self.warned_budget = True
            needed = (slot_bytes + self.waiting[0].nbytes) / 2**30
            logger.warning(
                "decode_memory=%.3g GiB holds no row (one needs %.3g GiB): rows decode one at a time; raise it, or "
                "leave it null for the default",
                self.memory_bytes / 2**30,
                needed,
            )
        return max(1, affordable)

    def _arrange(self) -> None:
        """Keep rows of like slot length next to each other, so that a decoding step attends each segment of slots
        over its own width (SlotCache.plan); after an admission, moving only the rows out of place."""
        order = arrangement([row.slot_length if row is not None else None for row in self.rows])
        self.cache.permute(order)
        self.rows = [self.rows[source] for source in order]

    def _append(self, slot: int, row: RunningRow, token: int) -> list[FinishedRow]:
        ended = row.take(token, self.stop_ids)
        if row.turns.replaying:  # the next pass feeds back the recorded token the row took, not the greedy one
            self.cache.tokens[slot] = row.tokens[-1]
        if not ended:
            return []
        if row.turns.last_turn:  # a single question's answer, or a conversation's last turn
            return [self._leave(slot, row, row.tokens)]
        answered = [] if row.turns.replaying else [self._answered(slot, row, list(row.tokens))]
        # The next turn: what leaves the cache of this answer, then the row waits for its next question pass.
        self.cache.crop(slot, row.next_turn())
        self.cache.set_live(slot, 0)
        row.asking = True
        return answered

    def _answered(self, slot: int, row: RunningRow, output) -> FinishedRow:
        """A row's answer as it stands in its slot: for a decoding press, with the lengths and masks it left."""
        final, masks, compressed, keys = row.compression.final_state(self.cache, slot)
        return FinishedRow(
            row.request.tag, output, row.cost, final, masks, row.turn, compressed=compressed, final_keys=keys
        )

    def _leave(self, slot: int, row: RunningRow, output) -> FinishedRow:
        finished = self._answered(slot, row, output)
        self.rows[slot] = None
        self.cache.free(slot)
        return finished

    def _fail(self, slot: int, row: RunningRow, failure: Exception) -> FinishedRow:
        """A row whose own work in a pass raised leaves with the failure; the pass's other rows keep what it gave
        them, as their rows never read another's slot."""
        self.rows[slot] = None
        self.cache.free(slot)
        return FinishedRow(row.request.tag, [], row.cost, turn=row.turn, failure=failure)

    def _compact(self) -> None:
        """Once no row waits and most slots are idle, decode the remaining rows in a smaller buffer."""
        active = sum(row is not None for row in self.rows)
        if self.waiting or self.cache is None or active == 0 or active > len(self.rows) // 2:
            return
        self._resize(active, self.cache.capacity)


def decode_all(model, requests: list[DecodeRequest], batch_size: int, memory_bytes: int = 2**40) -> list[list[int]]:
    """The greedy tokens of every request, in order, decoded in one pool."""
    tokens: list[list[int] | None] = [None] * len(requests)
    pool = DecodingPool(model, batch_size, memory_bytes)
    for index, request in enumerate(requests):
        pool.submit(replace(request, tag=index))
    while pool.busy():
        for row in pool.step():
            tokens[row.tag] = row.output
    return tokens
