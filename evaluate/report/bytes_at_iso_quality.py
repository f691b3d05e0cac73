"""Evict, quantize, or both? The ``bytes_at_iso_quality`` table, in reports that hold a run on a quantized cache.

For each benchmark, model and query-awareness, every run at a compression ratio (uncompressed or evicting; on the
model's own cache or on a quantized one, ``cache=quantized``) is set against the reference: the uncompressed run on
the model's own cache. Each row gives the run's score, its difference from the reference's with a paired bootstrap
95 % interval over the samples both answered, and the KV bytes it held per context (run.json's
``kv_bytes_held_per_context``: a quantized cache's packed bits, scales, zero points and full-precision residual).
Iso-quality in bytes is the fewest bytes per context of a run whose score stays within δ of the reference's (the
absolute threshold of the iso-quality tables, ``--iso-delta``); that run is starred.
"""

import logging
from collections.abc import Sequence

import pandas as pd

from evaluate.report.frame import labelled, run_level
from evaluate.report.runs import RunResult
from evaluate.report.tables import Table, cr_cells, fmt_interval, fmt_mib, fmt_number
from evaluate.score.bootstrap import NoInterval, difference_interval

logger = logging.getLogger(__name__)

NAME = "bytes_at_iso_quality"
_GROUP = ["benchmark", "model", "query_aware", "turn_mode"]


def bytes_table(
    runs: Sequence[RunResult], frame: pd.DataFrame, delta: float, resamples: int = 1000, seed: int = 0
) -> Table | None:
    """The table, None unless a scored run on a quantized cache and its reference are in ``frame``."""
    level = labelled(run_level(frame))
    level = level[level.cr.notna() & level.score.notna() & level.kv_bytes_held_per_context.notna()]
    if not (level.cache != "").any():
        return None
    sections, data = [], []
    for keys, members in level.groupby(_GROUP, sort=True):
        references = members[members.reference & (members.cache == "")]
        if len(references) != 1 or not (members.cache != "").any():
            continue
        rows = _rows(runs, members, references.iloc[0], delta, resamples, seed)
        data.append(rows.assign(**dict(zip(_GROUP, keys, strict=True))))
        sections.append((" · ".join(str(key) for key in keys[:2]) + ("" if not keys[2] else " (query-aware)"), rows))
    if not data:
        return None
    shown = [(heading, _shown(rows)) for heading, rows in sections]
    title = f"Evict, quantize or both: KV bytes per context against the score (★: the fewest bytes within {delta:g})"
    found = pd.concat(data, ignore_index=True)
    return Table(NAME, title, found, shown, _notes(delta, resamples, found.interval_note))


def _rows(runs, members: pd.DataFrame, reference, delta: float, resamples: int, seed: int) -> pd.DataFrame:
    """A row per run of a group, fewest bytes first: its label, cr, cache, score, difference from the reference with
    its interval, bytes per context and their share of the reference's, and whether it stays within ``delta``."""
    members = members.sort_values(["kv_bytes_held_per_context", "label"], kind="stable")
    found = []
    for point in members.itertuples():
        low, high, why = _interval(runs[point.run], runs[reference.run], resamples, seed)
        difference = point.score - reference.score
        found.append(
            {
                "method": point.label,
                "cr": point.cr,
                "cache": point.cache or "model dtype",
                "score": point.score,
                "delta": difference,
                "ci_low": low,
                "ci_high": high,
                "interval_note": why,
                "kv_bytes_held_per_context": point.kv_bytes_held_per_context,
                "bytes_share": point.kv_bytes_held_per_context / reference.kv_bytes_held_per_context,
                "within_delta": difference >= -delta,
            }
        )
    rows = pd.DataFrame(found)
    rows["fewest_bytes_within_delta"] = False
    within = rows.index[rows.within_delta]
    if len(within):
        rows.loc[within[0], "fewest_bytes_within_delta"] = True
    return rows


def _interval(
    run: RunResult, reference: RunResult, resamples: int, seed: int
) -> tuple[float | None, float | None, str]:
    """(low, high, why): the paired interval of the run's score minus the reference's, or why there is none."""
    if run is reference or resamples <= 0:
        return None, None, ""
    try:
        found = difference_interval(
            run.benchmark_object, run.rows, reference.benchmark_object, reference.rows, resamples, seed
        )
    except NoInterval as reason:
        return None, None, str(reason)
    return (None, None, "") if found is None else (found.low, found.high, "")


def _shown(rows: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "method": rows.method + rows.fewest_bytes_within_delta.map({True: " ★", False: ""}),
            "cr": cr_cells(rows),
            "score": rows.score.map(fmt_number),
            "Δ score [95% CI]": [
                fmt_number(delta, signed=True) + fmt_interval(low, high, signed=True)
                for delta, low, high in zip(rows.delta, rows.ci_low, rows.ci_high, strict=True)
            ],
            "KV MiB per context": rows.kv_bytes_held_per_context.map(fmt_mib),
            "bytes vs uncompressed": rows.bytes_share.map(lambda share: f"{100 * share:.1f} %"),
        }
    )


def _notes(delta: float, resamples: int, reasons: pd.Series) -> list[str]:
    interval = (
        f"paired bootstrap 95% interval over the samples both runs answered ({resamples} resamples)"
        if resamples > 0
        else "no intervals (--bootstrap 0)"
    )
    return [
        "Each run against the uncompressed run on the model's own cache, same benchmark, model and samples: "
        f"Δ score = its score − that run's, {interval}. KV MiB per context: what its cache held (a quantized cache's "
        "packed bits, scales and zero points, and its full-precision residual). ★: the fewest bytes of a run whose "
        f"score is at most {delta:g} below the reference's (--iso-delta). Definition: docs/results.md."
    ] + [f"{count} runs: {reason}" for reason, count in reasons[reasons != ""].value_counts().items()]
