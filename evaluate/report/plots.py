"""Score against compression ratio, in the style of the kvpress leaderboard plot: ``{benchmark}.png``, the headline
score of each method with its bootstrap 95% band and its baseline's score as a dashed line, a panel per model
(and query-awareness); ``{benchmark}_tasks.png``, the same for every task, a small panel each. Partial runs are drawn
with hollow markers. ``{benchmark}_kl.png``: the mean answer KL from the uncompressed model against cr, for runs
with the likelihood fields; ``{benchmark}_answer_length.png``: the mean answer length, the tokens shared with the
uncompressed answer and the share hitting max_new_tokens against cr, for runs that recorded answer token ids;
``{benchmark}_cost.png``: score against the KV bytes held, each point labelled with its
ratio; ``{benchmark}_iso.png``: each method's compression at iso-quality against its baseline;
``{benchmark}_budget.png``: the headline score against token budget, for ``budget=N`` runs, and
``{benchmark}_iso_budget.png`` their smallest budget at iso-quality against their baseline;
``{benchmark}_turns.png``: the score on each turn of the conversations against the turn, for runs whose samples are
turns of conversations (a line per run: multi-turn runs against independent ones). For
needle-in-a-haystack runs also ``{benchmark}_heatmap.png``: the needle score by depth and context length, a panel
per method and compression ratio, each beside its answer retention where the runs have it. On request
(``--kept-map RUN``), ``kept_map_<run>.png``: which context positions one row's compressed cache kept, by layer."""

import math
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import matplotlib
import numpy as np
import pandas as pd

from evaluate import rundir
from evaluate.benchmarks.needle_in_haystack import TASK_SCORE_LABEL, NeedleInHaystack, task_depth
from evaluate.kept_store import read_run_kept
from evaluate.report.frame import QUERY_AWARE, bracketed, cache_mark, labelled, run_level, split_by_axis
from evaluate.report.runs import NO_PRESS, ReportError, read_run
from evaluate.report.turns import turn_benchmarks, turn_points
from evaluate.score.bootstrap import sample_scores

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt  # noqa: E402

_REFERENCE_COLOR = "0.25"
_MARKERS = "osD^vP*Xph"
# Every figure is at most this wide at the dpi it is saved with, so that it reads at 100 %: panels wrap into rows.
MAX_WIDTH_PX = 1800
# A legend beside the panels: its entries wrapped to lines of this many characters at this size, which the inches
# beside the panels hold (a label never widens the figure).
_LEGEND_CHARS = 36
_LEGEND_FONT = 9
_LEGEND_ROOM = 3.1
_DPI = 130  # the figures of one or a few large panels; the many small panels of the grids take 110


class Style(NamedTuple):
    """How one line is drawn, the same in every panel. Lines of equal values lie on top of each other: the line
    drawn first is the widest, with the largest markers, and each later one narrower and smaller on top of it, so
    that every line keeps a visible rim where they coincide (and its own color and marker)."""

    color: tuple
    marker: str
    scale: float  # 1 for the line drawn last, up to 1.7 for the first, drawn under every other


def percent_text(value: float) -> str:
    """A measured share kept, in percent, as a tick reads it: 37.5 %, 100 %."""
    return f"{value:.3g} %"


class XAxis(NamedTuple):
    """What a figure's x axis is: the compression ratio, the token budget of ``budget=N`` runs, or the share of KV
    pairs a decoding-time run kept, as measured."""

    column: str  # the runs frame's column
    label: str
    log: bool  # budgets span orders of magnitude (64, 256, 1024): a log2 axis spaces them evenly
    text: Callable[[float], str] = rundir.cr_text  # a tick's label
    title: str = ""  # what a panel's title adds after the model


CR_AXIS = XAxis("cr", "compression ratio (fraction of KV pairs removed)", False)
BUDGET_AXIS = XAxis("budget", "token budget (KV pairs kept of each context)", True, "{:.0f}".format)
KEPT_AXIS = XAxis(
    "kept_percent",
    "KV pairs kept, measured (% of the uncompressed context)",
    False,
    percent_text,
    ": decoding-time presses",
)


def _lines(
    frame: pd.DataFrame,
    benchmark: str,
    qualified: bool = False,
    axis: XAxis = CR_AXIS,
    values: Sequence[str] = ("score",),
) -> tuple[pd.DataFrame, dict, list[float]]:
    """The rows of ``benchmark`` that have every one of ``values`` to draw, by cr (or ``axis``), with their ``line``
    (method, variant, quantized cache, multi-turn mode, and model and query-awareness when ``qualified`` and several),
    labelled by what tells the drawn runs apart (frame.labelled: a run without points, generate=false's, names
    nothing); one :class:`Style` per line; the ratios (or budgets) of the compressed runs. The rows keep only the
    ``no_press`` runs to draw (:func:`drawn_references`)."""
    rows = labelled(frame[frame.benchmark == benchmark].dropna(subset=list(values)))
    lines = rows.method + rows.variant.map(bracketed) + rows.cache.map(cache_mark) + rows.turn_mode
    if qualified and len(rows[["model", "query_aware"]].drop_duplicates()) > 1:
        lines += " · " + rows.model + rows.query_aware.map(QUERY_AWARE)
    rows = drawn_references(rows.assign(line=lines.map(short_labels(lines))).sort_values(axis.column, kind="stable"))
    styles = line_styles(sorted(rows.line[~rows.reference].unique()))
    return rows, styles, sorted(rows[axis.column][~rows.reference].unique()) or [0.0]


