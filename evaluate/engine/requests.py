"""What the engine is asked, and what it gives back: a row to answer greedily or teacher-force on a compressed cache,
the row while it runs, and the row it finished with its share of the work."""

from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from evaluate.engine.cost import Cost
from evaluate.engine.decoding_compression import CompressionPolicy, NoCompression, RowCompression
from evaluate.engine.kept_sets import Diagnosed
from evaluate.engine.turns import Conversation, SingleQuestion


@dataclass
class RowCost:
    """One row's share of the pool's work: each forward pass's time and count split over the rows it served."""

    decode_seconds: float = 0.0
    forward_passes: float = 0.0
    generated_tokens: int = 0


@dataclass
class DecodeRequest:
    """One question to answer greedily from ``cache``, which the pool only reads.

    ``context_length`` is the uncompressed context's length: the question's positions follow it, as in kvpress's
    pipeline, whatever the press removed. ``hidden`` holds, per layer, the (head, position) pairs AdaKV masks in
    the cache (None where nothing is masked). ``tag`` is the caller's: the finished row carries it back.

    With ``answer_ids`` the row is teacher-forced instead (evaluate/engine/teacher_forcing.py): the answer follows
    the question in the row's one forward pass, and the finished row's output is the float32 log-probabilities
    ([answer tokens, vocabulary]) of the tokens at the answer's positions; the row then leaves, having generated
    nothing.

    ``compression`` is what the row does to its own cache after each of its passes: nothing, or, under a decoding-time
    press (``DecodingCompression``), compress it on its own schedule (evaluate/engine/decoding_compression.py).

    With ``conversation`` the row asks a conversation's turns one after the other on its cache
    (evaluate/engine/turns.py): ``question_ids`` is then the first turn's input, and ``tag`` a list with each turn's
    tag (None for a turn replayed from an earlier session's record).
    """

    cache: DynamicCache | None  # None once the pool holds it in a slot (RunningRow)
    question_ids: torch.Tensor
    context_length: int
    max_new_tokens: int
    hidden: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...] = ()
    answer_ids: torch.Tensor | None = None
    tag: object = None
    compression: CompressionPolicy = NoCompression()
    conversation: Conversation | None = None

    @property
    def input_ids(self) -> torch.Tensor:
        """The row's first forward pass: its question, then the teacher-forced answer if any."""
        if self.answer_ids is None:
            return self.question_ids
        return torch.cat([self.question_ids, self.answer_ids.to(self.question_ids.device)], dim=-1)

    @property
    def turns(self) -> "Conversation | SingleQuestion":
        """What happens when the row's answer ends: a conversation's next turn, or the row leaves."""
        if self.conversation is not None:
            return self.conversation
        return SingleQuestion(self.input_ids, self.max_new_tokens)

    @property
    def nbytes(self) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in self.cache.layers)

    def slot_length(self) -> int:
        """Positions a slot needs for this row, as its turns and its compression count them from its longest layer."""
        longest = max(layer.keys.shape[2] for layer in self.cache.layers)
        return self.turns.slot_length(longest, self.compression)


@dataclass
class RunningRow:
    """A request while it holds a slot: the tokens so far, its cost, its slot's length, its compression policy's state
    (``DecodeRequest.compression.start``); its turns (:attr:`DecodeRequest.turns`: what happens when its answer
    ends, and which tokens a replayed turn feeds back instead of its greedy ones); the input its next question pass runs
    and that input's first position (a conversation's turn after turn).

    Made once the slot holds the request's keys and values: the row keeps its request without the cache, which
    would otherwise stay in memory beside its slot's copy until the row leaves (the cache is freed once no waiting
    row of its context and point holds it either)."""

    request: DecodeRequest
    tokens: list[int] = field(default_factory=list)
    cost: RowCost = field(default_factory=RowCost)
    compression: RowCompression | NoCompression = field(init=False)
    turns: Conversation | SingleQuestion = field(init=False)
    slot_length: int = 0
    input_ids: torch.Tensor | None = None
    start_position: int = 0
    asking: bool = True

    def __post_init__(self) -> None:
        self.slot_length = self.request.slot_length()
        self.compression = self.request.compression.start(len(self.request.cache.layers))
        self.turns = turns = self.request.turns
        turns.start(self.request.context_length)
        self.input_ids, self.start_position = turns.input_ids, turns.position
        self.request = replace(self.request, cache=None, hidden=())

    @property
    def turn(self) -> int | None:
        return self.turns.turn

    def take(self, greedy: int, stop_ids: set[int]) -> bool:
        """Take a pass's ``greedy`` token into the answer, or, in a replayed turn, its recorded token instead (its
        turns say which); returns whether the turn's answer ended."""
        self.turns.take(self.tokens, greedy)
        self.cost.generated_tokens += not self.turns.replaying
        return self.turns.ended(self.tokens, stop_ids)

    def next_turn(self) -> int:
        """Move on to the conversation's next turn; returns how many of the slot's last positions to drop."""
        if not self.turns.replaying:  # a replayed turn's passes go to the next answered turn, as on the pipeline's path
            self.cost = RowCost()
        dropped = self.turns.next_turn(self.tokens)
        self.tokens = []
        self.input_ids, self.start_position = self.turns.input_ids, self.turns.position
        return dropped


