"""Tables of the runs frame: Markdown for people and CSV for programs, with the number formats they share; the
headline, per-task and runs tables are pivots of the frame."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from evaluate import rundir
from evaluate.cost_schema import COST_KEYS, cost_metadata
from evaluate.report.frame import labelled, run_level
from evaluate.report.runs import NO_PRESS, flatten
from evaluate.score.likelihood import FIELDS as LIKELIHOOD_FIELDS

# Frame columns that the CSV files name otherwise.
_CSV_NAMES = {"cr": "compression_ratio", "task_score": "score", "task_n": "n"}
# The headline CSV's columns at each ratio: a run's figure, and the suffix of its column name.
_HEADLINE_CSV = {"score": "", "ci_low": " ci_low", "ci_high": " ci_high", "n": " n", "partial": " partial"}
# Below this many contexts per task the percentile bootstrap sees too few distinct resamples to show the noise.
FEW_CONTEXTS = 10


def fmt_number(value: float | None, signed: bool = False) -> str:
    return "-" if pd.isna(value) else format(value, "+.2f" if signed else ".2f")


def fmt_cr(cr: float) -> str:
    return f"cr={rundir.cr_text(cr)}"


def fmt_budget(budget: float) -> str:
    return f"budget={budget:.0f}"


@dataclass(frozen=True)
class Axis:
    """What a headline table's columns are: the compression ratio, or the token budget (``budget=N``) of the runs
    that have one (frame.split_by_axis gives each its runs)."""

    column: str  # the frame's column
    header: Callable[[float], str]  # a column's header
    title: str
    suffix: str  # of the table's file name


RATIO = Axis("ratio", fmt_cr, "compression ratio", "")
BUDGET = Axis("budget", fmt_budget, "token budget (KV pairs kept of each context)", "_budget")


def fmt_interval(low: float | None, high: float | None, signed: bool = False) -> str:
    """`` [low, high]``, or nothing without an interval."""
    return "" if pd.isna(low) else f" [{fmt_number(low, signed)}, {fmt_number(high, signed)}]"


def csv_cell(value: Any) -> str:
    """A value as the CSV files write it: missing as empty, floats rounded to 4 decimals."""
    if isinstance(value, float):
        return "" if math.isnan(value) else repr(round(float(value), 4))
    return "" if value is None or value is pd.NA else str(value)


def markdown_table(frame: pd.DataFrame) -> str:
    """A Markdown table of string cells, the header from the columns."""
    rows = [frame.columns, *frame.to_numpy()]
    header, *lines = ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join([header, "|" + "---|" * len(frame.columns), *lines])


@dataclass
class Table:
    """One table: its CSV rows (``data``) and its Markdown, one table per section under the section's heading."""

    name: str  # file stem under the tables directory
    title: str
    data: pd.DataFrame
    sections: list[tuple[str, pd.DataFrame]] = field(default_factory=list)  # (heading, or "" for none)
    notes: list[str] = field(default_factory=list)

    @property
    def markdown(self) -> str:
        return "\n\n".join((heading and f"{heading}\n\n") + markdown_table(body) for heading, body in self.sections)

    def cells(self) -> pd.DataFrame:
        """``data`` as the strings the CSV file holds."""
        return self.data.astype(object).map(csv_cell)

    @property
    def csv(self) -> str:
        return self.cells().to_csv(index=False, lineterminator="\n")

    def page(self) -> str:
        return "\n\n".join([f"### {self.title}", self.markdown, *self.notes])  # a paragraph per note


def run_cell(run: pd.Series) -> str:
    """``score [low, high] n=N``, with ``*`` when the run is partial."""
    return f"{fmt_number(run.score)}{fmt_interval(run.ci_low, run.ci_high)} n={run.n}" + ("*" if run.partial else "")


def placed_references(runs: pd.DataFrame, axis: Axis = RATIO) -> tuple[list[float], pd.DataFrame]:
    """A table's columns (ratios, or budgets), and its ``no_press`` runs (run level) with the ``column`` each is shown
    in: every ratio of the compressed runs it is the baseline of (evaluate/score/baseline.py), never beside runs of
    other data or settings; one that is the baseline of none (or of a table without compressed runs) in a ``cr=0``
    column."""
    compressed = runs[~runs.reference]
    paired = compressed[["baseline", axis.column]].dropna().drop_duplicates().astype({"baseline": int})
    references = runs[runs.reference]
    placed = references.merge(paired.rename(columns={"baseline": "run", axis.column: "column"}), on="run")
    alone = references[~references.run.isin(placed.run)].assign(column=0.0)
    placed = pd.concat([placed, alone], ignore_index=True).astype({"reference": bool, "column": float})
    return sorted({*compressed[axis.column], *placed.column}), placed


