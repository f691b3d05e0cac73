"""Several configurations in one process: each model loaded once, each context prefilled once, one decoding pool.

``run_sweep`` types, checks and resolves every configuration once (evaluate/spec/), locks its run directory, plans
it and answers it on its model: through the pooled path (evaluate/engine/pooled.py) where the press acts only after
each layer's attention and ``decode_batch_size`` is above 1, else through kvpress's pipeline
(evaluate/engine/pipeline.py). The engines give back what they finished; this loop hands it to each point's recorder,
the only writer. A single run is the sweep of one point.
"""

import logging
from collections.abc import Iterator, Sequence
from contextlib import ExitStack

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging

from evaluate import rundir
from evaluate.engine.attention import why_not_pooled
from evaluate.engine.pipeline import answer_with_pipeline, context_budget
from evaluate.engine.pooled import answer_pooled
from evaluate.engine.requests import AnsweredGroup
from evaluate.engine.scheduler import decode_memory_bytes
from evaluate.errors import ConfigError
from evaluate.models.loading import Models, warn_if_unpatched
from evaluate.run.recorder import AnsweringClock, Recorder
from evaluate.spec.config import described_press, refuse_unread_knobs, validate
from evaluate.spec.plan import Plan, make_plan
from evaluate.spec.point import PointSpec, resolve
from evaluate.spec.press_traits import changes_the_model, prepare_model, why_not_shared_prefill
from evaluate.spec.settings import typed

logger = logging.getLogger(__name__)


def pooled(plan: Plan, model) -> bool:
    """Whether the run's answers come from the pooled path; the reason is logged when they do not."""
    if plan.cfg.decode_batch_size == 1:
        return False  # kvpress's pipeline path, exactly
    reason = why_not_shared_prefill(plan.press, plan.spec.attention) or why_not_pooled(model)
    if reason is not None:
        logger.info("%s takes kvpress's pipeline path: %s", plan.out.name, reason)
    return reason is None


def checked(cfgs: Sequence[DictConfig], single: bool = False) -> list[PointSpec]:
    """Each configuration typed, checked (every check that needs no model) and resolved, once: a ConfigError for the
    first that fails, or for two points that are one run (a sweep would run it twice, or race itself). Every
    launcher calls it for every point before any runs; ``single`` also refuses a knob the run's entry does not read."""
    cfgs = [typed(cfg) for cfg in cfgs]  # overwrite=no is false, query_aware=maybe is refused
    for cfg in cfgs:
        validate(cfg)
        if single:
            refuse_unread_knobs(cfg)
    specs = [resolve(cfg) for cfg in cfgs]
    directories = [spec.out for spec in specs]
    duplicates = {str(path) for path in directories if directories.count(path) > 1}
    if duplicates:
        raise ConfigError(
            f"the sweep runs the same configuration twice: {', '.join(sorted(duplicates))}; "
            "drop the repeats (press=none is one run at any cr; limit, device and the like make no other run)"
        )
    return specs


