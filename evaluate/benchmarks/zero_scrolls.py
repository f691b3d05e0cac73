"""ZeroSCROLLS as kvpress runs it: ten long-text tasks whose test answers are not public.

Data: the kvpress hub dataset ``simonjegou/zero_scrolls`` (one split, no data_dir), made by kvpress's
``evaluation/benchmarks/zero_scrolls/create_huggingface_dataset.py`` from ``tau/zero_scrolls``: each ZeroSCROLLS
``input`` is cut at its ``document_end_index`` and ``query_end_index`` into context (instructions and document),
question, and answer prefix (the rest, stripped); max_new_tokens per task (gov_report 1024, summ_screen_fd 512,
qmsum 512, qasper 128, narrative_qa 64, quality 10, musique 32, squality 512, space_digest 36, book_sum_sort 256);
``answer`` is empty. Rows keep ZeroSCROLLS's ``id``, which a submission needs. A local ``path`` holds the same
columns. The chat template is applied and over-long contexts keep their head (the runner's ``max_context_length``),
as in kvpress. kvpress loads the whole split at once, so ``fraction`` draws from all rows; ``limit`` keeps the first
rows of each task in source order.

Metric: none. ZeroSCROLLS publishes no test answers (predictions are scored by its website), and kvpress's
``calculate_metrics`` returns ``{}``. metrics.json records, honestly, no score: the headline ``score`` and every
task ``score`` are null, ``score_label`` says why, and each task has its sample count ``n``. The predictions are
what a run delivers: ``python -m evaluate.benchmarks.zero_scrolls RUN_DIR`` writes them in the website's submission
format (ZeroSCROLLS's ``prepare_submission.py``: a CSV with columns Task, ID, Prediction, one row per example id).
"""

import argparse
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from evaluate import rundir
from evaluate.benchmarks import Sample, Source, TaskedHubBenchmark
from evaluate.benchmarks.sources import TEXT, Schema, first_rows_per_task, kvpress_sample, split_rows
from evaluate.errors import ConfigError, refuse

# kvpress's tasks, in the order of its create_huggingface_dataset.py.
TASKS: tuple[str, ...] = (
    "gov_report",
    "summ_screen_fd",
    "qmsum",
    "qasper",
    "narrative_qa",
    "quality",
    "musique",
    "squality",
    "space_digest",
    "book_sum_sort",
)
# No ``answer``: the test answers are not public, so rows are read without references and scored as none (below).
SCHEMA = Schema(("context", "question", "answer_prefix", "task", "max_new_tokens", "id"), {"id": TEXT})
HUB = Source(dataset="simonjegou/zero_scrolls")
SUBMISSION_URL = "https://www.zero.scrolls-benchmark.com/"
SCORE_LABEL = "not scored: ZeroSCROLLS test answers are not public"
SUBMISSION_FILE = "zero_scrolls_predictions.csv"
SUBMISSION_NOTE = (
    f"python -m evaluate.benchmarks.zero_scrolls RUN_DIR writes RUN_DIR/{SUBMISSION_FILE}; "
    f"submit it at {SUBMISSION_URL}"
)


def score_predictions(rows: Iterable[dict], benchmark: str = "zero_scrolls") -> dict:
    """metrics.json content: sample counts per task, and no score (see the module docstring)."""
    counts = Counter(row["task"] for row in rows)
    unknown = sorted(set(counts) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown ZeroSCROLLS task(s) {', '.join(unknown)}; the tasks are {', '.join(TASKS)}")
    return {
        "benchmark": benchmark,
        "score": None,
        "score_label": SCORE_LABEL,
        "submission": SUBMISSION_NOTE,
        "tasks": {
            task: {"score": None, "n": counts[task], "metric": "none (answers not public)"}
            for task in TASKS
            if task in counts
        },
    }


def submission_csv(rows: Iterable[dict]) -> str:
    """The predictions as ZeroSCROLLS's submission CSV (Task, ID, Prediction), the first prediction of each id."""
    import pandas as pd

    seen: set[tuple[str, str]] = set()
    records = []
    for row in rows:
        key = (row["task"], row["zero_scrolls_id"])
        if key not in seen:
            seen.add(key)
            records.append({"Task": key[0], "ID": key[1], "Prediction": row.get("prediction") or ""})
    return pd.DataFrame(records, columns=["Task", "ID", "Prediction"]).to_csv(index=False)


@dataclass
class ZeroScrolls(TaskedHubBenchmark):
    """ZeroSCROLLS's ten tasks from the kvpress hub dataset or local files; predictions only, no score.

    Parameters
    ----------
    tasks : list[str], optional
        Tasks to run; all ten when null.
    path : str, optional
        Local source instead of the hub, with kvpress's columns: a parquet / jsonl file, a saved dataset or a
        directory of data files (see :mod:`evaluate.benchmarks.sources`).
    dataset, split : str
        Where the data lives on the hub.
    name : str
        Benchmark name in run directories and metrics.json.
    """

    name: str = "zero_scrolls"
    # kvpress loads the whole split at once, so ``fraction`` draws from all of its rows at once.
    fraction_by_task: ClassVar[bool] = False
    all_tasks: ClassVar[tuple[str, ...]] = TASKS
    source: ClassVar[Source] = HUB
    # Its rows have no answers, and score_predictions scores none of them.
    scored_on_references: ClassVar[bool] = False

    def load(self, tokenizer, limit: int | None = None) -> list[Sample]:
        """At most ``limit`` samples per task, in source order (the order kvpress's ``fraction`` draws in)."""
        self.selected_tasks("ZeroSCROLLS")
        layout = "the rows of every task (a .jsonl/.parquet file or folder)"
        rows = split_rows(self.dataset, None, self.split, self.path, layout, SCHEMA)
        # No tasks selected keeps every row, of a task outside TASKS too, as kvpress runs the whole split.
        return [
            kvpress_sample(task, index, row, [], {"zero_scrolls_id": row["id"]})  # answers: not public
            for task, index, row in first_rows_per_task(rows, lambda row: row["task"], self.tasks, limit)
        ]

    def score(self, rows: list[dict]) -> dict:
        return score_predictions(rows, benchmark=self.name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m evaluate.benchmarks.zero_scrolls",
        description="Write a ZeroSCROLLS run's predictions as the website's submission CSV.",
    )
    parser.add_argument("run_dir", type=Path, help="a zero_scrolls run directory")
    parser.add_argument("--out", type=Path, help=f"default: RUN_DIR/{SUBMISSION_FILE}")
    args = parser.parse_args(argv)
    predictions = args.run_dir / rundir.PREDICTIONS
    if not predictions.is_file():
        refuse(ConfigError(f"{predictions} does not exist; pass a zero_scrolls run directory"))
    try:
        rows = rundir.read_predictions(predictions)
    except rundir.DamagedPredictions as error:
        refuse(error)
    out = args.out or args.run_dir / SUBMISSION_FILE
    rundir.write_atomic(out, submission_csv(rows))
    tasks = Counter(row["task"] for row in rows)
    print(f"{out}: {sum(tasks.values())} predictions of {len(tasks)} of {len(TASKS)} tasks")
    if len(tasks) < len(TASKS):
        print(f"the website expects every example of all {len(TASKS)} tasks; this run has fewer")


if __name__ == "__main__":
    main()
