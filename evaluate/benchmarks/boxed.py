"""Reasoning benchmarks scored on the ``\\boxed{...}`` answer: what ``aime25`` and ``math500`` share.

kvpress runs these sets with decoding-time compression (``DecodingPress``) and long generations; each row carries
its own ``max_new_tokens``. The hub datasets' creation scripts are not published with kvpress, so the row schema
assumed here is the one kvpress's ``evaluation/evaluate.py`` reads: ``context``, ``question``, ``answer_prefix``,
``max_new_tokens``, and ``answer`` (the only column its scorers read), a number or a string. The rows are fed as
they are (chat template on, no prompt added); every row belongs to one task named after the benchmark.

Metric, as kvpress's ``evaluation/benchmarks/{aime25,math500}/calculate_metrics.py`` with
``evaluation/benchmarks/utils.py``'s ``extract_boxed`` compute it (kvpress 0.5.5):

- the boxed answer of a prediction: the text after one occurrence of ``boxed{`` up to the brace that closes it,
  nested braces counted; the first occurrence for math500, the last for aime25, and none when that occurrence is
  never closed (an earlier, closed one is not tried). Any ``boxed{`` counts, without a backslash too;
- ``correct``: rows whose boxed answer equals ``str(answer)`` exactly (no normalisation: ``\\frac12`` differs from
  ``\\frac{1}{2}``, ``5.0`` from ``5``);
- ``answered``: rows whose prediction contains ``boxed{`` (closed or not);
- ``accuracy`` = correct / total, ``total`` the number of rows.

These four keys are kvpress's metrics.json, unrounded. The task ``score`` and the headline ``score`` are
accuracy x 100, rounded to 2 decimals (the scale of the other PressBench benchmarks).
"""

from dataclasses import dataclass
from typing import ClassVar

from evaluate.benchmarks import HubBenchmark, Sample, Source
from evaluate.benchmarks.sources import Kind, Schema, first_rows, is_number, kvpress_sample, split_rows

MARKER = "boxed{"
# ``answer`` is a number or a string, compared as ``str(answer)``; an empty one is no reference.
ANSWER = Kind(
    "a number or a non-empty string (the reference answer a row is scored against)",
    lambda value: is_number(value) or (isinstance(value, str) and bool(value)),
)
SCHEMA = Schema(("context", "question", "answer_prefix", "answer", "max_new_tokens"), {"answer": ANSWER})


def extract_boxed(text: str, last: bool = False) -> str | None:
    """The content of the first (``last``: the last) ``boxed{...}`` in ``text``; None if absent or never closed."""
    start = text.rfind(MARKER) if last else text.find(MARKER)
    if start == -1:
        return None
    start += len(MARKER)
    depth = 1
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start:index]
    return None


def score_boxed(rows: list[dict], benchmark: str, last: bool, label: str) -> dict:
    """metrics.json content from rows with ``task`` (the benchmark's name), ``answers`` and ``prediction``."""
    correct = answered = 0
    for row in rows:
        if row["task"] != benchmark:
            raise ValueError(f"a {benchmark} row has task {row['task']!r}; every {benchmark} row has task {benchmark}")
        prediction = row.get("prediction") or ""  # a failed sample has no prediction: wrong and unanswered
        correct += extract_boxed(prediction, last=last) == row["answers"][0]
        answered += MARKER in prediction
    tasks = {}
    if rows:
        accuracy = correct / len(rows)
        tasks[benchmark] = {
            "score": round(100 * accuracy, 2),
            "n": len(rows),
            "metric": "accuracy",
            "correct": correct,
            "answered": answered,
            "accuracy": accuracy,
            "total": len(rows),
        }
    return {
        "benchmark": benchmark,
        "score": tasks[benchmark]["score"] if tasks else None,
        "score_label": label,
        "tasks": tasks,
    }


@dataclass
class BoxedAnswerBenchmark(HubBenchmark):
    """One hub dataset of problems (one task), scored on the first or last ``\\boxed{...}`` of the prediction.

    Subclasses set the default of ``name``, and ``source``, ``all_tasks`` (the name) and ``last``: all that tells
    one such benchmark from another.

    Parameters
    ----------
    path : str, optional
        Local source instead of the hub, with the hub's columns (context, question, answer_prefix, answer,
        max_new_tokens): a .jsonl/.json/.parquet file, a saved dataset or a directory of data files.
    dataset, split : str
        Hub dataset and split.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    name: str
    # kvpress loads the whole split (no data_dir), so ``fraction`` draws from all rows at once.
    fraction_by_task: ClassVar[bool] = False
    source: ClassVar[Source]
    last: ClassVar[bool]

    @property
    def score_label(self) -> str:
        which = "last" if self.last else "first"
        return f"accuracy ×100: the {which} \\boxed{{}} of the prediction equals the answer"

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """At most ``limit`` samples, in source order; the answer as a string, as kvpress compares it."""
        layout = f"its {self.split} rows (a .jsonl/.parquet file, a saved dataset or a snapshot directory)"
        rows = split_rows(self.dataset, None, self.split, self.path, layout, SCHEMA)
        return [
            kvpress_sample(task, index, row, [str(row["answer"])])
            for task, index, row in first_rows({self.name: rows}, limit)
        ]

    def score(self, rows: list[dict]) -> dict:
        return score_boxed(rows, self.name, self.last, self.score_label)
