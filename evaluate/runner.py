"""One run: config -> model + press -> samples -> predictions -> metrics.

Samples that share a context (and answer prefix and generation length) are answered from one compressed
cache through kvpress's pipeline with ``questions=``. Each context's predictions are appended to
predictions.jsonl as soon as they exist, so rerunning the same command resumes where a crash stopped.
"""

import hashlib
import logging
import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.utils import logging as transformers_logging

from evaluate import rundir
from evaluate.benchmarks import Sample
from evaluate.config import (
    ConfigError,
    effective_cr,
    fingerprint,
    resolve_device,
    run_dir,
    validate,
    validate_context_lengths,
)
from evaluate.score import score_rows
from evaluate.tables import format_task_table

logger = logging.getLogger(__name__)


def context_id(context: str) -> str:
    return hashlib.sha1(context.encode("utf-8")).hexdigest()[:12]


def group_by_context(samples: list[Sample], query_aware: bool) -> list[list[Sample]]:
    """Samples answerable from one compressed cache, in first-appearance order.

    Query-aware runs compress the context with the question appended (as the kvpress leaderboard does), so
    each of their questions needs its own compression.
    """
    groups: dict[tuple, list[Sample]] = {}
    for sample in samples:
        question = sample.question if query_aware else None
        key = (sample.context, question, sample.answer_prefix, sample.max_new_tokens, sample.chat_template)
        groups.setdefault(key, []).append(sample)
    return list(groups.values())


@contextmanager
def chat_template_enabled(tokenizer, enabled: bool):
    """kvpress's pipeline applies the tokenizer's chat template whenever it has one; a raw prompt hides it."""
    if enabled:
        yield
        return
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        yield
    finally:
        tokenizer.chat_template = template


class PrefillProbe:
    """Times the prefill pass and records the context length the pipeline actually fed the model.

    kvpress's pipeline runs the prefill as one call of the bare decoder (``model.model``) before any
    decoding step, so the first such call after ``reset`` is the prefill.
    """

    def __init__(self, model: torch.nn.Module):
        self._synchronize = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
        self._handles = [
            model.model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.model.register_forward_hook(self._after, with_kwargs=True),
        ]
        self.reset()

    def reset(self) -> None:
        self.context_length: int | None = None
        self.seconds = 0.0
        self._start: float | None = None

    def _before(self, module, args, kwargs):
        if self.context_length is None:
            self.context_length = kwargs["input_ids"].shape[1]
            self._synchronize()
            self._start = time.perf_counter()

    def _after(self, module, args, kwargs, output):
        if self._start is not None:
            self._synchronize()
            self.seconds = time.perf_counter() - self._start
            self._start = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def measure_kept_ratio(model: torch.nn.Module, cache: DynamicCache, context_length: int) -> float:
    """KV pairs kept over context length, averaged over layers and KV heads.

    Presses that mask rather than remove (AdaKV) leave the masked positions in the cache and record them
    on each attention module; those are subtracted.
    """
    ratios = []
    for layer, cache_layer in zip(model.model.layers, cache.layers, strict=True):
        num_heads, length = cache_layer.keys.shape[1], cache_layer.keys.shape[2]
        kept = torch.full((num_heads,), float(length), dtype=torch.float64)
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            batch_indices, head_indices, _ = masked
            kept -= torch.bincount(head_indices[batch_indices == 0].cpu(), minlength=num_heads)
        ratios.append(kept / context_length)
    return float(torch.cat(ratios).mean())


