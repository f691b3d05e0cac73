"""Bootstrap 95% intervals for a run's headline score, and for the difference between two runs.

The headline is whatever the benchmark's ``score(rows)["score"]`` returns; this module never assumes a metric.
It resamples within each task (the headline is a mean over tasks, so every resample keeps every task), and
it resamples contexts rather than rows: questions that share a context are not independent.

Two paths compute the resampled headlines:

- **Decomposed (fast, the usual case).** Each row's score is the benchmark's own: ``benchmark.score([row])`` on
  the row alone, so every protocol and extra field (``all_classes``) is honoured. The tasks that count towards
  the headline are those whose rows alone give a headline (LOOGLE's cloze task gives none). The decomposition
  is used only after checking that it gives back every task score and the headline of ``benchmark.score(rows)``
  (headline = unweighted mean of those tasks' means) to within rounding; resampling is then vectorised.
- **Generic (slow).** Otherwise ``benchmark.score`` is called on every resampled row set.
"""

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

# Scores of single rows and of tasks are both rounded to 2 decimals, so a decomposition is accepted within that.
_TOLERANCE = 0.02
# Bounds the index matrix drawn at once: resamples x clusters.
_MAX_DRAW = 4_000_000


class NoInterval(ValueError):
    """A run (or pair) whose samples cannot give an interval; the message says why."""


def _require_spread(task_clusters: dict[str, Sequence]) -> int:
    """The fewest contexts of any task. Resampling one context always draws that context: the interval would
    have zero width whatever the noise, so that is refused."""
    single = sorted(task for task, ids in task_clusters.items() if len(ids) < 2)
    if single:
        shown = ", ".join(single[:3]) + (", ..." if len(single) > 3 else "")
        raise NoInterval(f"no interval: {shown} {'has' if len(single) == 1 else 'have'} a single context")
    return min(len(ids) for ids in task_clusters.values())


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    resamples: int
    decomposed: bool  # True when the vectorised per-sample path was verified and used
    contexts: int  # the fewest contexts resampled in any task; a handful gives too narrow an interval


@dataclass
class _Task:
    """One task's clusters (contexts): per-cluster sums of sample scores and sizes."""

    cluster_ids: list[str]
    sums: np.ndarray
    sizes: np.ndarray


def _clusters(rows: Sequence[dict]) -> dict[str, dict[str, list[int]]]:
    """task -> cluster id -> row indices. A row without ``context_id`` is its own cluster."""
    tasks: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for index, row in enumerate(rows):
        cluster = row.get("context_id") or f"row-{row.get('id', index)}"
        tasks[row["task"]][cluster].append(index)
    return tasks


def _metrics_or_none(benchmark, rows: Sequence[dict]) -> dict | None:
    """The benchmark's metrics when they have a finite headline, else None."""
    try:
        metrics = benchmark.score(list(rows))
    except Exception:  # a benchmark may refuse a row set that lacks its headline tasks
        return None
    value = metrics.get("score")
    if value is None or not math.isfinite(float(value)):
        return None
    return metrics


def _score_or_none(benchmark, rows: Sequence[dict]) -> float | None:
    metrics = _metrics_or_none(benchmark, rows)
    return None if metrics is None else float(metrics["score"])


def sample_scores(benchmark, rows: Sequence[dict]) -> list[float | None]:
    """Each row's score on its task's scale, from ``benchmark.score`` on the row alone (None where the task has no
    score: ZeroSCROLLS, or an InfiniteBench task kvpress cannot score)."""
    scores = [benchmark.score([row])["tasks"][row["task"]]["score"] for row in rows]
    return [None if score is None else float(score) for score in scores]


