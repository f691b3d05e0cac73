"""One worker of the ``gpus`` launcher: ``python -m hydra_plugins.pressbench_gpus_launcher._worker TASK RESULT``.

TASK is the pickle the launcher wrote (this worker's points, checked and resolved by the launcher); RESULT
receives ``{"metrics": [...]}`` in job order, or ``{"error": "..."}``. The launcher has already set
CUDA_VISIBLE_DEVICES to this worker's GPU. (Hydra's plugin scan skips modules whose name starts with ``_``.)
"""

import json
import os
import pickle
import sys
import traceback
from pathlib import Path


def main(task_path: str, result_path: str) -> int:
    with open(task_path, "rb") as handle:
        task = pickle.load(handle)

    try:
        from evaluate.run.entry import run_points

        result = {"metrics": run_points(task["points"])}
    except Exception as error:
        traceback.print_exc()
        result = {"error": f"{type(error).__name__}: {error}"}
    staging = Path(f"{result_path}.partial")
    staging.write_text(json.dumps(result), encoding="utf-8")
    os.replace(staging, result_path)
    return 0 if "metrics" in result else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
