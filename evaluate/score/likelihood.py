"""The likelihood fields of prediction rows (evaluate/engine/teacher_forcing.py computes them): which they are, and
metrics.json's summary of them."""

from collections import defaultdict
from collections.abc import Iterable

FIELDS = ("answer_nll", "answer_nll_uncompressed", "answer_kl", "answer_top1")


def row_fields(row: dict) -> dict[str, float] | None:
    """A prediction row's likelihood fields, or None when the row has none (not computed, or the sample failed)."""
    if row.get("error") or any(row.get(name) is None for name in FIELDS):
        return None
    return {name: float(row[name]) for name in FIELDS}


def likelihood_metrics(rows: Iterable[dict]) -> dict | None:
    """metrics.json's ``likelihood``: each field's mean per task and, as the headline, the unweighted mean of the
    task means (as the benchmarks' headlines weigh tasks); ``n`` counts the rows that have the fields. None when no
    row has them."""
    by_task: dict[str, list[dict[str, float]]] = defaultdict(list)
    for row in rows:
        fields = row_fields(row)
        if fields is not None:
            by_task[row["task"]].append(fields)
    if not by_task:
        return None
    tasks = {
        task: {**{name: sum(f[name] for f in values) / len(values) for name in FIELDS}, "n": len(values)}
        for task, values in sorted(by_task.items())
    }
    headline = {name: sum(task[name] for task in tasks.values()) / len(tasks) for name in FIELDS}
    return {**headline, "n": sum(task["n"] for task in tasks.values()), "tasks": tasks}
