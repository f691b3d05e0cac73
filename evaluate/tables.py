"""Plain-text tables printed at the end of a run and by the rescoring command."""


def format_task_table(metrics: dict, title: str = "") -> str:
    """Per-task scores with sample counts, then the headline score."""
    rows = [(task, f"{values['score']:.2f}", str(values["n"])) for task, values in metrics["tasks"].items()]
    headline = metrics["score"]
    label = metrics.get("score_label", "mean over tasks")
    rows.append((f"score ({label})", "-" if headline is None else f"{headline:.2f}", ""))
    widths = [max(len(row[i]) for row in [("task", "score", "n"), *rows]) for i in range(3)]
    lines = [title] if title else []
    lines.append(f"{'task':<{widths[0]}}  {'score':>{widths[1]}}  {'n':>{widths[2]}}")
    lines.append("-" * (sum(widths) + 4))
    for index, (task, score, n) in enumerate(rows):
        if index == len(rows) - 1:
            lines.append("-" * (sum(widths) + 4))
        lines.append(f"{task:<{widths[0]}}  {score:>{widths[1]}}  {n:>{widths[2]}}")
    return "\n".join(lines)
