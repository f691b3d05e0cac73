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

import pandas as pd
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
    attention_implementation,
    effective_cr,
    fingerprint,
    method_name,
    resolve_device,
    run_dir,
    validate,
    validate_context_lengths,
)
from evaluate.layer_masks import fit_masks_to_layers
from evaluate.score import score_rows
from evaluate.tables import format_task_table
from evaluate.tracking import Tracker

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
        "method": method_name(cfg),
        "compression_ratio": effective_cr(cfg),
        "fingerprint": run_fingerprint,
        "press": repr(press),
        "device": device,
        "versions": {
            "python": sys.version.split()[0],
            **{name: version(name) for name in ("torch", "transformers", "kvpress", "pressbench")},
        },
        # The attention that ran, where the config left it to kvpress's rule (null).
        "config": {**OmegaConf.to_container(cfg, resolve=True), "attn_implementation": attention_implementation(cfg)},
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


def select_fraction(samples: list[Sample], fraction: float, seed: int, by_task: bool) -> list[Sample]:
    """kvpress's ``fraction``: pandas ``sample(frac=fraction, random_state=seed)`` of each data_dir's rows.

    kvpress loads one data_dir at a time, one per task for LongBench and LOOGLE (``by_task``), the whole split
    for RULER; pandas draws the rows from the frame's length and the seed alone, so drawing positions from a frame
    of the same length in the same source order picks the same rows. Samples keep their source order.
    """
    if fraction >= 1:
        return samples
    frames: dict[str, list[Sample]] = {}
    for sample in samples:
        frames.setdefault(sample.task if by_task else "", []).append(sample)
    chosen: set[str] = set()
    for frame in frames.values():
        positions = pd.DataFrame({"position": range(len(frame))}).sample(frac=fraction, random_state=seed)["position"]
        chosen.update(frame[position].id for position in positions)
    return [sample for sample in samples if sample.id in chosen]


def first_per_task(samples: list[Sample], limit: int | None) -> list[Sample]:
    """At most ``limit`` samples of each task, in source order."""
    if limit is None:
        return samples
    counts: dict[str, int] = {}
    kept = []
    for sample in samples:
        counts[sample.task] = counts.get(sample.task, 0) + 1
        if counts[sample.task] <= limit:
            kept.append(sample)
    return kept


def load_samples(benchmark, tokenizer, cfg: DictConfig) -> list[Sample]:
    """The run's samples: the drawn ``fraction`` of each data_dir's rows, then at most ``limit`` per task."""
    if cfg.fraction >= 1:
        return check_samples(benchmark.load(tokenizer, cfg.limit))
    # The draw needs every row of the frame kvpress would sample from; the limit applies to what was drawn.
    drawn = select_fraction(
        check_samples(benchmark.load(tokenizer, None)), cfg.fraction, cfg.seed, benchmark.fraction_by_task
    )
    return first_per_task(drawn, cfg.limit)


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


_loaded: dict[str, tuple[tuple, object]] = {}


def _reuse(kind: str, key: tuple, load):
    """Keep the last model (and tokenizer) loaded, so that a sweep in one process loads each model once."""
    if kind in _loaded and _loaded[kind][0] == key:
        return _loaded[kind][1]
    _loaded.pop(kind, None)
    if kind == "model" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    value = load()
    _loaded[kind] = (key, value)
    return value


def load_tokenizer(source):
    return _reuse("tokenizer", (repr(source),), source.load_tokenizer)


def load_model(source, device: str, dtype: str, attn_implementation: str):
    """The model, with attention masks fitted to each layer's cache (kvpress's ChunkKV leaves uneven layers)."""

    def load():
        model = source.load_model(device, dtype, attn_implementation)
        fit_masks_to_layers(model)
        return model

    return _reuse("model", (repr(source), device, dtype, attn_implementation), load)


