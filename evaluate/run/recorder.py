"""The one writer of a run directory: predictions, config.yaml, run.json, metrics.json, and the tracker.

Predictions are appended per context as soon as they exist (evaluate/rundir.py makes every write crash-safe), so a
rerun of the same command resumes where a crash stopped.

A shard of a point (evaluate/points/shard.py) writes its rows and its sessions into files of its own, and keeps the
point's run.json saying which shards run, finished or are missing; the shard that answers the point's last sample
merges every shard's rows into ``predictions.jsonl``, in the order one process writes them, and scores the point
(:meth:`Recorder.close`). A whole run first folds in whatever an earlier sharded session left.
"""

import logging
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from importlib.metadata import version

import torch

from evaluate import rundir
from evaluate.cost_schema import RunCost
from evaluate.engine.cost import Cost
from evaluate.engine.requests import AnsweredGroup
from evaluate.errors import ConfigError
from evaluate.kept_store import KEPT, write_kept
from evaluate.points.plan import Plan
from evaluate.points.shard import Shard
from evaluate.run.planning import sample_identity
from evaluate.run.tracking import Tracker
from evaluate.score.answer_length import row_columns
from evaluate.score.decoding import DECODING_COMPRESSED, decoding_record
from evaluate.score.rescore import score_run
from evaluate.score.tables import format_task_table

logger = logging.getLogger(__name__)


def environment_failure(failure: BaseException) -> bool:
    """Whether a failure is the machine's rather than the sample's: memory (host or device), the disk or another
    operating-system error, or the device itself. Such a failure says nothing about the sample, so its samples are
    left for the rerun instead of being recorded as wrong answers."""
    if isinstance(failure, (MemoryError, OSError, torch.OutOfMemoryError)):
        return True
    message = str(failure)
    return isinstance(failure, RuntimeError) and (
        "out of memory" in message.lower() or message.startswith("CUDA error")
    )


def describe(failure: BaseException) -> str:
    return f"{type(failure).__name__}: {' '.join(str(failure).split())}"


def peak_memory_mb(device: str, device_map=None) -> float:
    """The process's peak memory: on CUDA, the sum over every visible GPU of each one's peak allocation where the
    model is spread by a device map (each GPU holds its layers' share; the peaks need not be simultaneous, so the sum
    bounds the true peak from above), else the device's own; on the CPU, the peak resident memory."""
    if device_map is not None and torch.cuda.is_available():
        return sum(torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count())) / 2**20
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class RunStats:
    """Cumulative over every process that worked on the run, so a resumed run reports its full cost.

    The stage seconds (``cost``) are this run's own share of the work: its contexts' prefill, compression, decoding
    and likelihood shares, each second in one stage. ``wall_seconds`` is this run's share of the elapsed time while
    it was being answered (:class:`AnsweringClock`), plus its earlier sessions': the points of one sweep sum to the
    sweep's answering time, where a sum of stage times would count the work outside the timed stages nowhere and
    could count a shared second twice. ``contexts`` counts the compressed caches the byte totals are over.
    """

    cost: Cost = field(default_factory=Cost)
    contexts: int = 0
    questions: int = 0
    conversations: int = 0
    sessions: int = 0
    started_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    earlier_wall_seconds: float = 0.0
    session_seconds: float = 0.0  # this session's stage seconds: its weight in the clock's share
    clock: "AnsweringClock | None" = None

    def add(self, cost: Cost) -> None:
        self.cost += cost
        self.session_seconds += cost.seconds

    @property
    def wall_seconds(self) -> float:
        return self.earlier_wall_seconds + (self.clock.share(self) if self.clock is not None else 0.0)

    @classmethod
    def resume(cls, previous: dict | None) -> "RunStats":
        if not previous:
            return cls(sessions=1)
        # Runs recorded before the totals existed kept the phase seconds at the top level.
        totals = previous.get("totals") or previous
        return cls(
            cost=Cost(**{f.name: totals.get(f.name) or 0 for f in fields(Cost)}),
            contexts=previous.get("contexts", 0),
            questions=previous.get("questions", 0),
            conversations=previous.get("conversations", 0),
            sessions=previous.get("sessions", 0) + 1,
            started_at=previous.get("started_at") or datetime.now(timezone.utc).isoformat(timespec="seconds"),
            earlier_wall_seconds=previous.get("wall_seconds") or 0.0,
        )

    @classmethod
    def combined(cls, records: list[dict]) -> "RunStats":
        """The sessions of several records (what a point's shards, and the whole runs before them, recorded) as
        one run's."""
        parts = [cls.resume(record) for record in records if record]
        return cls(
            cost=sum((part.cost for part in parts), Cost()),
            contexts=sum(part.contexts for part in parts),
            questions=sum(part.questions for part in parts),
            conversations=sum(part.conversations for part in parts),
            sessions=sum(part.sessions - 1 for part in parts),
            started_at=min((part.started_at for part in parts), default=cls().started_at),
            earlier_wall_seconds=sum(part.earlier_wall_seconds for part in parts),
        )

    def record(self, peak_memory_mb: float) -> dict:
        """run.json's cost fields (evaluate/cost_schema.py): per run, per question and per context; then the counts
        they are over and the totals a resume adds to."""
        cost = self.cost
        costs = RunCost(
            prefill_seconds=round(cost.prefill_seconds, 3),
            compress_seconds=round(cost.compress_seconds, 3),
            decode_seconds=round(cost.decode_seconds, 3),
            likelihood_seconds=round(cost.likelihood_seconds, 3),
            retention_seconds=round(cost.retention_seconds, 3) if cost.retention_seconds else None,
            attention_recall_seconds=round(cost.attention_recall_seconds, 3) if cost.attention_recall_seconds else None,
            generated_tokens=cost.generated_tokens,
            decode_tokens_per_second=round(cost.generated_tokens / cost.decode_seconds, 2)
            if cost.decode_seconds
            else None,
            forward_passes_per_question=round(cost.forward_passes / self.questions, 4) if self.questions else None,
            prefills_per_conversation=round(cost.prefills / self.conversations, 3) if self.conversations else None,
            kv_bytes_held_per_context=round(cost.kv_bytes_held / self.contexts) if self.contexts else None,
            kv_bytes_kept_per_context=round(cost.kv_bytes_kept / self.contexts) if self.contexts else None,
            wall_seconds=round(self.wall_seconds, 3),
            peak_memory_mb=round(peak_memory_mb, 1),
        )
        counts = {"contexts": self.contexts, "questions": self.questions}
        if self.conversations:
            counts["conversations"] = self.conversations
        return {**costs.record(), **counts, "totals": asdict(cost)}


