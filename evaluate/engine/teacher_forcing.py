"""Quality without generation: how likely the compressed cache makes the reference answer, and how far its
next-token distributions move from the uncompressed model's.

For one question on one context, the reference answer (``Benchmark.reference_answer``) is teacher-forced after the
question and the answer prefix, in one forward pass over the cache, at the positions greedy decoding would use
(kvpress's ``generate_answer``: the question starts at the context's length). Over the answer's tokens:

- ``answer_nll``: the mean negative log-likelihood per token of the reference, on the compressed cache;
- ``answer_nll_uncompressed``: the same on the context's uncompressed cache;
- ``answer_kl``: the mean KL(uncompressed ‖ compressed) of the next-token distributions;
- ``answer_top1``: the share of positions whose most likely token is the same under both.

These are what llama.cpp's ``perplexity --kl-divergence`` reports for quantization, per sample. A teacher-forced
pass leaves the cache as it found it, as kvpress's pipeline does after each answer.

Where they come from: the uncompressed distributions once per context and group of questions, on the context's
uncompressed cache (in a sweep that cache is the shared prefill; on kvpress's pipeline path it costs one more
prefill per context, :func:`reference_log_probs`); the compressed ones once per point, on the cache its press left.
Both are teacher-forced by the decoding pool's machinery (evaluate/engine/decoding_pool.py), a group's rows on one
cache batched in one forward pass of fixed composition, over one slot buffer that every call reuses
(:func:`forcing_pool`, :func:`teacher_forced` says why the composition is fixed), with AdaKV's masks carried as in
greedy decoding. Presses that compress while decoding (DecodingPress) have no fixed cache to teacher-force, and get
no fields (``press_profile.why_not_teacher_forced``). ``likelihood=false`` leaves them out; ``generate=false``
computes them alone, without greedy decoding (the rows' ``prediction`` is null and the run has no accuracy score).
"""

import torch
from transformers import DynamicCache

from evaluate.engine.decoding_pool import DecodingPool
from evaluate.engine.requests import DecodeRequest


def answer_text(reference: str, answer_prefix: str) -> str:
    """The reference as the model would write it after the prefix: RULER's prefixes end without the space its
    answers start with."""
    return reference if not answer_prefix or answer_prefix[-1].isspace() else " " + reference


def answer_ids(tokenizer, reference: str, answer_prefix: str) -> torch.Tensor | None:
    """The reference's tokens ([1, n]) as teacher-forced after the prefix; None for an empty reference."""
    ids = tokenizer.encode(answer_text(reference, answer_prefix), add_special_tokens=False) if reference else []
    return torch.tensor([ids]) if ids else None


def reference_answer_ids(benchmark, sample, tokenizer) -> torch.Tensor | None:
    """The tokens of ``sample``'s reference answer that the likelihood fields teacher-force (None: none)."""
    return answer_ids(tokenizer, benchmark.reference_answer(sample), sample.answer_prefix)


def forcing_pool(model) -> DecodingPool:
    """The pool that teacher-forces a run's rows: one per run, so that its slot buffer is allocated once and then
    reused (allocating and zero-filling a fresh buffer per row was 26 % of a row's 446 ms on the CPU, issue 28).
    :func:`teacher_forced` gives it one row at a time."""
    return DecodingPool(model, batch_size=1, memory_bytes=2**62)


def reference_log_probs(
    pool: DecodingPool,
    language_model,
    context_ids: torch.Tensor,
    questions: list[torch.Tensor],
    answers: list[torch.Tensor | None],
) -> tuple[list[torch.Tensor | None], int]:
    """The uncompressed model's log-probabilities at each question's answer positions: one prefill of the context
    (``language_model``, the bare decoder, as kvpress's pipeline runs it), then :func:`teacher_forced`."""
    cache = DynamicCache()
    with torch.no_grad():
        language_model(input_ids=context_ids, past_key_values=cache)
    log_probs, passes = teacher_forced(pool, cache, (), questions, answers, context_ids.shape[1])
    return log_probs, passes + 1


def teacher_forced(
    pool: DecodingPool,
    cache: DynamicCache,
    hidden: tuple,
    questions: list[torch.Tensor],
    answers: list[torch.Tensor | None],
    context_length: int,
) -> tuple[list[torch.Tensor | None], int]:
    """Log-probabilities (float32, [answer tokens, vocabulary]) of each answer's tokens after its question on
    ``cache`` (with the keys ``hidden`` masks hidden), None where there is no answer; also the forward passes made.

    Each row with an answer is teacher-forced by ``pool`` (:func:`forcing_pool`, whose one slot is reused) in a
    forward pass of its own: batched with other rows, its float32 sums would be rounded in an order that depends on
    them, and a resumed or repaired run, which answers a part of a context's group, would give other fields than
    the run it resumes. Alone, a row's fields depend on its cache, question and answer only, and a sweep, a
    separate run, a resumed or repaired one and kvpress's pipeline path give them bit for bit (in one process;
    docs/metrics.md says where two processes were seen to differ).
    """
    rows = [
        DecodeRequest(cache, question, context_length, 0, hidden, answer, tag=index)
        for index, (question, answer) in enumerate(zip(questions, answers, strict=True))
        if answer is not None
    ]
    log_probs: list[torch.Tensor | None] = [None] * len(questions)
    passes = pool.forward_passes
    try:
        for row in rows:
            pool.submit(row)
            while pool.busy():
                for row in pool.step():
                    log_probs[row.tag] = row.output
    except BaseException:
        pool.abandon()  # a failed pass leaves its rows in their slots: the next call starts from an empty pool
        raise
    return log_probs, pool.forward_passes - passes


def likelihood_fields(compressed: torch.Tensor, uncompressed: torch.Tensor, answer_ids: torch.Tensor) -> dict:
    """The four fields of one sample, from the two log-probability tensors of :func:`teacher_forced`."""
    targets = answer_ids.reshape(-1, 1).to(compressed.device)
    kl = torch.sum(uncompressed.exp() * (uncompressed - compressed), dim=-1)
    return {
        "answer_nll": -compressed.gather(-1, targets).mean().item(),
        "answer_nll_uncompressed": -uncompressed.gather(-1, targets).mean().item(),
        # Rounding leaves tiny negative values where the distributions agree; KL is never below zero.
        "answer_kl": kl.clamp(min=0).mean().item(),
        "answer_top1": int((compressed.argmax(-1) == uncompressed.argmax(-1)).sum()) / len(targets),
    }