def baseline_notes(runs: pd.DataFrame, axis: Axis = RATIO) -> list[str]:
    """Which compressed runs have no uncompressed baseline, and what a ``cr=0`` column holds."""
    missing = runs[~runs.reference & runs.baseline.isna()]
    if not runs.reference.any():
        return [f"No `{NO_PRESS}` run: run `press=none` for the no-compression row."]
    notes = []
    if not missing.empty:
        notes.append(
            no_baseline_note(", ".join(dict.fromkeys(missing.label + " " + missing[axis.column].map(axis.header))))
        )
    alone = runs.reference & ~runs.run.isin(runs.baseline.dropna())
    if alone.any() and not runs.reference.all():
        notes.append(
            f"{fmt_cr(0.0)}: `{NO_PRESS}` runs that are the baseline of no compressed run here (their data, samples "
            "or settings differ)."
        )
    return notes


def no_baseline_note(listed: str) -> str:
    """The note for the compressed runs ``listed`` that have no uncompressed baseline here."""
    return (
        f"No uncompressed baseline for {listed}: no `{NO_PRESS}` run here has the same data, samples and settings "
        "but the press; run `press=none` with their settings for one."
    )


def row_method(runs: pd.DataFrame) -> pd.Series:
    """The method column of the CSV files: the label where it names a variant or a multi-turn run, else the method."""
    return runs.label.where((runs.variant != "") | (runs.turn_mode != ""), runs.method)


def settings_note(runs: pd.DataFrame) -> list[str]:
    """The benchmark settings every run shares, so that a table says which data it was measured on."""
    first, *others = [flatten(settings) for settings in runs.settings]
    shared = {k: v for k, v in first.items() if k not in ("_target_", "name") and v is not None}
    shared = {k: v for k, v in shared.items() if not isinstance(v, list) and all(flat.get(k) == v for flat in others)}
    return ["Settings: " + ", ".join(f"{key}={value}" for key, value in sorted(shared.items()))] if shared else []


def partial_note(runs: pd.DataFrame) -> list[str]:
    counts = runs.partial_reasons.explode().dropna().value_counts().sort_index()
    listed = "; ".join(f"{reason} ({count} of {len(runs)} runs)" for reason, count in counts.items())
    return [f"\\* partial: fewer samples than the full benchmark: {listed}."] if listed else []


def interval_notes(items: pd.DataFrame) -> list[str]:
    """Why some cells have no interval, once per reason; and a warning when intervals rest on few contexts."""
    counts = items.interval_note[items.interval_note != ""].value_counts().sort_index()
    notes = [f"{note[0].upper()}{note[1:]} ({count} cells)." for note, count in counts.items()]
    fewest = items.contexts.min()
    if pd.notna(fewest) and fewest < FEW_CONTEXTS:
        notes.append(
            f"Some intervals resample only {fewest} contexts per task: with fewer than {FEW_CONTEXTS} the bootstrap "
            "understates the noise; read them as a lower bound on the uncertainty."
        )
    return notes


def headline_table(frame: pd.DataFrame, benchmark: str, axis: Axis = RATIO) -> Table:
    """Rows benchmark x method (x model when several), columns cr (or budget, ``axis``); no compression beside the
    runs it is the baseline of (:func:`placed_references`)."""
    frame = labelled(run_level(frame[frame.benchmark == benchmark]))
    ratios, references = placed_references(frame, axis)
    compressed = frame[~frame.reference]
    placed = pd.concat([compressed.assign(column=compressed[axis.column]), references], ignore_index=True)
    placed = placed.assign(cell=placed.apply(run_cell, axis=1), compressed=~placed.reference, row=row_method(placed))
    keys = ["model", "query_aware", "compressed", "method", "variant", "label", "row"]
    grid = placed.astype(object).pivot(index=keys, columns="column", values=["cell", *_HEADLINE_CSV]).sort_index()
    rows = grid.index.to_frame(index=False)
    models = {"model": rows.model} if frame.model.nunique() > 1 else {}
    md = pd.DataFrame({"benchmark": benchmark, **models, "method": rows.label})
    md[[axis.header(cr) for cr in ratios]] = grid["cell"].fillna("").to_numpy()
    data = rows[["model", "row", "query_aware"]].rename(columns={"row": "method"})
    data.insert(0, "benchmark", benchmark)
    columns = [(value, cr) for cr in ratios for value in _HEADLINE_CSV]
    data[[axis.header(cr) + _HEADLINE_CSV[value] for value, cr in columns]] = grid[columns].to_numpy()
    notes = settings_note(frame) + partial_note(frame) + interval_notes(frame)
    if (frame.score.isna() & frame.answer_kl.notna()).any():
        notes.append("`-` with n: made with generate=false, no answers to score; see the likelihood table.")
    notes += baseline_notes(frame, axis)
    title = f"{benchmark}: headline score by {axis.title}"
    return Table(benchmark + axis.suffix, title, data, [("", md)], notes)


