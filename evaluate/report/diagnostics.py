"""Why a press fails, by point (``{benchmark}_diagnostics``): each run's score beside its answer retention and
attention recall (evaluate/score/diagnostics.py), and how well each orders the points by score: Spearman's rank
correlation across the compressed points of the benchmark."""

import pandas as pd

from evaluate.report.frame import labelled, run_level
from evaluate.report.tables import Table, cr_cells, fmt_number, kept_columns, kept_shown, kept_types, row_method
from evaluate.score.diagnostics import FIELDS

HEADINGS = {"answer_retention": "answer retention", "attention_recall": "attention recall"}
# Fewer points than this rank nothing worth a correlation.
MIN_POINTS = 3


def spearman(first: pd.Series, second: pd.Series) -> float | None:
    """Spearman's rank correlation (Pearson's on average ranks, ties sharing theirs); None where either is constant."""
    ranks = pd.DataFrame({"first": first.rank(), "second": second.rank()})
    if ranks["first"].nunique() < 2 or ranks["second"].nunique() < 2:
        return None
    return float(ranks["first"].corr(ranks["second"]))


def correlation_notes(runs: pd.DataFrame) -> list[str]:
    """For each diagnostic, Spearman's correlation of the score with it across the compressed points that have both."""
    notes = []
    for name, heading in HEADINGS.items():
        points = runs[~runs.reference].dropna(subset=["score", name])
        if len(points) < MIN_POINTS:
            if len(points):
                notes.append(
                    f"Spearman's ρ(score, {heading}) needs {MIN_POINTS} compressed points; {len(points)} have both."
                )
            continue
        rho = spearman(points.score, points[name])
        shown = "undefined (one of them is constant)" if rho is None else f"{rho:+.2f}"
        notes.append(f"Spearman's ρ(score, {heading}) across {len(points)} compressed points: {shown}.")
    return notes


def diagnostics_table(frame: pd.DataFrame, benchmark: str) -> Table | None:
    """A row per run of ``benchmark`` with a diagnostic: method, cr (or what decides what it keeps), score, answer
    retention, attention recall; with the correlation notes. None where no run has one."""
    level = run_level(frame[frame.benchmark == benchmark])
    present = [name for name in FIELDS if level[name].notna().any()]
    if not present:
        return None
    runs = labelled(level.dropna(subset=present, how="all"))
    runs = runs.sort_values(["model", "method", "variant", "cr", "budget"], kind="stable").reset_index(drop=True)
    models = {"model": runs.model} if runs.model.nunique() > 1 else {}
    shown = pd.DataFrame({"method": runs.label, **models, "cr": cr_cells(runs)})
    shown[kept_columns(runs)] = kept_shown(runs)
    shown["score"] = runs.score.map(fmt_number)
    for name in present:
        shown[HEADINGS[name]] = runs[name].map(lambda share: "-" if pd.isna(share) else f"{100 * share:.1f} %")
    columns = ["benchmark", "model", "method", "query_aware", "cr", *kept_columns(runs), "score", "n", *present]
    data = runs.assign(method=row_method(runs))[columns].astype(kept_types(runs))
    notes = [
        "Answer retention: the share of the reference answer's context positions the compressed cache kept, averaged "
        "over layers and KV heads; attention recall: the share of the uncompressed model's attention on the context, "
        "while it reads the reference answer, that falls on kept positions (docs/metrics.md). Means over the rows "
        "that have them (the answer in the context, the kept set known).",
        *correlation_notes(runs),
    ]
    title = f"Why a press fails on {benchmark}: score, answer retention and attention recall"
    return Table(
        f"{benchmark}_diagnostics", title, data.rename(columns={"cr": "compression_ratio"}), [("", shown)], notes
    )