class Point:
    """One configuration of a run or sweep: its run directory, the samples it still has to answer, and the
    files that record them. Engines answer its context groups; the point writes each answer down."""

    def __init__(self, cfg: DictConfig):
        validate(cfg)
        self.cfg = cfg
        self.out = run_dir(cfg)
        self.benchmark = instantiate(cfg.benchmark)
        self.source = instantiate(cfg.model.source)
        self.press = instantiate(cfg.press.press) if cfg.press.compresses else None
        self.device = resolve_device(cfg.device)
        self.todo: list[Sample] = []

    def open(self, tokenizer, started: float) -> None:
        """Resume the run directory (the caller holds its lock) and work out which samples remain."""
        cfg = self.cfg
        self.tracker = Tracker()
        run_fingerprint = fingerprint(cfg)
        _prepare_directory(self.out, cfg, run_fingerprint)
        samples = load_samples(self.benchmark, tokenizer, cfg)
        self.context_tokens = {s.context: len(tokenizer.encode(s.context, add_special_tokens=False)) for s in samples}
        question_tokens = max(len(tokenizer.encode(s.question, add_special_tokens=False)) for s in samples)
        validate_context_lengths(cfg, min(self.context_tokens.values()) + (question_tokens if cfg.query_aware else 0))

        self.predictions = self.out / rundir.PREDICTIONS
        rows = rundir.read_predictions(self.predictions, repair=True)
        if cfg.retry_errors and _error_rows(rows):
            rows = [row for row in rows if not row.get("error")]
            rundir.rewrite_predictions(self.predictions, rows)
        self.samples = samples
        self.done_ids = {row["id"] for row in rows}
        self.todo = [sample for sample in samples if sample.id not in self.done_ids]
        self.n_errors = len(_error_rows(rows))
        self.truncated: int | None = None
        self.started = started
        if not self.todo:
            print(f"{self.out} is already complete ({len(samples)} samples); pass overwrite=true to redo it")
            return
        rundir.write_yaml(self.out / rundir.CONFIG, _config_record(cfg, run_fingerprint, self.press, self.device))
        self.stats = RunStats.resume(rundir.read_json(self.out / rundir.RUN))
        self.session_start = self.stats.wall_seconds
        self._write_run("running")
        self.tracker = Tracker.from_config(cfg, self.out.name)

    def max_context(self, model, tokenizer) -> int:
        """The context budget in tokens; counts and reports the samples that exceed it.

        ``truncation=pipeline`` (kvpress's rule): the pipeline cuts the chat-templated context (with the question
        appended in query-aware runs) at ``max_context_length``, else at the tokenizer's ``model_max_length``.
        ``head``/``middle``: the harness cuts the raw context at ``max_context_length``, else at the model's
        ``max_position_embeddings``, before the pipeline sees it.
        """
        cfg = self.cfg
        if cfg.truncation == "pipeline":
            max_context = cfg.max_context_length or pipeline_max_context_length(tokenizer)
            length = templated_context_length(make_pipeline(model, tokenizer, self.device), tokenizer)
            self.truncated = sum(
                length(self.compressed_text(sample), sample.chat_template) > max_context for sample in self.samples
            )
        else:
            max_context = cfg.max_context_length or model.config.max_position_embeddings
            self.truncated = sum(self.context_tokens[sample.context] > max_context for sample in self.samples)
        if self.truncated:
            logger.warning(
                "%d of %d samples have contexts longer than %d tokens and are truncated (truncation=%s)",
                self.truncated,
                len(self.samples),
                max_context,
                cfg.truncation,
            )
        return max_context

    def compressed_text(self, sample: Sample) -> str:
        """What the press compresses: the context, with the question appended in query-aware runs (as kvpress)."""
        return sample.context + sample.question if self.cfg.query_aware else sample.context

    def context(self, sample: Sample, tokenizer, max_context: int) -> str:
        """The sample's context as the pipeline receives it; only the harness's own policies cut it here."""
        if self.cfg.truncation == "pipeline" or self.context_tokens[sample.context] <= max_context:
            return sample.context
        return truncate(tokenizer, sample.context, max_context, self.cfg.truncation)

    def pipeline_budget(self, tokenizer, max_context: int) -> int:
        """The ``max_context_length`` handed to kvpress's pipeline."""
        return max_context if self.cfg.truncation == "pipeline" else pipeline_max_context_length(tokenizer)

    def groups(self) -> list[list[Sample]]:
        return group_by_context(self.todo, self.cfg.query_aware)

    def record(
        self,
        group: list[Sample],
        answers: list[str],
        kept_ratio: float | None,
        context_length: int | None,
        error: str | None,
        prefill_seconds: float,
        seconds: float,
    ) -> None:
        rundir.append_predictions(
            self.predictions,
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
                    "compression_ratio": effective_cr(self.cfg),
                    "kept_ratio": kept_ratio,
                    "context_length": context_length,
                    **sample.extra,
                    **({"error": error} if error else {}),
                }
                for sample, answer in zip(group, answers, strict=True)
            ),
        )
        self.n_errors += len(group) if error else 0
        self.stats.prefill_seconds += prefill_seconds
        self.stats.decode_seconds += seconds - prefill_seconds
        self.stats.wall_seconds = self.session_start + time.perf_counter() - self.started
        self.done_ids.update(sample.id for sample in group)
        self._write_run("running")
        self.tracker.log_progress(
            len(self.done_ids),
            len(self.samples),
            wall_seconds=self.stats.wall_seconds,
            prefill_seconds=self.stats.prefill_seconds,
            decode_seconds=self.stats.decode_seconds,
            kept_ratio=kept_ratio,
            errors=self.n_errors,
        )

    def fail(self, group: list[Sample], failure: Exception) -> tuple[list[str], None, None, str]:
        """Answers for a context that raised: empty and marked, unless the run must stop at the first error."""
        if self.cfg.fail_fast:
            raise failure
        # One bad context must not kill a sweep: record it, count it as wrong, and go on.
        error = f"{type(failure).__name__}: {failure}"
        logger.warning("context of %s failed and is scored as wrong: %s", group[0].id, error)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [""] * len(group), None, None, error

    def interrupted(self) -> None:
        if self.todo:
            self._write_run("interrupted")
            self.tracker.finish(exit_code=1)

    def close(self) -> dict:
        if self.todo:
            self._write_run("complete_with_errors" if self.n_errors else "complete")
            if self.n_errors:
                logger.warning(
                    "%d samples failed; they count as wrong answers (see the error field in predictions)",
                    self.n_errors,
                )
        metrics = _finish(self.out, self.benchmark)
        if self.todo:
            rows = rundir.read_predictions(self.predictions)
            self.tracker.log_metrics(metrics, rows, self.benchmark, rundir.read_json(self.out / rundir.RUN))
        self.tracker.finish()
        return metrics

    def _write_run(self, status: str) -> None:
        record = {
            "status": status,
            "samples": len(self.done_ids),
            "samples_expected": len(self.samples),
            "errors": self.n_errors,
            "truncated_samples": self.truncated,
            "wall_seconds": round(self.stats.wall_seconds, 3),
            "prefill_seconds": round(self.stats.prefill_seconds, 3),
            "decode_seconds": round(self.stats.decode_seconds, 3),
            "peak_memory_mb": round(peak_memory_mb(self.device), 1),
            "device": self.device,
            "sessions": self.stats.sessions,
            "started_at": self.stats.started_at,
            "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        rundir.write_json(self.out / rundir.RUN, record)


def _error_rows(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row.get("error")]


def pipeline_max_context_length(tokenizer) -> int:
    """kvpress's pipeline's budget when none is given."""
    return min(tokenizer.model_max_length, int(1e10))


def templated_context_length(pipe, tokenizer):
    """Token count of a text as the pipeline's context (chat template applied or not), memoized per text."""
    lengths: dict[tuple[str, bool], int] = {}

    def length(text: str, chat_template: bool) -> int:
        if (text, chat_template) not in lengths:
            with chat_template_enabled(tokenizer, chat_template):
                context_ids = pipe.preprocess(text, [""], "", int(1e10))["context_ids"]
            lengths[text, chat_template] = context_ids.shape[1]
        return lengths[text, chat_template]

    return length


def make_pipeline(model, tokenizer, device: str):
    from kvpress import KVPressTextGenerationPipeline  # imported late: kvpress patches attention globally

    return KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device(device))


