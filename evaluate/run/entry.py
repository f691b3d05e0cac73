"""Several configurations in one process: each model loaded once, each context prefilled once, one decoding pool.

``run_sweep`` types, checks and resolves every configuration once (evaluate/points/), locks its run directory, plans
it and answers it on its model: through the pooled path (evaluate/engine/pool_engine.py) where the press acts only
after each layer's attention and ``decode_batch_size`` is above 1, else through kvpress's pipeline
(evaluate/engine/pipeline_engine.py). The engines give back what they finished; this loop hands it to each point's
recorder, the only writer. A single run is the sweep of one point.
"""

import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from hydra.utils import instantiate
from kvpress import DecodingPress
from omegaconf import DictConfig
from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging

from evaluate import rundir
from evaluate.engine.attention import HALF_PRECISION, why_not_pooled
from evaluate.engine.context_budget import check_budget_fits, check_generation_fits, context_budget, context_cap
from evaluate.engine.decoding_pool import decode_memory_bytes
from evaluate.engine.engine import Engine
from evaluate.engine.pipeline_engine import PipelineEngine
from evaluate.engine.pool_engine import PoolEngine
from evaluate.engine.requests import AnsweredGroup, Prefilled
from evaluate.errors import ConfigError, RunIncomplete, exit_code, fail, refuse, stop_on_signals
from evaluate.models.loading import Models, warn_if_unpatched, weights_bytes
from evaluate.points.config import described, validate_choices
from evaluate.points.plan import Plan
from evaluate.points.point import PointSpec
from evaluate.points.resolve import checked
from evaluate.press_profile import (
    profile,
    selects_by_position,
)
from evaluate.run.planning import make_plan
from evaluate.run.recorder import AnsweringClock, Recorder, describe
from evaluate.run.summary import failed_samples, interrupted_summary, run_summary, sweep_summary, waiting_summary

logger = logging.getLogger(__name__)


def answer_path(plan: Plan, model) -> tuple[str, str, str | None]:
    """Which engine answers the run, ``pool`` or kvpress's ``pipeline``, why (logged when not the pool), and what
    the pool may change in its answers, if anything."""
    if plan.spec.decode_batch_size == 1:
        return "pipeline", "decode_batch_size=1 asks for kvpress's pipeline path, one question at a time", None
    reason = (
        plan.profile.why_not_shared_prefill(plan.spec.attention)
        or plan.spec.kv_cache.why_not_pooled
        or why_not_pooled(model)
    )
    if reason is not None:
        logger.info("%s takes kvpress's pipeline path: %s", plan.out.name, reason)
        return "pipeline", reason, None
    decoding = plan.profile.decoding
    if decoding is not None:
        why = (
            f"the press compresses while decoding: each row compresses its own cache on its own schedule in the pool, "
            f"its prefill shared (decode_batch_size={plan.spec.decode_batch_size})"
        )
    else:
        why = (
            f"the press acts only after each layer's attention, so the context's prefill is shared and its questions "
            f"are decoded in the pool (decode_batch_size={plan.spec.decode_batch_size})"
        )
    return "pool", why, pool_note(decoding, model.dtype)


# What the pool's half-precision rounding measured on a real model: results/bench/pool_agreement_bfloat16_cpu.md
# (tests/test_dtype_agreement.py holds this line to that table).
HALF_PRECISION_MEASURED = (
    "measured on SmolLM2-135M in bfloat16 at 1,024 tokens, 188 of 792 rows parted and every score difference's "
    "paired 95 % interval held 0"
)


