"""Differences between two methods: pairs of runs merged from the runs frame, with a paired bootstrap interval.
Which pairs get an effect table is configuration: conf/report.yaml's ``effects``, or an experiment's ``report:``."""

import logging
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import pandas as pd
import yaml
from tqdm.auto import tqdm

from evaluate.report.frame import QUERY_AWARE, bracketed, run_level, runs_frame
from evaluate.report.runs import NO_PRESS, ReportError, RunResult
from evaluate.report.tables import Table, fmt_cr, fmt_interval, fmt_number, interval_notes
from evaluate.score.bootstrap import NoInterval, difference_interval
from evaluate.score.rescore import CONF_DIR

logger = logging.getLogger(__name__)

SCORER = "{scorer}"
# The CSV columns of a difference table: the pairs' columns, those in _CSV_NAMES renamed.
_CSV_COLUMNS = "benchmark model query_aware row label_a label_b cr_a score_a score_b delta ci_low ci_high".split()
_CSV_COLUMNS += ["shared_samples", "partial"]
_CSV_NAMES = {"label_a": "method_a", "label_b": "method_b", "cr_a": "compression_ratio"}
# A pair's interval columns, with their types.
_INTERVAL = {"ci_low": float, "ci_high": float, "contexts": "Int64", "shared_samples": "Int64"}
_INTERVAL |= {"different_samples": bool, "interval_note": str}
_CELLS = "Cells: a − b [paired bootstrap 95% interval] n=samples both runs answered. "
_CELLS += "An interval that contains 0 means the difference is within the noise."
_CELLS_WITHOUT_INTERVALS = "Cells: a − b n=samples both runs answered; no intervals (--bootstrap 0)."
# What the two runs of a pair share (against no_press, a run's baseline shares all but the ratio): a multi-turn run is
# paired with multi-turn runs alone (turn_mode: the words the labels add for turns and history).
_SHARED = ["benchmark", "model", "query_aware", "turns", "history", "turn_mode", "ratio"]


@dataclass(frozen=True)
class Effect:
    """A table of method ``a`` − method ``b`` for every inner scorer run with both; ``{scorer}`` stands for it
    (a pattern without it names one method)."""

    name: str  # file stem
    title: str
    a: str
    b: str

    def method_pairs(self, methods: Collection[str]) -> list[tuple[str, str, str]]:
        """(scorer, method a, method b) for every scorer that both patterns match among ``methods``."""
        regexes = [re.compile(re.escape(pattern).replace(re.escape(SCORER), "(.*)", 1)) for pattern in (self.a, self.b)]
        a, b = ({"".join(match.groups()) for match in map(regex.fullmatch, methods) if match} for regex in regexes)
        return [(scorer, self.a.replace(SCORER, scorer), self.b.replace(SCORER, scorer)) for scorer in sorted(a & b)]


def load_effects(experiment: str | None = None) -> list[Effect]:
    """The effect tables of conf/report.yaml, or of an experiment preset's ``report:`` entry when it has one."""
    path = CONF_DIR / "report.yaml"
    settings = yaml.safe_load(path.read_text(encoding="utf-8"))
    if experiment is not None:
        path = CONF_DIR / "experiment" / f"{experiment}.yaml"
        if not path.is_file():
            raise ReportError(f"--experiment {experiment}: no {path}")
        settings = yaml.safe_load(path.read_text(encoding="utf-8")).get("report") or settings
    try:
        return [Effect(**entry) for entry in settings["effects"]]
    except (KeyError, TypeError) as error:
        raise ReportError(f"{path}: report effects need a name, title, a and b ({error})") from None


def pair_runs(runs: pd.DataFrame, method_a: str, method_b: str) -> pd.DataFrame:
    """Every (a, b) pair of runs of the two methods on the same benchmark, model, query-awareness, conversation
    settings and ratio, a run with several partners taking the one of its variant; against ``no_press``, each run of
    a with its baseline (evaluate/score/baseline.py), at a's ratio, and none for a run without one. Columns: the
    shared keys, then each run's columns with the suffix ``_a`` or ``_b``."""
    a = runs[(runs.method == method_a) & (method_a != NO_PRESS)]
    b = runs[runs.method == method_b]
    if method_b == NO_PRESS:
        pairs = a.merge(b, left_on="baseline", right_on="run", suffixes=("_a", "_b"))
        pairs = pairs.rename(columns={f"{key}_a": key for key in _SHARED})
        return pairs.sort_values(["benchmark", "model", "query_aware", "variant_a", "cr_a"])
    pairs = a.merge(b, on=_SHARED, suffixes=("_a", "_b"))
    candidates = pairs.groupby("run_a").run_b.transform("size")
    pairs = pairs[(candidates == 1) | (pairs.variant_a == pairs.variant_b)]
    candidates = pairs.groupby("run_a").run_b.transform("size")
    for path in pairs.run_dir_a[candidates > 1].unique():
        logger.warning(
            "%s: several %s runs could be its partner; left out of %s - %s", path, method_b, method_a, method_b
        )
    pairs = pairs[candidates == 1]
    return pairs.sort_values(["benchmark", "model", "query_aware", "variant_a", "cr_a"])


