"""LongBench v2 as kvpress runs it: 503 four-choice questions on long contexts, answered zero-shot.

Data: the kvpress hub dataset ``simonjegou/LongBench-v2``, data_dir ``0shot``, made by kvpress's
``evaluation/benchmarks/longbenchv2/create_huggingface_dataset.py`` from ``THUDM/LongBench-v2`` with LongBench's
0-shot prompt: the context wrapped in ``<text>`` tags, the question with its choices (A) to (D) and the instruction
to answer 'The correct answer is (insert answer here)', an empty answer prefix and 16 new tokens. Rows also hold
answer (the letter), difficulty (easy / hard), length (short / medium / long), domain, sub_domain and _id; a local
``path`` holds the same columns. The chat template is applied and over-long contexts keep their head (the runner's
``max_context_length``), as in kvpress.

Tasks: the length groups short, medium and long. They partition the questions (difficulty cuts across them), and
length is what KV-cache compression is measured against, so the per-task tables show accuracy by context length.
kvpress loads the whole split at once, so ``fraction`` draws from all rows, and ``limit`` keeps the first rows of
each length group in source order.

Metric: kvpress's ``evaluation/benchmarks/longbenchv2/calculate_metrics.py`` (kvpress 0.5.5), LongBench's
``extract_answer`` rule: with every ``*`` removed, a prediction is correct when it contains "The correct answer is
(X)" or "The correct answer is X" for the gold letter X (so "The correct answer is Apple" counts for A, as in
kvpress). kvpress reports fractions: ``average`` over all questions, then the mean per difficulty and per length.
Here every value is x100 and rounded to 2: the headline ``score`` is kvpress's ``average``, each task's ``score`` is
its length's value, ``difficulty`` holds the easy / hard values, and each task also splits by difficulty.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from evaluate.benchmarks import Sample, Source, TaskedHubBenchmark
from evaluate.benchmarks.sources import (
    REFERENCE,
    Schema,
    data_dir_layout,
    first_rows_per_task,
    kvpress_sample,
    split_rows,
)
from evaluate.errors import ConfigError

TASKS: tuple[str, ...] = ("short", "medium", "long")
DIFFICULTIES: tuple[str, ...] = ("easy", "hard")
# ``answer`` is the letter of the right choice; ``length`` the row's length group (its task).
SCHEMA = Schema(
    ("context", "question", "answer_prefix", "answer", "max_new_tokens", "difficulty", "length"), {"answer": REFERENCE}
)
HUB = Source(dataset="simonjegou/LongBench-v2", data_dir="0shot")


def is_correct(prediction: str, answer: str) -> bool:
    text = prediction.replace("*", "")
    return f"The correct answer is ({answer})" in text or f"The correct answer is {answer}" in text


def _percent(hits: list[bool]) -> float | None:
    return round(100 * (sum(hits) / len(hits)), 2) if hits else None


def score_predictions(rows: Iterable[dict], benchmark: str = "longbench_v2") -> dict:
    """metrics.json content from rows with ``task`` (the length), ``answers`` (the letter), ``prediction`` and
    ``difficulty``."""
    by_task: dict[str, list[bool]] = {}
    by_difficulty: dict[str, list[bool]] = {}
    by_both: dict[tuple[str, str], list[bool]] = {}
    every: list[bool] = []
    for row in rows:
        task, difficulty = row["task"], row["difficulty"]
        if task not in TASKS:
            raise ValueError(f"unknown LongBench v2 length {task!r}; the tasks are {', '.join(TASKS)}")
        hit = is_correct(row.get("prediction") or "", row["answers"][0])
        every.append(hit)
        by_task.setdefault(task, []).append(hit)
        by_difficulty.setdefault(difficulty, []).append(hit)
        by_both.setdefault((task, difficulty), []).append(hit)
    tasks = {
        task: {
            "score": _percent(by_task[task]),
            "n": len(by_task[task]),
            "metric": "accuracy",
            **{level: _percent(by_both.get((task, level), [])) for level in DIFFICULTIES},
        }
        for task in TASKS
        if task in by_task
    }
    return {
        "benchmark": benchmark,
        "score": _percent(every),
        "score_label": f"accuracy ×100 over all {len(every)} questions (kvpress's average)",
        "difficulty": {level: _percent(hits) for level, hits in sorted(by_difficulty.items())},
        "difficulty_n": {level: len(hits) for level, hits in sorted(by_difficulty.items())},
        "tasks": tasks,
    }


@dataclass
class LongBenchV2(TaskedHubBenchmark):
    """LongBench v2 from the kvpress hub dataset (data_dir ``0shot``) or local files; tasks are the length groups.

    Parameters
    ----------
    tasks : list[str], optional
        Length groups to run (short, medium, long); all three when null.
    path : str, optional
        Local source instead of the hub, with kvpress's columns: a parquet / jsonl file, a saved dataset, a directory
        of data files, or a hub snapshot directory holding ``{data_dir}/`` (see :mod:`evaluate.benchmarks.sources`).
    dataset, data_dir, split : str
        Where the data lives on the hub.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    name: str = "longbench_v2"
    # kvpress loads the whole split as one data_dir, so ``fraction`` draws from all of its rows at once.
    fraction_by_task: ClassVar[bool] = False
    all_tasks: ClassVar[tuple[str, ...]] = TASKS
    source: ClassVar[Source] = HUB
    data_dir: str = HUB.data_dir

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """At most ``limit`` samples per length group, in source order (the order kvpress's ``fraction`` draws in)."""
        self.selected_tasks("LongBench v2", kind="length")
        layout = data_dir_layout(self.data_dir)
        rows = split_rows(self.dataset, self.data_dir, self.split, self.path, layout, SCHEMA)
        return [
            kvpress_sample(task, index, row, [row["answer"]], {"difficulty": row["difficulty"]})
            for task, index, row in first_rows_per_task(rows, self._length, self.tasks, limit)
        ]

    def _length(self, row: dict) -> str:
        """The row's task, its length group, which must be one of TASKS."""
        if row["length"] not in TASKS:
            raise ConfigError(f"LongBench v2 row with length {row['length']!r}; the lengths are {', '.join(TASKS)}")
        return row["length"]

    def score(self, rows: list[dict]) -> dict:
        return score_predictions(rows, benchmark=self.name)
