"""Tables from finished runs: ``python -m evaluate.report [RUNS_DIR]``.

Writes Markdown and CSV tables (built by :mod:`evaluate.results`) under ``results/tables/`` (``--out``) and plots
under its ``plots/`` (``--plots``; both ignored by git: the committed example plots in results/plots/ stay as they are):
``{benchmark}``, the headline in the EG-ChunkKV PR's layout (benchmark x method rows, ``cr=`` columns,
``no compression`` from each run's ``no_press`` baseline; each cell with its bootstrap 95% interval, its sample
count and ``*`` when partial); ``{benchmark}_tasks``, task x method per ratio; an effect table per entry of
conf/report.yaml's ``effects`` or ``--experiment NAME``'s ``report:`` (by default ``gate_effect``:
``eg_chunkkv_{scorer}`` − ``chunkkv_{scorer}`` with a paired interval) and per ``--diff A B``; ``iso_quality``, the
largest cr of each method within ``--iso-delta`` points and ``--iso-relative`` of its baseline; ``capacity``, the
rows whose KV cache fits in ``--serving-memory-gb`` less the model's weights, against uncompressed; ``compare``
(``--compare``): measured against ``results/reference/*.csv``; ``runs.csv``, a row per run; ``report.md``, all in one.
Instead of the report, ``--agreement RUN_A RUN_B`` gives the Jaccard overlap of two runs' kept sets by layer
(``agreement``), and ``--kept-map RUN`` draws one row's kept set (``plots/kept_map_<run>.png``).
"""

import argparse
import logging
import sys
from pathlib import Path

from evaluate import rundir
from evaluate.errors import ConfigError, exit_code, refuse
from evaluate.report.agreement import agreement_table
from evaluate.report.build import build_report, write_report
from evaluate.report.capacity import DEFAULT_MEMORY_GB, check_memory
from evaluate.report.differences import load_effects
from evaluate.report.runs import DEFAULT_RUNS, ReportError, collect_runs
from evaluate.score.iso_quality import DEFAULT_DELTA, DEFAULT_RELATIVE, check_thresholds