def task_table(frame: pd.DataFrame, benchmark: str) -> Table:
    """Task x method at each compression ratio; each section holds the no-compression columns of its runs'
    baselines (:func:`placed_references`)."""
    frame = labelled(frame[frame.benchmark == benchmark])
    scored = frame.dropna(subset=["task"])
    runs = run_level(frame)
    if runs.model.nunique() > 1:
        runs = runs.assign(label=runs.label + " (" + runs.model + ")")
    partial = scored.partial.map({True: "*", False: ""})
    text = scored.task_score.map(fmt_number) + " n=" + scored.task_n.astype(str) + partial
    cells = scored.assign(text=text).pivot(index="task", columns="run", values="text")
    sections = []
    ratios, references = placed_references(runs)
    for cr in ratios:
        compressed = runs[~runs.reference & (runs.ratio == cr)]
        ordered = compressed.sort_values(["model", "query_aware", "method", "variant"])
        shown = pd.concat([references[references.column == cr].drop(columns="column"), ordered])
        body = cells.reindex(columns=shown.run).fillna("")
        body.loc["**score**"] = shown.score.map(fmt_number).to_numpy()
        section = pd.DataFrame(body.reset_index().to_numpy(), columns=["task", *shown.label])
        sections.append((f"#### {fmt_cr(cr)}", section))
    ordered = scored.sort_values(["cr", "model", "query_aware", "method", "variant", "task"])
    columns = ["benchmark", "model", "method", "query_aware", "cr", "task", "task_score", "task_n", "partial"]
    data = ordered.assign(method=row_method(ordered))[columns].rename(columns=_CSV_NAMES)
    return Table(f"{benchmark}_tasks", f"{benchmark}: per-task scores", data, sections, partial_note(runs))


# A decoding-time run's own columns (config.yaml's decoding): what it compresses to, and how often.
DECODING_COLUMNS = ["target_size", "compression_interval"]


def kept_columns(frame: pd.DataFrame) -> list[str]:
    """What decides what a run keeps, besides cr, where the table lists runs it decides for: ``budget`` for
    token-budget runs, :data:`DECODING_COLUMNS` for decoding-time runs (reports without them keep their columns)."""
    return (["budget"] if frame.budget.notna().any() else []) + (DECODING_COLUMNS if frame.decoding.any() else [])


def kept_types(frame: pd.DataFrame) -> dict[str, str]:
    """:func:`kept_columns` are whole numbers of tokens or steps, missing for the runs they do not decide: the tables
    write 256, not 256.0."""
    return dict.fromkeys(kept_columns(frame), "Int64")


def kept_values(level: pd.DataFrame) -> pd.DataFrame:
    """:func:`kept_columns` of ``level``, as the CSV files hold them (:func:`kept_types`)."""
    return level[kept_columns(level)].astype(kept_types(level))


def kept_shown(level: pd.DataFrame) -> pd.DataFrame:
    """:func:`kept_values` as the Markdown shows them: "-" where the column does not apply."""
    return kept_values(level).astype(object).fillna("-")


def turn_columns(frame: pd.DataFrame) -> list[str]:
    """The ``turns`` and ``history`` columns, where a multi-turn run is listed (reports without one keep their
    columns)."""
    return ["turns", "history"] if (frame.turns != "independent").any() else []


def cr_cells(level: pd.DataFrame) -> pd.Series:
    """Each run's cr as the tables show it; "-" for a token-budget or decoding-time run, which has none (its budget,
    or its target size, is beside it: :func:`kept_columns`)."""
    return level.cr.map(lambda cr: "-" if pd.isna(cr) else fmt_cr(cr))


