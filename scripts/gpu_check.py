"""Stages of scripts/gpu_check.sh: PressBench's CUDA code paths checked for correctness and timed.

    python scripts/gpu_check.py env          --device cuda --out OUT --work WORK   # versions, imports, ruler_synth data
    python scripts/gpu_check.py correctness  --device cuda --out OUT --work WORK   # -> OUT/correctness.csv
    python scripts/gpu_check.py throughput   --device cuda --out OUT --work WORK   # -> OUT/throughput.csv
    python scripts/gpu_check.py launcher     --device cuda --out OUT --work WORK   # hydra/launcher=gpus
    python scripts/gpu_check.py summarize    --device cuda --out OUT --work WORK   # -> OUT/summary.md

Each stage leaves a JSON fragment in WORK that ``summarize`` turns into summary.md together with the stage
statuses gpu_check.sh records (WORK/stages.tsv) and the tables of scripts/bench_presses.py and bench_sweep.py.
``--smoke 1`` scales every model and context down so that all stages run in minutes on a 2-core CPU.
Each stage is a module of scripts/gpu_check_stages/ (env.py, correctness.py, throughput.py, launcher.py,
summarize.py), and common.py holds what they share. docs/gpu.md says what each stage measures and why.
"""

import argparse
import sys
from pathlib import Path

from gpu_check_stages.correctness import stage_correctness
from gpu_check_stages.env import stage_env
from gpu_check_stages.launcher import stage_launcher
from gpu_check_stages.summarize import stage_summarize
from gpu_check_stages.throughput import stage_throughput

STAGES = {
    "env": stage_env,
    "correctness": stage_correctness,
    "throughput": stage_throughput,
    "launcher": stage_launcher,
    "summarize": stage_summarize,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=list(STAGES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="folder of the files that come back")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder shared by the stages")
    parser.add_argument("--smoke", type=int, default=0, help="1: scaled-down shapes for a CPU dry run")
    parser.add_argument("--budget", type=int, help="summarize: the script's time budget in seconds")
    # Datasheet ceilings of the GPU the check runs on; the defaults are an H200's (dense bf16, HBM3e).
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="throughput: the GPU's dense bf16 TFLOP/s")
    parser.add_argument("--peak-tbs", type=float, default=4.8, help="throughput: the GPU's memory bandwidth, TB/s")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    return STAGES[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())
