"""What the stages of scripts/gpu_check.py share: the repository on sys.path, their JSON fragments and timing."""

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def save_fragment(work: Path, stage: str, fragment: dict) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{stage}.json").write_text(json.dumps(fragment, indent=1, default=str))


def synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], device: str, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