def _interval(a: RunResult, b: RunResult, resamples: int, seed: int) -> tuple:
    """A pair's _INTERVAL columns: the paired interval of a − b, or why there is none."""
    try:
        if resamples > 0:
            i = difference_interval(a.benchmark_object, a.rows, b.benchmark_object, b.rows, resamples, seed)
            return i.low, i.high, i.contexts, i.shared_samples, not i.same_samples, ""
    except NoInterval as reason:
        return None, None, None, None, False, str(reason)
    except Exception as error:
        logger.warning("no paired interval for %s - %s: %s", a.path.name, b.path.name, error)
    return None, None, None, None, False, ""


def _difference_cell(pair) -> str:
    text = fmt_number(pair.delta, signed=True) + fmt_interval(pair.ci_low, pair.ci_high, signed=True)
    if pd.notna(pair.shared_samples):
        text += f" n={pair.shared_samples}" + ("†" if pair.different_samples else "")
    return text + ("*" if pair.partial else "")


def differences(runs: Sequence[RunResult], method_a: str, method_b: str, resamples: int, seed: int = 0) -> pd.DataFrame:
    """The pairs of :func:`pair_runs` with their difference (``delta``), its paired interval (or why there is
    none) and the Markdown ``cell``."""
    pairs = pair_runs(run_level(runs_frame(runs)), method_a, method_b)
    indices = tqdm(zip(pairs.run_a, pairs.run_b, strict=True), "paired bootstrap", disable=len(pairs) < 2, leave=False)
    found = [_interval(runs[a], runs[b], resamples, seed) for a, b in indices]
    intervals = pd.DataFrame(found, columns=list(_INTERVAL), index=pairs.index).astype(_INTERVAL)
    pairs = pd.concat([pairs, intervals], axis=1)
    delta = (pairs.score_a - pairs.score_b).map(lambda value: round(float(value), 2))
    pairs = pairs.assign(delta=delta, partial=pairs.partial_a | pairs.partial_b)
    return pairs.assign(cell=[_difference_cell(pair) for pair in pairs.itertuples()])


def difference_table(name: str, title: str, pairs: pd.DataFrame, row_header: str) -> Table:
    """Rows keyed by ``pairs.row`` (scorer, or settings) per benchmark and model, columns cr."""
    index = ["benchmark", "model", "query_aware", "turn_mode", "row"]
    grid = pairs.pivot(index=index, columns="ratio", values="cell").sort_index()
    rows = grid.index.to_frame(index=False)
    models = {"model": rows.model} if pairs.model.nunique() > 1 else {}
    label = rows.row + rows.query_aware.map(QUERY_AWARE) + rows.turn_mode
    md = pd.DataFrame({"benchmark": rows.benchmark, **models, row_header: label})
    md[[fmt_cr(cr) for cr in grid.columns]] = grid.fillna("").to_numpy()
    notes = [_CELLS if pairs.ci_low.notna().any() else _CELLS_WITHOUT_INTERVALS, *interval_notes(pairs)]
    if pairs.different_samples.any():
        notes.append("† the two runs answered different samples; the interval covers the samples both answered.")
    if pairs.partial.any():
        notes.append("\\* at least one of the two runs is partial.")
    return Table(name, title, pairs[_CSV_COLUMNS].rename(columns=_CSV_NAMES), [("", md)], notes)


def effect_table(runs: Sequence[RunResult], effect: Effect, resamples: int, seed: int = 0) -> Table | None:
    """``effect.a`` − ``effect.b`` for every scorer both were run with; None when no pair of runs exists."""
    found = [
        differences(runs, method_a, method_b, resamples, seed).assign(row=scorer)
        for scorer, method_a, method_b in effect.method_pairs({run.method for run in runs})
    ]
    found = [pairs for pairs in found if not pairs.empty]
    if not found:
        return None
    pairs = pd.concat(found, ignore_index=True)
    pairs = pairs.assign(row=pairs.row + pairs.variant_a.map(bracketed))
    return difference_table(effect.name, effect.title, pairs, row_header="inner scorer")


def diff_table(runs: Sequence[RunResult], method_a: str, method_b: str, resamples: int, seed: int = 0) -> Table:
    found = {run.method for run in runs}
    if missing := [method for method in (method_a, method_b) if method not in found]:
        raise ReportError(
            f"--diff: no finished run of method {missing[0]!r}; methods found: {', '.join(sorted(found))}"
        )
    pairs = differences(runs, method_a, method_b, resamples, seed)
    if pairs.empty:
        same = (
            "with its uncompressed baseline (same data, samples and settings)"
            if method_b == NO_PRESS
            else ("on the same benchmark, model, query-awareness and cr")
        )
        raise ReportError(f"--diff {method_a} {method_b}: no pair of runs {same}")
    pairs = pairs.assign(row=pairs.variant_a.where(pairs.variant_a != "", "all"))
    return difference_table(f"diff__{method_a}__{method_b}", f"{method_a} − {method_b}", pairs, row_header="settings")
