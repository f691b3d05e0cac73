"""Plain-text tables printed at the end of a run and by the rescoring command."""


def _score(value: float | None) -> str:
    # None: a benchmark without a score (ZeroSCROLLS, whose answers are not public) or without this task's.
    return "-" if value is None else f"{value:.2f}"


def format_task_table(metrics: dict, title: str = "") -> str:
    """Per-task scores with sample counts, then the headline score."""
    rows = [(task, _score(values["score"]), str(values["n"])) for task, values in metrics["tasks"].items()]
    label = metrics.get("score_label", "mean over tasks")
    rows.append((f"score ({label})", _score(metrics["score"]), ""))
    widths = [max(len(row[i]) for row in [("task", "score", "n"), *rows]) for i in range(3)]
    lines = [title] if title else []
    lines.append(f"{'task':<{widths[0]}}  {'score':>{widths[1]}}  {'n':>{widths[2]}}")
    lines.append("-" * (sum(widths) + 4))
    for index, (task, score, n) in enumerate(rows):
        if index == len(rows) - 1:
            lines.append("-" * (sum(widths) + 4))
        lines.append(f"{task:<{widths[0]}}  {score:>{widths[1]}}  {n:>{widths[2]}}")
    return "\n".join(lines)