_ISO_DELTA = "iso-quality table: the largest cr scoring ≥ baseline − POINTS (default: %(default)s)"
_ISO_RELATIVE = "iso-quality table: the largest cr scoring ≥ SHARE × baseline, SHARE in (0, 1] (default: %(default)s)"
_MEMORY = "serving-capacity table: the GB (10^9 bytes) the weights and KV rows share (default: %(default)s)"
# What 0 means for each numeric flag, for its refusal.
_ZERO = {"--bootstrap": "no intervals", "--seed": "the default seed"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m evaluate.report", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("runs_dir", nargs="?", type=Path, default=DEFAULT_RUNS, help="default: %(default)s")
    add("--out", type=Path, default=Path("results/tables"), help="tables folder (default: %(default)s)")
    add("--plots", type=Path, help="plots folder (default: the tables folder's plots/)")
    add("--no-plots", action="store_true", help="write tables only")
    add("--diff", nargs=2, action="append", default=[], metavar=("A", "B"), help="add a table of method A − method B")
    add("--experiment", metavar="NAME", help="effect tables of conf/experiment/NAME.yaml's report: entry")
    add("--compare", action="store_true", help="compare with the published numbers in --reference")
    add("--reference", type=Path, default=Path("results/reference"), help="default: %(default)s")
    add("--bootstrap", type=int, default=1000, metavar="N", help="resamples per interval; 0 disables (default: 1000)")
    add("--seed", type=int, default=0, help="bootstrap seed (default: 0)")
    add("--iso-delta", type=float, default=DEFAULT_DELTA, metavar="POINTS", help=_ISO_DELTA)
    add("--iso-relative", type=float, default=DEFAULT_RELATIVE, metavar="SHARE", help=_ISO_RELATIVE)
    add("--serving-memory-gb", type=float, default=DEFAULT_MEMORY_GB, metavar="GB", help=_MEMORY)
    wandb = "also log the tables and plots to one wandb summary run (bare --wandb: online)"
    add("--wandb", nargs="?", const="online", choices=["offline", "online"], help=wandb)
    add("--wandb-project", default="pressbench", help="default: %(default)s")
    kept = "instead of the report: the Jaccard overlap of two runs' stored kept sets (save_kept=true), by layer"
    add("--agreement", nargs=2, type=Path, metavar=("RUN_A", "RUN_B"), help=kept)
    add("--kept-map", type=Path, metavar="RUN", help="instead of the report: draw one row's kept set (save_kept=true)")
    add("--sample", metavar="ID", help="--kept-map's row (default: the first whose answer is in its context)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    for flag, value in (("--bootstrap", args.bootstrap), ("--seed", args.seed)):
        if value < 0:
            refuse(ConfigError(f"{flag} {value}: cannot be negative; pass 0 or more ({flag} 0: {_ZERO[flag]})"))
    try:
        check_thresholds(args.iso_delta, args.iso_relative)
        check_memory(args.serving_memory_gb)
    except ConfigError as error:
        refuse(error)
    unwritten = ["no table or plot was written"]
    try:
        if args.agreement or args.kept_map:
            kept_sets(args)
            return
        report(args, unwritten)
    except KeyboardInterrupt as interrupt:  # Ctrl-C: one line saying what is missing, not a traceback
        print(f"interrupted: {unwritten[0]}; rerun the same command to write the report", file=sys.stderr)
        sys.exit(exit_code(interrupt))


def kept_sets(args: argparse.Namespace) -> None:
    """``--agreement``: the agreement table printed and written under ``--out``; ``--kept-map``: the map drawn
    under the plots folder."""
    try:
        if args.agreement:
            table = agreement_table(*args.agreement)
            path = args.out / f"{table.name}.md"
            rundir.write_atomic(path, table.page() + "\n")
            rundir.write_atomic(args.out / f"{table.name}.csv", table.csv)
            print(table.page())
            print(f"tables: {path}, {path.with_suffix('.csv')}")
        if args.kept_map:
            from evaluate.report.plots import plot_kept_map  # matplotlib only when drawing

            folder = args.plots or args.out / "plots"
            print(f"plots: {plot_kept_map(args.kept_map, args.sample, folder / f'kept_map_{args.kept_map.name}.png')}")
    except ReportError as error:
        raise SystemExit(f"error: {error}") from None


def report(args: argparse.Namespace, unwritten: list[str]) -> None:
    """The report of ``args``; ``unwritten[0]`` says what is not written yet, for an interrupted report to name."""
    try:
        effects = load_effects(args.experiment)
        runs, skipped = collect_runs(args.runs_dir)
        if not runs:
            detail = "".join(f"\n  {path}: {reason}" for path, reason in skipped)
            raise ReportError(f"no finished run under {args.runs_dir}{detail}")
        diffs, reference = [tuple(pair) for pair in args.diff], args.reference if args.compare else None
        built = build_report(
            runs,
            skipped,
            args.bootstrap,
            args.seed,
            diffs,
            reference,
            effects,
            args.iso_delta,
            args.iso_relative,
            args.serving_memory_gb,
        )
    except ReportError as error:
        raise SystemExit(f"error: {error}") from None

    folder = args.plots or args.out / "plots"
    unwritten[0] = f"the tables in {args.out} are not all written, and no plot"
    tables = write_report(built, args.out, args.runs_dir, args.bootstrap)
    plots = []
    if not args.no_plots:
        from evaluate.report.plots import plot_all  # matplotlib only when drawing

        unwritten[0] = f"the tables are written, the plots in {folder} not all"
        plots = plot_all(built.frame, folder, built.iso_series, built.iso_budget_series)
    print(built.page(args.runs_dir, args.bootstrap))
    for path, reason in skipped:
        print(f"skipped {path}: {reason}", file=sys.stderr)
    print(f"tables: {', '.join(map(str, tables))}")
    if plots:
        print(f"plots: {', '.join(map(str, plots))}")
    if args.wandb:
        from evaluate.report.tracking import log_report

        print(f"wandb summary run: {log_report(built, plots, mode=args.wandb, project=args.wandb_project)}")
