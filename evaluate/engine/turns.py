"""A conversation's turns on one cache (``turns=multi``, SCBench's multi-turn mode), the same on both engine paths.

The context is prefilled and compressed once (with the first turn's question in query-aware runs, which is what
kvpress's runner appends to what it compresses); then, turn after turn:

1. the turn's input runs on the cache. The first turn's is kvpress's question: the question, the chat template's
   question suffix and the answer prefix. A later turn's is the previous answer as the cache still lacks it, then the
   chat template's follow-up (the end of the assistant's message and a new user message), the question, the suffix
   and the answer prefix;
2. the answer is generated greedily, as kvpress's ``generate_answer`` generates it; a decoding-time press keeps
   compressing the growing cache as it does while decoding;
3. what stays of the answer. ``history=reference`` (SCBench's choice, the default): the generated tokens leave the
   cache as kvpress's ``_remove_answer_from_cache`` takes them out, the question stays, and the next input starts
   with the reference answer. ``history=model``: the answer stays as generated: the cache holds every token but the
   last (never fed back while decoding), which the next input starts with, unless it is the stop token that the
   follow-up writes anyway.

Positions continue the uncompressed conversation: the first input starts at the context's length (kvpress's
``context_length``), and each later one where the previous input and its answer ended.

A turn an earlier session recorded is replayed, not asked: its input runs, and under ``history=model`` its recorded
answer is fed back token by token in the passes its generation made, so that the cache the next turn finds is the
one an uninterrupted run leaves (evaluate/run/planning.py reads the recorded answers).
"""

from dataclasses import dataclass, field

import torch

from evaluate.engine.decoding_compression import CompressionPolicy

# Markers no chat template writes, to find where a template puts a message's content.
_ANSWER_MARK, _QUESTION_MARK = "\x00answer\x00", "\x00question\x00"