def kept_cells(level: pd.DataFrame) -> pd.Series:
    """What each run keeps, as a note names it: cr=0.75, budget=256, or target_size=64 (a decoding-time run)."""
    kept = [
        f"target_size={target}" if pd.notna(target) else fmt_cr(cr) if pd.isna(budget) else fmt_budget(budget)
        for cr, budget, target in zip(level.cr, level.budget, level.target_size, strict=True)
    ]
    return pd.Series(kept, index=level.index)


def runs_table(frame: pd.DataFrame) -> Table:
    """Every run with every figure the other tables show, one row each."""
    frame = run_level(frame).sort_values(["benchmark", "model", "method", "variant", "cr", "budget"], kind="stable")
    columns = "benchmark model model_id method variant query_aware".split() + turn_columns(frame)
    columns += ["cr", *kept_columns(frame)]
    columns += "score ci_low ci_high n partial".split()
    columns += "partial_reasons status kept_ratio wall_seconds peak_memory_mb run_dir".split()
    data = frame.assign(partial_reasons=frame.partial_reasons.str.join("; "))[columns].astype(kept_types(frame))
    return Table("runs", "Runs", data.rename(columns=_CSV_NAMES))


def cost_table(frame: pd.DataFrame) -> Table:
    """Every run's cost beside its score, one column per cost key of run.json (evaluate/cost_schema.py): seconds by
    phase, decoding speed, forward passes per question, the KV bytes each context's cache physically held against
    those its press counts as kept, wall time and peak memory."""
    frame = run_level(frame).sort_values(["benchmark", "model", "method", "variant", "cr", "budget"], kind="stable")
    frame = labelled(frame)
    columns = ["benchmark", "model", "method", "variant", "query_aware", *turn_columns(frame), "cr"]
    columns += [*kept_columns(frame), "score"]
    # A cost only some runs measure (prefills per conversation) is a column where one of them is in the table.
    keys = [key for key in COST_KEYS if not cost_metadata(key)["optional"] or frame[key].notna().any()]
    columns += keys
    data = frame[columns].astype(kept_types(frame)).rename(columns=_CSV_NAMES)
    shown_as = {"number": fmt_number, "count": fmt_count, "mib": fmt_mib}
    # A token-budget or decoding-time run has no one ratio, a cr run no budget: "-" in the column that does not apply.
    kept = kept_columns(frame)
    axes = {name: data[name].astype(object).fillna("-") for name in ("compression_ratio", *kept) if kept}
    shown = data.assign(
        score=data.score.map(fmt_number),
        **axes,
        **{key: data[key].map(shown_as[cost_metadata(key)["shown"]]) for key in keys},
    ).rename(columns={key: cost_metadata(key)["column"] for key in keys if cost_metadata(key)["column"]})
    notes = [
        "KV MiB per context: held is what the compressed cache physically stores (masking presses keep every pair), "
        "kept is what the press counts as kept. Seconds are each run's own share of a sweep's shared work."
    ]
    return Table("cost", "Cost beside quality", data, [("", shown)], notes + decoding_notes(frame))


def decoding_notes(level: pd.DataFrame) -> list[str]:
    """What a table of KV bytes says of its decoding-time runs: their bytes are measured, never their recorded cr's,
    and which of them never compressed."""
    if not level.decoding.any():
        return []
    notes = [
        "Decoding-time presses (decoding_*, cam_*) compress the cache to target_size every compression_interval "
        "decoding steps and ignore cr (`-`): their KV bytes are those the answers' last compression left, as measured."
    ]
    return notes + never_compressed_note(level)


def never_compressed_note(level: pd.DataFrame) -> list[str]:
    """Which decoding-time runs of ``level`` never compressed, and why they say nothing of compression."""
    never = level[level.never_compressed]
    if never.empty:
        return []
    listed = ", ".join(dict.fromkeys(never.benchmark + " " + never.label + " " + kept_cells(never)))
    return [
        f"Never compressed: {listed}: no answer grew its cache past target_size, so the press never ran and the run "
        "measured the uncompressed model; it holds quality at no compression."
    ]


def fmt_count(value: float | None) -> str:
    return "-" if pd.isna(value) else f"{value:.0f}"


def fmt_mib(value: float | None) -> str:
    return "-" if pd.isna(value) else f"{value / 2**20:.2f}"


# The likelihood fields as the tables head them.
LIKELIHOOD_HEADINGS = {
    "answer_nll": "answer NLL",
    "answer_nll_uncompressed": "uncompressed NLL",
    "answer_kl": "answer KL",
    "answer_top1": "top-1 agreement",
}