@dataclass
class AnsweringClock:
    """The elapsed time of one answering loop, from ``with`` to its end, shared among the runs it answers in
    proportion to their stage seconds this session (``RunStats.session_seconds``).

    An engine interleaves its runs (one pool pass serves many points), so no run's elapsed time can be read off a
    stopwatch; weighting by stage seconds shares the loop's time as the timed work was shared, and gives the time
    outside the timed stages (tokenizing, writing, the loop itself) to the runs in the same proportion.
    """

    runs: list[RunStats]
    started: float = 0.0
    stopped: float | None = None

    def __enter__(self) -> "AnsweringClock":
        self.started = time.perf_counter()
        for stats in self.runs:
            stats.clock = self
        return self

    def __exit__(self, *exc) -> None:
        self.stopped = time.perf_counter()

    def share(self, stats: RunStats) -> float:
        elapsed = (self.stopped if self.stopped is not None else time.perf_counter()) - self.started
        total = sum(run.session_seconds for run in self.runs)
        return elapsed * stats.session_seconds / total if total else 0.0


def config_record(plan: Plan) -> dict:
    """config.yaml: what the run is, as the readers of a results tree and a resume read it."""
    target = plan.spec.decoding_target
    return {
        "method": plan.spec.method,
        "compression_ratio": plan.spec.effective_cr,
        # KV pairs kept of each context, where a token budget (not one ratio) decides what is kept.
        **({"budget": plan.spec.budget} if plan.spec.budget is not None else {}),
        # What a decoding-time press keeps instead of a ratio (evaluate/score/decoding.py says whether it did).
        **({"decoding": dict(zip(("target_size", "compression_interval"), target, strict=True))} if target else {}),
        "fingerprint": plan.spec.fingerprint,
        "press": repr(plan.press),
        # The code of a press defined outside kvpress and PressBench, which no version above identifies.
        **({"sources": sources} if (sources := plan.spec.press_sources) else {}),
        "device": plan.spec.device,
        "versions": {
            "python": sys.version.split()[0],
            **{name: version(name) for name in ("torch", "transformers", "kvpress", "pressbench")},
        },
        # The attention that ran, where the config left it to kvpress's rule (null).
        "config": {**plan.spec.recorded, "attn_implementation": plan.spec.attention},
    }


