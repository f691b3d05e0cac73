"""Kept-set agreement between two runs (``python -m evaluate.report --agreement RUN_A RUN_B``): the Jaccard overlap
of the context positions each kept, by layer and overall, from the kept sets both stored (``save_kept=true``,
evaluate/kept_store.py).

Per row, layer and KV head, |A ∩ B| / |A ∪ B| of the two kept sets (1 where both kept nothing); a layer's figure is
the mean over rows and KV heads, the overall one the mean over layers. Typical pairs: one press in float32 and in
bfloat16 (kvpress issue #276), two presses, the pool and ``decode_batch_size=1``. The runs must have stored the same
samples over contexts of the same lengths, or the comparison means nothing: they are refused in one line.
"""

from pathlib import Path

import numpy as np
import pandas as pd

from evaluate.kept_store import StoredKept, read_run_kept
from evaluate.report.runs import ReportError
from evaluate.report.tables import Table


def _stored(run: Path) -> dict[str, StoredKept]:
    if not run.is_dir():
        raise ReportError(f"{run} is not a run directory")
    stored = read_run_kept(run)
    if not stored:
        raise ReportError(f"{run} stored no kept sets: rerun it with save_kept=true (and overwrite=true if finished)")
    return stored


def _matched(first: dict[str, StoredKept], second: dict[str, StoredKept], names: tuple[str, str]) -> list[str]:
    """The samples both stored, refused where the two runs' samples or contexts differ."""
    if first.keys() != second.keys():
        only = sorted(first.keys() - second.keys())[:1] or sorted(second.keys() - first.keys())[:1]
        raise ReportError(
            f"{names[0]} and {names[1]} stored the kept sets of different samples ({len(first)} and {len(second)}, "
            f"e.g. {only[0]} in one only): agreement compares runs over the same samples"
        )
    for sample, kept in first.items():
        if kept.mask.shape != second[sample].mask.shape:
            raise ReportError(
                f"sample {sample} has a context of {kept.context_length} positions in {names[0]} and "
                f"{second[sample].context_length} in {names[1]} (layers x KV heads {kept.mask.shape[:2]} and "
                f"{second[sample].mask.shape[:2]}): agreement compares runs over the same contexts and model"
            )
    return sorted(first)


def jaccard_by_layer(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Per layer, the mean over KV heads of the Jaccard overlap of two kept masks [layers, KV heads, positions]."""
    both = np.logical_and(first, second).sum(axis=-1)
    either = np.logical_or(first, second).sum(axis=-1)
    overlap = np.where(either > 0, both / np.maximum(either, 1), 1.0)
    return overlap.mean(axis=-1)


def agreement_table(run_a: Path, run_b: Path) -> Table:
    """The agreement of two runs' kept sets: a row per layer and one overall, with the rows compared."""
    first, second = _stored(run_a), _stored(run_b)
    samples = _matched(first, second, (str(run_a), str(run_b)))
    by_layer = np.stack([jaccard_by_layer(first[sample].mask, second[sample].mask) for sample in samples])
    layers = by_layer.mean(axis=0)
    data = pd.DataFrame({"layer": [*map(str, range(len(layers))), "all"], "jaccard": [*layers, layers.mean()]})
    data["rows"] = len(samples)
    shown = pd.DataFrame({"layer": data.layer, "Jaccard": data.jaccard.map(lambda value: f"{value:.3f}")})
    kept = [first[sample].mask.mean() for sample in samples], [second[sample].mask.mean() for sample in samples]
    notes = [
        f"A: `{run_a}`; B: `{run_b}`; {len(samples)} rows. Kept share of the context: A {np.mean(kept[0]):.3f}, "
        f"B {np.mean(kept[1]):.3f}.",
        "Per row, layer and KV head, |A ∩ B| / |A ∪ B| of the context positions each kept; a layer's figure is the "
        "mean over rows and KV heads, all's the mean over layers (docs/metrics.md).",
    ]
    return Table("agreement", "Kept-set agreement (Jaccard) by layer", data, [("", shown)], notes)