def answer_ended(answer: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    """Whether a greedy answer ends here: at its ``max_new_tokens``, or on a stop token. As kvpress's pipeline, never
    on its first token (the question's own output)."""
    return len(answer) >= max_new_tokens or (len(answer) > 1 and answer[-1] in stop_ids)


def follow_up_text(tokenizer, chat_template: bool) -> tuple[str, str]:
    """What the chat template writes between an answer and the next question, and after a question (before the
    answer prefix), in a conversation's second user message. Without a template: a new line each, as kvpress's
    ``question_suffix`` is then."""
    if not chat_template or tokenizer.chat_template is None:
        return "\n", "\n"
    messages = [
        {"role": "user", "content": "context"},
        {"role": "assistant", "content": _ANSWER_MARK},
        {"role": "user", "content": _QUESTION_MARK},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer_end, question_start = text.index(_ANSWER_MARK) + len(_ANSWER_MARK), text.index(_QUESTION_MARK)
    return text[answer_end:question_start], text[question_start + len(_QUESTION_MARK) :]


def follow_up_ids(tokenizer, chat_template: bool, question: str, answer_prefix: str) -> torch.Tensor:
    """A later turn's input after the previous answer: the follow-up, its question, the suffix and its answer prefix
    ([1, n])."""
    between, suffix = follow_up_text(tokenizer, chat_template)
    ids = tokenizer.encode(between + question + suffix + answer_prefix, add_special_tokens=False)
    return torch.tensor([ids])


@dataclass
class Conversation:
    """One conversation's turns on one cache, as a row asks them: each turn's input and first position, and how much
    of its answer leaves the cache after it.

    ``inputs``: the first turn's whole input, then each later turn's follow-up (:func:`follow_up_ids`);
    ``references``: each turn's reference answer ids (the next input's start under ``history=reference``);
    ``recorded``: each turn's answer tokens where an earlier session recorded them (replayed, not asked), else None.
    """

    inputs: list[torch.Tensor]
    references: list[torch.Tensor | None]
    max_new_tokens: list[int]
    keep_answers: bool
    stop_ids: set[int]
    recorded: list[tuple[int, ...] | None]
    turn: int = 0
    position: int = 0
    input_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.long))

    def start(self, context_length: int) -> None:
        """The first turn, at the context's length."""
        self.turn, self.position, self.input_ids = 0, context_length, self.inputs[0]

    @property
    def replaying(self) -> bool:
        return self.recorded[self.turn] is not None

    @property
    def last_turn(self) -> bool:
        return self.turn == len(self.inputs) - 1

    @property
    def turn_max_new_tokens(self) -> int:
        """The tokens this turn's answer may generate."""
        return self.max_new_tokens[self.turn]

    def take(self, answer: list[int], greedy: int) -> None:
        """Append to this turn's ``answer`` the pass's ``greedy`` token, or, in a replayed turn, its recorded token
        instead (which the next pass then feeds back)."""
        forced = self.forced()
        answer.append(greedy if forced is None else forced[len(answer)])

    def ended(self, answer: list[int], stop_ids: set[int]) -> bool:
        """Whether this turn's answer is over: a replayed turn's once its recorded tokens are fed back."""
        forced = self.forced()
        if forced is None:
            return answer_ended(answer, self.turn_max_new_tokens, stop_ids)
        return len(answer) == len(forced)

    def forced(self) -> tuple[int, ...] | None:
        """The tokens a replayed turn feeds back: its recorded answer under ``history=model``, nothing (its question
        alone, the answer being dropped anyway) under ``history=reference``; None for a turn to answer."""
        recorded = self.recorded[self.turn]
        if recorded is None:
            return None
        return recorded if self.keep_answers else recorded[:1]

    def next_turn(self, answer: list[int]) -> int:
        """Move on after this turn's ``answer`` (its tokens as generated or replayed); returns how many of the last
        positions of the cache to drop (the generated tokens under ``history=reference``)."""
        written = len(answer) - 1  # the last token is never fed back while decoding
        end = self.position + self.input_ids.shape[1] + written
        if self.keep_answers:
            kept, dropped = answer[-1:] if answer[-1] not in self.stop_ids else [], 0
            history = torch.tensor([kept], dtype=torch.long)
        else:
            history, dropped, end = self.references[self.turn], written, end - written
            history = history if history is not None else torch.zeros(1, 0, dtype=torch.long)
        self.turn += 1
        self.position = end
        self.input_ids = torch.cat([history.to(self.inputs[self.turn].device), self.inputs[self.turn]], dim=-1)
        return dropped

    def slot_length(self, cache_length: int, compression: CompressionPolicy) -> int:
        """Positions a slot needs for the whole conversation (a bound: every input, reference and answer written,
        nothing dropped, whatever the row's ``compression`` removes), plus the spare last position padding writes
        to."""
        references = sum(reference.shape[1] for reference in self.references if reference is not None)
        inputs = sum(ids.shape[1] for ids in self.inputs) + len(self.inputs)  # a kept answer's last token each
        return cache_length + inputs + references + sum(self.max_new_tokens) + 1


@dataclass
class SingleQuestion:
    """The turns of a row that asks one question, every row but a conversation's (whose turns are a
    :class:`Conversation`): one input at the context's length, nothing replayed, and the row leaves once its answer
    ends. A row's turns say what happens when its answer ends, so a conversation's row and a single question's go
    through the same pool step (evaluate/engine/decoding_pool.py)."""

    input_ids: torch.Tensor
    turn_max_new_tokens: int
    turn: None = None
    last_turn: bool = True
    position: int = 0

    def start(self, context_length: int) -> None:
        self.position = context_length

    replaying: bool = False

    def take(self, answer: list[int], greedy: int) -> None:
        answer.append(greedy)

    def ended(self, answer: list[int], stop_ids: set[int]) -> bool:
        return answer_ended(answer, self.turn_max_new_tokens, stop_ids)

    def slot_length(self, cache_length: int, compression: CompressionPolicy) -> int:
        """Positions the row's slot needs, as its compression policy counts them for its one question and answer."""
        return compression.slot_length(cache_length, self.input_ids.shape[1], self.turn_max_new_tokens)

    def forced(self) -> None:
        return None

    def next_turn(self, answer: list[int]) -> int:
        raise ValueError("a single question has no next turn")
