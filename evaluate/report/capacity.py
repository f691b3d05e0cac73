"""The serving-capacity table: how many rows (contexts) a device's memory holds at each point, from the KV bytes its
cache physically held per context, against its uncompressed baseline (evaluate/score/baseline.py, the frame's
``baseline`` column), beside the decoding speed the run measured. Token-budget runs (``budget=N``) are rows of their
own, labelled by their budget in a ``budget`` column (where the report has any) instead of a cr.

rows that fit = floor((memory − weights) / KV bytes held per row), memory in GB (10⁹ bytes), 80 by default (an 80 GB
GPU), weights = the bytes the model's parameters held as the run loaded them (run.json's ``model_weights_bytes``,
measured at load). Only the KV cache counts: no
activations, no fragmentation, no framework overhead, so it is an upper bound on the rows a server holds.
"""

import math
from collections.abc import Sequence

import pandas as pd

from evaluate.errors import ConfigError
from evaluate.report.frame import labelled, run_level
from evaluate.report.iso_quality import NO_BASELINE
from evaluate.report.runs import NO_PRESS, RunResult
from evaluate.report.tables import (
    Table,
    cr_cells,
    decoding_notes,
    fmt_mib,
    fmt_number,
    kept_cells,
    kept_columns,
    kept_shown,
    kept_values,
    row_method,
)

NAME = "capacity"
DEFAULT_MEMORY_GB = 80.0
GB = 10**9


def check_memory(memory_gb: float) -> float:
    """``memory_gb`` when it is a finite number of GB above zero; ConfigError in one line otherwise."""
    if not (math.isfinite(memory_gb) and memory_gb > 0):
        raise ConfigError(
            f"--serving-memory-gb {memory_gb:g}: must be a finite number of GB above 0 "
            f"(default: {DEFAULT_MEMORY_GB:g}, an 80 GB GPU)"
        )
    return memory_gb


def rows_that_fit(memory_bytes: float, weights: int | None, bytes_per_row: float | None) -> int | None:
    """floor((memory − weights) / bytes per row), at least 0; None without weights or bytes."""
    if weights is None or bytes_per_row is None or pd.isna(bytes_per_row) or bytes_per_row <= 0:
        return None
    return max(0, math.floor((memory_bytes - weights) / bytes_per_row))


def capacity_table(
    runs: Sequence[RunResult], frame: pd.DataFrame, memory_gb: float = DEFAULT_MEMORY_GB
) -> Table | None:
    """The ``capacity`` table, a row per run (uncompressed runs as their own baseline), None when no run recorded the
    KV bytes its cache held."""
    level = labelled(run_level(frame))
    if level.kv_bytes_held_per_context.isna().all():
        return None
    memory = check_memory(memory_gb) * GB
    level = level.sort_values(
        ["benchmark", "model", "query_aware", "reference", "method", "variant", "cr", "budget", "target_size"],
        ascending=[
            True,
            True,
            True,
            False,
            True,
            True,
            True,
            False,
            False,
        ],  # the largest budget first: least kept last
        kind="stable",
    ).reset_index(drop=True)
    found = _counts(runs, level, memory)
    models = {"model": level.model} if level.model.nunique() > 1 else {}
    shown = pd.DataFrame({"benchmark": level.benchmark, **models, "method": level.label, "cr": cr_cells(level)})
    shown[kept_columns(level)] = kept_shown(level)  # no column where no run has a budget or target size
    shown["weights GB"] = found.weights.map(lambda w: "unknown" if pd.isna(w) else f"{w / GB:.2f}")
    shown["KV MiB held per row"] = level.kv_bytes_held_per_context.map(fmt_mib)
    shown["rows that fit"] = found.rows.map(_count)
    shown["uncompressed rows that fit"] = found.baseline_rows.map(_count)
    shown["× rows"] = found.ratio.map(lambda r: "-" if pd.isna(r) else f"{r:.2f}×")
    shown["decode tokens/s (batch, device)"] = [
        _speed(speed, batch, device)
        for speed, batch, device in zip(level.decode_tokens_per_second, found.batch, found.device, strict=True)
    ]
    data = level[["benchmark", "model"]].assign(method=row_method(level), query_aware=level.query_aware)
    data["compression_ratio"] = level.cr
    data[kept_columns(level)] = kept_values(level)
    data["memory_gb"] = float(memory_gb)
    data["weights_gb"] = found.weights.astype(float) / GB
    data["kv_bytes_held_per_context"] = level.kv_bytes_held_per_context.astype(float)
    data["rows_that_fit"] = found.rows.astype("Int64")
    data["uncompressed_rows_that_fit"] = found.baseline_rows.astype("Int64")
    data["rows_ratio"] = found.ratio.astype(float)
    data["decode_tokens_per_second"] = level.decode_tokens_per_second.astype(float)
    data["decode_batch_size"] = found.batch.astype("Int64")
    data["device"] = found.device.fillna("")
    title = f"Serving capacity: rows whose KV cache fits in {memory_gb:g} GB less the model's weights"
    return Table(NAME, title, data, [("", shown)], _notes(level, found, memory_gb))


