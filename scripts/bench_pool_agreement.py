"""Decoding-time presses in the pool against one by one: how many rows part, and whether the score moves.

    python scripts/bench_pool_agreement.py                                     # SmolLM2, ruler_synth at 1k, 66 rows
    python scripts/bench_pool_agreement.py --model tiny_random --tasks niah_single_1 --limit 2   # a check
    python scripts/bench_pool_agreement.py --random-model --device cuda --dtype bfloat16 --max-seq-length 4096
        # Llama-3.1-8B's shape, random weights (scripts/gpu_check.sh's agreement stage)

The same sweep (by default ``decoding_knorm`` and ``decoding_tova`` at two targets; ``--methods`` and ``--crs`` add
prefill presses, ``--dtype bfloat16`` the leaderboard's dtype) runs twice as ``python -m evaluate -m``:
once in the decoding pool (``decode_batch_size=32``, the default path) and once one row at a time
(``decode_batch_size=1``, kvpress's pipeline path, bit-exact with kvpress's ``evaluate.py``). A score-based press
breaks near-ties of its scores by the rounding of the step it compresses after, and the pool's batched step rounds
otherwise than a batch of one (docs/performance.md). Prints, per point: the rows whose answer tokens part, the first
token where they part (median), each path's score, and the paired bootstrap interval (95 %, contexts resampled) of
the pool's score minus one by one's; writes the table to results/bench/pool_agreement_{dtype}_cpu.md.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from hydra.utils import instantiate

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import (  # noqa: E402
    add_model_arguments,
    model_label,
    model_overrides,
    table_head,
    table_row,
    timed,
    write_report,
)
from kvpress_evaluation import kvpress_predictions  # noqa: E402

from evaluate import registry, rundir  # noqa: E402
from evaluate.press_profile import knobs_read  # noqa: E402
from evaluate.score.answer_length import TOKENS  # noqa: E402
from evaluate.score.bootstrap import difference_interval  # noqa: E402
from evaluate.score.decoding import decoding_record  # noqa: E402


def sweep_command(args: argparse.Namespace, out: Path, batch: int) -> list[str]:
    """The sweep of ``--methods``, answered by a pool of ``batch`` rows; the decoding-time knobs only where an entry
    reads them (a sweep whose points all ignore a knob is refused)."""
    read = set().union(*(knobs_read(registry.PRESS_REGISTRY[name]()) for name in args.methods.split(",")))
    knobs = {"target_size": args.targets, "compression_interval": args.interval}
    return [
        sys.executable,
        "-m",
        "evaluate",
        "-m",
        *model_overrides(args),
        f"device={args.device}",
        *args.override,
        "benchmark=ruler_synth",
        f"benchmark.max_seq_length={args.max_seq_length}",
        *([f"benchmark.tasks=[{args.tasks}]"] if args.tasks else []),
        f"limit={args.limit}",
        f"dtype={args.dtype}",
        "likelihood=false",
        f"max_new_tokens={args.max_new_tokens}",
        f"method={args.methods}",
        f"cr={args.crs}",
        *(f"{knob}={value}" for knob, value in knobs.items() if knob in read),
        f"decode_batch_size={batch}",
        f"output_dir={out}",
    ]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first token index where two answers differ (None when equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None if len(a) == len(b) else 0)


def point_name(record: dict) -> str:
    """A point as the table names it: its method and what it keeps (a decoding-time press's target, or cr)."""
    if record.get("decoding"):
        return f"{record['method']} target {record['decoding']['target_size']}"
    return f"{record['method']} cr {record['compression_ratio']:g}"


def answered(out: Path) -> bool:
    """Whether a run directory holds every sample its run expects (its metrics come only when its sweep ends)."""
    record = rundir.read_json(out / rundir.RUN) or {}
    return (
        "samples_expected" in record
        and len(rundir.read_predictions(out / rundir.PREDICTIONS)) == record["samples_expected"]
    )


def compare(pool_dir: Path, one_dir: Path, reference: Path | None) -> dict:
    """One point's two runs: rows that part, where, each score, and the paired interval of the difference; with a
    ``reference`` folder, also kvpress's own evaluate.py on the point: the rows whose answer parts from each run's,
    and its score."""
    record = rundir.read_yaml(pool_dir / rundir.CONFIG)
    benchmark = instantiate(record["config"]["benchmark"])
    pool = {row["id"]: row for row in rundir.read_predictions(pool_dir / rundir.PREDICTIONS)}
    one = {row["id"]: row for row in rundir.read_predictions(one_dir / rundir.PREDICTIONS)}
    parts = [first_difference(pool[key][TOKENS], one[key][TOKENS]) for key in one]
    parted = [index for index in parts if index is not None]
    interval = difference_interval(benchmark, list(pool.values()), benchmark, list(one.values()))
    return {
        "point": point_name(record),
        "rows": len(one),
        "parted": len(parted),
        "first": statistics.median(parted) if parted else None,
        "pool": benchmark.score(list(pool.values()))["score"],
        "one": benchmark.score(list(one.values()))["score"],
        "interval": None if interval is None else (interval.low, interval.high),
        "compressed": decoding_record(one.values()),
        **({} if reference is None else against_kvpress(one_dir, reference / one_dir.name, pool, one)),
    }


def against_kvpress(run: Path, output_dir: Path, pool: dict[str, dict], one: dict[str, dict]) -> dict:
    """kvpress's evaluate.py on ``run``'s point and rows: how many of its answers differ from each path's, and its
    own score (the mean over tasks of its ``calculate_metrics``)."""
    answers, score = kvpress_predictions(run, output_dir)
    return {
        "kvpress": {
            "one": sum(answers[key] != row["prediction"] for key, row in one.items()),
            "pool": sum(answers[key] != row["prediction"] for key, row in pool.items()),
            "score": score,
        }
    }


def table(results: list[dict], header: str) -> str:
    kvpress = all("kvpress" in result for result in results)
    columns = [
        "point",
        "rows",
        "rows that part",
        "first differing token (median)",
        "pool",
        "one by one",
        "pool − one by one (95 % paired)",
        "rows compressed",
    ]
    kvpress_columns = ["kvpress evaluate.py", "its answers ≠ one by one's", "≠ the pool's"] if kvpress else []
    lines = [header, "", *table_head([*columns, *kvpress_columns], "lrrrrrlr" + "r" * len(kvpress_columns))]
    for result in results:
        low_high = (
            "-" if result["interval"] is None else f"[{result['interval'][0]:+.2f}, {result['interval'][1]:+.2f}]"
        )
        counted = result["compressed"]
        compressed = "-" if not counted else f"{counted['rows_compressed']} of {counted['rows']}"
        first = "-" if result["first"] is None else result["first"]
        theirs = result["kvpress"] if kvpress else {}
        lines.append(
            table_row(
                result["point"],
                result["rows"],
                f"{result['parted']} ({100 * result['parted'] / result['rows']:.1f} %)",
                first,
                f"{result['pool']:.2f}",
                f"{result['one']:.2f}",
                f"{result['pool'] - result['one']:+.2f} {low_high}",
                compressed,
                *([f"{theirs['score']:.2f}", theirs["one"], theirs["pool"]] if kvpress else []),
            )
        )
    return "\n".join(lines)


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument(
        "--override", action="append", default=[], help="extra Hydra override for every run, repeatable"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-seq-length", type=int, default=1024)
    parser.add_argument("--tasks", help="ruler_synth tasks (default: the 11 that need no QA files)")
    parser.add_argument("--limit", type=int, default=6, help="samples per task")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--methods", default="decoding_knorm,decoding_tova", help="registry entries, any kind")
    parser.add_argument("--crs", default="0.5", help="the prefill presses' ratios (decoding-time presses read none)")
    parser.add_argument("--targets", default="256,512", help="the decoding-time presses' target sizes")
    parser.add_argument(
        "--out", type=Path, help="keep the runs here (a rerun resumes them); default: a temporary folder"
    )
    parser.add_argument(
        "--compare-only", action="store_true", help="run nothing: compare the points --out holds finished both ways"
    )
    parser.add_argument(
        "--kvpress-evaluate",
        action="store_true",
        help="also run kvpress's own evaluation/evaluate.py on each point (scripts/kvpress_evaluation.py)",
    )
    parser.add_argument("--table", type=Path, help="where the table goes (default: results/bench/pool_agreement_...)")
    parser.add_argument("--interval", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    with tempfile.TemporaryDirectory() as scratch:
        outs = {batch: (args.out or Path(scratch)) / f"batch{batch}" for batch in (32, 1)}
        seconds = (
            {}
            if args.compare_only
            else {batch: timed(sweep_command(args, out, batch))[0] for batch, out in outs.items()}
        )
        names = sorted(
            path.name for path in outs[1].iterdir() if all(answered(out / path.name) for out in outs.values())
        )
        reference = (args.out or Path(scratch)) / "kvpress_evaluate" if args.kvpress_evaluate else None
        results = [compare(outs[32] / name, outs[1] / name, reference) for name in names]
    model = model_label(args)
    overrides = "".join(f", {override}" for override in args.override)
    header = (
        f"{model} ({args.dtype}{overrides}) on {args.device}, ruler_synth at {args.max_seq_length} tokens "
        f"({args.limit} per task), "
        f"compression_interval {args.interval}, max_new_tokens {args.max_new_tokens}; "
        + (
            f"pool {seconds[32]:.1f} s, one by one {seconds[1]:.1f} s ({seconds[1] / seconds[32]:.2f}x)"
            if seconds
            else "the points --out holds finished both ways, not timed"
        )
    )
    text = table(results, header)
    print(text)
    length = "" if args.max_seq_length == 1024 else f"_{args.max_seq_length}"
    device = args.device.split(":")[0]
    path = args.table or REPO / "results" / "bench" / f"pool_agreement_{args.dtype}{length}_{device}.md"
    if args.table or (args.model == "smollm2_135m" and not args.random_model):  # a quick check writes no table
        write_report(path, text)
        print(f"written to {path}")


if __name__ == "__main__":
    main()
