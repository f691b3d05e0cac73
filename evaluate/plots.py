"""Score against compression ratio, in the style of the kvpress leaderboard plot.

- ``{benchmark}.png``: headline score against cr, one line per method, its bootstrap 95% band, and the
  no-compression score as a dashed horizontal line; one panel per model (and per query-awareness).
- ``{benchmark}_tasks.png``: the same lines for every task, one small panel each.

Partial runs are drawn with hollow markers.
"""

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from evaluate.report import RunResult

_REFERENCE_COLOR = "0.25"


_MARKERS = "osD^vP*Xph"


def _styles(labels: Sequence[str]) -> dict[str, tuple[tuple, str]]:
    """One color and marker per method label, the same in every panel and figure; the marker tells apart
    lines that lie on top of each other."""
    palette = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    return {label: (palette(i % palette.N), _MARKERS[i % len(_MARKERS)]) for i, label in enumerate(sorted(labels))}


def _panels(runs: Sequence["RunResult"]) -> dict[tuple[str, bool], list["RunResult"]]:
    panels: dict[tuple[str, bool], list[RunResult]] = defaultdict(list)
    for run in runs:
        panels[(run.model, run.query_aware)].append(run)
    return dict(sorted(panels.items()))


def _lines(runs: Sequence["RunResult"]) -> dict[str, list["RunResult"]]:
    """Compressed runs by method label, each sorted by compression ratio."""
    lines: dict[str, list[RunResult]] = defaultdict(list)
    for run in runs:
        if not run.is_reference:
            lines[_method_label(run)].append(run)
    return {label: sorted(members, key=lambda r: r.compression_ratio) for label, members in sorted(lines.items())}


def _method_label(run: "RunResult") -> str:
    return run.method + (f" [{run.variant}]" if run.variant else "")


def _draw_points(ax, xs, ys, partial, style, label, size=6):
    color, marker = style
    ax.plot(xs, ys, "-", color=color, linewidth=2 if size > 4 else 1.5, marker=marker, markersize=size, label=label)
    for x, y, hollow in zip(xs, ys, partial, strict=True):
        if hollow:
            ax.plot(x, y, marker, markersize=size, color=color, markerfacecolor="white")


def _draw_reference(ax, reference: "RunResult", with_band: bool, label: str | None) -> None:
    if reference.score is None:
        return
    ax.axhline(reference.score, color=_REFERENCE_COLOR, linestyle="--", linewidth=1.5, label=label)
    if with_band and reference.interval is not None:
        ax.axhspan(reference.interval.low, reference.interval.high, color=_REFERENCE_COLOR, alpha=0.08)


