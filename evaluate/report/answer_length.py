"""The answer-length table of a benchmark (``{benchmark}_answer_length``): how each run's greedy answers differ in
length from its uncompressed baseline's for the same samples (evaluate/score/answer_length.py defines the fields)."""

import pandas as pd

from evaluate.report.frame import labelled, run_level
from evaluate.report.runs import NO_PRESS
from evaluate.report.tables import Table, cr_cells, kept_cells, kept_columns, kept_shown, kept_values, row_method
from evaluate.score.answer_length import DRIFT_FIELDS, NO_TOKENS

NOT_AVAILABLE = "n/a"
_NO_BASELINE = "no uncompressed run with token ids to compare with"
_NOT_GENERATED = "made with generate=false: such a run decodes no answer, so it has no answer lengths"
# Baselines first, then by method, and what each run keeps: by cr, then budgets from the largest.
_ORDER = {"reference": False, "model": True, "query_aware": True, "method": True, "variant": True, "cr": True}
_ORDER |= {"budget": False, "target_size": True}


def fmt_tokens(value: float | None) -> str:
    return NOT_AVAILABLE if pd.isna(value) else f"{value:.2f}"


def fmt_share(value: float | None) -> str:
    return NOT_AVAILABLE if pd.isna(value) else f"{100 * value:.1f} %"


def _prefix_cell(mean: float | None, median: float | None) -> str:
    return NOT_AVAILABLE if pd.isna(mean) else f"{mean:.2f} (median {median:g})"


def answer_length_table(frame: pd.DataFrame, benchmark: str) -> Table | None:
    """A row per run of ``benchmark`` (its baselines first, then by method and what it keeps: cr, budget or target
    size, so that token-budget and decoding-time runs have rows too): the mean answer tokens and the
    share hitting ``max_new_tokens``, its baseline's on the same samples, the share that stopped earlier than the
    baseline's answer and the tokens shared with it before the first difference. None when no run of the benchmark
    recorded answer token ids (runs made before the column, or with generate=false)."""
    runs = labelled(run_level(frame[frame.benchmark == benchmark]))
    if runs.answer_tokens.isna().all():
        return None
    runs = runs.sort_values(list(_ORDER), ascending=list(_ORDER.values()), kind="stable")
    models = {"model": runs.model} if runs.model.nunique() > 1 else {}
    shown = pd.DataFrame({"method": runs.label, **models, "cr": cr_cells(runs)})
    shown[kept_columns(runs)] = kept_shown(runs)
    shown["answer tokens"] = runs.answer_tokens.map(fmt_tokens)
    shown["uncompressed"] = runs.answer_tokens_uncompressed.map(fmt_tokens)
    shown["hit max_new_tokens"] = runs.hit_cap.map(fmt_share)
    shown["uncompressed hit"] = runs.hit_cap_uncompressed.map(fmt_share)
    shown["stopped earlier"] = runs.stopped_earlier.map(fmt_share)
    shown["common prefix"] = [
        _prefix_cell(*pair) for pair in runs[["common_prefix", "common_prefix_median"]].to_numpy()
    ]
    shown["n"] = runs.answer_length_n.map(lambda n: NOT_AVAILABLE if pd.isna(n) else f"{n:.0f}")
    # A baseline has nothing to be compared with: its paired cells are empty, not missing.
    paired = ["uncompressed", "uncompressed hit", "stopped earlier", "common prefix"]
    shown.loc[runs.reference.to_numpy(), paired] = ""
    data = runs.assign(method=row_method(runs))[["benchmark", "model", "method", "query_aware", "cr"]]
    data = pd.concat([data, kept_values(runs), runs[[*DRIFT_FIELDS, "answer_length_n"]]], axis=1)
    data = data.rename(columns={"cr": "compression_ratio", "answer_length_n": "n"})
    title = f"{benchmark}: answer length against the uncompressed answers of the same samples"
    return Table(f"{benchmark}_answer_length", title, data, [("", shown.reset_index(drop=True))], _notes(runs))


def _notes(runs: pd.DataFrame) -> list[str]:
    """What the cells are, and why some read n/a, once per reason: a generate=false run never had answers to record."""
    notes = [
        "Tokens are the greedy answers' own, as decoded (their stop token included); uncompressed: the baseline's "
        "answers to the same samples; stopped earlier: answers shorter than the baseline's; common prefix: tokens "
        "shared with the baseline's answer before the first difference (docs/metrics.md#answer-length-drift)."
    ]
    missing = runs.answer_tokens.isna()
    if (missing & runs.generate).any():
        notes.append(f"{NOT_AVAILABLE}: {NO_TOKENS}.")
    if (missing & ~runs.generate).any():
        notes.append(f"{NOT_AVAILABLE} for {_listed(runs[missing & ~runs.generate])}: {_NOT_GENERATED}.")
    unpaired = runs[~runs.reference & runs.answer_tokens.notna() & runs.common_prefix.isna()]
    if not unpaired.empty:
        listed = _listed(unpaired)
        notes.append(f"{_NO_BASELINE[0].upper()}{_NO_BASELINE[1:]} for {listed}: run `press=none` ({NO_PRESS}).")
    return notes


def _listed(runs: pd.DataFrame) -> str:
    """The runs as a note names them: label and what each keeps."""
    return ", ".join(dict.fromkeys(runs.label + " " + kept_cells(runs)))
