"""A conversation's scores by turn (SCBench's multi-turn setting): the benchmark's own headline on each turn's rows,
so that metrics.json tells how a press holds up as a conversation goes on, next to the run's headline over all turns.
"""

from collections import defaultdict

SCORE_BY_TURN = "score_by_turn"
SAMPLES_BY_TURN = "samples_by_turn"


def rows_by_turn(rows: list[dict]) -> dict[int, list[dict]]:
    """The rows that carry a turn (a question on its own carries none), by turn, the first turn first."""
    found: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        if row.get("turn") is not None:
            found[int(row["turn"])].append(row)
    return dict(sorted(found.items()))


def turn_metrics(benchmark, rows: list[dict], generated: bool = True) -> dict:
    """metrics.json's ``score_by_turn``, the benchmark's ``score(rows)["score"]`` on each turn's rows (None without
    generated answers, as the headline is), and ``samples_by_turn``; each keyed by the turn as a string (JSON's keys
    are strings), in turn order. Empty when no row carries a turn, so that other runs' metrics stay as they were."""
    turns = rows_by_turn(rows)
    if not turns:
        return {}
    return {
        SCORE_BY_TURN: {str(turn): benchmark.score(own)["score"] if generated else None for turn, own in turns.items()},
        SAMPLES_BY_TURN: {str(turn): len(own) for turn, own in turns.items()},
    }
