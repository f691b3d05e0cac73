"""The uncompressed baseline of a run: the one definition the run's closing lines (evaluate/run/summary.py) and the
report (evaluate/report/) pair a run with ``no_press`` by.

A finished ``no_press`` run is the baseline of a run when both recorded the same result settings but the press and
its ratio (evaluate/settings.py's ``PRESS_KEYS``: press, scorer, cr and the runner's knobs) and the baseline answered
every sample the run answered: the same data, model, context budget, seed and query-awareness, so that the two
differ in the compression alone. Any other ``no_press`` run is no baseline of it, however close.
"""

import json
from collections.abc import Callable, Iterable
from functools import cache, partial
from pathlib import Path

from evaluate import rundir
from evaluate.settings import NON_RESULT_KEYS, PRESS_KEYS, RECORDED_DEFAULTS, without_old_defaults

NO_PRESS = "no_press"


def baseline_key(config: dict) -> str:
    """What a run shares with its baseline: its recorded config (config.yaml's ``config``) without the keys that
    change no prediction and those that choose the press, as canonical JSON."""
    kept = {key: value for key, value in config.items() if key not in NON_RESULT_KEYS and key not in PRESS_KEYS}
    kept.setdefault("generate", RECORDED_DEFAULTS["generate"])  # runs recorded before generate=false existed generated
    kept = without_old_defaults(kept)
    if kept.get("max_new_tokens") is None or not kept["generate"]:
        # Each row's own, as in the runs recorded before the key existed; generate=false reads none.
        kept.pop("max_new_tokens", None)
    return json.dumps(kept, sort_keys=True, default=str)


def answered_ids(rows: Iterable[dict]) -> set[str]:
    """The samples a run answered: its rows' ids, but those whose sample failed."""
    return {row["id"] for row in rows if not row.get("error")}


def is_baseline(record: dict, rows: Callable[[], list[dict]], config: dict, sample_ids: set[str]) -> bool:
    """Whether the run recorded as ``record`` (its config.yaml), whose prediction rows ``rows`` reads, is the
    baseline of a run recorded with ``config`` that answered ``sample_ids``. ``rows`` is called only when the
    settings match, so that a results tree's other runs are never read."""
    if record.get("method") != NO_PRESS or baseline_key(record.get("config", {})) != baseline_key(config):
        return False
    return sample_ids <= answered_ids(rows())


def _readable_rows(path: Path) -> list[dict]:
    try:
        return rundir.read_predictions(path)
    except rundir.DamagedPredictions:  # not a baseline to compare with until it is repaired
        return []


def find_baseline(folder: Path, config: dict, sample_ids: set[str]) -> tuple[Path, list[dict]] | None:
    """The run directory directly under ``folder`` that is the baseline of a run recorded with ``config`` that
    answered ``sample_ids``, with its rows; None when none is. A run directory whose files cannot be read is none."""
    for config_path in sorted(folder.glob("*/" + rundir.CONFIG)):
        rows = cache(partial(_readable_rows, config_path.parent / rundir.PREDICTIONS))
        try:
            record = rundir.read_record(config_path) or {}
        except rundir.Unreadable:
            continue
        if is_baseline(record, rows, config, sample_ids):
            return config_path.parent, rows()
    return None