@dataclass
class FinishedRow:
    """What a pool step gives back for a row that left: the greedy tokens (or the teacher-forced log-probabilities),
    its cost, and its request's ``tag`` (a conversation's: the ``turn`` answered); for a row that compressed while
    decoding, each layer's length when it left
    (``final_lengths``), the keys its last compression masked on each layer (``final_masks``, AdaKV's) and whether
    any compression removed pairs (``compressed``, :class:`GeneratedAnswer`). A row
    whose own work raised (its press's compression) leaves with the ``failure`` and no output; the step's other
    rows go on."""

    tag: object
    output: list[int] | torch.Tensor
    cost: RowCost
    final_lengths: tuple[int, ...] | None = None
    final_masks: tuple | None = None
    turn: int | None = None
    failure: Exception | None = None
    compressed: bool | None = None
    final_keys: tuple | None = None  # a compressing row's: each layer's key fingerprints as it left (kept_sets.py)


def hidden_keys(attention_modules) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]:
    """The keys the last compression masked on each attention module (AdaKV does), as (heads, positions) of row 0.

    kvpress hides them from every query with a fake key whose attention weight underflows to zero; the pool hides
    them with its mask, which gives the same weights.
    """
    hidden = []
    for module in attention_modules:
        masked = getattr(module, "masked_key_indices", None)
        if masked is None:
            hidden.append(None)
            continue
        batch, heads, positions = masked
        hidden.append((heads[batch == 0], positions[batch == 0]))
    return tuple(hidden)


@dataclass(frozen=True)
class GeneratedAnswer:
    """One greedy answer as token ids, exactly as decoded (its stop token included), and whether it ended on a stop
    token rather than at its ``max_new_tokens``; under a decoding-time press, whether the press removed pairs of the
    row's cache before the answer ended (``compressed``: a press whose target holds the whole row never does, and
    the row is the uncompressed model's), else None."""

    token_ids: tuple[int, ...]
    stopped_on_eos: bool
    compressed: bool | None = None

    @classmethod
    def of(cls, tokens: list[int], stop_ids: set[int], compressed: bool | None = None) -> "GeneratedAnswer":
        # As both paths stop: the first token (the question's own output) is never tested against the stop tokens.
        return cls(tuple(int(token) for token in tokens), len(tokens) > 1 and int(tokens[-1]) in stop_ids, compressed)


@dataclass
class AnsweredGroup:
    """What the engine finished: one point's questions on one context, answered (or failed with ``failure``), with
    the likelihood fields of each sample where the point wants them, and the cost. ``generated`` holds each
    answer's tokens (:class:`GeneratedAnswer`), None where nothing was generated (generate=false, a failure);
    ``contexts``, the compressed contexts whose cost and bytes it carries; ``diagnosis``, each row's diagnostic fields
    and the kept set they were measured on (evaluate/engine/kept_sets.py), None under ``diagnostics=none``.
    ``point`` indexes the plans the engine was given; the run loop records it."""

    point: int
    group: list
    answers: list[str | None]
    kept_ratio: float | None
    context_length: int | None
    cost: Cost
    likelihood: list[dict] | None = None
    failure: Exception | None = None
    generated: list[GeneratedAnswer | None] | None = None
    contexts: int = 1  # compressed contexts its cost covers: none for a conversation's later turns
    diagnosis: Diagnosed | None = None


@dataclass
class Prefilled:
    """Progress the engine reports between answers: how many of its contexts are prefilled and compressed (the
    phase that takes longest before the first answer on a CPU)."""

    contexts: int
    of: int