def peak_memory_mb(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class RunStats:
    """Cumulative over every process that worked on the run, so a resumed run reports its full cost."""

    wall_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    sessions: int = 0
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    @classmethod
    def resume(cls, previous: dict | None) -> "RunStats":
        if not previous:
            return cls(sessions=1)
        return cls(
            wall_seconds=previous.get("wall_seconds", 0.0),
            prefill_seconds=previous.get("prefill_seconds", 0.0),
            decode_seconds=previous.get("decode_seconds", 0.0),
            sessions=previous.get("sessions", 0) + 1,
            started_at=previous.get("started_at") or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )


def _prepare_directory(out: Path, cfg: DictConfig, run_fingerprint: str) -> None:
    """Start fresh when asked; refuse to mix predictions of two configurations."""
    recorded = rundir.read_yaml(out / rundir.CONFIG)
    if cfg.overwrite:
        for name in (rundir.PREDICTIONS, rundir.METRICS, rundir.RUN, rundir.CONFIG):
            (out / name).unlink(missing_ok=True)
    elif recorded is not None and recorded.get("fingerprint") != run_fingerprint:
        raise ConfigError(
            f"{out} holds predictions of a different configuration; pass overwrite=true to discard them "
            "or output_dir=... to keep both"
        )


def _config_record(cfg: DictConfig, run_fingerprint: str, press, device: str) -> dict:
    return {
        "method": cfg.press.method,
        "compression_ratio": effective_cr(cfg),
        "fingerprint": run_fingerprint,
        "press": repr(press),
        "device": device,
        "versions": {
            "python": sys.version.split()[0],
            **{name: version(name) for name in ("torch", "transformers", "kvpress", "pressbench")},
        },
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def valid_unicode(text: str) -> str:
    """Replace lone surrogates (what undecodable bytes become under ``surrogateescape``) with U+FFFD.

    Tokenizers reject such strings outright, so they are mapped to the replacement character, the same way
    on every run; control characters are kept, since some benchmarks put them in prompts on purpose.
    """
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def check_samples(samples: list[Sample]) -> list[Sample]:
    """Refuse samples no model can answer meaningfully, naming the sample; make their text valid Unicode.

    An empty question is legitimate: the reference datasets use one where the context already ends with the
    instruction (LOOGLE's summarization, LongBench's lcc), and query-aware runs always ask one.
    """
    if not samples:
        raise ConfigError("the benchmark produced no samples; check benchmark.tasks and limit")
    seen: set[str] = set()
    for sample in samples:
        if sample.id in seen:
            raise ConfigError(f"sample id {sample.id!r} appears twice; ids must be unique within a benchmark")
        seen.add(sample.id)
        if not sample.context.strip():
            raise ConfigError(f"sample {sample.id!r} has an empty context")
    return [
        replace(
            sample,
            context=valid_unicode(sample.context),
            question=valid_unicode(sample.question),
            answer_prefix=valid_unicode(sample.answer_prefix),
            answers=[valid_unicode(answer) for answer in sample.answers],
        )
        for sample in samples
    ]


def select_fraction(samples: list[Sample], fraction: float, seed: int) -> list[Sample]:
    """A random share of the samples, as kvpress's ``fraction`` (pandas ``sample(frac, random_state)``)."""
    if fraction >= 1:
        return samples
    chosen = np.random.RandomState(seed).choice(len(samples), size=round(fraction * len(samples)), replace=False)
    return [samples[index] for index in sorted(chosen)]


def truncate(tokenizer, text: str, max_tokens: int, policy: str) -> str:
    """Cut a context to ``max_tokens`` tokens: keep the head, or both ends as LongBench's pred.py does."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    if policy == "head":
        return tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)
    half = max_tokens // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[len(ids) - (max_tokens - half) :], skip_special_tokens=True
    )


def warn_if_unpatched(model) -> None:
    from kvpress import SUPPORTED_MODELS

    if not isinstance(model, SUPPORTED_MODELS):
        supported = ", ".join(cls.__name__ for cls in SUPPORTED_MODELS)
        logger.warning(
            "%s is not an architecture kvpress patches and tests (%s): compression may be silently wrong",
            type(model).__name__,
            supported,
        )


def _error_rows(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row.get("error")]


def run(cfg: DictConfig) -> dict:
    """Run (or resume) one configuration; return its metrics."""
    started = time.perf_counter()
    validate(cfg)
    # Our own bar tracks the run; per-tensor loading bars would bury it.
    transformers_logging.disable_progress_bar()
    out = run_dir(cfg)
    benchmark = instantiate(cfg.benchmark)
    source = instantiate(cfg.model.source)
    press = instantiate(cfg.press.press) if cfg.press.compresses else None
    with rundir.locked(out):
        return _run_locked(cfg, out, benchmark, source, press, started)


def _run_locked(cfg: DictConfig, out: Path, benchmark, source, press, started: float) -> dict:
    run_fingerprint = fingerprint(cfg)
    device = resolve_device(cfg.device)
    _prepare_directory(out, cfg, run_fingerprint)

    tokenizer = source.load_tokenizer()
    samples = select_fraction(check_samples(benchmark.load(tokenizer, cfg.limit)), cfg.fraction, cfg.seed)
    context_tokens = {s.context: len(tokenizer.encode(s.context, add_special_tokens=False)) for s in samples}
    question_tokens = max(len(tokenizer.encode(s.question, add_special_tokens=False)) for s in samples)
    validate_context_lengths(cfg, min(context_tokens.values()) + (question_tokens if cfg.query_aware else 0))

    predictions_path = out / rundir.PREDICTIONS
    rows = rundir.read_predictions(predictions_path, repair=True)
    if cfg.retry_errors and _error_rows(rows):
        rundir.rewrite_predictions(predictions_path, [row for row in rows if not row.get("error")])
        rows = [row for row in rows if not row.get("error")]
    done_ids = {row["id"] for row in rows}
    todo = [sample for sample in samples if sample.id not in done_ids]
    if not todo:
        print(f"{out} is already complete ({len(samples)} samples); pass overwrite=true to redo it")
        return _finish(out, benchmark)

    rundir.write_yaml(out / rundir.CONFIG, _config_record(cfg, run_fingerprint, press, device))
    stats = RunStats.resume(rundir.read_json(out / rundir.RUN))
    n_errors = len(_error_rows(rows))
    _write_run(out, stats, "running", len(done_ids), len(samples), device, n_errors)

    torch.manual_seed(cfg.seed)
    model = source.load_model(device, cfg.dtype, cfg.attn_implementation)
    warn_if_unpatched(model)
    max_context = cfg.max_context_length or model.config.max_position_embeddings
    truncated = sum(context_tokens[sample.context] > max_context for sample in samples)
    if truncated:
        logger.warning(
            "%d of %d samples have contexts longer than %d tokens and are truncated (truncation=%s)",
            truncated,
            len(samples),
            max_context,
            cfg.truncation,
        )
    from kvpress import KVPressTextGenerationPipeline  # imported late: kvpress patches attention globally

    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device(device))
    probe = PrefillProbe(model)
    progress = tqdm(total=len(samples), initial=len(done_ids), unit="sample", desc=out.name, dynamic_ncols=True)
    session_start = stats.wall_seconds
    try:
        for group in group_by_context(todo, cfg.query_aware):
            context = truncate(tokenizer, group[0].context, max_context, cfg.truncation)
            probe.reset()
            group_start = time.perf_counter()
            cache = DynamicCache()
            error = None
            try:
                with chat_template_enabled(tokenizer, group[0].chat_template):
                    answers = pipe(
                        context + group[0].question if cfg.query_aware else context,
                        questions=["" if cfg.query_aware else sample.question for sample in group],
                        answer_prefix=group[0].answer_prefix,
                        press=press,
                        max_new_tokens=group[0].max_new_tokens,
                        cache=cache,
                    )["answers"]
                kept_ratio = measure_kept_ratio(model, cache, probe.context_length)
            except Exception as failure:
                if cfg.fail_fast:
                    raise
                # One bad context must not kill a sweep: record it, count it as wrong, and go on.
                error = f"{type(failure).__name__}: {failure}"
                logger.warning("context of %s failed and is scored as wrong: %s", group[0].id, error)
                answers, kept_ratio = [""] * len(group), None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            rundir.append_predictions(
                predictions_path,
                (
                    {
                        "id": sample.id,
                        "task": sample.task,
                        "context_id": context_id(sample.context),
                        "question": sample.question,
                        "answer_prefix": sample.answer_prefix,
                        "answers": list(sample.answers),
                        "prediction": answer,
                        "max_new_tokens": sample.max_new_tokens,
                        "compression_ratio": effective_cr(cfg),
                        "kept_ratio": kept_ratio,
                        "context_length": probe.context_length,
                        **sample.extra,
                        **({"error": error} if error else {}),
                    }
                    for sample, answer in zip(group, answers, strict=True)
                ),
            )
            n_errors += len(group) if error else 0
            stats.prefill_seconds += probe.seconds
            stats.decode_seconds += time.perf_counter() - group_start - probe.seconds
            stats.wall_seconds = session_start + time.perf_counter() - started
            done_ids.update(sample.id for sample in group)
            _write_run(out, stats, "running", len(done_ids), len(samples), device, n_errors, truncated)
            progress.update(len(group))
    except BaseException:
        _write_run(out, stats, "interrupted", len(done_ids), len(samples), device, n_errors, truncated)
        raise
    finally:
        progress.close()
        probe.close()
    status = "complete_with_errors" if n_errors else "complete"
    _write_run(out, stats, status, len(done_ids), len(samples), device, n_errors, truncated)
    if n_errors:
        logger.warning("%d samples failed; they count as wrong answers (see the error field in predictions)", n_errors)
    return _finish(out, benchmark)


def _write_run(
    out: Path,
    stats: RunStats,
    status: str,
    done: int,
    expected: int,
    device: str,
    errors: int,
    truncated: int | None = None,
) -> None:
    record = {
        "status": status,
        "samples": done,
        "samples_expected": expected,
        "errors": errors,
        "truncated_samples": truncated,
        "wall_seconds": round(stats.wall_seconds, 3),
        "prefill_seconds": round(stats.prefill_seconds, 3),
        "decode_seconds": round(stats.decode_seconds, 3),
        "peak_memory_mb": round(peak_memory_mb(device), 1),
        "device": device,
        "sessions": stats.sessions,
        "started_at": stats.started_at,
        "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    rundir.write_json(out / rundir.RUN, record)


def _finish(out: Path, benchmark) -> dict:
    metrics = score_rows(benchmark, rundir.read_predictions(out / rundir.PREDICTIONS))
    rundir.write_json(out / rundir.METRICS, metrics)
    print(format_task_table(metrics, title=out.name))
    print(f"results in {out}")
    return metrics
