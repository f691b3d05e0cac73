"""LongBench-E as the kvpress leaderboard runs it: 13 LongBench tasks re-sampled evenly over context lengths.

Data: the kvpress hub dataset ``Xnhyacinth/LongBench``, one data_dir per task named ``{task}_e`` (kvpress's
``--dataset longbench-e --data_dir qasper_e``), made by kvpress's ``create_huggingface_dataset.py`` from LongBench's
``{task}_e`` files with the same prompts as LongBench (v1). Rows hold context, question, answer_prefix, answers,
all_classes, length (LongBench's word count of the context), task (the plain LongBench name), _id and max_new_tokens
(dataset2maxlen + 20); a local ``path`` holds the same columns. Each row is run as kvpress runs it: the chat template
on every task, the row's generation length, over-long contexts keep their head (the runner's ``max_context_length``).

Metric: kvpress's ``calculate_metrics_e`` (``evaluation/benchmarks/longbench/calculate_metrics.py``, kvpress 0.5.5),
which is LongBench eval.py's ``scorer_e``. Each sample takes the max over its answers of the task's LongBench metric
(qa_f1, ROUGE-L F, classification, retrieval, count, code_sim; the tables of :mod:`evaluate.benchmarks.longbench`)
after LongBench's own clean-up, the ``official`` one: trec, triviaqa and samsum keep the first line after leading
newlines are stripped, and nothing else is stripped (unlike LongBench's ``kvpress`` protocol, whose scorer left-strips
every prediction). An empty or blank prediction is scored as it is, so code_sim may give it a few points, as in
kvpress. Samples fall into length buckets by the row's ``length``: ``0-4k`` (< 4000), ``4-8k`` (< 8000), ``8k+``.

metrics.json: each task keeps kvpress's three values, ``0-4k``, ``4-8k`` and ``8k+`` (100 x the bucket's mean,
rounded to 2; null for an empty bucket, where kvpress writes NaN), and ``n_by_length``; its ``score`` is 100 x the
mean over all of its samples (the buckets weighted by their sizes; kvpress reports no per-task total). The headline
``score`` is the mean of the task scores; ``lengths`` holds, per bucket, the mean over tasks of that bucket's value.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from evaluate.benchmarks import Sample, Source, TaskedHubBenchmark
from evaluate.benchmarks.longbench import KVPRESS_COLUMNS, METRICS, best_score, clean_prediction
from evaluate.benchmarks.sources import POSITIVE_INT, Schema, first_rows, kvpress_sample, rows_by_task

# kvpress's LongBench-E tasks, in the order of its create_huggingface_dataset.py; each is the data_dir {task}_e.
LONGBENCH_TASKS: tuple[str, ...] = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
SUFFIX = "_e"
TASKS: tuple[str, ...] = tuple(task + SUFFIX for task in LONGBENCH_TASKS)
# (bucket, exclusive upper bound of the row's length; None: unbounded), as scorer_e splits them.
LENGTH_BUCKETS: tuple[tuple[str, int | None], ...] = (("0-4k", 4000), ("4-8k", 8000), ("8k+", None))
# ``length``: the context's words, which pick the row's length bucket.
SCHEMA = Schema((*KVPRESS_COLUMNS, "length", "max_new_tokens"), {"length": POSITIVE_INT})
HUB = Source(dataset="Xnhyacinth/LongBench")


def length_bucket(length: int) -> str:
    return next(name for name, bound in LENGTH_BUCKETS if bound is None or length < bound)


def longbench_task(task: str) -> str:
    """The LongBench task whose metric scores a LongBench-E task (``qasper_e`` -> ``qasper``)."""
    return task.removesuffix(SUFFIX)


def sample_score(task: str, prediction: str, answers: Iterable[str], all_classes: list[str] | None = None) -> float:
    """One sample's score in [0, 1], as scorer_e computes it (LongBench's official clean-up, no blank shortcut)."""
    base = longbench_task(task)
    return best_score(base, clean_prediction(base, prediction, "official"), answers, all_classes)


def _percent(scores: list[float]) -> float | None:
    # np.mean, as kvpress: its pairwise summation can differ from sum() in the last bit, which rounding may show.
    return round(100 * float(np.mean(scores)), 2) if scores else None


def _mean(values: Iterable[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return round(sum(present) / len(present), 2) if present else None


def score_predictions(rows: Iterable[dict], benchmark: str = "longbench_e") -> dict:
    """metrics.json content from rows with ``task``, ``answers``, ``prediction``, ``length`` and ``all_classes``."""
    per_task: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        task = row["task"]
        if task not in TASKS:
            raise ValueError(f"unknown LongBench-E task {task!r}; the tasks are {', '.join(TASKS)}")
        score = sample_score(task, row.get("prediction") or "", row["answers"], row.get("all_classes"))
        buckets = per_task.setdefault(task, {name: [] for name, _ in LENGTH_BUCKETS})
        buckets[length_bucket(int(row["length"]))].append(score)
    tasks = {}
    for task in TASKS:
        if task not in per_task:
            continue
        buckets = per_task[task]
        every = [score for scores in buckets.values() for score in scores]
        tasks[task] = {
            "score": _percent(every),
            "n": len(every),
            "metric": METRICS[longbench_task(task)].__name__.removesuffix("_score"),
            **{name: _percent(scores) for name, scores in buckets.items()},
            "n_by_length": {name: len(scores) for name, scores in buckets.items()},
        }
    return {
        "benchmark": benchmark,
        "score": _mean(values["score"] for values in tasks.values()),
        "score_label": f"mean over the {len(tasks)} task scores (each over all its lengths)",
        "lengths": {name: _mean(values[name] for values in tasks.values()) for name, _ in LENGTH_BUCKETS},
        "lengths_label": "per length bucket, the mean over the tasks with samples in it",
        "tasks": tasks,
    }


@dataclass
class LongBenchE(TaskedHubBenchmark):
    """LongBench-E's 13 tasks from the kvpress hub dataset (data_dir ``{task}_e``) or local files.

    Parameters
    ----------
    tasks : list[str], optional
        Tasks to run, named as kvpress's data_dirs (``qasper_e``, ...); all 13 when null.
    path : str, optional
        Local source instead of the hub: a directory with ``{task}_e.jsonl|.json|.parquet`` or ``{task}_e/`` per
        task (a hub snapshot), with kvpress's columns.
    dataset, split : str
        Hub dataset (one data_dir per task) and split.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    name: str = "longbench_e"
    # kvpress loads one data_dir per task, so ``fraction`` draws within each task's rows.
    fraction_by_task: ClassVar[bool] = True
    all_tasks: ClassVar[tuple[str, ...]] = TASKS
    source: ClassVar[Source] = HUB

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """At most ``limit`` samples per task, in source order, task after task."""
        layout = "one {task}_e.jsonl or {task}_e.parquet file, or {task}_e/ folder, per LongBench-E task"
        sources = rows_by_task(self.dataset, self.selected_tasks("LongBench-E"), self.split, self.path, layout, SCHEMA)
        return [self._sample(task, index, row) for task, index, row in first_rows(sources, limit)]

    def _sample(self, task: str, index: int, row: dict) -> Sample:
        extra = {"all_classes": row.get("all_classes"), "length": int(row["length"])}
        return kvpress_sample(task, index, row, list(row["answers"]), extra)

    def score(self, rows: list[dict]) -> dict:
        return score_predictions(rows, benchmark=self.name)
