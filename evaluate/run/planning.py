"""Planning a point of the run: its press, benchmark and model source built from its config, its samples loaded and
checked, and what an earlier session of its run directory answered read back, in one step and without writing
anything (the recorder writes, evaluate/run/recorder.py). The result is the point's :class:`Plan`.
"""

from dataclasses import replace
from pathlib import Path

from hydra.utils import instantiate

from evaluate import rundir
from evaluate.benchmarks import Sample
from evaluate.benchmarks.selection import load_samples
from evaluate.errors import ConfigError
from evaluate.points.config import build_press, validate_budget, validate_context_lengths, warn_uncompressed_decoding
from evaluate.points.plan import Plan, context_id
from evaluate.points.point import PointSpec
from evaluate.press_profile import profile
from evaluate.score.answer_length import TOKENS


def sample_identity(sample: Sample) -> dict:
    """What a prediction row records of its sample first (resuming checks it, with ``max_new_tokens``, unchanged)."""
    return {
        "id": sample.id,
        "task": sample.task,
        "context_id": context_id(sample.context),
        "question": sample.question,
        "answer_prefix": sample.answer_prefix,
        "answers": list(sample.answers),
        **({"conversation": sample.conversation, "turn": sample.turn} if sample.turn is not None else {}),
    }


def check_same_samples(out: Path, rows: list[dict], samples: list[Sample]) -> None:
    """Refuse to resume on rows answered for other data than the benchmark now loads (a data file edited in place
    under the same path): a stale row would otherwise be reported as complete."""
    now = {sample.id: {**sample_identity(sample), "max_new_tokens": sample.max_new_tokens} for sample in samples}
    stale = [
        (row["id"], changed)
        for row in rows
        if (changed := [key for key, value in now.get(row["id"], {}).items() if key in row and row[key] != value])
    ]
    if stale:
        first, changed = stale[0]
        raise ConfigError(
            f"{out}: {len(stale)} of its {len(rows)} predictions answer samples that have changed since (the first, "
            f"{first}: its {', '.join(changed)}); the data changed under the same name: pass overwrite=true to redo "
            "the run or output_dir=... to keep both"
        )


def previous_rows(spec: PointSpec) -> list[dict]:
    """The rows earlier sessions of this run left, a shard's included, that this session keeps; refuses another
    configuration's. Only this process's own file is repaired (its torn last line cut): another shard may be
    appending to its own."""
    out, run_fingerprint = spec.out, spec.fingerprint
    if spec.overwrite:
        return []
    recorded = rundir.read_yaml(out / rundir.CONFIG)
    if recorded is not None and recorded.get("fingerprint") != run_fingerprint:
        raise ConfigError(
            f"{out} holds predictions of a different configuration; pass overwrite=true to discard them "
            "or output_dir=... to keep both"
        )
    answered_with = (recorded or {}).get("sources") or {}
    sources = spec.press_sources if answered_with else {}
    changed = sorted(name for name in set(sources) | set(answered_with) if sources.get(name) != answered_with.get(name))
    if changed:
        name = changed[0]
        raise ConfigError(
            f"{out} was answered by other code of its press: {name} was {answered_with.get(name) or 'absent'}, is "
            f"{sources.get(name) or 'absent'} now (sha256); pass overwrite=true to redo the run with this code, "
            "output_dir=... to keep both, or restore the code it was answered with to resume"
        )
    own = out / rundir.PREDICTIONS if spec.shard.whole else rundir.shard_path(out, spec.shard.name, ".jsonl")
    rundir.read_predictions(own, repair=True)
    rows = rundir.read_all_predictions(out)
    return [row for row in rows if not row.get("error")] if spec.retry_errors else rows


def make_plan(spec: PointSpec, tokenizer) -> Plan:
    """Plan a resolved point (``run_sweep`` checks every point before it locks any run directory), its run
    directory locked by the caller: the checks that need the tokenizer and the samples run here."""
    out = spec.out
    benchmark = instantiate(spec.benchmark)
    samples = load_samples(benchmark, tokenizer, spec.fraction, spec.limit, spec.seed)
    if spec.max_new_tokens is not None:
        # kvpress's max_new_tokens: the run's value instead of each row's, so the rows record it and resuming checks it.
        samples = [replace(sample, max_new_tokens=spec.max_new_tokens) for sample in samples]
    context_tokens = {s.context: len(tokenizer.encode(s.context, add_special_tokens=False)) for s in samples}
    questions = {s.id: len(tokenizer.encode(s.question, add_special_tokens=False)) for s in samples}
    question_tokens = max(questions.values())
    shortest_context = min(context_tokens.values()) + (question_tokens if spec.query_aware else 0)
    validate_context_lengths(spec, shortest_context)
    validate_budget(spec, shortest_context)
    longest_row = max(context_tokens[s.context] + questions[s.id] + s.max_new_tokens for s in samples)
    warn_uncompressed_decoding(spec, longest_row, question_tokens, max(s.max_new_tokens for s in samples))
    if spec.turns == "multi" and any(sample.conversation is None for sample in samples):
        raise ConfigError(
            f"turns=multi asks a conversation's turns on one cache, and {benchmark.name}'s samples have no turns; "
            "use benchmark=ruler_synth benchmark.turns=K (K >= 2) or benchmark=scbench, or drop turns=multi"
        )
    kept = previous_rows(spec)
    check_same_samples(out, kept, samples)
    done = {row["id"] for row in kept}
    contexts = spec.shard.contexts(sample.context for sample in samples)
    share = tuple(sample for sample in samples if sample.context in contexts)
    press = build_press(spec)
    return Plan(
        spec=spec,
        benchmark=benchmark,
        source=instantiate(spec.model_source),
        press=press,
        profile=profile(press),
        samples=tuple(samples),
        kept_rows=tuple(kept),
        share=share,
        todo=tuple(sample for sample in share if sample.id not in done),
        context_tokens=context_tokens,
        # A conversation resumed at its first unanswered turn replays the answers its earlier turns recorded.
        answered_tokens={row["id"]: tuple(row[TOKENS]) for row in kept if row.get(TOKENS) and not row.get("error")},
    )