def answer_with_pipeline(point: Point, model, tokenizer, max_context: int) -> None:
    """Each context group through kvpress's pipeline, the press hooked into the prefill."""
    cfg = point.cfg
    pipe = make_pipeline(model, tokenizer, point.device)
    probe = PrefillProbe(model)
    progress = tqdm(
        total=len(point.samples), initial=len(point.done_ids), unit="sample", desc=point.out.name, dynamic_ncols=True
    )
    try:
        for group in point.groups():
            context = point.context(group[0], tokenizer, max_context)
            probe.reset()
            group_start = time.perf_counter()
            cache = DynamicCache()
            try:
                with chat_template_enabled(tokenizer, group[0].chat_template):
                    answers = pipe(
                        context + group[0].question if cfg.query_aware else context,
                        questions=["" if cfg.query_aware else sample.question for sample in group],
                        answer_prefix=group[0].answer_prefix,
                        press=point.press,
                        max_new_tokens=group[0].max_new_tokens,
                        max_context_length=point.pipeline_budget(tokenizer, max_context),
                        cache=cache,
                    )["answers"]
                outcome = answers, measure_kept_ratio(model, cache, probe.context_length), probe.context_length, None
            except Exception as failure:
                outcome = point.fail(group, failure)
            point.record(group, *outcome, probe.seconds, time.perf_counter() - group_start)
            progress.update(len(group))
    finally:
        progress.close()
        probe.close()


def run(cfg: DictConfig) -> dict:
    """Run (or resume) one configuration through kvpress's pipeline; return its metrics."""
    started = time.perf_counter()
    # Our own bar tracks the run; per-tensor loading bars would bury it.
    transformers_logging.disable_progress_bar()
    point = Point(cfg)
    with rundir.locked(point.out):
        tokenizer = load_tokenizer(point.source)
        point.open(tokenizer, started)
        if point.todo:
            torch.manual_seed(cfg.seed)
            model = load_model(point.source, point.device, cfg.dtype, attention_implementation(cfg))
            warn_if_unpatched(model)
            try:
                answer_with_pipeline(point, model, tokenizer, point.max_context(model, tokenizer))
            except BaseException:
                point.interrupted()
                raise
        return point.close()


def _finish(out: Path, benchmark) -> dict:
    metrics = score_rows(benchmark, rundir.read_predictions(out / rundir.PREDICTIONS))
    rundir.write_json(out / rundir.METRICS, metrics)
    print(format_task_table(metrics, title=out.name))
    print(f"results in {out}")
    return metrics
