"""Move the damaged lines of a run's predictions aside, so that rerunning the run answers their samples again.

    python -m evaluate.run.repair RUN_DIR

Every line of RUN_DIR/predictions.jsonl that is not a prediction row (a line damaged by a disk or an editor, or a
torn last line) is appended as it was to predictions.jsonl.damaged, and fsynced, before predictions.jsonl is
rewritten with its readable rows: nothing is dropped. It holds the run's lock, so a process writing the run is
never raced. Rerunning the run's command then resumes it: the moved samples have no row and are answered again.
"""

import argparse
from pathlib import Path

from evaluate import rundir
from evaluate.errors import ConfigError, refuse


def repair(run_directory: Path) -> str:
    """Move the damaged lines of ``run_directory``'s predictions aside; returns what was done, in one line."""
    predictions = run_directory / rundir.PREDICTIONS
    if not predictions.is_file():
        raise ConfigError(f"{predictions} does not exist; pass a run directory")
    with rundir.locked(run_directory):
        kept, moved, aside = rundir.move_damaged_lines(predictions)
    if not moved:
        return f"{predictions}: nothing damaged, {kept} rows"
    return f"{predictions}: moved {moved} damaged lines to {aside}, kept {kept} rows; rerun the run to answer them"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evaluate.run.repair", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory whose predictions.jsonl has damaged lines")
    args = parser.parse_args(argv)
    try:
        print(repair(args.run_dir))
    except ConfigError as error:
        refuse(error)


if __name__ == "__main__":
    main()
