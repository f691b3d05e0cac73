"""The launcher stage: a small multirun through hydra/launcher=gpus against the default launcher, same points."""

import argparse
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_stages.common import REPO, save_fragment


def run_launcher(launcher: str, common: list[str], base: Path) -> tuple[int, float]:
    """``python -m evaluate -m`` through one launcher: its exit code and seconds (its output's tail printed)."""
    start = time.perf_counter()
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "evaluate",
            "-m",
            *common,
            f"hydra/launcher={launcher}",
            f"output_dir={base / launcher}",
            f"hydra.sweep.dir={base / (launcher + '_sweep')}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    print(completed.stdout[-3000:], completed.stderr[-3000:], sep="\n")
    return completed.returncode, time.perf_counter() - start


def compare_runs(base: Path) -> tuple[list[str], int, int, set]:
    """The gpus launcher's worker logs and runs against the default launcher's: lines, runs, identical, devices."""
    from evaluate import rundir

    lines = []
    logs = sorted((base / "gpus_sweep" / "gpus").glob("*.log")) if (base / "gpus_sweep").exists() else []
    lines.append(f"- gpus launcher worker logs: {', '.join(log.name for log in logs) or 'none'}")
    runs = sorted(path.name for path in (base / "gpus").iterdir()) if (base / "gpus").exists() else []
    same, devices = 0, set()
    for name in runs:
        record = rundir.read_json(base / "gpus" / name / rundir.RUN) or {}
        devices.add(record.get("device"))
        a = (base / "gpus" / name / rundir.PREDICTIONS).read_bytes()
        b = base / "shared_prefill" / name / rundir.PREDICTIONS
        same += b.exists() and a == b.read_bytes()
    lines.append(
        f"- {len(runs)} runs through the gpus launcher on {', '.join(map(str, sorted(devices, key=str)))}; "
        f"predictions identical to the default launcher's in {same}/{len(runs)}"
    )
    return lines, len(runs), same, devices


def stage_launcher(args: argparse.Namespace) -> int:
    """A small multirun through hydra/launcher=gpus against the default launcher, same points."""
    base = args.work / "launcher"
    device = "auto" if args.device.startswith("cuda") else args.device
    common = [
        "model=tiny_random",
        f"device={device}",
        "press=topk,eg_chunkkv",
        "cr=0.5,0.9",
        "limit=1",
        "benchmark.tasks=[niah_single_1]",
        "benchmark.max_seq_length=1024",
    ]
    results = {launcher: run_launcher(launcher, common, base) for launcher in ("gpus", "shared_prefill")}
    lines = [f"`python -m evaluate -m {' '.join(common)} hydra/launcher=...`", ""]
    ok = all(code == 0 for code, _ in results.values())
    lines += [f"- {name}: exit {code}, {seconds:.1f} s" for name, (code, seconds) in results.items()]
    compared, runs, same, devices = compare_runs(base)
    lines += compared
    expected_device = "cuda" if args.device.startswith("cuda") else args.device
    ok = ok and runs == 4 and same == runs and devices == {expected_device}
    save_fragment(args.work, "launcher", {"lines": lines})
    print("\n".join(lines))
    return 0 if ok else 1
