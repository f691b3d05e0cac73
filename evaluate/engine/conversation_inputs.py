"""A conversation of a planned run as both engines ask it (evaluate/engine/turns.py runs it on one cache)."""

import torch

from evaluate.benchmarks import Sample
from evaluate.engine.teacher_forcing import reference_answer_ids
from evaluate.engine.turns import Conversation, follow_up_ids
from evaluate.points.plan import Plan


def conversation_of(plan: Plan, turns: list[Sample], first_input: torch.Tensor, tokenizer, stop_ids: set[int]):
    """A conversation's turns as both engines ask them (evaluate/engine/turns.py): the first turn's input as kvpress's
    pipeline tokenizes it (``first_input``), each later turn's follow-up, each turn's reference answer as the
    likelihood fields teacher-force it, and the answers recorded for the turns before the first one left to answer.
    A ``ValueError`` where such a turn cannot be replayed: it failed, and ``history=model`` needs its answer."""
    first_asked = turns.index(plan.asked(turns)[0])
    keep_answers = plan.spec.history == "model"
    recorded: list[tuple[int, ...] | None] = [None] * len(turns)
    for turn, sample in enumerate(turns[:first_asked]):
        answer = plan.answered_tokens.get(sample.id)
        if answer is None and keep_answers:
            raise ValueError(
                f"turn {turn} of conversation {sample.conversation} failed in an earlier session, and history=model "
                "needs its answer; rerun with retry_errors=true"
            )
        # Under history=reference the answer is dropped: the turn's question pass alone is replayed.
        recorded[turn] = answer or (0,)
    return Conversation(
        inputs=[first_input]
        + [follow_up_ids(tokenizer, s.chat_template, s.question, s.answer_prefix) for s in turns[1:]],
        references=[reference_answer_ids(plan.benchmark, sample, tokenizer) for sample in turns],
        max_new_tokens=[sample.max_new_tokens for sample in turns],
        keep_answers=keep_answers,
        stop_ids=stop_ids,
        recorded=recorded,
    )
