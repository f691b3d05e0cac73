"""Time a small sweep two ways, in one run on one machine, and check both give the same predictions.

1. The harness: one ``python -m evaluate -m ...`` multirun; the default launcher loads the model once,
   prefills each context once for every sweep point and decodes every point's questions in one pool
   (evaluate/engine/pool_engine.py, decoding_pool.py). It also runs with ``decode_batch_size=1``: one model load,
   then kvpress's pipeline for each point.
2. The way kvpress's evaluation runs a sweep: one process per point, each loading the model and running the
   pipeline context by context (``python -m evaluate`` for that single point).

    python scripts/bench_sweep.py                                   # prefill-bound: SmolLM2, 4,096-token contexts
    python scripts/bench_sweep.py --workload decode                 # decode-bound: 1,024 tokens, long answers
    python scripts/bench_sweep.py --workload reasoning              # decoding-time presses, 256-512 new tokens
    python scripts/bench_sweep.py --model tiny_random --max-seq-length 1024   # a quick check of the script itself
    python scripts/bench_sweep.py --random-model --device cuda --dtype bfloat16  # Llama-3.1-8B's shape, random weights
    python scripts/bench_sweep.py --shards 2                        # one process against 2 shard processes side by side

Prints wall time, samples/s, peak resident memory, the speed-up, whether every point's predictions are
byte-identical and the harness's compression seconds per point, and writes the same tables to
results/bench/sweep_{workload}_{device}.md (``--out-dir``), with each run's prefill, compression and decode seconds,
peak device memory and differing predictions in sweep_{workload}_{device}.csv.

``--shards N`` times something else: the harness's sweep in one process against N processes side by side, each on
its shard of the contexts (``shard=i/N``, as torchrun's ranks run it), with the contexts each way prefilled (read
from the processes' logs), whether the merged predictions.jsonl and metrics.json of every point are byte-identical,
into results/bench/shards_{workload}_{device}.md.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import (
    add_model_arguments,
    model_label,
    model_overrides,
    table_head,
    table_row,
    timed,
    wait_for,
    warm_up,
    write_csv,
    write_report,
)

REPO = Path(__file__).resolve().parent.parent


# prefill: the EG-ChunkKV preset's presses on 4,096-token contexts with short answers. decode: 1,024-token contexts and
# the tasks with long answers (cwe 120 tokens, niah_multivalue 128, fwe 50), the preset's presses at four ratios plus
# adakv_snapkv at 0.5 (whose masked caches decode in the same pool). reasoning: math500-format rows (REASONING_ROWS)
# whose answers run to 256-512 new tokens, under two of kvpress's decoding-time presses at two target sizes, each
# compressing every 32 generated tokens (``presses`` are registry entries there, ``crs`` target sizes).
WORKLOADS = {
    "prefill": dict(
        presses="chunkkv,eg_chunkkv",
        crs="0.5,0.7,0.9",
        tasks="niah_single_1,niah_multikey_2",
        limit=4,
        extra="",
        max_seq_length=4096,
    ),
    "decode": dict(
        presses="chunkkv,eg_chunkkv",
        crs="0.25,0.5,0.75,0.875",
        extra="adakv:0.5",
        tasks="niah_single_1,niah_multivalue,cwe,fwe",
        limit=2,
        max_seq_length=1024,
    ),
    "reasoning": dict(
        presses="decoding_knorm,decoding_streaming_llm",
        crs="64,128",
        extra="",
        tasks="math500",
        limit=8,
        max_seq_length=0,
    ),
}
REASONING_INTERVAL = 32


def reasoning_rows(count: int) -> list[dict]:
    """``count`` MATH-500-format rows (kvpress's columns) asking for a worked product, each allowed 256 to 512 new
    tokens: a long generation under decoding-time compression, on any model."""
    question = "Please reason step by step, and put your final answer within \\boxed{}."
    return [
        {
            "context": f"A crate holds {12 + index} boxes of {7 + 3 * index} apples each. How many apples are in "
            f"{3 + index} such crates? Explain every step of the multiplication.",
            "question": question,
            "answer_prefix": "",
            "answer": str((12 + index) * (7 + 3 * index) * (3 + index)),
            "max_new_tokens": 256 + (256 * index) // max(1, count - 1),
        }
        for index in range(count)
    ]


def benchmark_overrides(args: argparse.Namespace, scratch: Path) -> list[str]:
    """The benchmark of the workload: RULER generated offline, or the reasoning rows written to ``scratch``."""
    if args.workload != "reasoning":
        return [
            "benchmark=ruler_synth",
            f"benchmark.tasks=[{args.tasks}]",
            f"benchmark.max_seq_length={args.max_seq_length}",
        ]
    path = scratch / "math500.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in reasoning_rows(args.limit)))
    return ["benchmark=math500", f"benchmark.path={path}"]


def workload_text(args: argparse.Namespace) -> str:
    """The workload's points and data, as the tables' first line names them."""
    if args.workload == "reasoning":
        return (
            f"presses {args.presses} x target_size {args.crs} (compression_interval {REASONING_INTERVAL}), "
            f"{args.limit} math500-format rows of 256-512 new tokens"
        )
    extra = f" + {args.extra}" if args.extra else ""
    return (
        f"presses {args.presses} x cr {args.crs}{extra}, ruler_synth {args.tasks} x {args.limit}, max_seq_length "
        f"{args.max_seq_length}"
    )


def point_overrides(args: argparse.Namespace) -> list[dict[str, str]]:
    """Each sweep point's overrides: a press at a ratio, or (reasoning) a registry entry at a target size."""
    pairs = [(press, cr) for press in args.presses.split(",") for cr in args.crs.split(",")]
    pairs += [tuple(point.split(":")) for point in args.extra.split(",") if point]
    if args.workload != "reasoning":
        return [{"press": press, "cr": cr} for press, cr in pairs]
    return [
        {"method": method, "target_size": size, "compression_interval": str(REASONING_INTERVAL)}
        for method, size in pairs
    ]


def grids_override(points: list[dict[str, str]]) -> str:
    """One sweep over every point: a union of one-point grids (hydra/sweeper=grids)."""
    grids = ",".join("{" + ",".join(f"{key}:{value}" for key, value in point.items()) + "}" for point in points)
    return f"hydra.sweeper.grids=[{grids}]"


def prefilled(log: str) -> int:
    """The contexts a sweep prefilled, as its log says (evaluate/run/entry.py); 0 when it prefilled none."""
    return sum(int(count) for count in re.findall(r"(\d+) contexts prefilled, once each", log))


def sharded(sweep: list[str], shards: int, out: Path) -> tuple[float, float, int]:
    """The sweep as ``shards`` processes side by side: wall seconds until the last ends, the largest peak resident
    MiB, and the contexts they prefilled together."""
    logs = [out.parent / f"{out.name}-{index}.log" for index in range(shards)]
    start = time.perf_counter()
    children = []
    for index, log in enumerate(logs):
        with log.open("w") as handle:
            command = [*sweep, f"output_dir={out}", *([f"shard={index}/{shards}"] if shards > 1 else [])]
            # As torchrun does: the cores shared among the processes, or their thread pools fight over them.
            threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // shards))} if shards > 1 else {}
            env = {**os.environ, **threads}
            children.append(subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, env=env))
    peak = max([0.0, *(wait_for(child) for child in children)])
    return time.perf_counter() - start, peak, sum(prefilled(log.read_text()) for log in logs)