def _counts(runs: Sequence[RunResult], level: pd.DataFrame, memory: float) -> pd.DataFrame:
    """Each run's weights, rows that fit, its baseline's rows that fit, their ratio, decode batch and device."""
    held = dict(zip(level.run, level.kv_bytes_held_per_context, strict=True))
    records = []
    for point in level.itertuples():
        run = runs[point.run]
        weights = run.run.get("model_weights_bytes")
        rows = rows_that_fit(memory, weights, point.kv_bytes_held_per_context)
        baseline = point.run if point.reference else (None if pd.isna(point.baseline) else int(point.baseline))
        uncompressed = None if baseline is None else rows_that_fit(memory, weights, held[baseline])
        records.append(
            {
                "weights": weights,
                "rows": rows,
                "baseline_rows": uncompressed,
                "ratio": rows / uncompressed if rows is not None and uncompressed else None,
                # kvpress's pipeline path decodes one row at a time, whatever decode_batch_size says.
                "batch": 1 if answered_by(run) == "pipeline" else run.config.get("decode_batch_size"),
                "device": run.run.get("device"),
            }
        )
    return pd.DataFrame(records, index=level.index)


def answered_by(run: RunResult) -> str | None:
    """The engine path run.json says answered the run (``pool`` or ``pipeline``; None for runs from before it)."""
    return (run.run.get("answered_by") or {}).get("path")


def _count(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{int(value)}"


def _speed(speed, batch, device) -> str:
    if pd.isna(speed):
        return "-"
    where = ", ".join(part for part in (None if pd.isna(batch) else f"batch ≤{int(batch)}", device or None) if part)
    return fmt_number(speed) + (f" ({where})" if where else "")


def _notes(level: pd.DataFrame, found: pd.DataFrame, memory_gb: float) -> list[str]:
    notes = [
        f"Rows that fit = floor(({memory_gb:g} GB − weights) / KV bytes held per row), GB = 10⁹ bytes "
        "(`--serving-memory-gb`); weights = the bytes the model's parameters held as the run loaded them. They "
        "count the KV cache alone: no activations, no fragmentation, no framework overhead, so a server holds fewer. "
        f"Uncompressed: the same for the run's `{NO_PRESS}` baseline (its own for an uncompressed run); × rows: rows "
        "that fit over the uncompressed rows that fit. Definition: docs/results.md#serving-capacity.",
        "Decode tokens/s: what this run measured on its device (run.json's decode_tokens_per_second: generated "
        "tokens over decode seconds) with its decode_batch_size, the most rows it decoded at once; not a serving "
        "throughput at the rows that fit.",
    ]
    missing = level[~level.reference & level.baseline.isna()]
    if not missing.empty:
        listed = ", ".join(dict.fromkeys(missing.benchmark + " " + missing.label + " " + kept_cells(missing)))
        notes.append(
            f"{NO_BASELINE[0].upper()}{NO_BASELINE[1:]} for {listed}: no `{NO_PRESS}` run here has the same data, "
            "samples and settings but the press; run `press=none` with their settings for one."
        )
    unknown = level.model[found.weights.isna()].unique()
    if len(unknown):
        notes.append(
            f"Weights unknown for {', '.join(sorted(unknown))}: runs recorded before run.json measured the model's "
            "weights (model_weights_bytes), so no rows are counted."
        )
    if level.kv_bytes_held_per_context.isna().any():
        notes.append("`-` KV MiB held: the run recorded no kv_bytes_held_per_context (a run made before it existed).")
    full = found.rows.eq(0) & found.weights.notna()
    if full.any():
        notes.append(f"0 rows: the weights alone fill {memory_gb:g} GB.")
    return notes + decoding_notes(level)
