"""The decoding-time table of a benchmark (``{benchmark}_decoding``): runs of kvpress's decoding-time presses
(``decoding_*``, ``cam_*``: its ``DecodingPress``), which compress the cache to ``target_size`` pairs every
``compression_interval`` decoding steps and ignore cr, read by what they kept rather than by a ratio they never
applied.

A run is decoding-time where its config.yaml records ``decoding: {target_size, compression_interval}`` (and
``compression_ratio: null``); runs recorded before that stay under their recorded cr. What a run kept is measured:
the mean of its rows' ``kept_ratio``, the share of the uncompressed context's KV pairs that each answer's last
compression left (1 where it never compressed). A run none of whose rows was compressed (run.json's
``decoding.rows_compressed`` is 0; without it, every row kept 1) measured the uncompressed model: it is flagged, and
it holds quality at no compression.
"""

import pandas as pd

from evaluate.report.frame import labelled, run_level
from evaluate.report.runs import NO_PRESS
from evaluate.report.tables import (
    Table,
    fmt_number,
    interval_notes,
    kept_cells,
    never_compressed_note,
    no_baseline_note,
    partial_note,
    row_method,
    run_cell,
    settings_note,
)

_ORDER = ["model", "query_aware", "method", "variant", "compression_interval", "target_size"]


def fmt_kept(ratio: float | None) -> str:
    """A measured kept share as a percentage of the uncompressed context's pairs."""
    return "-" if pd.isna(ratio) else f"{100 * ratio:.1f} %"


def decoding_table(frame: pd.DataFrame, benchmark: str) -> Table:
    """A row per decoding-time run of ``benchmark`` (frame.split_by_axis's third part: the runs and their
    baselines): method, target_size, compression_interval, the measured kept share, the score with its interval,
    its uncompressed baseline's score and the difference, and whether it never compressed."""
    level = run_level(frame[frame.benchmark == benchmark])
    scores = dict(zip(level.run, level.score, strict=True))
    runs = labelled(level[level.decoding]).sort_values(_ORDER, kind="stable").reset_index(drop=True)
    baseline = runs.baseline.map(lambda run: scores.get(run) if pd.notna(run) else None).astype(float)
    models = {"model": runs.model} if runs.model.nunique() > 1 else {}
    shown = pd.DataFrame({"method": runs.label, **models})
    shown = shown.assign(target_size=runs.target_size, compression_interval=runs.compression_interval)
    shown["kept (measured)"] = runs.kept_ratio.map(fmt_kept)
    shown["score"] = runs.apply(run_cell, axis=1)
    shown["uncompressed"] = baseline.map(fmt_number)
    shown["− uncompressed"] = (runs.score - baseline).map(lambda value: fmt_number(value, signed=True))
    shown["never compressed"] = runs.never_compressed.map({True: "yes", False: ""})
    data = runs[["benchmark", "model"]].assign(method=row_method(runs), query_aware=runs.query_aware)
    data = data.assign(target_size=runs.target_size, compression_interval=runs.compression_interval)
    data = data.assign(kept_ratio=runs.kept_ratio.astype(float), score=runs.score, ci_low=runs.ci_low)
    data = data.assign(ci_high=runs.ci_high, n=runs.n, partial=runs.partial, baseline_score=baseline)
    data = data.assign(delta=runs.score - baseline, never_compressed=runs.never_compressed)
    data = data.assign(rows_compressed=runs.rows_compressed)
    title = f"{benchmark}: decoding-time presses by the KV cache they kept"
    return Table(f"{benchmark}_decoding", title, data, [("", shown)], _notes(runs, level))


def _notes(runs: pd.DataFrame, level: pd.DataFrame) -> list[str]:
    notes = [
        "Decoding-time presses compress the cache to target_size KV pairs every compression_interval decoding steps, "
        "whatever cr says. Kept (measured): the mean over rows of the share of the uncompressed context's KV pairs "
        "that the answer's last compression left (100 % where it never compressed). Uncompressed: the score of the "
        f"run's `{NO_PRESS}` baseline; − uncompressed: the difference. Definition: "
        "docs/results.md#decoding-time-presses."
    ]
    notes += never_compressed_note(runs)
    missing = runs[runs.baseline.isna()]
    if not missing.empty:
        notes.append(no_baseline_note(", ".join(dict.fromkeys(missing.label + " " + kept_cells(missing)))))
    return notes + settings_note(level) + partial_note(runs) + interval_notes(runs)