def fmt_likelihood(value: float | None, low: float | None = None, high: float | None = None) -> str:
    """``value [low, high]`` to 3 decimals (the fields are nats and shares, far below 1 where a press does well)."""
    if pd.isna(value):
        return "-"
    return f"{value:.3f}" + ("" if pd.isna(low) else f" [{low:.3f}, {high:.3f}]")


# The likelihood tables' order: by cr, then budgets from the largest (the least compression first).
_LIKELIHOOD_ORDER = ["benchmark", "model", "query_aware", "cr", "budget", "target_size", "method", "variant"]
_LIKELIHOOD_ASCENDING = [True, True, True, True, False, True, True, True]


def likelihood_tables(frame: pd.DataFrame) -> list[Table]:
    """The likelihood fields of every run that has them (evaluate/engine/teacher_forcing.py): ``likelihood``, each
    field's headline (the unweighted mean of its task means) with its bootstrap 95% interval, a row per run; and
    ``likelihood_tasks``, the task means, a row per run x task. None of them without such runs. Runs at a ratio,
    token-budget and decoding-time runs alike: each says what it keeps (:func:`cr_cells`, :func:`kept_columns`)."""
    runs = labelled(run_level(frame).dropna(subset=["answer_kl"]))
    if runs.empty:
        return []
    runs = runs.sort_values(_LIKELIHOOD_ORDER, ascending=_LIKELIHOOD_ASCENDING, kind="stable")
    models = {"model": runs.model} if runs.model.nunique() > 1 else {}
    shown = pd.DataFrame({"benchmark": runs.benchmark, **models, "method": runs.label, "cr": cr_cells(runs)})
    shown[kept_columns(runs)] = kept_shown(runs)
    for name, heading in LIKELIHOOD_HEADINGS.items():
        shown[heading] = [fmt_likelihood(*values) for values in runs[[name, f"{name}_low", f"{name}_high"]].to_numpy()]
    shown["n"] = runs.likelihood_n.astype(str)
    columns = ["benchmark", "model", "method", "query_aware", "cr", *kept_columns(runs)]
    columns += [f"{name}{end}" for name in LIKELIHOOD_FIELDS for end in ("", "_low", "_high")] + ["likelihood_n"]
    data = runs.assign(method=row_method(runs))[columns].astype(kept_types(runs))
    data = data.rename(columns={**_CSV_NAMES, "likelihood_n": "n"})
    notes = [
        "Per sample, the reference answer teacher-forced on the compressed cache: its mean negative log-likelihood "
        "per token (nats), that on the uncompressed cache, the mean KL(uncompressed ‖ compressed) of the next-token "
        "distributions, and the share of answer positions whose most likely token is unchanged (docs/metrics.md). "
        "Each is the unweighted mean of its task means"
        + (
            ", with its bootstrap 95% interval (contexts resampled within each task)."
            if runs.answer_kl_low.notna().any()
            else "."
        )
    ]
    title = "Quality without generation: answer likelihood and divergence from the uncompressed model"
    headline = Table("likelihood", title, data, [("", shown.reset_index(drop=True))], notes + interval_notes(runs))
    tasks = labelled(frame[frame.run.isin(runs.run)]).dropna(subset=["task_answer_kl"])  # labelled as the runs are
    tasks = tasks.sort_values([*_LIKELIHOOD_ORDER, "task"], ascending=[*_LIKELIHOOD_ASCENDING, True], kind="stable")
    task_columns = ["benchmark", "model", "method", "query_aware", "cr", *kept_columns(runs), "task"]
    task_columns += [f"task_{name}" for name in LIKELIHOOD_FIELDS] + ["task_likelihood_n"]
    task_data = tasks.assign(method=row_method(tasks))[task_columns].astype(kept_types(runs))
    task_data = task_data.rename(columns={"cr": "compression_ratio", "task_likelihood_n": "n"})
    task_data = task_data.rename(columns=lambda column: column.removeprefix("task_") if column != "task" else column)
    sections = []
    for benchmark, members in tasks.groupby("benchmark"):
        kl = members.assign(row=members.label + " " + kept_cells(members)).pivot_table(
            index="task", columns="row", values="task_answer_kl", sort=False
        )
        body = kl.map(fmt_likelihood).reset_index()
        sections.append((f"#### {benchmark}: answer KL by task", body))
    return [headline, Table("likelihood_tasks", "Answer KL by task", task_data, sections)]