def pool_note(decoding: DecodingPress | None, dtype: torch.dtype) -> str | None:
    """What the pool's rows may differ in from kvpress's batch of one (docs/performance.md measures how often, and
    whether the score moves): in half precision, any row where two candidates nearly tie, since the batched steps
    round otherwise (a pool of one row equals the pipeline); outside float64, a decoding-time press that selects by
    scores, whose near-ties the batched step's rounding can break otherwise."""
    name = str(dtype).removeprefix("torch.")
    if dtype in HALF_PRECISION:
        return (
            f"in {name} the pool's batched steps round otherwise than kvpress's batch of one, so an answer may part "
            f"from it where two tokens or scores nearly tie ({HALF_PRECISION_MEASURED}: docs/performance.md, 'The "
            "pool in half precision'); decode_batch_size=1 is the bit-exact path"
        )
    if decoding is None or selects_by_position(decoding.base_press) or dtype == torch.float64:
        return None
    return (
        f"{type(decoding.base_press).__name__} selects by scores, and in {name} the pool's batched rounding can break "
        "near-ties of them otherwise than kvpress's batch of one, so a row's answer may part from it after a "
        "compression; decode_batch_size=1 is the bit-exact path"
    )


def _first_of_each() -> Callable[[logging.LogRecord], bool]:
    seen: set[tuple[str, int, str]] = set()

    def first(record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in seen:
            return False
        seen.add(key)
        return True

    return first


@contextmanager
def each_warning_once() -> Iterator[None]:
    """A warning that every point of a sweep would repeat word for word (a benchmark's skipped tasks, a truncation
    count) is printed once: a filter on each of the root logger's handlers (each its own, since every handler sees
    every record) for the sweep's duration."""
    filters = [(handler, _first_of_each()) for handler in logging.getLogger().handlers]
    for handler, first in filters:
        handler.addFilter(first)
    try:
        yield
    finally:
        for handler, first in filters:
            handler.removeFilter(first)


def run_sweep(cfgs: Sequence[DictConfig], single: bool = False) -> list[dict | None]:
    """Run (or resume) every configuration, each checked first (:func:`checked`); see :func:`run_points`."""
    return run_points(checked(cfgs, single), single)


def run_points(specs: Sequence[PointSpec], single: bool = False) -> list[dict | None]:
    """Run (or resume) every checked point; return their metrics in order (None for a point left to another).

    A launcher that checked its points (:func:`checked`) hands them here, so nothing is checked twice. A
    point whose run directory another process holds is left to it (or waited for, with ``wait_for_locks=true``)
    and listed at the end; a ``single`` run refuses it. Points on the same model share one model load; among
    those, the ones whose press acts only after attention share each context's prefill. SIGTERM stops it as Ctrl-C
    does, each run directory saying so; a failure of the machine that left samples unanswered raises
    :class:`RunIncomplete` once every point has closed.
    """
    # Our own bars track the runs; per-tensor loading bars would bury them.
    transformers_logging.disable_progress_bar()
    directories = [spec.out for spec in specs]
    models = Models()
    metrics: dict[int, dict] = {}
    skipped: list[str] = []
    # For each run directory this sweep will create, the topmost folder on its path that does not exist yet.
    created = {out: rundir.first_missing(out) for out in directories if not out.exists()}
    incomplete: list[str] = []
    try:
        with ExitStack() as held:
            held.enter_context(stop_on_signals())
            held.enter_context(each_warning_once())
            for indices in _lock_by_model(specs, held, single, skipped).values():
                recorders = _run_on_one_model([specs[index] for index in indices], models)
                metrics.update(zip(indices, (recorder.close() for recorder in recorders), strict=True))
                incomplete += [
                    f"{recorder.plan.out}: {recorder.unanswered} samples ({recorder.environment_error})"
                    for recorder in recorders
                    if recorder.unanswered
                ]
    except BaseException:
        _remove_created(created)
        raise
    if skipped:
        print(f"{len(skipped)} of {len(specs)} points were left to the processes holding them; rerun to resume them:")
        print("\n".join(f"  {point}" for point in skipped))
    if incomplete:
        raise RunIncomplete(
            f"the machine failed, not the samples, so these were left unanswered: {'; '.join(incomplete)}; free "
            "what ran short (memory, disk, or lower decode_batch_size / decode_memory) and rerun the same command "
            "to answer them"
        )
    _read_points_other_shards_finished(specs, metrics)
    return [metrics.get(directories.index(spec.out)) for spec in specs]


def _lock_by_model(specs: list[PointSpec], held: ExitStack, single: bool, skipped: list[str]) -> dict[str, list[int]]:
    """Lock each point's run directory (held until ``held`` closes); the indices of the points locked, by model. A
    point another process holds is listed in ``skipped`` (a ``single`` run refuses it instead)."""
    by_model: dict[str, list[int]] = {}
    directories = [spec.out for spec in specs]
    for index, spec in enumerate(specs):
        out = spec.out
        if out in directories[:index]:
            continue  # press=none asked at several ratios: one run, whose metrics every such point gets
        try:
            shard = None if spec.shard.whole else spec.shard.name
            held.enter_context(rundir.locked(out, wait=spec.wait_for_locks, shard=shard))
        except rundir.RunLocked as locked:
            if single:
                raise
            skipped.append(f"{out} (held by {locked.holder})")
            continue
        by_model.setdefault(spec.model_key, []).append(index)
    return by_model


def _remove_created(created: Mapping[Path, Path]) -> None:
    """A point refused or failed while planning (its data is broken or changed, its predictions are damaged, its
    tokenizer does not load) leaves no folder that holds only the lock this sweep created, nor the empty folders
    above it (``created`` maps each run directory to the topmost folder the sweep created for it)."""
    for out, top in created.items():
        if out.is_dir() and rundir.holds_only_locks(out):
            rundir.remove_locks(out)
            for folder in (out, *out.parents[: len(out.parents) - len(top.parents)]):
                if any(folder.iterdir()):
                    break
                folder.rmdir()


def _read_points_other_shards_finished(specs: list[PointSpec], metrics: dict[int, dict | None]) -> None:
    """Another shard may have answered a point's last samples, and scored it, since this one closed it."""
    for index, spec in enumerate(specs):
        if index not in metrics or metrics[index] is not None or spec.shard.whole:
            continue
        if (rundir.read_json(spec.out / rundir.RUN) or {}).get("status") in rundir.FINISHED:
            metrics[index] = rundir.read_json(spec.out / rundir.METRICS)


def command(
    cfgs: Sequence[DictConfig],
    choices: Sequence[Mapping[str, str | None]],
    single: bool,
    refused: Callable[[], None] = lambda: None,
    overrides: Sequence[str] = (),
) -> list[dict | None]:
    """The one entry of ``python -m evaluate`` and of every launcher: check each point's config group ``choices``
    (Hydra's), run the points, print their closing lines, and end the process as docs/configuration.md documents
    each way a run ends (``refused`` undoes what the launcher made before a refusal: its sweep folder; a single
    run's summary suggests commands that keep its command line's ``overrides``)."""
    specs: list[PointSpec] = []
    try:
        for chosen in choices:
            validate_choices(chosen)
        specs = checked(cfgs, single)
        metrics = run_points(specs, single)
    except ConfigError as error:
        refused()
        refuse(error)
    except KeyboardInterrupt as interrupt:  # Ctrl-C or SIGTERM: what was kept and how to resume, not a traceback
        print(interrupted_summary(specs), file=sys.stderr)
        sys.exit(exit_code(interrupt))
    except RunIncomplete as error:
        fail(error)
    except OSError as error:  # the disk or the system failed the run's own writes
        fail(OSError(f"{describe(error)}; the run directory keeps what was written: fix it and rerun the same command"))
    if single and metrics[0] is None:  # a shard whose point waits for the other shards
        print(waiting_summary(specs, metrics))
    elif single:
        print(run_summary(specs[0], metrics[0], overrides))
        failed, samples = failed_samples(metrics[0])
        if samples and failed == samples:  # nothing was answered: a broken configuration, not a score of 0
            sys.exit(1)
    else:
        print(sweep_summary(specs, metrics))
    return metrics


def run(cfg: DictConfig) -> dict:
    """Run (or resume) one configuration: the sweep of one point, which takes kvpress's pipeline path."""
    return run_sweep([cfg], single=True)[0]


def _run_on_one_model(specs: list[PointSpec], models: Models) -> list[Recorder]:
    if any(profile(described(spec.press)).changes_model for spec in specs):
        models = Models()  # its own model and tokenizer, changed for this configuration alone (config.model_key)
    tokenizer = models.tokenizer(instantiate(specs[0].model_source))
    recorders = [Recorder(make_plan(spec, tokenizer)) for spec in specs]
    pending = [recorder for recorder in recorders if recorder.plan.todo]
    for recorder in pending:  # the tokenizer counts the contexts as the model will receive them
        check_budget_fits(recorder.plan, tokenizer)
    # The model loads, and its samples are checked against it, before any session opens: a model that cannot load
    # or rows that cannot fit it leave no run directory behind (the refusal's one line, exit 2).
    model = _load_model(pending, models, tokenizer) if pending else None
    started: list[Recorder] = []
    try:
        for recorder in recorders:
            recorder.start()
            started.append(recorder)
        if pending:
            _answer(pending, model, tokenizer)
    except BaseException as reason:
        # From the first session opened on, every way out says in run.json how it ended, never ``running``.
        for recorder in started:
            recorder.stopped(reason)
        raise
    return recorders


def _load_model(pending: list[Recorder], models: Models, tokenizer):
    """The model the pending points share, loaded with the first one's seed; each point's samples checked to fit."""
    torch.manual_seed(pending[0].plan.spec.seed)
    model = models.model(pending[0].plan)
    warn_if_unpatched(model)
    for recorder in pending:
        check_generation_fits(recorder.plan, model, tokenizer)
        if context_cap(recorder.plan.spec, tokenizer) is None:  # cut at the model's positions: known now
            check_budget_fits(recorder.plan, tokenizer, model)
        recorder.note_weights(weights_bytes(model))
    return model


def _answer(pending: list[Recorder], model, tokenizer) -> None:
    """Answer the pending points on their model: the pooled ones together, the others one by one through kvpress's
    pipeline."""
    for recorder in pending:
        recorder.plan.profile.prepare_model(model, tokenizer, recorder.plan.spec.seed)
    budgets = []
    for recorder in pending:
        budget, truncated = context_budget(recorder.plan, model, tokenizer)
        recorder.note_truncated(truncated)
        budgets.append(budget)
    for recorder in pending:
        recorder.note_path(*answer_path(recorder.plan, model))
    in_pool = [recorder for recorder in pending if recorder.path == "pool"]
    # Both engines are asked the same way, for the points they serve with their context budgets; kvpress's pipeline
    # answers one point after the other, each under its own progress bar and clock.
    pipeline = PipelineEngine(model, tokenizer)
    batches: list[tuple[Engine, list[Recorder], str]] = [
        (pipeline, [r], r.plan.out.name) for r in pending if r.path == "pipeline"
    ]
    if in_pool:
        pool = PoolEngine(
            model,
            tokenizer,
            # Points may ask for different sizes (neither changes a prediction): the smallest holds for all.
            min(recorder.plan.spec.decode_batch_size for recorder in in_pool),
            min(decode_memory_bytes(recorder.plan.spec.decode_memory, model) for recorder in in_pool),
        )
        batches.append((pool, in_pool, "answering"))
    for engine, served, label in batches:
        plans, served_budgets = [r.plan for r in served], [budgets[pending.index(r)] for r in served]
        _record(engine.answer(plans, served_budgets), served, label)


def _record(answered: Iterator[AnsweredGroup | Prefilled], recorders: list[Recorder], label: str) -> None:
    """Hand each group the engine finished to its point's recorder, with one progress bar over the points that
    also shows the contexts prefilled (and compressed) so far; the loop's elapsed time is the points' wall time,
    shared by the clock."""
    total = sum(len(recorder.plan.share) for recorder in recorders)
    done = sum(len(recorder.done_ids) for recorder in recorders)
    progress = tqdm(total=total, initial=done, unit="sample", desc=label, dynamic_ncols=True)
    prefilled = None
    with progress, AnsweringClock([recorder.stats for recorder in recorders]):
        for result in answered:
            if isinstance(result, Prefilled):
                prefilled = result
                progress.set_postfix_str(f"contexts prefilled {result.contexts}/{result.of}")
                continue
            recorders[result.point].record(result)
            progress.update(len(result.group))
    if prefilled is not None:
        logger.info("%d contexts prefilled, once each, for %d points", prefilled.contexts, len(recorders))
