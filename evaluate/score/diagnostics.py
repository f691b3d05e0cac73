"""The diagnostic fields of prediction rows (evaluate/engine/diagnosis.py computes them at run time; the rows carry
them, so rescoring keeps them): which they are, and metrics.json's ``diagnostics``."""

from collections import defaultdict
from collections.abc import Iterable

# Each headline field, and its per-layer list.
FIELDS = {"answer_retention": "answer_retention_by_layer", "attention_recall": "attention_recall_by_layer"}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def diagnostics_metrics(rows: Iterable[dict]) -> dict | None:
    """metrics.json's ``diagnostics``: for each field some row has, its mean over the rows that have it per task, the
    unweighted mean of the task means as the headline (as the benchmarks' headlines weigh tasks), its mean per layer
    and ``n``, the rows it is over. Rows where a field is null (the answer is not in the context, the kept set is
    unknown, the sample failed) are left out of that field. None where no row has any."""
    values: dict[str, dict[str, list]] = {name: defaultdict(list) for name in FIELDS}
    layers: dict[str, list[list[float]]] = {name: [] for name in FIELDS}
    for row in rows:
        for name, by_layer in FIELDS.items():
            if not row.get("error") and row.get(name) is not None:
                values[name][row["task"]].append(float(row[name]))
                if row.get(by_layer):
                    layers[name].append(row[by_layer])
    summary = {}
    for name, by_task in values.items():
        if not by_task:
            continue
        tasks = {task: {"mean": _mean(found), "n": len(found)} for task, found in sorted(by_task.items())}
        summary[name] = {
            "mean": _mean([task["mean"] for task in tasks.values()]),
            "n": sum(task["n"] for task in tasks.values()),
            "by_layer": [round(_mean(list(layer)), 4) for layer in zip(*layers[name], strict=True)],
            "tasks": tasks,
        }
    return summary or None