def compare_shards(sweep: list[str], shards: int, scratch: Path, title: str, out: Path) -> None:
    """One process against ``shards`` side by side: the table of ``--shards``."""
    ways = {count: sharded(sweep, count, scratch / f"shards{count}") for count in (1, shards)}
    runs = sorted(path.name for path in (scratch / "shards1").iterdir() if (path / "metrics.json").exists())
    identical = bool(runs) and all(
        (scratch / f"shards{shards}" / name / file).read_bytes() == (scratch / "shards1" / name / file).read_bytes()
        for name in runs
        for file in ("predictions.jsonl", "metrics.json")
    )
    lines = [
        title,
        "",
        *table_head(["processes", "wall s", "peak RSS MiB (largest process)", "contexts prefilled"], "rrrr"),
        *(table_row(count, f"{wall:.1f}", f"{peak:.0f}", contexts) for count, (wall, peak, contexts) in ways.items()),
        "",
        f"Speed-up of {shards} shards: {ways[1][0] / ways[shards][0]:.2f}x. Contexts prefilled: {ways[1][2]} in one "
        f"process, {ways[shards][2]} over {shards}. predictions.jsonl and metrics.json byte-identical for all "
        f"{len(runs)} points: {identical}.",
    ]
    report = "\n".join(lines)
    print(report)
    write_report(out, report)
    print(f"written to {out}")


def read_rows(path: Path) -> dict[str, str]:
    """Prediction of every sample id in a predictions.jsonl (empty when the file is missing)."""
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {row["id"]: row["prediction"] for row in rows}


