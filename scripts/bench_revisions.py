"""Time the harness's sweep at two git revisions, in one run on one machine: did a change slow the pool?

    python scripts/bench_revisions.py --base f600034                       # both workloads of bench_sweep.py
    python scripts/bench_revisions.py --base HEAD~1 --workloads decode --repeats 3

For each of ``bench_sweep.py``'s workloads (prefill-bound and decode-bound), the harness's one sweep (one model
load, one prefill per context, one decoding pool: the first way of ``bench_sweep.py``) runs at ``--base`` (checked
out into a temporary git worktree) and at this working tree, interleaved A B B A ... so that a machine that slows
down over the run weighs on both alike. Prints each time, each side's mean, the ratio after/before, and whether every
point's predictions are byte-identical across all the runs; writes the table to
results/bench/revisions_{device}.md.
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import table_head, table_row, timed, warm_up, write_report  # noqa: E402
from bench_sweep import WORKLOADS, benchmark_overrides, grids_override, point_overrides  # noqa: E402


def sweep(workload: str, args: argparse.Namespace, scratch: Path) -> list[str]:
    """The harness's sweep command of a workload, as bench_sweep.py runs it."""
    settings = argparse.Namespace(workload=workload, **WORKLOADS[workload])
    return [
        sys.executable,
        "-m",
        "evaluate",
        "-m",
        f"model={args.model}",
        f"limit={settings.limit}",
        f"device={args.device}",
        "likelihood=false",
        *benchmark_overrides(settings, scratch),
        "hydra/sweeper=grids",
        grids_override(point_overrides(settings)),
    ]


def predictions(folder: Path) -> dict[str, bytes]:
    return {path.parent.name: path.read_bytes() for path in folder.glob("*/predictions.jsonl")}


def compare(workload: str, args: argparse.Namespace, checkouts: dict[str, Path], scratch: Path) -> str:
    """One workload's row: the times of each side, A B B A ..., and whether every run predicted the same."""
    command = sweep(workload, args, scratch)
    warm_up([*command[:3], *command[4:-2]], scratch)  # the same settings as one run, not a sweep
    pairs = [("before", "after") if index % 2 == 0 else ("after", "before") for index in range(args.repeats)]
    order = [side for pair in pairs for side in pair]
    walls: dict[str, list[float]] = {"before": [], "after": []}
    outputs = []
    for index, side in enumerate(order):
        out = scratch / f"{workload}_{side}{index}"
        walls[side].append(timed([*command, f"output_dir={out}"], cwd=checkouts[side])[0])
        outputs.append(predictions(out))
        print(f"{workload} {side}: {walls[side][-1]:.1f} s", flush=True)
    identical = bool(outputs[0]) and all(output == outputs[0] for output in outputs)
    before, after = statistics.mean(walls["before"]), statistics.mean(walls["after"])
    times = " / ".join(f"{wall:.1f}" for wall in walls["before"]), " / ".join(f"{wall:.1f}" for wall in walls["after"])
    ratio = f"{after / before:.3f}"
    return table_row(workload, *times, f"{before:.1f}", f"{after:.1f}", ratio, f"{len(outputs[0])} points, {identical}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare this working tree with")
    parser.add_argument("--workloads", default="prefill,decode")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side per workload")
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=REPO, check=True)
        try:
            checkouts = {"before": base, "after": REPO}
            rows = [compare(workload, args, checkouts, Path(scratch)) for workload in args.workloads.split(",")]
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, check=True)
    lines = [
        f"The harness's sweep at {args.base} (before) and at this working tree (after), {args.model} on "
        f"{args.device}, interleaved A B B A; wall seconds.",
        "",
        *table_head(
            ["workload", "before", "after", "mean before", "mean after", "after / before", "predictions identical"],
            "lllrrrl",
        ),
        *rows,
    ]
    print("\n".join(lines))
    path = REPO / "results" / "bench" / f"revisions_{args.device.split(':')[0]}.md"
    write_report(path, "\n".join(lines))
    print(f"written to {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
