"""The summarize stage: the stage statuses, the stages' fragments and the bench scripts' tables -> OUT/summary.md."""

import argparse
import csv
import json
import time
from pathlib import Path


def markdown_section(path: Path, start: str | None = None) -> list[str]:
    """A file's lines, or those from the heading ``start`` to the next heading of the same level."""
    if not path.exists():
        return [f"({path.name} was not written)"]
    lines = path.read_text().splitlines()
    if start is None:
        return lines
    try:
        first = lines.index(start)
    except ValueError:
        return lines
    level = start.split(" ")[0]
    end = next((i for i in range(first + 1, len(lines)) if lines[i].startswith(level + " ")), len(lines))
    return lines[first + 1 : end]


def press_targets(path: Path) -> list[str]:
    """The setting line and the targets table of bench_presses.py's Markdown."""
    lines = markdown_section(path)
    heading = next((line for line in lines if line.startswith("## Targets")), None)
    setting = [line for line in lines if line.startswith("One attention layer")]
    if heading is None:
        return lines
    return [*setting, "", f"Targets: {heading.removeprefix('## Targets').strip()}", *markdown_section(path, heading)]


def press_ratios(path: Path) -> list[str]:
    """EG-ChunkKV's compress time over kvpress's EntropyGatedChunkKVPress's, scorer by scorer."""
    if not path.exists():
        return []
    with path.open() as handle:
        rows = {(row["press"], row["scorer"]): row for row in csv.DictReader(handle)}
    lines = []
    for (press, scorer), row in sorted(rows.items()):
        upstream = rows.get(("eg_chunkkv_upstream", scorer))
        if press == "eg_chunkkv" and upstream:
            ours, theirs = float(row["ms"]), float(upstream["ms"])
            lines.append(f"| {scorer} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f} |")
    if not lines:
        return []
    return ["| scorer | eg_chunkkv ms | kvpress EG ms | ratio |", "|---|---:|---:|---:|", *lines]


def failure_note(log: list[str], stage: str) -> str | None:
    """A failed or stopped stage's last line of output in the log (usually the exception), or None."""
    start = next((i for i, line in enumerate(log) if line.startswith(f"## stage {stage} ")), None)
    if start is None:
        return None
    end = next((i for i in range(start + 1, len(log)) if log[i].startswith("## stage ")), len(log))
    tail = [line.strip() for line in log[start + 1 : end] if line.strip()]
    errors = [line for line in tail if "Error" in line or "Exception" in line]
    return (errors or tail or [""])[-1][:200].replace("|", "/")


def stage_rows(work: Path, out: Path) -> list[list[str]]:
    """gpu_check.sh's stage statuses (WORK/stages.tsv); a failed or stopped stage's note gets its last line."""
    stages = []
    stages_path = work / "stages.tsv"
    if stages_path.exists():
        stages = [line.split("\t") for line in stages_path.read_text().splitlines() if line.strip()]
    log = (out / "log.md").read_text(errors="replace").splitlines() if (out / "log.md").exists() else []
    for cols in stages:
        if len(cols) >= 2 and cols[1] in ("failed", "timeout"):
            note = failure_note(log, cols[0])
            if note is not None:
                cols[4:] = [f"{cols[4]} {note}".strip() if len(cols) > 4 else note]
    return stages


def fragment(work: Path, name: str) -> list[str]:
    path = work / f"{name}.json"
    return json.loads(path.read_text())["lines"] if path.exists() else ["(not run, or did not finish)"]


def header_lines(args: argparse.Namespace, stages: list[list[str]]) -> list[str]:
    """The title, when and how the check ran, and the stages' table."""
    return [
        f"# PressBench GPU check ({args.device})",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; `bash scripts/gpu_check.sh --device {args.device}`"
        f"{' (smoke shapes)' if args.smoke else ''}, budget {args.budget} s. Full output: log.md.",
        "",
        "## Stages",
        "",
        "| stage | status | exit | seconds | note |",
        "|---|---|---:|---:|---|",
        *(f"| {' | '.join((cols + [''] * 5)[:5])} |" for cols in stages),
        "",
    ]


def bench_lines(out: Path, kind: str) -> list[str]:
    """The tables of scripts/bench_presses.py, bench_decoding.py, bench_pool_agreement.py and bench_sweep.py."""
    return [
        "## Press overhead (scripts/bench_presses.py)",
        "",
        *press_targets(out / f"presses_{kind}.md"),
        "",
        "EG-ChunkKV against kvpress's own EntropyGatedChunkKVPress (compress, medians):",
        "",
        *(press_ratios(out / f"presses_{kind}.csv") or ["(no presses table)"]),
        "",
        "## Decoding pool against one-by-one decoding (scripts/bench_decoding.py)",
        "",
        *markdown_section(out / f"pool_{kind}.md"),
        "",
        "## The pool against one by one in bfloat16: rows whose answers part (scripts/bench_pool_agreement.py)",
        "",
        *markdown_section(out / f"pool_agreement_{kind}.md"),
        "",
        "## Sweep: harness against one process per point (scripts/bench_sweep.py)",
        "",
        *markdown_section(out / f"sweep_prefill_{kind}.md"),
        "",
        "## Reasoning: decoding-time presses, harness against one process per point (bench_sweep.py --workload "
        "reasoning)",
        "",
        *markdown_section(out / f"sweep_reasoning_{kind}.md"),
        "",
    ]


def stage_summarize(args: argparse.Namespace) -> int:
    kind = args.device.split(":")[0]
    lines = [
        *header_lines(args, stage_rows(args.work, args.out)),
        "## Environment",
        "",
        *fragment(args.work, "env"),
        "",
        "## Correctness",
        "",
        *fragment(args.work, "correctness"),
        "",
        "## Prefill and decode throughput (random weights)",
        "",
        *fragment(args.work, "throughput"),
        "",
        *bench_lines(args.out, kind),
        "## gpus launcher",
        "",
        *fragment(args.work, "launcher"),
        "",
    ]
    (args.out / "summary.md").write_text("\n".join(lines))
    return 0