def run_record(directory: Path) -> dict:
    path = directory / "run.json"
    return json.loads(path.read_text()) if path.exists() else {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; the workload gives the defaults of the point and data options left out."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        help="extra Hydra override for every run, repeatable (e.g. +model.source.num_hidden_layers=2)",
    )
    parser.add_argument("--dtype", help="model dtype for every run (default: the config's)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "results" / "bench", help="where the tables go")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="prefill", help="defaults of the next five")
    parser.add_argument("--presses")
    parser.add_argument("--crs")
    parser.add_argument("--extra", help="more points beyond presses x crs, as press:cr,press:cr")
    parser.add_argument("--tasks", help="ruler_synth tasks")
    parser.add_argument("--limit", type=int, help="contexts per task")
    parser.add_argument("--max-seq-length", type=int)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shards", type=int, help="time one process against this many shard processes instead")
    args = parser.parse_args(argv)
    for key, value in WORKLOADS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def sweep_label(args: argparse.Namespace) -> str:
    """The model as the tables name it, with the extra overrides it ran under."""
    label = model_label(args)
    return label + f" [{' '.join(args.override)}]" if args.override else label


def common_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides of every run, each way, but the benchmark's (which may need a file written first)."""
    return [
        *model_overrides(args),
        f"limit={args.limit}",
        f"device={args.device}",
        # kvpress's evaluation computes no likelihood fields: each way does kvpress's work, and only that.
        "likelihood=false",
        *([f"dtype={args.dtype}"] if args.dtype else []),
        *args.override,
    ]


def time_ways(
    single: list[str], sweep: list[str], points: list[dict[str, str]], dirs: dict[str, Path]
) -> dict[str, tuple[float, float]]:
    """Wall seconds and peak resident MiB of each way (the separate way's seconds summed over its processes, its peak
    their largest), each writing its runs into ``dirs[way]``."""
    ways = {"harness": timed([*sweep, f"output_dir={dirs['harness']}"])}
    print(f"harness: {ways['harness'][0]:.1f} s")
    ways["harness_one_by_one"] = timed([*sweep, "decode_batch_size=1", f"output_dir={dirs['harness_one_by_one']}"])
    print(f"harness, one-by-one decoding: {ways['harness_one_by_one'][0]:.1f} s")
    separate_wall, separate_peak = 0.0, 0.0
    for point in points:
        # kvpress's evaluate.py: the pipeline, one question at a time (a single run would otherwise use the pool).
        settings = [f"{key}={value}" for key, value in point.items()]
        wall, peak = timed([*single, *settings, "decode_batch_size=1", f"output_dir={dirs['separate']}"])
        separate_wall += wall
        separate_peak = max(separate_peak, peak)
        print(f"  separate {' '.join(settings)}: {wall:.1f} s")
    ways["separate"] = (separate_wall, separate_peak)
    return ways


def run_names(dirs: dict[str, Path]) -> list[str]:
    """The runs the separate way finished, by folder name (the same names each way)."""
    return sorted(path.name for path in dirs["separate"].iterdir() if (path / "predictions.jsonl").exists())


def all_identical(dirs: dict[str, Path], runs: list[str], points: int) -> bool:
    """Whether every point ran each way, with byte-identical predictions."""
    return len(runs) == points and all(
        (dirs[way] / name / "predictions.jsonl").read_bytes()
        == (dirs["separate"] / name / "predictions.jsonl").read_bytes()
        for name in runs
        for way in ("harness", "harness_one_by_one")
    )


def run_details(dirs: dict[str, Path], runs: list[str]) -> list[dict]:
    """Per run and way: its predictions that differ from the separate way's, and run.json's cumulative seconds and
    peak memory (device memory on CUDA, resident memory on CPU)."""
    details = []
    for name in runs:
        reference = read_rows(dirs["separate"] / name / "predictions.jsonl")
        for way in ("harness", "harness_one_by_one", "separate"):
            record = run_record(dirs[way] / name)
            predictions = reference if way == "separate" else read_rows(dirs[way] / name / "predictions.jsonl")
            details.append(
                {
                    "way": way,
                    "run": name,
                    "samples": len(predictions),
                    "differing_from_separate": sum(predictions.get(key) != value for key, value in reference.items()),
                    "wall_s": record.get("wall_seconds"),
                    "prefill_s": record.get("prefill_seconds"),
                    "compress_s": record.get("compress_seconds"),
                    "decode_s": record.get("decode_seconds"),
                    "generated_tokens": record.get("generated_tokens"),
                    "forward_passes_per_question": record.get("forward_passes_per_question"),
                    "peak_memory_mb": record.get("peak_memory_mb"),
                    "device": record.get("device"),
                }
            )
    return details


def passes(details: list[dict], way: str) -> float:
    """Forward passes per answered question, over every point of the way."""
    values = [row["forward_passes_per_question"] for row in details if row["way"] == way]
    return sum(values) / len(values) if values and None not in values else float("nan")


def compress_lines(details: list[dict], per_point: int) -> list[str]:
    """The harness's compression seconds per point: each point's own (the shared scores are paid by the first point
    of each context to ask for them), summed over its contexts."""
    harness = [row for row in details if row["way"] == "harness" and row["compress_s"] is not None]
    return [
        *table_head(["point (harness)", "compress s", "compress ms per sample"], "lrr"),
        *(
            table_row(row["run"], f"{row['compress_s']:.2f}", f"{1000 * row['compress_s'] / per_point:.0f}")
            for row in harness
        ),
        f"Compress seconds, every point of the harness: {sum(row['compress_s'] for row in harness):.2f}.",
    ]


def report_lines(
    args: argparse.Namespace,
    n_samples: int,
    points: int,
    ways: dict[str, tuple[float, float]],
    identical: bool,
    details: list[dict],
) -> list[str]:
    """The sweep's tables: each way's wall time, rate, forward passes and peak memory, then the harness's
    compression seconds per point."""
    names = {
        "harness": "harness: one prefill per context, one decoding pool",
        "harness_one_by_one": "harness with decode_batch_size=1 (kvpress's pipeline)",
        "separate": "one process per point (kvpress evaluation)",
    }
    separate = ways["separate"][0]
    fewer_passes = passes(details, "harness") / passes(details, "separate")
    return [
        f"Sweep: {sweep_label(args)}, {workload_text(args)}, {args.device}; {n_samples} samples in all.",
        "",
        *table_head(["way", "wall s", "samples/s", "forward passes per question", "peak RSS MiB"], "lrrrr"),
        *(
            table_row(name, f"{wall:.1f}", f"{n_samples / wall:.3f}", f"{passes(details, way):.2f}", f"{peak:.0f}")
            for way, name in names.items()
            for wall, peak in [ways[way]]
        ),
        "",
        f"Speed-up: {separate / ways['harness'][0]:.2f}x ({separate / ways['harness_one_by_one'][0]:.2f}x with "
        f"decode_batch_size=1). Forward passes per question: {fewer_passes:.3f} of kvpress's. "
        f"Predictions identical for every point, all three ways: {identical}.",
        "Peak RSS of the one-process-per-point way is the largest single process.",
        "",
        *compress_lines(details, n_samples // points),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common = common_overrides(args)
    points = point_overrides(args)
    n_samples = len(points) * args.limit * len(args.tasks.split(","))
    python = [sys.executable, "-m", "evaluate"]
    with tempfile.TemporaryDirectory() as scratch:
        common += benchmark_overrides(args, Path(scratch))
        # Each way's runs in a folder of its own, the same run names in each, so that their predictions pair up.
        folders = {"harness": "shared", "harness_one_by_one": "one_by_one", "separate": "separate"}
        dirs = {way: Path(scratch) / folder for way, folder in folders.items()}
        print(f"{len(points)} points x {n_samples // len(points)} samples on {sweep_label(args)} ({args.device})")
        warm_up([*python, *common], scratch)
        sweep = [*python, "-m", *common, "hydra/sweeper=grids", grids_override(points)]
        if args.shards:
            title = (
                f"Sweep: {sweep_label(args)}, {len(points)} points, {workload_text(args)}, {args.device}; {n_samples} "
                f"samples in all, on {os.cpu_count()} CPU cores."
            )
            out = args.out_dir / f"shards_{args.workload}_{args.device.split(':')[0]}.md"
            compare_shards(sweep, args.shards, Path(scratch), title, out)
            return
        ways = time_ways([*python, *common], sweep, points, dirs)
        runs = run_names(dirs)
        identical = all_identical(dirs, runs, len(points))
        details = run_details(dirs, runs)
    report = "\n".join(report_lines(args, n_samples, len(points), ways, identical, details))
    print(report)
    out = args.out_dir / f"sweep_{args.workload}_{args.device.split(':')[0]}.md"
    write_report(out, report)
    # Per run: run.json's cumulative seconds and peak memory (device memory on CUDA, resident memory on CPU).
    write_csv(out.with_suffix(".csv"), details, list(details[0]) if details else ["way"])
    print(f"written to {out} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
