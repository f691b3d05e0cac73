"""The score by turn of a benchmark's conversations (``{benchmark}_turns``): each run's score on the samples of each
turn, from its metrics.json's ``score_by_turn`` (evaluate/score/turns.py), a row per run, so that how far a press's
score falls as a conversation goes on reads along a row, and a multi-turn run (one cache across the turns) against an
independent one (each turn from a fresh copy of the compressed context) down a column."""

import pandas as pd

from evaluate.report.frame import labelled, run_level
from evaluate.report.tables import (
    Table,
    cr_cells,
    fmt_number,
    kept_cells,
    kept_columns,
    kept_shown,
    kept_values,
    row_method,
)

# Baselines first, then by method, conversation settings and what the run keeps.
_ORDER = ["reference", "model", "query_aware", "method", "variant", "turns", "history", "cr", "budget", "target_size"]
_CELLS = (
    "Cells: the benchmark's score on the samples of each turn (turn 0: each conversation's first question) "
    "n=samples. turns: independent asks each turn on its own from a fresh copy of the compressed context; multi "
    "compresses the context once and asks the turns in order, each earlier question and answer staying in the cache "
    "(history: the reference answers there, or the model's own)."
)


def turn_benchmarks(frame: pd.DataFrame) -> list[str]:
    """The benchmarks of the frame that have runs with a score by turn."""
    return sorted(frame.benchmark[frame.score_by_turn.map(bool)].unique())


def turn_runs(frame: pd.DataFrame, benchmark: str) -> pd.DataFrame:
    """The runs of ``benchmark`` (run level) that have a score by turn, in the table's order, each with ``point``:
    its label and what it keeps (cr=0.5, or budget=256), after its model where several, as a line of the figure."""
    runs = run_level(frame[frame.benchmark == benchmark])
    runs = labelled(runs[runs.score_by_turn.map(bool)])
    runs = runs.sort_values(_ORDER, ascending=[False, *[True] * (len(_ORDER) - 1)], kind="stable")
    point = runs.label + " · " + kept_cells(runs)
    if runs.model.nunique() > 1:
        point = runs.model + " · " + point
    return runs.assign(point=point).reset_index(drop=True)


def turn_points(frame: pd.DataFrame, benchmark: str) -> pd.DataFrame:
    """:func:`turn_runs` as one row per run x turn, in turn order: ``turn`` (an int), ``turn_score`` and ``turn_n``."""
    runs = turn_runs(frame, benchmark)
    turns = runs.score_by_turn.map(lambda scores: sorted(map(int, scores)))
    points = runs.assign(turn=turns).explode("turn").astype({"turn": int})
    return points.assign(
        turn_score=[scores[str(turn)] for scores, turn in zip(points.score_by_turn, points.turn, strict=True)],
        turn_n=[counts.get(str(turn)) for counts, turn in zip(points.samples_by_turn, points.turn, strict=True)],
    ).astype({"turn_score": float, "turn_n": "Int64"})


def turn_table(frame: pd.DataFrame, benchmark: str) -> Table | None:
    """A row per run of ``benchmark`` with a score by turn (method, cr or budget, turns and history), a column per
    turn; None when no run of the benchmark has one (its samples are no conversations, or it was scored before)."""
    points = turn_points(frame, benchmark)
    if points.empty:
        return None
    runs = points.drop_duplicates("run")
    scores = points.pivot(index="run", columns="turn", values="turn_score").reindex(runs.run)
    counts = points.pivot(index="run", columns="turn", values="turn_n").reindex(runs.run)
    models = {"model": runs.model} if runs.model.nunique() > 1 else {}
    shown = pd.DataFrame({"method": runs.label, **models, "cr": cr_cells(runs)})
    shown[kept_columns(runs)] = kept_shown(runs)  # no column where no run has a budget or target size
    shown = shown.assign(turns=runs.turns, history=runs.history)
    data = runs[["benchmark", "model"]].assign(method=row_method(runs), query_aware=runs.query_aware)
    data["compression_ratio"] = runs.cr
    data[kept_columns(runs)] = kept_values(runs)
    data = data.assign(turns=runs.turns, history=runs.history)
    for turn in scores.columns:
        cells = [
            "" if pd.isna(n) else f"{fmt_number(score)} n={n}"
            for score, n in zip(scores[turn], counts[turn], strict=True)
        ]
        shown[f"turn {turn}"] = cells
        data[f"turn {turn}"], data[f"turn {turn} n"] = scores[turn].to_numpy(), counts[turn].to_numpy()
    notes = [_CELLS]
    if points.turn_score.isna().any():
        notes.append("`-`: made with generate=false, no answers to score.")
    title = f"{benchmark}: score by turn of the conversation"
    return Table(f"{benchmark}_turns", title, data, [("", shown.reset_index(drop=True))], notes)