def _style(ax, ratios: Sequence[float], top: float, fontsize: int = 10) -> None:
    ax.set_xticks(ratios)
    ax.set_xticklabels([f"{r:g}" for r in ratios], fontsize=fontsize)
    ax.tick_params(axis="y", labelsize=fontsize)
    span = (max(ratios) - min(ratios)) or 0.2
    ax.set_xlim(min(ratios) - 0.08 * span, max(ratios) + 0.08 * span)
    ax.set_ylim(0, top)
    ax.grid(True, alpha=0.3)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _top(values: Sequence[float | None]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    # Scores are on a 0-100 scale: an axis never shrinks below 0-10, so all-zero panels still read as near zero.
    return min(105.0, max(10.0, max(finite, default=0.0) * 1.12 + 1.0))


def plot_benchmark(benchmark: str, runs: Sequence["RunResult"], path: Path) -> Path:
    """Headline score against compression ratio for one benchmark."""
    runs = [run for run in runs if run.benchmark == benchmark]
    panels = _panels(runs)
    styles = _styles(list({_method_label(run) for run in runs if not run.is_reference}))
    ratios = sorted({run.compression_ratio for run in runs if not run.is_reference}) or [0.0]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels) + 2.5, 5.2), squeeze=False)
    for ax, ((model, query_aware), members) in zip(axes[0], panels.items(), strict=True):
        values = [run.score for run in members] + [run.interval.high for run in members if run.interval]
        for label, line in _lines(members).items():
            xs = [run.compression_ratio for run in line]
            ys = [run.score if run.score is not None else math.nan for run in line]
            _draw_points(ax, xs, ys, [run.partial for run in line], styles[label], label)
            if all(run.interval is not None for run in line):
                lows, highs = [run.interval.low for run in line], [run.interval.high for run in line]
                if len(line) > 1:
                    ax.fill_between(xs, lows, highs, color=styles[label][0], alpha=0.15, linewidth=0)
                else:  # a band needs two points; one point gets a whisker
                    ax.errorbar(xs, ys, yerr=[[ys[0] - lows[0]], [highs[0] - ys[0]]], color=styles[label][0], capsize=4)
        for reference in (run for run in members if run.is_reference):
            text = "no compression" + (f" [{reference.variant}]" if reference.variant else "")
            _draw_reference(ax, reference, with_band=True, label=f"{text} ({reference.score:.2f})")
        _style(ax, ratios, _top(values), fontsize=11)
        ax.set_xlabel("compression ratio (fraction of KV pairs removed)", fontsize=12)
        ax.set_ylabel("score", fontsize=12)
        title = f"{benchmark} — {model}" + (" (query-aware)" if query_aware else "")
        ax.set_title(title, fontsize=13)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    notes = ["bands and whiskers: bootstrap 95% interval"]
    if any(run.partial for run in runs):
        notes.append("hollow markers: partial runs")
    fig.legend(handles, labels, loc="upper left", bbox_to_anchor=(1 - 2.4 / fig.get_figwidth(), 0.9), fontsize=10)
    fig.text(0.01, 0.01, "; ".join(notes), fontsize=9, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1 - 2.5 / fig.get_figwidth(), 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path


def plot_task_grid(benchmark: str, runs: Sequence["RunResult"], path: Path) -> Path:
    """One small panel per task: task score against compression ratio, one line per method."""
    runs = [run for run in runs if run.benchmark == benchmark]
    tasks = sorted({task for run in runs for task in run.tasks})
    several = len({(run.model, run.query_aware) for run in runs}) > 1

    def label_of(run: "RunResult") -> str:
        if not several:
            return _method_label(run)
        return f"{_method_label(run)} · {run.model}" + (" (query-aware)" if run.query_aware else "")

    styles = _styles(list({label_of(run) for run in runs if not run.is_reference}))
    ratios = sorted({run.compression_ratio for run in runs if not run.is_reference}) or [0.0]
    columns = min(4, len(tasks))
    rows = math.ceil(len(tasks) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 2.9 * rows + 0.9), squeeze=False)
    lines: dict[str, list[RunResult]] = defaultdict(list)
    for run in runs:
        if not run.is_reference:
            lines[label_of(run)].append(run)
    for ax, task in zip(axes.flat, tasks, strict=False):
        values = []
        for label, line in sorted(lines.items()):
            line = sorted((run for run in line if task in run.tasks), key=lambda r: r.compression_ratio)
            ys = [run.tasks[task].get("score") for run in line]
            values += ys
            ys = [math.nan if y is None else y for y in ys]
            _draw_points(
                ax, [r.compression_ratio for r in line], ys, [r.partial for r in line], styles[label], label, 4
            )
        for reference in (run for run in runs if run.is_reference and task in run.tasks):
            values.append(reference.tasks[task].get("score"))
            score = reference.tasks[task].get("score")
            if score is not None:
                ax.axhline(score, color=_REFERENCE_COLOR, linestyle="--", linewidth=1.2, label="no compression")
        n = max((run.tasks[task].get("n", 0) for run in runs if task in run.tasks), default=0)
        ax.set_title(f"{task} (n≤{n})", fontsize=10)
        _style(ax, ratios, _top(values), fontsize=8)
    for ax in list(axes.flat)[len(tasks) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    fig.legend(unique.values(), unique.keys(), loc="lower center", ncol=min(4, len(unique)), fontsize=9)
    fig.suptitle(f"{benchmark}: task score against compression ratio", fontsize=12)
    # Fixed margins: tight_layout measures every tick label of every panel and costs more than the drawing.
    width, height = fig.get_size_inches()
    fig.subplots_adjust(
        left=0.5 / width, right=1 - 0.15 / width, top=1 - 0.65 / height, bottom=1.0 / height, wspace=0.25, hspace=0.45
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(runs: Sequence["RunResult"], out: Path) -> list[Path]:
    """Both figures for every benchmark; returns the files written."""
    written = []
    for benchmark in sorted({run.benchmark for run in runs}):
        written.append(plot_benchmark(benchmark, runs, out / f"{benchmark}.png"))
        written.append(plot_task_grid(benchmark, runs, out / f"{benchmark}_tasks.png"))
    return written