def run_sweep(cfgs: Sequence[DictConfig], single: bool = False) -> list[dict | None]:
    """Run (or resume) every configuration; return their metrics in order (None for a point left to another).

    Every configuration is checked before anything loads. A point whose run directory another process holds is
    left to it (or waited for, with ``wait_for_locks=true``) and listed at the end; a ``single`` run refuses it.
    Points on the same model share one model load; among those, the ones whose press acts only after attention
    share each context's prefill.
    """
    # Our own bars track the runs; per-tensor loading bars would bury them.
    transformers_logging.disable_progress_bar()
    specs = checked(cfgs, single)
    directories = [spec.out for spec in specs]
    models = Models()
    metrics: dict[int, dict] = {}
    skipped: list[str] = []
    # For each run directory this sweep will create, the topmost folder on its path that does not exist yet.
    created = {out: rundir.first_missing(out) for out in directories if not out.exists()}
    try:
        with ExitStack() as held:
            by_model: dict[str, list[int]] = {}
            for index, spec in enumerate(specs):
                out = spec.out
                try:
                    held.enter_context(rundir.locked(out, wait=spec.cfg.wait_for_locks))
                except rundir.RunLocked as locked:
                    if single:
                        raise
                    skipped.append(f"{out} (held by {locked.holder})")
                    continue
                by_model.setdefault(spec.model_key, []).append(index)
            for indices in by_model.values():
                recorders = _run_on_one_model([specs[index] for index in indices], models)
                metrics.update(zip(indices, (recorder.close() for recorder in recorders), strict=True))
    except ConfigError:
        # A point refused while planning (its data is broken or changed, its predictions are damaged) leaves no
        # folder that holds only the lock this sweep created, nor the empty folders above it.
        for out, top in created.items():
            if out.is_dir() and [path.name for path in out.iterdir()] == [rundir.LOCK]:
                (out / rundir.LOCK).unlink()
                for folder in (out, *out.parents[: len(out.parents) - len(top.parents)]):
                    if any(folder.iterdir()):
                        break
                    folder.rmdir()
        raise
    if skipped:
        print(f"{len(skipped)} of {len(cfgs)} points were left to the processes holding them; rerun to resume them:")
        print("\n".join(f"  {point}" for point in skipped))
    return [metrics.get(index) for index in range(len(cfgs))]


def run(cfg: DictConfig) -> dict:
    """Run (or resume) one configuration: the sweep of one point, which takes kvpress's pipeline path."""
    return run_sweep([cfg], single=True)[0]


def _run_on_one_model(specs: list[PointSpec], models: Models) -> list[Recorder]:
    cfgs = [spec.cfg for spec in specs]
    if any(changes_the_model(described_press(cfg)) for cfg in cfgs):
        models = Models()  # its own model and tokenizer, changed for this configuration alone (config.model_key)
    tokenizer = models.tokenizer(instantiate(cfgs[0].model.source))
    recorders = [Recorder(make_plan(spec, tokenizer)) for spec in specs]
    for recorder in recorders:
        recorder.start()
    pending = [recorder for recorder in recorders if recorder.plan.todo]
    if not pending:
        return recorders
    torch.manual_seed(cfgs[0].seed)
    model = models.model(pending[0].plan)
    warn_if_unpatched(model)
    for recorder in pending:
        prepare_model(recorder.plan.press, model, tokenizer, recorder.plan.cfg.seed)
    budgets = []
    for recorder in pending:
        budget, truncated = context_budget(recorder.plan, model, tokenizer)
        recorder.note_truncated(truncated)
        budgets.append(budget)
    in_pool = [recorder for recorder in pending if pooled(recorder.plan, model)]
    try:
        for recorder, budget in zip(pending, budgets, strict=True):
            if recorder not in in_pool:
                _record(
                    answer_with_pipeline(recorder.plan, model, tokenizer, budget), [recorder], recorder.plan.out.name
                )
        if in_pool:
            answered = answer_pooled(
                [recorder.plan for recorder in in_pool],
                model,
                tokenizer,
                [budgets[pending.index(recorder)] for recorder in in_pool],
                # Points may ask for different sizes (neither changes a prediction): the smallest holds for all.
                min(recorder.plan.cfg.decode_batch_size for recorder in in_pool),
                min(decode_memory_bytes(recorder.plan.cfg.decode_memory, model) for recorder in in_pool),
            )
            _record(answered, in_pool, "answering")
    except BaseException:
        for recorder in pending:
            recorder.interrupted()
        raise
    return recorders


def _record(answered: Iterator[AnsweredGroup], recorders: list[Recorder], label: str) -> None:
    """Hand each group the engine finished to its point's recorder, with one progress bar over the points; the
    loop's elapsed time is the points' wall time, shared by the clock."""
    total = sum(len(recorder.plan.samples) for recorder in recorders)
    done = sum(len(recorder.done_ids) for recorder in recorders)
    progress = tqdm(total=total, initial=done, unit="sample", desc=label, dynamic_ncols=True)
    with progress, AnsweringClock([recorder.stats for recorder in recorders]):
        for result in answered:
            recorders[result.point].record(result)
            progress.update(len(result.group))
