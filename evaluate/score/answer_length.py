"""Answer-length drift: how a compressed cache changes the greedy answers' length, against the uncompressed run of
the same samples (docs/metrics.md#answer-length-drift).

Each generated prediction row records its answer's exact token ids (``answer_token_ids``, the stop token included)
and why it ended (``answer_stop``: ``eos``, or ``max_new_tokens`` where it reached the row's cap), as the engine
decoded them; nothing here re-tokenizes text. A run's own fields need its rows alone (metrics.json's
``answer_length``); the drift fields pair each row with the same sample's row of its baseline
(evaluate/score/baseline.py), by task and id: metrics.json's ``answer_length.against_uncompressed`` against the
baseline found beside the run when it was scored (``python -m evaluate.score`` pairs it again), the report's
against the baseline in the tree it reads. Rows recorded before the columns existed, and failed rows, have no tokens:
a run without any has no fields (None), never a made-up length.
"""

import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from evaluate.score.baseline import NO_PRESS, answered_ids, find_baseline

TOKENS = "answer_token_ids"
STOP = "answer_stop"
EOS, CAP = "eos", "max_new_tokens"  # the values of STOP
# A run's own fields (metrics.json), and those against its baseline, in the order the tables show them.
OWN_FIELDS = ("answer_tokens", "hit_cap")
DRIFT_FIELDS = (
    "answer_tokens",
    "answer_tokens_uncompressed",
    "hit_cap",
    "hit_cap_uncompressed",
    "stopped_earlier",
    "common_prefix",
    "common_prefix_median",
)
NO_TOKENS = "no answer token ids recorded (rows written before the answer_token_ids column; rerun to record them)"


def row_columns(token_ids: Sequence[int], stopped_on_eos: bool) -> dict:
    """A prediction row's answer-length columns."""
    return {TOKENS: [int(token) for token in token_ids], STOP: EOS if stopped_on_eos else CAP}


def answer_tokens(row: dict) -> list[int] | None:
    """A row's answer token ids, or None when it has none (recorded before the column, failed, or not generated)."""
    if row.get("error") or not isinstance(row.get(TOKENS), list):
        return None
    return row[TOKENS]


def hit_cap(row: dict) -> bool:
    """Whether a row's answer ran to its ``max_new_tokens`` without a stop token."""
    return row.get(STOP) == CAP


def common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many tokens two answers share before they first differ."""
    shared = 0
    for mine, theirs in zip(first, second, strict=False):
        if mine != theirs:
            break
        shared += 1
    return shared


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def own_metrics(rows: Iterable[dict]) -> dict | None:
    """metrics.json's ``answer_length``: the mean answer length in tokens and the share of answers that hit their
    cap, over the rows that have token ids (``n``); None when none has them."""
    measured = [row for row in rows if answer_tokens(row) is not None]
    if not measured:
        return None
    return {
        "answer_tokens": _mean([len(answer_tokens(row)) for row in measured]),
        "hit_cap": _mean([float(hit_cap(row)) for row in measured]),
        "n": len(measured),
    }


def drift_metrics(rows: Iterable[dict], baseline_rows: Iterable[dict]) -> dict | None:
    """A run's answers against its baseline's for the same samples (paired by task and id, both with token ids):
    the mean length of each, the share of each that hit the cap, the share of the run's that stopped earlier (fewer
    tokens) than the baseline's, and the mean and median tokens they share before they first differ; ``n`` counts
    the pairs. None without a pair."""
    baseline = {(row["task"], row["id"]): answer_tokens(row) for row in baseline_rows}
    baseline_capped = {(row["task"], row["id"]): hit_cap(row) for row in baseline_rows}
    pairs = [
        (row, key)
        for row in rows
        if answer_tokens(row) is not None and baseline.get(key := (row["task"], row["id"])) is not None
    ]
    if not pairs:
        return None
    mine = [answer_tokens(row) for row, _ in pairs]
    theirs = [baseline[key] for _, key in pairs]
    prefixes = [common_prefix(a, b) for a, b in zip(mine, theirs, strict=True)]
    return {
        "answer_tokens": _mean([len(tokens) for tokens in mine]),
        "answer_tokens_uncompressed": _mean([len(tokens) for tokens in theirs]),
        "hit_cap": _mean([float(hit_cap(row)) for row, _ in pairs]),
        "hit_cap_uncompressed": _mean([float(baseline_capped[key]) for _, key in pairs]),
        "stopped_earlier": _mean([float(len(a) < len(b)) for a, b in zip(mine, theirs, strict=True)]),
        "common_prefix": _mean(prefixes),
        "common_prefix_median": float(statistics.median(prefixes)),
        "n": len(pairs),
    }


def against_baseline(out: Path, record: dict, rows: list[dict]) -> dict | None:
    """metrics.json's ``answer_length.against_uncompressed``: :func:`drift_metrics` against the baseline among the
    run directories beside ``out`` (the run's, recorded as ``record``, its config.yaml), with the baseline's
    directory name (``run``); None for an uncompressed run, a run without token ids, or one without a baseline there.
    """
    if record.get("method") == NO_PRESS or own_metrics(rows) is None:
        return None
    found = find_baseline(out.parent, record.get("config", {}), answered_ids(rows))
    drift = drift_metrics(rows, found[1]) if found is not None else None
    return None if drift is None else {**drift, "run": found[0].name}