class Decomposition:
    """A run's rows as per-task clusters of per-sample scores, verified against ``benchmark.score``."""

    def __init__(self, benchmark, rows: Sequence[dict]):
        self.rows = list(rows)
        metrics = _metrics_or_none(benchmark, self.rows) if self.rows else None
        self.headline = None if metrics is None else float(metrics["score"])
        self.tasks: dict[str, _Task] = {}
        self.decomposed = False
        if metrics is None:
            return
        grouped = _clusters(self.rows)
        for task, clusters in grouped.items():
            members = [self.rows[i] for indices in clusters.values() for i in indices]
            if _score_or_none(benchmark, members) is None:
                continue  # this task alone gives no headline, so it does not count towards it
            ids = sorted(clusters)
            ordered = [i for c in ids for i in clusters[c]]
            values = dict(zip(ordered, sample_scores(benchmark, [self.rows[i] for i in ordered]), strict=True))
            self.tasks[task] = _Task(
                cluster_ids=ids,
                sums=np.array([sum(values[i] for i in clusters[c]) for c in ids]),
                sizes=np.array([len(clusters[c]) for c in ids], dtype=float),
            )
        if not self.tasks:
            return
        means = {task: t.sums.sum() / t.sizes.sum() for task, t in self.tasks.items()}
        reported = metrics["tasks"]
        self.decomposed = all(abs(means[task] - float(reported[task]["score"])) <= _TOLERANCE for task in means) and (
            abs(sum(means.values()) / len(means) - self.headline) <= _TOLERANCE
        )

    def restricted(self, task_clusters: dict[str, list[str]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per task, the (sums, sizes) of the given clusters, in the given order."""
        out = {}
        for task, ids in task_clusters.items():
            t = self.tasks[task]
            position = {c: i for i, c in enumerate(t.cluster_ids)}
            order = [position[c] for c in ids]
            out[task] = (t.sums[order], t.sizes[order])
        return out


def _draw(rng: np.random.Generator, n_clusters: int, resamples: int) -> list[np.ndarray]:
    """Index matrices (resamples x n_clusters) in chunks that bound memory."""
    per_chunk = max(1, _MAX_DRAW // max(1, n_clusters))
    chunks, left = [], resamples
    while left > 0:
        size = min(per_chunk, left)
        chunks.append(rng.integers(0, n_clusters, size=(size, n_clusters)))
        left -= size
    return chunks


def _resampled_task_means(
    per_task: list[tuple[tuple[np.ndarray, np.ndarray], ...]], rng: np.random.Generator, resamples: int
) -> list[np.ndarray]:
    """For each of k aligned runs, the mean over tasks of resampled task means (same draws for every run)."""
    k = len(per_task[0])
    totals = [np.zeros(resamples) for _ in range(k)]
    for runs in per_task:
        n_clusters = len(runs[0][0])
        start = 0
        for indices in _draw(rng, n_clusters, resamples):
            stop = start + len(indices)
            for j, (sums, sizes) in enumerate(runs):
                totals[j][start:stop] += sums[indices].sum(axis=1) / sizes[indices].sum(axis=1)
            start = stop
    return [total / len(per_task) for total in totals]


def _percentiles(values: np.ndarray, level: float, digits: int | None = 2) -> tuple[float, float]:
    """The interval's bounds, rounded as the figure they bound is (``None``: not at all), so that rounding never
    moves a bound past the figure."""
    tail = 100 * (1 - level) / 2
    low, high = (float(bound) for bound in np.percentile(values, [tail, 100 - tail]))
    return (low, high) if digits is None else (round(low, digits), round(high, digits))


def _slow_resamples(
    benchmarks: Sequence, row_sets: Sequence[Sequence[dict]], task_clusters, rng, resamples: int, desc: str
) -> list[np.ndarray]:
    """Resampled headlines by calling each benchmark's ``score`` on resampled rows (same draws for each run)."""
    members = [_clusters(rows) for rows in row_sets]
    out = [np.empty(resamples) for _ in row_sets]
    for b in tqdm(range(resamples), desc=desc, unit="resample", leave=False, dynamic_ncols=True):
        picked: list[list[dict]] = [[] for _ in row_sets]
        for task, ids in task_clusters.items():
            for index in rng.integers(0, len(ids), size=len(ids)):
                cluster = ids[index]
                for j, rows in enumerate(row_sets):
                    picked[j].extend(rows[i] for i in members[j][task][cluster])
        for j, benchmark in enumerate(benchmarks):
            value = _score_or_none(benchmark, picked[j])
            out[j][b] = np.nan if value is None else value
    # A resample that lost a headline task has no headline; it is dropped for every run alike.
    keep = np.logical_and.reduce([~np.isnan(values) for values in out])
    return [values[keep] for values in out]


def headline_interval(
    benchmark, rows: Sequence[dict], resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> Interval | None:
    """Bootstrap interval of ``benchmark.score(rows)["score"]``; None when there is no headline to resample.

    Raises NoInterval when a task has a single context.
    """
    if resamples <= 0 or not rows:
        return None
    rng = np.random.default_rng(seed)
    decomposition = Decomposition(benchmark, rows)
    if decomposition.headline is None:
        return None
    if decomposition.decomposed:
        contexts = _require_spread({task: t.cluster_ids for task, t in decomposition.tasks.items()})
        per_task = [((t.sums, t.sizes),) for t in decomposition.tasks.values()]
        (values,) = _resampled_task_means(per_task, rng, resamples)
        return Interval(*_percentiles(values, level), resamples=resamples, decomposed=True, contexts=contexts)
    task_clusters = {task: sorted(clusters) for task, clusters in _clusters(rows).items()}
    contexts = _require_spread(task_clusters)
    (values,) = _slow_resamples([benchmark], [rows], task_clusters, rng, resamples, "bootstrap")
    if len(values) == 0:
        return None
    return Interval(*_percentiles(values, level), resamples=len(values), decomposed=False, contexts=contexts)


def mean_interval(
    rows: Sequence[dict], values: Sequence[float], resamples: int = 1000, seed: int = 0, level: float = 0.95
) -> Interval:
    """Bootstrap interval of the unweighted mean over tasks of each task's mean of ``values`` (one per row), drawn as
    the headline's: contexts resampled within each task. For per-sample quantities that need no benchmark to score
    (the likelihood fields); not rounded, as the means it bounds are not (metrics.json's likelihood): a KL far below
    1e-4 rounded to 4 decimals would leave its own mean outside. Raises NoInterval when a task has a single
    context."""
    grouped = _clusters(rows)
    contexts = _require_spread(grouped)
    per_task = []
    for clusters in grouped.values():
        ids = sorted(clusters)
        sums = np.array([sum(values[i] for i in clusters[c]) for c in ids])
        per_task.append(((sums, np.array([len(clusters[c]) for c in ids], dtype=float)),))
    (means,) = _resampled_task_means(per_task, np.random.default_rng(seed), resamples)
    return Interval(*_percentiles(means, level, digits=None), resamples=resamples, decomposed=True, contexts=contexts)


@dataclass(frozen=True)
class PairedInterval(Interval):
    shared_samples: int
    same_samples: bool  # both runs hold exactly the shared samples


@dataclass(frozen=True)
class PairedResamples:
    """Several runs' headlines on the same draws of the contexts they share: ``values[j]`` is run j's resampled
    headline, one per kept draw (a draw that lost a headline task is dropped for every run alike)."""

    values: list[np.ndarray]
    decomposed: bool
    contexts: int
    shared_samples: int
    same_samples: bool  # every run holds exactly the shared samples


def paired_resamples(
    benchmarks: Sequence, row_sets: Sequence[Sequence[dict]], resamples: int = 1000, seed: int = 0
) -> PairedResamples | None:
    """The headlines of several runs resampled with the same draws of contexts, over the samples every run answered;
    None when they share none or a run has no headline. Raises NoInterval when a task has a single shared context.
    The paired intervals (:func:`difference_interval`, and the iso-quality cr of evaluate/score/iso_quality.py)
    are percentiles of what they compute on these draws."""
    keys = [{(row["task"], row["id"]) for row in rows} for rows in row_sets]
    shared = set.intersection(*keys)
    if not shared:
        return None
    kept = [[row for row in rows if (row["task"], row["id"]) in shared] for rows in row_sets]
    clusters = [_clusters(rows) for rows in kept]
    task_clusters = {
        task: sorted(set.intersection(*(set(c.get(task, {})) for c in clusters)))
        for task in clusters[0]
        if all(task in c for c in clusters[1:])
    }
    task_clusters = {task: ids for task, ids in task_clusters.items() if ids}
    contexts = _require_spread(task_clusters)
    rng = np.random.default_rng(seed)
    decompositions = [Decomposition(benchmark, rows) for benchmark, rows in zip(benchmarks, kept, strict=True)]
    if any(decomposition.headline is None for decomposition in decompositions):
        return None
    values = _decomposed_resamples(decompositions, task_clusters, rng, resamples)
    decomposed = values is not None
    if values is None:
        values = _slow_resamples(benchmarks, kept, task_clusters, rng, resamples, "paired bootstrap")
    if len(values[0]) == 0:
        return None
    same = all(ids == keys[0] for ids in keys[1:])
    return PairedResamples(values, decomposed, contexts, len(shared), same)


def difference_interval(
    benchmark_a,
    rows_a: Sequence[dict],
    benchmark_b,
    rows_b: Sequence[dict],
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> PairedInterval | None:
    """Paired bootstrap interval of headline(a) - headline(b) over the samples both runs answered.

    Both runs are resampled with the same draws of contexts, so the noise they share (which samples are
    easy) cancels and the interval measures the difference itself.
    """
    if resamples <= 0:
        return None
    paired = paired_resamples([benchmark_a, benchmark_b], [rows_a, rows_b], resamples, seed)
    if paired is None:
        return None
    values_a, values_b = paired.values
    return PairedInterval(
        *_percentiles(values_a - values_b, level),
        resamples=len(values_a),
        decomposed=paired.decomposed,
        contexts=paired.contexts,
        shared_samples=paired.shared_samples,
        same_samples=paired.same_samples,
    )


def _decomposed_resamples(
    decompositions: Sequence[Decomposition], task_clusters: dict, rng: np.random.Generator, resamples: int
) -> list[np.ndarray] | None:
    """Every run's resampled headlines from its per-task means, with the same draws; None unless every headline
    decomposes over the same tasks, each with shared contexts."""
    first = decompositions[0]
    if not all(d.decomposed and set(d.tasks) == set(first.tasks) for d in decompositions):
        return None
    wanted = {task: task_clusters[task] for task in first.tasks if task in task_clusters}
    if len(wanted) != len(first.tasks):
        return None
    restricted = [d.restricted(wanted) for d in decompositions]
    return _resampled_task_means([tuple(r[task] for r in restricted) for task in wanted], rng, resamples)