def drawn_references(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with only the ``no_press`` runs a figure draws: those that are the baseline of a compressed row
    (evaluate/score/baseline.py), or all of them where no compressed row is drawn."""
    return rows if rows.reference.all() else rows[~rows.reference | rows.run.isin(rows.baseline.dropna())]


def line_styles(labels: Sequence[str]) -> dict[str, Style]:
    """One :class:`Style` per line label, in the order given: the first drawn widest, under the others."""
    palette = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    steps = max(1, len(labels) - 1)
    return {
        label: Style(palette(i % palette.N), _MARKERS[i % len(_MARKERS)], 1 + 0.7 * (len(labels) - 1 - i) / steps)
        for i, label in enumerate(labels)
    }


_PATH = re.compile(r'"[^"]*/[^"]*"')  # a JSON string in a variant that holds a path (benchmark.path)


def _path_tail(label: str, parts: int) -> str:
    """``label`` with each path in it cut to its last ``parts`` components, where that is shorter."""

    def cut(match: re.Match) -> str:
        tail = '"…/' + "/".join(match.group(0)[1:-1].split("/")[-parts:]) + '"'
        return min(match.group(0), tail, key=len)

    return _PATH.sub(cut, label)


def short_labels(labels: Iterable[str]) -> dict[str, str]:
    """Legend labels that fit a plot: each path in a variant (benchmark.path, often wider than the panel) cut to its
    last components, as few as keep the labels unique, so that every line can still be told apart and found in the
    tables (their labels hold the whole path). Other long labels widen the canvas rather than lose their words."""
    distinct = sorted(set(labels))
    unique = (depth for depth in range(1, 64) if len({_path_tail(label, depth) for label in distinct}) == len(distinct))
    depth = next(unique, 64)
    return {label: _path_tail(label, depth) for label in distinct}


def _draw_points(ax, line: pd.DataFrame, xs: list[float], ys: list[float], style: Style, label: str, size=6):
    """``ys`` against ``xs`` for the runs of ``line``, wider and larger as ``style`` scales it; partial runs get
    hollow markers."""
    width, size = (2 if size > 4 else 1.5) * style.scale, size * style.scale
    ax.plot(xs, ys, "-", color=style.color, linewidth=width, marker=style.marker, markersize=size, label=label)
    for x, y, hollow in zip(xs, ys, line.partial, strict=True):
        if hollow:
            ax.plot(x, y, style.marker, markersize=size, color=style.color, markerfacecolor="white")


def ratio_labels(
    ratios: Sequence[float], text: Callable[[float], str] = rundir.cr_text, across: float = 80
) -> list[str]:
    """Tick labels of ``ratios`` (the tables' cr labels, or ``text``'s), each moved down to the first line where it
    does not touch the label before it on that line (0.998 beside 0.999; 0.9375, 0.96875 and 0.97 on three lines),
    so that no two labels overlap; ``across`` is how many characters of the tick font the axis is wide."""
    span = (max(ratios) - min(ratios)) or 1.0
    ends: list[tuple[float, int]] = []  # each line's last label: its ratio and its length
    labels = []
    for ratio in ratios:
        label = text(ratio)

        def clear(end: tuple[float, int], label: str = label, ratio: float = ratio) -> bool:
            room = max(0.08, ((end[1] + len(label)) / 2 + 1) / across) * span  # half of each label, and a space
            return ratio - end[0] >= room

        line = next((number for number, end in enumerate(ends) if clear(end)), len(ends))
        ends[line : line + 1] = [(ratio, len(label))]
        labels.append("\n" * line + label)
    return labels


def _y_limits(ax, values: Iterable[float | None], score: bool) -> None:
    """Scores are on a 0-100 scale: an axis never shrinks below 0-10, so all-zero panels still read as near zero.
    Missing values (None: no interval, as under --bootstrap 0) do not count. Other quantities (KL in nats) take
    their own range from zero. The axis starts a little below zero so that a line of zeros is drawn above the axis,
    not hidden in it."""
    finite = [value for value in values if value is not None and math.isfinite(value)]
    top = max(finite, default=0.0)
    top = min(105.0, max(10.0, top * 1.12 + 1.0)) if score else max(top * 1.12, 1e-3)
    ax.set_ylim(-0.04 * top, top)


def _style(
    ax,
    ratios: Sequence[float],
    values: Sequence[float],
    fontsize: int = 10,
    score: bool = True,
    axis: XAxis = CR_AXIS,
) -> None:
    """Ticks at ``ratios`` (budgets on a log2 axis where ``axis`` says so), labelled as ``axis`` writes them and
    kept apart (:func:`ratio_labels`, for the characters the panel is wide), the y range, the grid."""
    if axis.log:
        ax.set_xscale("log", base=2)
        ax.set_xlim(min(ratios) / 1.4, max(ratios) * 1.4)
        ax.minorticks_off()
    ax.set_xticks(ratios)
    across = ax.figure.get_figwidth() * ax.get_position().width * 72 / (0.62 * fontsize)  # characters of ~0.6 em
    labels = [axis.text(ratio) for ratio in ratios] if axis.log else ratio_labels(ratios, axis.text, across)
    ax.set_xticklabels(labels, fontsize=fontsize)
    ax.tick_params(axis="y", labelsize=fontsize)
    if not axis.log:
        span = (max(ratios) - min(ratios)) or 0.2
        ax.set_xlim(min(ratios) - 0.08 * span, max(ratios) + 0.08 * span)
    _y_limits(ax, values, score)
    ax.grid(True, alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)


def _score_axes(ax, scores: Iterable[float | None], xlabel: str, ylabel: str, title: str) -> None:
    """A one-panel figure's axes: the score range, the grid, and its labels."""
    ax.tick_params(labelsize=11)
    _y_limits(ax, scores, score=True)
    ax.grid(True, alpha=0.3)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_xlabel(xlabel, fontsize=12)
    ax.set_ylabel(ylabel, fontsize=12)
    ax.set_title(title, fontsize=13)


def _save(fig, path: Path, dpi: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Everything lies inside the figure (the legend beside or under the panels): tight only trims the margins.
    fig.savefig(path, dpi=dpi, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return path


_BREAKS = re.compile(r"[^ /,]+[ /,]?|[ /,]")  # a label's pieces, each with the space, / or , after it


def wrapped(label: str, width: int = _LEGEND_CHARS) -> str:
    """``label`` on lines of at most ``width`` characters, broken after a space, a ``/`` or a ``,`` where it can (a
    path, a list of tasks) and inside a piece longer than a line where it must; every character kept but the spaces
    a line ends on: a legend entry never widens its figure."""
    lines = [""]
    for piece in _BREAKS.findall(label):
        if lines[-1] and len(lines[-1]) + len(piece.rstrip()) > width:
            lines.append("")
        while len(lines[-1]) + len(piece) > width and len(piece.rstrip()) > width:  # longer than any line
            cut = width - len(lines[-1])
            lines[-1] += piece[:cut]
            lines.append("")
            piece = piece[cut:]
        lines[-1] += piece
    return "\n".join(line.rstrip() for line in lines if line.strip())


def _grid(
    count: int,
    width: float,
    height: float,
    dpi: int = _DPI,
    room: float = _LEGEND_ROOM,
    most: int | None = None,
    **options,
):
    """A figure for ``count`` panels of ``width`` x ``height`` inches with ``room`` inches beside them for the legend,
    as many panels to a row (``most`` at most) as keep it within :data:`MAX_WIDTH_PX` at ``dpi`` (a panel narrowed
    to fit where one alone would not), laid out by matplotlib's constrained layout unless ``options`` say otherwise;
    its axes in order, the grid's spare ones hidden."""
    usable = MAX_WIDTH_PX / dpi - room - 0.4  # the saved margins
    width = min(width, usable)
    columns = max(1, min(count, most or count, int(usable // width)))
    rows = math.ceil(count / columns)
    options = {"layout": "constrained", **options}
    fig, axes = plt.subplots(rows, columns, figsize=(columns * width + room, rows * height), squeeze=False, **options)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:count])


def _entries(axes: Iterable) -> dict:
    """The legend entries of ``axes``, once per label in the order first drawn: a line in several panels, or a
    baseline every panel draws, is one entry; lines without points never made one (:func:`_lines`)."""
    entries: dict = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            entries.setdefault(label, handle)
    return entries


def _legend_beside(fig, axes: Iterable, notes: str, path: Path, dpi: int = _DPI) -> Path:
    """The legend of ``axes`` beside the panels, inside the figure, its labels wrapped (the figure grows taller, never
    wider, for a long one), and ``notes`` wrapped under the panels; saved to ``path``."""
    entries = _entries(axes)
    labels = [wrapped(label) for label in entries]
    lines = sum(label.count("\n") + 1 for label in labels)
    fig.set_figheight(max(fig.get_figheight(), 0.8 + 0.19 * lines))
    fig.legend(entries.values(), labels, loc="outside right upper", fontsize=_LEGEND_FONT)
    text = textwrap.fill(notes, int(fig.get_figwidth() * 72 / 5.3))  # 9-point characters of the figure's width
    fig.text(0.01, 0.005, text, fontsize=9, color="0.35", va="bottom")
    bottom = (0.1 + 0.16 * (text.count("\n") + 1)) / fig.get_figheight()
    fig.get_layout_engine().set(rect=(0, bottom, 1, 1 - bottom))
    return _save(fig, path, dpi)


# What a plot against cr can show: a run-level column (with ``{column}_low``/``_high`` or ci_low/ci_high for its
# interval), the axis label, the digits of the reference's value in the legend, and whether it is a 0-100 score.
_SCORE = ("score", "ci_low", "ci_high", "score", 2, True)
_KL = ("answer_kl", "answer_kl_low", "answer_kl_high", "answer KL(uncompressed ‖ compressed), nats", 3, False)


def plot_benchmark(benchmark: str, frame: pd.DataFrame, path: Path) -> Path:
    """Headline score against compression ratio for one benchmark."""
    return _against_cr(benchmark, frame, path, *_SCORE)


def plot_budget(benchmark: str, frame: pd.DataFrame, path: Path) -> Path:
    """Headline score against token budget for the ``budget=N`` runs of one benchmark (frame.split_by_axis)."""
    return _against_cr(benchmark, frame, path, *_SCORE, axis=BUDGET_AXIS)


def plot_decoding(benchmark: str, frame: pd.DataFrame, path: Path) -> Path:
    """Headline score against the share of KV pairs the decoding-time runs of one benchmark kept, as measured (the
    mean of their rows' kept_ratio; frame.split_by_axis's third part): they compress to a target size and ignore cr."""
    return _against_cr(benchmark, frame.assign(kept_percent=frame.kept_ratio * 100), path, *_SCORE, axis=KEPT_AXIS)


def plot_kl(benchmark: str, frame: pd.DataFrame, path: Path) -> Path:
    """Mean answer KL (the likelihood fields' divergence from the uncompressed model) against compression ratio."""
    return _against_cr(benchmark, frame, path, *_KL)


def _against_cr(
    benchmark: str,
    frame: pd.DataFrame,
    path: Path,
    value: str,
    low: str,
    high: str,
    name: str,
    digits: int,
    score: bool,
    axis: XAxis = CR_AXIS,
) -> Path:
    """``value`` of each method against compression ratio (or ``axis``) with its bootstrap band, the
    no-compression value as a dashed line (once per distinct baseline), a panel per model and query-awareness."""
    runs, styles, ratios = _lines(run_level(frame), benchmark, axis=axis, values=[value])
    compressed = runs[~runs.reference]
    panels = runs.sort_values("run").groupby(["model", "query_aware"])
    fig, axes = _grid(panels.ngroups, 7.5, 5.2)
    for ax, ((model, query_aware), members) in zip(axes, panels, strict=True):
        for label, line in compressed[compressed.run.isin(members.run)].groupby("line"):
            xs, ys, lows, highs = (line[column].tolist() for column in (axis.column, value, low, high))
            _draw_points(ax, line, xs, ys, styles[label], label)
            if line[low].isna().any():
                continue
            if len(line) > 1:
                ax.fill_between(xs, lows, highs, color=styles[label].color, alpha=0.15, linewidth=0)
            else:  # a band needs two points; one point gets a whisker, drawn from its bounds alone
                ax.errorbar(
                    xs,
                    [(lows[0] + highs[0]) / 2],
                    yerr=(highs[0] - lows[0]) / 2,
                    fmt="none",
                    capsize=4,
                    color=styles[label].color,
                )
        references = members[members.reference].sort_values("run")
        # One dashed line per distinct baseline: no_press runs of other settings that score the same, with the same
        # interval, are one line, its label saying how many it stands for.
        for _, alike in references.groupby([value, low, high], dropna=False, sort=False):
            first = alike.iloc[0]
            label = f"no compression{first.line.removeprefix(NO_PRESS)} ({first[value]:.{digits}f})"
            if len(alike) > 1:
                label = f"no compression ({first[value]:.{digits}f}): {len(alike)} baselines alike"
            # Under the lines (zorder 1.5): a run that scores as the uncompressed model stays in sight.
            ax.axhline(first[value], color=_REFERENCE_COLOR, linestyle="--", linewidth=1.5, label=label, zorder=1.5)
            if pd.notna(first[low]):
                ax.axhspan(first[low], first[high], color=_REFERENCE_COLOR, alpha=0.08)
        _style(ax, ratios, [*members[value], *members[high]], fontsize=11, score=score, axis=axis)
        ax.set_xlabel(axis.label, fontsize=12)
        ax.set_ylabel(name, fontsize=12)
        ax.set_title(f"{benchmark} — {model}{QUERY_AWARE[query_aware]}{axis.title}", fontsize=13)
    return _finish(fig, axes, runs, "bands and whiskers: bootstrap 95% interval; dashed: ", path)


def plot_turns(benchmark: str, frame: pd.DataFrame, path: Path) -> Path:
    """The score on each turn of the conversations against the turn, one line per run of ``benchmark`` that has a
    score by turn (a method at a cr or budget, a multi-turn run's label saying so: evaluate/report/turns.py); the
    uncompressed baselines dashed."""
    points = drawn_references(turn_points(frame, benchmark))
    compressed, references = points[~points.reference], points[points.reference]
    styles = line_styles(list(dict.fromkeys(compressed.point)))
    fig, (ax,) = _grid(1, 7.5, 5.2)
    for label, line in compressed.groupby("point", sort=False):
        _draw_points(ax, line, line.turn.tolist(), line.turn_score.tolist(), styles[label], label)
    for marker, (label, line) in zip(_MARKERS, references.groupby("point", sort=False), strict=False):
        ax.plot(line.turn, line.turn_score, "--", color=_REFERENCE_COLOR, linewidth=1.5, marker=marker, label=label)
    ax.set_xticks(sorted(points.turn.unique()))
    xlabel = "turn of the conversation (0: its first question)"
    _score_axes(ax, points.turn_score, xlabel, "score on the turn's samples", f"{benchmark}: score by turn")
    return _finish(fig, [ax], points, "multi-turn: one cache across the turns; dashed: ", path)


# The answer-length figure's panels: a run-level column, its axis label, and the baseline's column drawn dashed
# (evaluate/score/answer_length.py): the mean common prefix is bounded by the baseline's mean length.
_ANSWER_LENGTH_PANELS = (
    ("answer_tokens", "mean answer length (tokens)", "answer_tokens"),
    ("common_prefix", "mean common prefix with uncompressed (tokens)", "answer_tokens"),
    ("hit_cap", "share of answers hitting max_new_tokens (%)", "hit_cap"),
)


def plot_answer_length(benchmark: str, frame: pd.DataFrame, path: Path) -> Path:
    """Each method's mean answer length, its mean common prefix with the uncompressed answers and its share of
    answers hitting ``max_new_tokens``, against compression ratio; the uncompressed baseline's length and share
    dashed."""
    runs, styles, ratios = _lines(run_level(frame), benchmark, qualified=True, values=["answer_tokens"])
    runs = runs.assign(hit_cap=runs.hit_cap * 100)
    compressed, references = runs[~runs.reference], runs[runs.reference]
    fig, axes = _grid(len(_ANSWER_LENGTH_PANELS), 5, 4.6)
    for ax, (value, name, baseline) in zip(axes, _ANSWER_LENGTH_PANELS, strict=True):
        for label, line in compressed.dropna(subset=[value]).groupby("line"):
            _draw_points(ax, line, line.cr.tolist(), line[value].tolist(), styles[label], label)
        for reference in references.to_dict("records"):
            text = f"no compression{reference['line'].removeprefix(NO_PRESS)}"
            ax.axhline(reference[baseline], color=_REFERENCE_COLOR, linestyle="--", linewidth=1.5, label=text)
        _style(ax, ratios, [*runs[value], *references[baseline]], fontsize=10, score=value == "hit_cap")
        ax.set_xlabel("compression ratio", fontsize=11)
        ax.set_ylabel(wrapped(name, 30), fontsize=11)
    title = f"{benchmark}: answer length against the uncompressed answers of the same samples"
    fig.suptitle(wrapped(title, 60), fontsize=13)
    notes = "dashed (its mean length left and middle, the most a prefix can share; its share right): "
    return _finish(fig, axes, runs, notes, path)


def _finish(fig, axes: list, runs: pd.DataFrame, notes: str, path: Path) -> Path:
    """The legend beside the panels and the footnote under them (``notes``, then what the plots share), as every
    figure of a benchmark has them; saved to ``path``."""
    notes += "the uncompressed baseline of the runs drawn" + (
        "; hollow markers: partial runs" if runs.partial.any() else ""
    )
    return _legend_beside(fig, axes, notes, path)


def plot_task_grid(benchmark: str, frame: pd.DataFrame, path: Path) -> Path:
    """One small panel per task: task score against compression ratio, one line per method."""
    rows, styles, ratios = _lines(frame, benchmark, qualified=True)
    tasks = sorted(rows.task.dropna().unique())
    compressed = rows[~rows.reference]
    # One y-scale for every panel, so that panels compare at a glance and a task's low scores look low. Fixed
    # margins (layout=None): a layout engine measures every tick label of every panel and costs more than the drawing.
    fig, axes = _grid(len(tasks), 3.6, 2.9, dpi=110, room=0, layout=None, sharey=True)
    for ax, task in zip(axes, tasks, strict=True):
        for label, style in styles.items():  # every method, drawn empty where it lacks the task
            line = compressed[(compressed.line == label) & (compressed.task == task)]
            _draw_points(ax, line, line.cr.tolist(), line.task_score.tolist(), style, label, 4)
        for score in rows[rows.reference & (rows.task == task)].sort_values("run").task_score.dropna().unique():
            ax.axhline(score, color=_REFERENCE_COLOR, linestyle="--", linewidth=1.2, label="no compression")
        ax.set_title(f"{task} (n≤{rows.task_n[rows.task == task].max()})", fontsize=10)
        _style(ax, ratios, rows.task_score.tolist(), fontsize=8)
    entries = _entries(axes[:1])
    labels = [wrapped(label) for label in entries]
    width, height = fig.get_size_inches()
    columns = max(1, min(4, len(labels), int(width // 3.3)))  # entries of 36 characters, 3.3 inches each
    legend = 0.3 + 0.19 * sum(
        max(label.count("\n") + 1 for label in labels[start : start + columns])
        for start in range(0, len(labels), columns)
    )
    height += 0.65 + 0.45 + legend  # the title above; the last row's tick labels and the legend below
    fig.set_figheight(height)
    fig.legend(entries.values(), labels, loc="lower center", ncol=columns, fontsize=_LEGEND_FONT)
    fig.suptitle(f"{benchmark}: task score against compression ratio", fontsize=12)
    fig.subplots_adjust(
        left=0.5 / width,
        right=1 - 0.15 / width,
        top=1 - 0.65 / height,
        bottom=(0.45 + legend) / height,
        wspace=0.25,
        hspace=0.45,
    )
    return _save(fig, path, dpi=110)


NEEDLE_TARGET = f"{NeedleInHaystack.__module__}.{NeedleInHaystack.__qualname__}"
# The settings a needle sweep varies are the heatmap's axes; removed from a run's variant, what is left of it (a seed,
# a window size) tells panels apart. Their values are ints, lists of ints or null, so none holds a ", ".
_NEEDLE_AXES = re.compile(
    r"(?:benchmark\.depth|benchmark\.context_length|max_context_length)=(?:\[[^\]]*\]|[^,]*)(?:, )?"
)


def needle_benchmarks(frame: pd.DataFrame) -> list[str]:
    """The benchmarks of the frame whose runs are needle-in-a-haystack runs."""
    needle = frame.settings.map(lambda settings: settings.get("_target_") == NEEDLE_TARGET)
    return sorted(frame.benchmark[needle].unique())


def needle_grids(frame: pd.DataFrame, benchmark: str, values: str = "task_score") -> dict[str, pd.DataFrame]:
    """The needle score (or another task column, ``values``, ``task_answer_retention``) of ``benchmark``'s runs as
    one depth x context-length matrix per panel, by panel title.

    A panel is a method (with what else tells its runs apart, and query-awareness) at one compression ratio, and one
    model where there are several. Rows are the depths (a run's tasks), columns the context lengths (its recorded
    ``context_length``), both ascending and the same in every panel; a cell is the task score, NaN where no run
    measured the pair, the mean where several did (a run with a list of depths and one with a single depth).
    """
    rows = frame[(frame.benchmark == benchmark) & frame.task.notna()]
    lengths = rows.settings.map(lambda settings: settings.get("context_length"))
    rows = rows.assign(depth=rows.task.map(task_depth), length=lengths)[lengths.notna()].astype({"length": int})
    rows = labelled(rows)
    variant = rows.variant.str.replace(_NEEDLE_AXES, "", regex=True).str.rstrip(", ").map(bracketed)
    title = rows.method.mask(rows.reference, "no compression") + variant + rows.query_aware.map(QUERY_AWARE)
    title += rows.turn_mode
    if rows.model.nunique() > 1:
        title = rows.model + " · " + title
    rows = rows.assign(title=title + rows.cr.map(lambda cr: f" · cr={cr:g}").mask(rows.reference, ""))
    depths, columns = sorted(rows.depth.unique()), sorted(rows.length.unique())
    ordered = rows.sort_values(
        ["model", "query_aware", "reference", "method", "cr", "title"], ascending=[True, True, False, True, True, True]
    )
    return {
        title: panel.pivot_table(index="depth", columns="length", values=values, aggfunc="mean", dropna=False)
        .reindex(index=depths, columns=columns)
        .rename_axis(index="depth", columns="context_length")
        for title, panel in ordered.groupby("title", sort=False)
    }


def plot_needle_heatmap(benchmark: str, frame: pd.DataFrame, path: Path) -> Path:
    """One depth x context-length heatmap of the needle score per panel of :func:`needle_grids`, each beside the
    same of its answer retention (in %) where the runs have it."""
    grids = needle_grids(frame, benchmark)
    retention = needle_grids(frame, benchmark, "task_answer_retention")
    shown = frame[frame.benchmark == benchmark].task_answer_retention.notna().any()
    if shown:
        grids = {
            f"{title}{suffix}": grid
            for title, score in grids.items()
            for suffix, grid in (("", score), (" · answer retention", 100 * retention[title]))
        }
    first = next(iter(grids.values()))
    panel_width, panel_height = 1.6 + 0.8 * len(first.columns), 1.2 + 0.4 * len(first.index)
    most = 2 if shown else 3  # a panel's score and retention side by side
    # Room beside the panels for the color bar; the constrained layout makes room for every panel's tick labels.
    fig, axes = _grid(
        len(grids), max(panel_width, 5.3 / min(most, len(grids))), panel_height, dpi=110, room=1.2, most=most
    )
    fig.set_figheight(fig.get_figheight() + 0.8)  # the title
    colors = plt.get_cmap("RdYlGn").with_extremes(bad="0.85")  # grey: a pair no run measured
    for ax, (title, grid) in zip(axes, grids.items(), strict=True):
        values = grid.to_numpy(dtype=float)
        image = ax.imshow(values, cmap=colors, vmin=0, vmax=100, aspect="auto")
        for (row, column), value in np.ndenumerate(values):
            if not math.isnan(value):
                ax.text(column, row, f"{value:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(grid.columns)), [str(length) for length in grid.columns], fontsize=8)
        ax.set_yticks(range(len(grid.index)), [f"{depth}%" for depth in grid.index], fontsize=8)
        ax.set_xlabel("context length (tokens)", fontsize=9)
        ax.set_ylabel("needle depth", fontsize=9)
        ax.set_title(wrapped(title, 44), fontsize=10)
    label = f"{TASK_SCORE_LABEL}; answer retention (%)" if shown else TASK_SCORE_LABEL
    fig.colorbar(image, ax=axes, shrink=0.9, label=label)
    what = f"{TASK_SCORE_LABEL} and answer retention" if shown else TASK_SCORE_LABEL
    fig.suptitle(f"{benchmark}: {what}\nby needle depth and context length (grey: no run)", fontsize=11)
    return _save(fig, path, dpi=110)


def plot_cost(benchmark: str, frame: pd.DataFrame, path: Path) -> Path:
    """Headline score against the KV bytes a context's cache physically held, one line per method, each point
    labelled with its ratio (a decoding-time run's with the share it kept, measured, never its recorded cr); the
    uncompressed baseline is the point at the full cache."""
    runs, styles, _ = _lines(run_level(frame), benchmark, values=["score", "kv_bytes_held_per_context"])
    runs = runs.assign(mib=runs.kv_bytes_held_per_context / 2**20)
    fig, (ax,) = _grid(1, 7.5, 5.2)
    for label, line in runs[~runs.reference].groupby("line"):
        line = line.sort_values("mib")
        _draw_points(ax, line, line.mib.tolist(), line.score.tolist(), styles[label], label)
    _ratio_labels(ax, runs[~runs.reference & runs.score.notna()])
    for reference in runs[runs.reference].itertuples():
        label = f"no compression{reference.line.removeprefix(NO_PRESS)} ({reference.score:.2f})"
        ax.plot(reference.mib, reference.score, "s", color=_REFERENCE_COLOR, markersize=8, label=label)
    ax.set_xscale("log")
    title = f"{benchmark}: score against the memory the cache really holds"
    _score_axes(ax, runs.score, "KV cache held per context (MiB, log scale)", "score", title)
    notes = "labels: compression ratio, or a decoding-time press's measured share kept; square: "
    return _finish(fig, [ax], runs, notes if runs.decoding.any() else "labels: compression ratio; square: ", path)


def _ratio_labels(ax, runs: pd.DataFrame) -> None:
    """Each point's cr beside it, once where points of several lines coincide (same ratio, score and, within 5 %,
    bytes); labels alternate above and below in the order of the bytes, so that neighbours (cr 0.998 and 0.999,
    whose caches differ by half) never overlap."""
    placed: list[tuple[float, float, str]] = []
    for point in runs.sort_values(["mib", "cr"]).itertuples():
        # A decoding-time press ignores cr: its label is what it kept, as measured (frame.decoding_fields).
        text = f"kept {100 * point.kept_ratio:.0f} %" if point.decoding else rundir.cr_text(point.cr)
        if any(t == text and y == point.score and abs(math.log(x / point.mib)) < 0.05 for x, y, t in placed):
            continue
        offset = (0, 9) if len(placed) % 2 == 0 else (0, -15)
        ax.annotate(text, (point.mib, point.score), xytext=offset, textcoords="offset points", ha="center", fontsize=9)
        placed.append((point.mib, point.score, text))


# How the iso-quality figure marks each threshold's cr (evaluate/score/iso_quality.py).
_ISO_MARKERS = {"absolute": "v", "relative": "^"}
_ISO_NOTES = {
    "cr": "▼ / ▲: the largest cr within the absolute / relative threshold (hollow: ≥ the largest or < the smallest "
    "cr); bar: its bootstrap 95% interval",
    "budget": "▼ / ▲: the smallest budget within the absolute / relative threshold (hollow: ≤ the smallest or > the "
    "largest budget); bar: its bootstrap 95% interval",
}


def _iso_measured(series: pd.DataFrame | None, benchmark: str) -> pd.DataFrame:
    """The series of ``benchmark`` that have an iso-quality cr (a baseline to compare with)."""
    if series is None or series.empty or "absolute" not in series:
        return pd.DataFrame()
    chosen = series[series.benchmark == benchmark]
    return chosen[chosen.absolute.map(lambda value: value is not None and not isinstance(value, float))]


def plot_iso(
    benchmark: str, series: pd.DataFrame, thresholds: dict[str, float], path: Path, axis: XAxis = CR_AXIS
) -> Path:
    """Score against cr (or token budget, ``axis``) for each series of the iso-quality table (those with a
    baseline), a panel per model and query-awareness: the baseline dashed with the band down to the lower of the two
    thresholds shaded and each threshold dotted, and each series' iso-quality cr (or budget) marked on its threshold
    (▼ absolute, ▲ relative; hollow where it is a bound, ≥ or < for a cr, ≤ or > for a budget, rather than a
    crossing) with its interval as a bar from its low to its high bound (:func:`_interval_bar`)."""
    labels = sorted(series.label.unique())
    palette = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    colors = {label: palette(i % palette.N) for i, label in enumerate(labels)}
    panels = series.groupby(["model", "query_aware"], sort=True)
    fig, axes = _grid(panels.ngroups, 7.5, 5.2)
    ratios = sorted({cr for crs in series.ratios for cr in crs})
    for ax, ((model, query_aware), members) in zip(axes, panels, strict=True):
        values = []
        for baseline, lines in members.groupby("baseline_score", sort=True):
            floor = min(baseline - thresholds["absolute"], thresholds["relative"] * baseline)
            ax.axhline(
                baseline,
                color=_REFERENCE_COLOR,
                linestyle="--",
                linewidth=1.5,
                zorder=1.5,
                label=f"no compression ({baseline:.2f})",
            )
            ax.axhspan(floor, baseline, color=_REFERENCE_COLOR, alpha=0.08)
            for name, value in thresholds.items():
                level = baseline - value if name == "absolute" else value * baseline
                text = f"− {value:g}" if name == "absolute" else f"× {value:g}"
                style = ":" if name == "absolute" else "-."
                ax.axhline(level, color=_REFERENCE_COLOR, linestyle=style, linewidth=1, label=f"baseline {text}")
            values += [baseline]
            for line in lines.itertuples():
                color = colors[line.label]
                ax.plot(line.ratios, line.scores, "-o", color=color, linewidth=2, markersize=5, label=line.label)
                values += list(line.scores)
                for name, marker in _ISO_MARKERS.items():
                    found = getattr(line, name)
                    level = baseline - thresholds[name] if name == "absolute" else thresholds[name] * baseline
                    face = color if found.mark in ("interpolated", "measured") else "white"
                    ax.plot([found.cr], [level], marker, color=color, markerfacecolor=face, markersize=10)
                    interval = getattr(line, f"{name}_interval")
                    if interval is not None and not isinstance(interval, float):  # its bootstrap interval
                        _interval_bar(ax, interval.low, interval.high, level, color)
        _style(ax, ratios, values, fontsize=11, axis=axis)
        ax.set_xlabel(axis.label, fontsize=12)
        ax.set_ylabel("score", fontsize=12)
        ax.set_title(f"{benchmark} — {model}{QUERY_AWARE[query_aware]}: iso-quality", fontsize=13)
    return _legend_beside(fig, axes, _ISO_NOTES[axis.column], path)


def _interval_bar(ax, low: float, high: float, level: float, color) -> None:
    """An interval on the x axis at height ``level``, drawn from its own bounds with a cap at each: the estimate it
    belongs to may lie outside it (a bound's draws, an interpolation's skew), so it is never a distance from that."""
    ax.plot([low, high], [level, level], "-", color=color, linewidth=1.5, marker="|", markersize=9)


def plot_all(
    frame: pd.DataFrame,
    out: Path,
    iso_series: pd.DataFrame | None = None,
    iso_budget_series: pd.DataFrame | None = None,
) -> list[Path]:
    """For every benchmark of the runs frame: both score figures where its runs have scores (``generate=false``
    runs have none), the answer KL against cr where they have the likelihood fields, the score against KV bytes
    where runs recorded them, the iso-quality figure where ``iso_series`` (the iso-quality table's series) has a
    series with a baseline; the score against token budget where runs have one (``budget=N``), with its
    iso-quality figure where ``iso_budget_series`` (the iso_quality_budget table's series) has a series with a
    baseline; the score by turn where runs have one; and the heatmap of needle runs. Returns the files written."""
    # Runs at a ratio and token-budget runs are points of one figure by turn.
    written = [plot_turns(name, frame, out / f"{name}_turns.png") for name in turn_benchmarks(frame)]
    frame, by_budget, by_decoding = split_by_axis(frame)
    for name in sorted(by_budget.benchmark[by_budget.score.notna() & by_budget.budget.notna()].unique()):
        written.append(plot_budget(name, by_budget, out / f"{name}_budget.png"))
        measured = _iso_measured(iso_budget_series, name)
        if not measured.empty:
            thresholds, path = iso_budget_series.attrs["thresholds"], out / f"{name}_iso_budget.png"
            written.append(plot_iso(name, measured, thresholds, path, BUDGET_AXIS))
    for name in sorted(by_decoding.benchmark[by_decoding.score.notna() & by_decoding.decoding].unique()):
        written.append(plot_decoding(name, by_decoding, out / f"{name}_decoding.png"))
    for name, runs in frame.groupby("benchmark"):
        scored = runs.score.notna().any()
        # The cost figure reads measured bytes: decoding-time runs are points of it too.
        held = pd.concat([runs, by_decoding[(by_decoding.benchmark == name) & by_decoding.decoding]])
        plots = [(plot_benchmark, runs, ""), (plot_task_grid, runs, "_tasks")] if scored else []
        plots += [(plot_cost, held, "_cost")] if scored and runs.kv_bytes_held_per_context.notna().any() else []
        plots += [(plot_kl, runs, "_kl")] if runs.answer_kl.notna().any() else []
        plots += [(plot_answer_length, runs, "_answer_length")] if runs.answer_tokens.notna().any() else []
        written += [plot(name, runs, out / f"{name}{suffix}.png") for plot, runs, suffix in plots]
        measured = _iso_measured(iso_series, name)
        if not measured.empty:
            written.append(plot_iso(name, measured, iso_series.attrs["thresholds"], out / f"{name}_iso.png"))
    return written + [
        plot_needle_heatmap(name, frame, out / f"{name}_heatmap.png") for name in needle_benchmarks(frame)
    ]


def _mark_answer(ax, positions: np.ndarray) -> None:
    """The answer's tokens outlined in red over the whole height, and named above the axes."""
    for start, end in _runs(positions):
        ax.axvspan(start - 0.5, end + 0.5, facecolor="none", edgecolor="red", lw=1.4)
    middle = float(positions.mean())
    ax.annotate("answer", (middle, 1.0), xycoords=("data", "axes fraction"), xytext=(0, 3),
                textcoords="offset points", ha="center", va="bottom", color="red", fontsize=8)  # fmt: skip


def _runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive positions as (first, last) runs."""
    breaks = np.flatnonzero(np.diff(positions) != 1)
    starts, ends = np.r_[positions[:1], positions[breaks + 1]], np.r_[positions[breaks], positions[-1:]]
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


# The kept map's close-up: this many positions either side of the answer.
_CLOSE_UP = 48


def plot_kept_map(run: Path, sample: str | None, path: Path) -> Path:
    """The kept map of one row of ``run`` (its kept set stored by ``save_kept=true``): layers by context position,
    the share of KV heads keeping each position, the answer's span outlined, and beneath, where the answer is in the
    context, a close-up of the positions around it; ``sample`` None: the first stored row whose answer is in its
    context. The title names the press, its ratio, the run's score and the sample's."""
    stored = read_run_kept(run)
    if not stored:
        raise ReportError(f"{run} stored no kept sets: rerun it with save_kept=true (and overwrite=true if finished)")
    if sample is None:
        sample = next((name for name, kept in stored.items() if kept.answer_positions.size), next(iter(stored)))
    if sample not in stored:
        raise ReportError(f"{run} stored no kept set of sample {sample}; it stored e.g. {next(iter(stored))}")
    kept = stored[sample]
    shares = kept.mask.mean(axis=1)  # [layers, positions]
    answer = np.sort(kept.answer_positions)
    finished = read_run(run)
    row = next((row for row in finished.rows if row["id"] == sample), None)
    row_score = (
        sample_scores(finished.benchmark_object, [row])[0] if row and row.get("prediction") is not None else None
    )
    height = 1.2 + 0.12 * shares.shape[0]
    panels = 2 if answer.size else 1
    fig, axes = plt.subplots(panels, 1, figsize=(11, height * panels + 0.4), layout="constrained", squeeze=False)
    low = max(0, int(answer[0]) - _CLOSE_UP) if answer.size else 0
    high = min(shares.shape[1], int(answer[-1]) + _CLOSE_UP + 1) if answer.size else shares.shape[1]
    views = [(axes[0, 0], 0, shares.shape[1], "context position (token)")]
    views += [(axes[1, 0], low, high, "context position (token), around the answer")] if answer.size else []
    for ax, first, last, label in views:
        image = ax.imshow(
            shares[:, first:last], cmap="viridis", vmin=0, vmax=1, aspect="auto", interpolation="nearest",
            extent=(first - 0.5, last - 0.5, shares.shape[0] - 0.5, -0.5),
        )  # fmt: skip
        if answer.size:
            _mark_answer(ax, answer)
        ax.set_xlabel(label, fontsize=9)
        ax.set_ylabel("layer", fontsize=9)
    fig.colorbar(image, ax=axes[:, 0], label="share of KV heads keeping it", shrink=0.9)
    ratio, score = finished.record.get("compression_ratio"), finished.score
    ratio_text = "" if ratio is None else f" · cr={ratio:g}"
    score_text = "" if score is None else f" · run score {score:.2f}"
    score_text += "" if row_score is None else f" · this sample {row_score:.0f}"
    kept_text = f" · kept {100 * kept.mask.mean():.1f} % of the context"
    retained = f", {100 * kept.mask[:, :, answer].mean():.1f} % of the answer's tokens" if answer.size else ""
    title = f"{finished.method}{ratio_text}{score_text} · sample {sample}{kept_text}{retained}"
    fig.suptitle(wrapped(title, 120), fontsize=10)
    return _save(fig, path, dpi=_DPI)