class Recorder:
    """Writes one planned run: starts its session, records each answered context, closes it with its metrics."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.shard = plan.spec.shard
        if self.shard.whole:
            self.predictions, self.record_path = plan.out / rundir.PREDICTIONS, plan.out / rundir.RUN
        else:
            self.predictions = rundir.shard_path(plan.out, self.shard.name, ".jsonl")
            self.record_path = rundir.shard_path(plan.out, self.shard.name, ".json")
        share = {sample.id for sample in plan.share}
        self.kept_rows = [row for row in plan.kept_rows if row["id"] in share]
        self.done_ids = {row["id"] for row in self.kept_rows}
        # Conversations with an answered turn: what prefills per conversation are counted over.
        self.conversations = {row["conversation"] for row in self.kept_rows if row.get("conversation")}
        self.n_errors = sum(1 for row in self.kept_rows if row.get("error"))
        self.unanswered = 0  # samples an environment failure left for the rerun
        self.environment_error: str | None = None
        self.truncated: int | None = None
        self.path: str | None = None
        self.path_why: str | None = None
        self.path_note: str | None = None
        self.weights_bytes: int | None = None
        self.tracker = Tracker()

    def start(self) -> None:
        """Make the directory match the plan (earlier rows dropped by overwrite or retry_errors) and open a session."""
        plan = self.plan
        left = rundir.shard_paths(plan.out, ".json") + rundir.shard_paths(plan.out, ".jsonl")
        if self.shard.whole and (plan.spec.overwrite or left):
            self._fold_shards()
        if not plan.todo:
            recorded = rundir.read_json(self.record_path) or {}
            point = rundir.read_json(plan.out / rundir.RUN) or {}
            if not self.shard.whole and point.get("status") in rundir.FINISHED:
                pass  # the point is merged and scored: nothing is left to this shard
            elif recorded.get("status") not in rundir.FINISHED:
                # Stopped after its last answer but before it closed (SIGKILL): this session only closes it.
                self.stats = RunStats.resume(recorded)
                self._write_run(self._finished_status())
            which = "" if self.shard.whole else f"shard {self.shard} of "
            # overwrite is refused to a shard (evaluate/points/point.py): the point is redone in one process.
            redo = (
                "overwrite=true to redo it" if self.shard.whole else "overwrite=true without shard= to redo the point"
            )
            print(f"{which}{plan.out} is already complete ({len(plan.share)} samples); pass {redo}")
            return
        if plan.spec.overwrite:
            for name in (rundir.PREDICTIONS, rundir.METRICS, rundir.RUN, rundir.CONFIG):
                (plan.out / name).unlink(missing_ok=True)
            shutil.rmtree(plan.out / KEPT, ignore_errors=True)
        elif plan.spec.retry_errors:
            # The plan dropped the failed rows: the file keeps only what the plan kept.
            rundir.rewrite_predictions(self.predictions, plan.kept_rows)
        rundir.write_yaml(plan.out / rundir.CONFIG, config_record(plan))
        self.stats = RunStats.resume(rundir.read_json(self.record_path))
        self._write_run("running")
        self._update_point()
        self.tracker = Tracker.from_spec(plan.spec)

    def _fold_shards(self) -> None:
        """A whole run takes over what shards left (this process holds the directory alone): their rows into
        ``predictions.jsonl`` and their sessions into run.json, so that it goes on as if one process had run them
        (under ``overwrite`` they are dropped with the rest)."""
        out = self.plan.out
        if not self.plan.spec.overwrite:
            rundir.rewrite_predictions(out / rundir.PREDICTIONS, rundir.read_all_predictions(out))
            rundir.write_json(out / rundir.RUN, self._sharded_record(out))
        rundir.remove_shard_files(out)

    def note_truncated(self, count: int) -> None:
        self.truncated = count

    def note_weights(self, count: int) -> None:
        """The bytes of the model's weights as this session loaded them, kept in run.json."""
        self.weights_bytes = count

    def note_path(self, path: str, why: str, note: str | None = None) -> None:
        """Which engine answers this session (``pool`` or kvpress's ``pipeline``) and why, kept in run.json, with
        what the path may change in its answers (``note``, which the run's closing lines repeat)."""
        self.path, self.path_why, self.path_note = path, why, note

    def record(self, result: AnsweredGroup) -> None:
        """Append a group's rows as the engine finished them (``likelihood`` holds each sample's likelihood fields,
        empty where it has none). A failed group is the failure policy's, the only one: it stops the run under
        ``fail_fast``; a failure of the machine (:func:`environment_failure`) leaves its samples unanswered for the
        rerun; any other failure records them empty, marked with the error, counted as wrong."""
        group, error = result.group, None
        if result.failure is not None:
            if self._left_for_the_rerun(result):
                return
            # One bad context must not kill a sweep: record it, count it as wrong, and go on.
            error = describe(result.failure)
            logger.warning("context of %s failed and is scored as wrong: %s", group[0].id, error)
        if self.plan.spec.save_kept and not error:
            self._store_kept(result)
        rundir.append_predictions(self.predictions, self._rows(result, error))
        kept_ratio = None if error else result.kept_ratio
        self.n_errors += len(group) if error else 0
        self.stats.add(result.cost)
        if not error:
            self.stats.contexts += result.contexts
            self.stats.questions += len(group)
            new = {sample.conversation for sample in group if sample.conversation} - self.conversations
            self.conversations |= new
            self.stats.conversations += len(new)
        self.done_ids.update(sample.id for sample in group)
        self._write_run("running")
        self.tracker.log_progress(
            len(self.done_ids),
            len(self.plan.samples),
            wall_seconds=self.stats.wall_seconds,
            prefill_seconds=self.stats.cost.prefill_seconds,
            decode_seconds=self.stats.cost.decode_seconds,
            kept_ratio=kept_ratio,
            errors=self.n_errors,
        )

    def _store_kept(self, result: AnsweredGroup) -> None:
        """Each row's kept set under kept/ (``save_kept=true``), before its row: a row recorded has its file."""
        diagnosis = result.diagnosis
        if diagnosis is None:
            return
        for sample, kept, positions in zip(result.group, diagnosis.kept, diagnosis.answer_positions, strict=True):
            if kept is not None:
                write_kept(
                    self.plan.out, sample.id, kept.mask.numpy(), None if positions is None else positions.numpy()
                )

    def _left_for_the_rerun(self, result: AnsweredGroup) -> bool:
        """Whether a failed group is left unanswered for the rerun, as a failure of the machine is; raises it under
        ``fail_fast``."""
        if self.plan.spec.fail_fast:
            raise result.failure
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if not environment_failure(result.failure):
            return False
        self.unanswered += len(result.group)
        self.environment_error = self.environment_error or describe(result.failure)
        logger.warning(
            "context of %s not answered (%s): its %d samples are left for the rerun",
            result.group[0].id,
            describe(result.failure),
            len(result.group),
        )
        self.stats.cost += result.cost
        self._write_run("running")
        return True

    def _rows(self, result: AnsweredGroup, error: str | None) -> Iterator[dict]:
        """The group's prediction rows; a failed group's empty and marked with its ``error``."""
        answers = [""] * len(result.group) if error else result.answers
        likelihood = (None if error else result.likelihood) or [{}] * len(result.group)
        generated = (None if error else result.generated) or [None] * len(result.group)
        diagnosed = (None if error or result.diagnosis is None else result.diagnosis.fields) or [{}] * len(result.group)
        for sample, answer, scores, tokens, diagnostics in zip(
            result.group, answers, likelihood, generated, diagnosed, strict=True
        ):
            # The answer's exact token ids and why it ended (evaluate/score/answer_length.py); none when not generated.
            length = row_columns(tokens.token_ids, tokens.stopped_on_eos) if tokens is not None else {}
            if tokens is not None and tokens.compressed is not None:
                length[DECODING_COMPRESSED] = tokens.compressed
            yield {
                **sample_identity(sample),
                "prediction": answer,
                "max_new_tokens": sample.max_new_tokens,
                "compression_ratio": self.plan.spec.effective_cr,
                "kept_ratio": None if error else result.kept_ratio,
                "context_length": None if error else result.context_length,
                **length,
                **sample.extra,
                **scores,
                **diagnostics,
                **({"error": error} if error else {}),
            }

    def stopped(self, reason: BaseException) -> None:
        """Say in run.json how this session ended early: ``interrupted`` by a signal (which one), or ``failed`` with
        the exception. Best effort: on a full disk run.json may not be writable, and stays ``running`` under a lock
        no process holds, which the report reads as a run that was stopped."""
        if not self.plan.todo:
            return
        if isinstance(reason, KeyboardInterrupt):
            status, detail = "interrupted", {"signal": str(reason) or "SIGINT"}
        else:
            status, detail = "failed", {"error": describe(reason)}
        try:
            # What the file holds, not what this process last counted: a signal can land between a group's append
            # and its count (a torn last line is not a row, and the rerun cuts it).
            written = {row["id"] for row in rundir.read_predictions(self.predictions)}
            self.done_ids = {row["id"] for row in self.kept_rows} | (written & {s.id for s in self.plan.share})
            self._write_run(status, **detail)
            self._update_point()
        except OSError as error:
            logger.warning("could not record how %s ended in %s: %s", self.plan.out, rundir.RUN, describe(error))
        self.tracker.finish(exit_code=1)

    def close(self) -> dict | None:
        """Finish the session and score every prediction of the run; returns metrics.json's content. A shard scores
        the point only when the point's last sample is answered (by it or by the other shards before it), and
        returns None while some are missing."""
        plan = self.plan
        if plan.todo:
            self._write_run(self._finished_status())
            if self.n_errors:
                logger.warning(
                    "%d samples failed; they count as wrong answers (see the error field in predictions)",
                    self.n_errors,
                )
        if self.shard.whole:
            return self._score(rundir.read_predictions(self.predictions))
        with rundir.merging(plan.out):
            rows = rundir.read_all_predictions(plan.out)
            record = self._sharded_record(plan.out, rows)
            if record["status"] not in rundir.FINISHED:
                rundir.write_json(plan.out / rundir.RUN, record)
                self.tracker.finish()
                print(f"shard {self.shard} of {plan.out} is done; the point is {record['status']}: {record['error']}")
                return None
            # The last shard merges: predictions.jsonl first (a crash before the shards' files go leaves each row
            # twice, read once), then run.json, then the shards' files.
            rundir.rewrite_predictions(plan.out / rundir.PREDICTIONS, rows)
            rundir.write_json(plan.out / rundir.RUN, record)
            rundir.remove_shard_files(plan.out)
            return self._score(rows)

    def _score(self, rows: list[dict]) -> dict:
        """Score every row of the run, kept in the benchmark's order, and write metrics.json."""
        plan = self.plan
        predictions = plan.out / rundir.PREDICTIONS
        # Answered in kvpress's order (contexts sorted), kept in the benchmark's, as kvpress's predictions.csv is.
        position = {sample.id: index for index, sample in enumerate(plan.samples)}
        in_order = sorted(rows, key=lambda row: position.get(row["id"], len(position)))
        if in_order != rows:
            rundir.rewrite_predictions(predictions, in_order)
            rows = in_order
        decoding = decoding_record(rows)
        if decoding is not None:  # whether a decoding-time press compressed at all (evaluate/score/decoding.py)
            recorded = rundir.read_json(plan.out / rundir.RUN) or {}
            rundir.write_json(plan.out / rundir.RUN, {**recorded, "decoding": decoding})
        try:
            metrics = score_run(plan.benchmark, rows, plan.out)
        except Exception as error:
            # A run never stays "complete" without its metrics: run.json says that scoring failed and why.
            failure = f"scoring failed: {type(error).__name__}: {' '.join(str(error).split())}"
            (plan.out / rundir.METRICS).unlink(missing_ok=True)
            recorded = rundir.read_json(plan.out / rundir.RUN) or {}
            rundir.write_json(plan.out / rundir.RUN, {**recorded, "status": "failed", "error": failure})
            self.tracker.finish(exit_code=1)
            raise ConfigError(
                f"{plan.out}: {failure}; its predictions are kept: fix the cause, then python -m evaluate.score "
                f"{plan.out}"
            ) from error
        rundir.write_json(plan.out / rundir.METRICS, metrics)
        print(format_task_table(metrics, title=plan.out.name))
        print(f"results in {plan.out}")
        if plan.todo:
            self.tracker.log_metrics(metrics, rows, plan.benchmark, rundir.read_json(plan.out / rundir.RUN))
        self.tracker.finish()
        return metrics

    def _finished_status(self) -> str:
        if self.unanswered:
            return "incomplete"
        return rundir.FINISHED[1] if self.n_errors else rundir.FINISHED[0]

    def _write_run(self, status: str, **detail: str) -> None:
        """This session's record: run.json for a whole run, the shard's own record for a shard."""
        unanswered = {"unanswered": self.unanswered, "error": self.environment_error} if self.unanswered else {}
        record = {
            "status": status,
            **unanswered,
            **detail,
            **({"budget": self.plan.spec.budget} if self.plan.spec.budget is not None else {}),
            "samples": len(self.done_ids),
            "session_samples": len(self.done_ids) - len(self.kept_rows),
            "samples_expected": len(self.plan.share),
            "errors": self.n_errors,
            "truncated_samples": self.truncated,
            **({"answered_by": self._answered_by()} if self.path else {}),
            **({"model_weights_bytes": self.weights_bytes} if self.weights_bytes else {}),
            **self.stats.record(peak_memory_mb(self.plan.spec.device, self.plan.spec.device_map)),
            "device": self.plan.spec.device,
            "sessions": self.stats.sessions,
            "started_at": self.stats.started_at,
            "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        rundir.write_json(self.record_path, record)

    def _answered_by(self) -> dict[str, str]:
        return {"path": self.path, "why": self.path_why, **({"note": self.path_note} if self.path_note else {})}

    def _update_point(self) -> None:
        """A shard keeps its point's run.json saying how the point stands (a whole run's session record is it)."""
        if not self.shard.whole:
            with rundir.merging(self.plan.out):
                rundir.write_json(self.plan.out / rundir.RUN, self._sharded_record(self.plan.out))

    def _waiting_state(self, missing: list, records: dict[str, dict], live: set[str], base: dict) -> dict:
        """What run.json says of a sharded point with samples ``missing``: how many, which shards hold them, and each
        shard's own state (``live``: the shards still running)."""
        samples = self.plan.samples
        unanswered_contexts = {sample.context for sample in missing}
        shards = [
            shard
            for shard in (Shard(index, self.shard.count) for index in range(self.shard.count))
            if shard.contexts(sample.context for sample in samples) & unanswered_contexts
        ]
        return {
            "unanswered": len(missing),
            "error": f"shards {', '.join(map(str, shards))} have samples unanswered"
            + ("" if live else "; run each again with shard=INDEX/COUNT, or the point in one process"),
            "shards": {
                name: {key: record.get(key) for key in ("status", "samples", "samples_expected", "updated_at")}
                | ({"running": True} if name in live else {})
                for name, record in records.items()
            },
            "unsharded": base,
        }

    def _sharded_record(self, out, rows: list[dict] | None = None) -> dict:
        """run.json of a point that shards answer: what the whole runs before them recorded (``unsharded``) plus
        every shard's sessions; its status says whether every sample is answered, a shard still runs, or which
        shards' samples are missing. Each shard's own state is under ``shards``."""
        plan = self.plan
        rows = rundir.read_all_predictions(out) if rows is None else rows
        recorded = rundir.read_json(out / rundir.RUN) or {}
        base = recorded["unsharded"] if "unsharded" in recorded else recorded
        records = {}
        for path in rundir.shard_paths(out, ".json"):
            try:
                records[path.stem] = rundir.read_record(path)
            except rundir.Unreadable as error:
                logger.warning("%s; its sessions are left out of %s", error, rundir.RUN)
        live = set(rundir.live_shards(out)) - {self.shard.name}
        answered = {row["id"] for row in rows}
        missing = [sample for sample in plan.samples if sample.id not in answered]
        errors = sum(1 for row in rows if row.get("error"))
        stats = RunStats.combined([base, *records.values()])
        state = {}
        if missing:
            status = "running" if live else "incomplete"
            state = self._waiting_state(missing, records, live, base)
        else:
            status = rundir.FINISHED[1] if errors else rundir.FINISHED[0]
        every = [base, *records.values()]
        truncated = [record.get("truncated_samples") for record in every if record.get("truncated_samples")]
        return {
            "status": status,
            **state,
            "samples": len(answered),
            "samples_expected": len(plan.samples),
            "errors": errors,
            "truncated_samples": max(truncated, default=None),
            **(
                {"model_weights_bytes": weights[0]}
                if (weights := [r["model_weights_bytes"] for r in every if r.get("model_weights_bytes")])
                else {}
            ),
            **stats.record(max((record.get("peak_memory_mb") or 0.0 for record in every), default=0.0)),
            "device": self.plan.spec.device,
            "sessions": stats.sessions,
            "started_at": stats.started_at,
            "updated_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
