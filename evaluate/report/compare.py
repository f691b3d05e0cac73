"""Measured against published numbers (results/reference/*.csv): the references merged with the runs frame."""

import csv
from collections import namedtuple
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from evaluate.report.differences import differences
from evaluate.report.frame import run_level, runs_frame
from evaluate.report.runs import ReportError, RunResult
from evaluate.report.tables import Table, fmt_number, run_cell

_SCORE_COLUMNS = ("benchmark", "model", "method", "query_aware", "compression_ratio", "score")
_DELTA_COLUMNS = ("benchmark", "model", "method_a", "method_b", "query_aware", "compression_ratio", "delta")
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False, "": False}
_NOTES = ["delta = measured − published. \\* partial run: the measured figure covers fewer samples."]
_RUN_KEYS = ["benchmark", "method", "query_aware"]
_HEADER = ["benchmark", "model", "method", "query_aware", "cr"]  # of the Markdown table's first columns

Reference = namedtuple(  # one published figure: a score, or a difference between two methods when method_b is set
    "Reference", "benchmark settings model method method_b query_aware compression_ratio value metric source file"
)


def _reference(row: dict, is_delta: bool, file: str) -> Reference:
    """A CSV row as a Reference; a ValueError names the malformed field."""
    items = (row.get("benchmark_settings") or "").split(";")
    settings = [item.strip().partition("=") for item in items if item.strip()]
    if malformed := [key for key, sep, _ in settings if not sep]:
        raise ValueError(f"benchmark_settings must be key=value pairs separated by ';', got {malformed[0]!r}")
    if row["query_aware"].strip().lower() not in _BOOLEANS:
        raise ValueError(f"query_aware must be true or false, got {row['query_aware']!r}")
    return Reference(
        benchmark=row["benchmark"],
        settings=tuple((key.strip(), value.strip()) for key, _, value in settings),
        model=row["model"],
        method=row["method_a" if is_delta else "method"],
        method_b=row["method_b"] if is_delta else "",
        query_aware=_BOOLEANS[row["query_aware"].strip().lower()],
        compression_ratio=float(row["compression_ratio"]),
        value=float(row["delta" if is_delta else "score"]),
        metric=row.get("metric", ""),
        source=row.get("source", ""),
        file=file,
    )


def load_references(folder: Path) -> list[Reference]:
    """Rows of every CSV in ``folder`` that carries either the score or the difference columns."""
    files = sorted(folder.glob("*.csv"))
    if not files:
        raise ReportError(f"--compare: no reference CSV in {folder}")
    references = []
    for path in files:
        with path.open(encoding="utf-8", newline="") as handle:
            reader = csv.DictReader(handle)
            is_delta = set(_DELTA_COLUMNS) <= set(reader.fieldnames or [])
            if not is_delta and not set(_SCORE_COLUMNS) <= set(reader.fieldnames or []):
                raise ReportError(
                    f"{path}: needs the columns {', '.join(_SCORE_COLUMNS)} (a score) "
                    f"or {', '.join(_DELTA_COLUMNS)} (a difference)"
                )
            for line, row in enumerate(reader, start=2):
                try:
                    references.append(_reference(row, is_delta, path.name))
                except ValueError as error:
                    raise ReportError(f"{path}:{line}: {error}") from error
    return references


def _matched(references: pd.DataFrame, candidates: pd.DataFrame, keys: list[str], order: str) -> pd.DataFrame:
    """Each reference next to every candidate (run or pair of runs) it describes: the same ``keys``, benchmark
    settings, model and ratio; in the order of the references, then of the candidates' ``order`` column. Models
    match by the last component of their hub id or path, as a local copy of the weights keeps the repo name."""
    merged = references.merge(candidates, on=keys, suffixes=("", "_run"))
    matches = [
        all(str(row.settings_run.get(key)) == value for key, value in row.settings)
        and row.model.rstrip("/").split("/")[-1]
        in {m.rstrip("/").split("/")[-1] for m in (row.model_id, row.model_run)}
        and abs(row.cr - row.compression_ratio) < 5e-4
        for row in merged.itertuples()
    ]
    return merged.loc[matches].sort_values(["reference", order])


def _comparison(found: pd.DataFrame, differences: bool) -> Table:
    """Measured (``score``, shown as ``cell``) next to published, for runs or, for differences, pairs of runs."""
    delta = (found.score - found.value).map(lambda value: None if pd.isna(value) else round(float(value), 2))
    common = pd.DataFrame({"benchmark": found.benchmark, "model": found.model, "method": found.label})
    common = common.assign(query_aware=found.query_aware.map(str).str.lower())
    common = common.assign(compression_ratio=found.cr.map("{:g}".format))
    md = common.set_axis([*_HEADER[:2], "a − b" if differences else "method", *_HEADER[3:]], axis=1)
    md = md.assign(measured=found.cell, published=found.value.map(lambda value: fmt_number(value, signed=differences)))
    md = md.assign(delta=delta.map(lambda value: fmt_number(value, signed=True)), source=found.source)
    data = common.assign(measured=found.score, ci_low=found.ci_low, ci_high=found.ci_high, n=found.get("n"))
    data = data.assign(partial=found.partial, published=found.value, delta=delta, metric=found.metric)
    data = data.assign(source=found.source, reference_file=found.file, run_dir=found.get("run_dir"))
    if differences:  # a pair of runs has no single sample count or directory
        data = data.drop(columns=["n", "run_dir"]).rename(columns={"method": "methods"})
    name, title = ("compare_differences", "differences") if differences else ("compare", "scores")
    return Table(name, f"Measured vs published {title}", data, [("", md)], _NOTES)


def compare_tables(
    runs: Sequence[RunResult], references: Sequence[Reference], resamples: int, seed: int = 0
) -> tuple[list[Table], int]:
    """Measured vs published, side by side; returns the tables and the number of unmatched references."""
    published = pd.DataFrame(references, columns=Reference._fields).rename_axis("reference").reset_index()
    measured = run_level(runs_frame(runs))
    measured = measured.assign(cell=measured.apply(run_cell, axis=1))
    # Published figures ask each question on its own (kvpress's evaluation): a multi-turn run measures another thing.
    measured = measured[measured.turns == "independent"]
    scores = _matched(published[published.method_b == ""], measured, _RUN_KEYS, "run")
    deltas = published[published.method_b != ""]
    if not deltas.empty:
        wanted = deltas[["method", "method_b"]].drop_duplicates().itertuples(index=False)
        # A pair of runs stands for its run a, and keeps the order differences() gives it.
        pairs = pd.concat([differences(runs, a, b, resamples, seed) for a, b in wanted], ignore_index=True)
        pairs = pairs[pairs.turns == "independent"]
        pairs = pairs.rename(columns={f"{name}_a": name for name in ("method", "settings", "model_id", "cr")})
        pairs = pairs.assign(score=pairs.delta, label=pairs.label_a + " − " + pairs.label_b)
        deltas = _matched(deltas, pairs.rename_axis("pair").reset_index(), [*_RUN_KEYS, "method_b"], "pair")
    unmatched = len(published) - len(set(scores.reference) | set(deltas.reference))
    found = [(scores, False), (deltas, True)]
    return [_comparison(table, differences) for table, differences in found if not table.empty], unmatched
