"""kvpress's own ``evaluation/evaluate.py``, run on the rows and the model of a PressBench run directory.

The evaluation folder is not in kvpress's wheel; it comes from kvpress's sdist, which pip downloads once into
``$PRESSBENCH_CACHE`` (default ``~/.cache/pressbench``). Its ``EvaluationRunner`` runs as its script runs it (seeds,
``_setup_press``, the pipeline and its attention rule, rows grouped by context or asked one by one for a
``DecodingPress``, ``calculate_metrics``), with two things given from outside, since this machine reaches no hub:
``model`` is the local directory PressBench loads the model from, and ``load_dataset`` returns the rows the run
answered, as PressBench selected them.
"""

import functools
import importlib.util
import subprocess
import sys
import tarfile
import tempfile
import types
from importlib.metadata import version
from pathlib import Path

import datasets
import pandas as pd
from hydra.utils import instantiate
from omegaconf import OmegaConf

from evaluate import rundir
from evaluate.benchmarks.selection import load_samples
from evaluate.models.sources import CACHE_DIR


def evaluation_dir() -> Path:
    """kvpress's ``evaluation`` folder for the installed kvpress, from its sdist (downloaded on first use)."""
    release = f"kvpress-{version('kvpress')}"
    folder = CACHE_DIR / release / "evaluation"
    if not (folder / "evaluate.py").exists():
        with tempfile.TemporaryDirectory() as download:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", f"kvpress=={version('kvpress')}", "--no-binary", ":all:"]
                + ["--no-deps", "--quiet", "--dest", download],
                check=True,
            )
            with tarfile.open(Path(download) / f"{release}.tar.gz") as archive:
                archive.extractall(CACHE_DIR, filter="data")
    return folder


# The other benchmarks' metric packages, which evaluate_registry.py imports at import time: LongBench's jieba,
# fuzzywuzzy and rouge, LOOGLE's bert_score. RULER's calculate_metrics uses none of them, so where one is not
# installed a stand-in that refuses any use takes its place.
OTHER_METRICS = ("jieba", "fuzzywuzzy", "rouge", "bert_score")


def _refusing_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    def refuse(attribute: str):
        def unavailable(*args, **kwargs):
            raise ImportError(f"{name} is not installed; only RULER's metrics run here (scripts/kvpress_evaluation.py)")

        return unavailable

    module.__getattr__ = refuse
    return module


@functools.cache
def _runner_module():
    """evaluate.py imported under another name (PressBench's package is called ``evaluate`` too)."""
    folder = evaluation_dir()
    for name in OTHER_METRICS:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules.setdefault(name, _refusing_module(name))
    sys.path.insert(0, str(folder))  # its own imports: benchmarks, evaluate_registry
    spec = importlib.util.spec_from_file_location("kvpress_evaluate", folder / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_frame(run: Path) -> tuple[pd.DataFrame, str]:
    """The rows a PressBench run answered, as kvpress's RULER frame holds them (plus PressBench's ``id``), and the
    local directory of its model."""
    cfg = OmegaConf.create(rundir.read_yaml(run / rundir.CONFIG)["config"])
    source = instantiate(cfg.model.source)
    if not hasattr(source, "cache_path"):
        raise SystemExit(f"{run}: its model has no local directory for kvpress's evaluate.py to load")
    tokenizer = source.load_tokenizer()
    samples = load_samples(instantiate(cfg.benchmark), tokenizer, cfg.fraction, cfg.limit, cfg.seed)
    frame = pd.DataFrame(
        {
            "id": sample.id,
            "context": sample.context,
            "question": sample.question,
            "answer_prefix": sample.answer_prefix,
            "answer": sample.answers,
            "task": sample.task,
            "max_new_tokens": sample.max_new_tokens,
        }
        for sample in samples
    )
    return frame, str(source.cache_path)


def kvpress_predictions(run: Path, output_dir: Path) -> tuple[dict[str, str], float]:
    """kvpress's evaluate.py on the point of ``run``, in its dtype: each row's predicted answer by PressBench id,
    and the mean over tasks of its ``calculate_metrics``."""
    module = _runner_module()
    record = rundir.read_yaml(run / rundir.CONFIG)
    cfg = record["config"]
    frame, model_dir = run_frame(run)
    module.load_dataset = lambda *args, **kwargs: datasets.Dataset.from_pandas(frame)
    decoding = record.get("decoding") or {}
    config = module.EvaluationConfig(
        dataset="ruler",
        data_dir=str(cfg["benchmark"].get("max_seq_length", "")),
        model=model_dir,
        device=cfg["device"] if cfg["device"] != "auto" else None,
        press_name=record["method"],
        compression_ratio=record["compression_ratio"] or 0.0,
        max_new_tokens=cfg["max_new_tokens"],
        max_context_length=cfg["max_context_length"],
        query_aware=cfg["query_aware"],
        compression_interval=decoding.get("compression_interval"),
        target_size=decoding.get("target_size"),
        output_dir=str(output_dir),
        # As evaluate_config.yaml gives them, with the run's dtype for its "auto".
        model_kwargs={"attn_implementation": None, "dtype": cfg["dtype"]},
        seed=cfg["seed"],
        log_level="WARNING",
    )
    runner = module.EvaluationRunner(config)
    answered: dict[str, pd.DataFrame] = {}
    # The answers as inference left them: calculate_metrics strips them in place, and a CSV reads "" back as NaN.
    runner._save_results = lambda path: answered.setdefault("frame", runner.df.copy())
    runner.run_evaluation()
    metrics = rundir.read_json(next(output_dir.glob("**/metrics.json")))
    score = sum(next(iter(task.values())) for task in metrics.values()) / len(metrics)
    rows = answered["frame"]
    return dict(zip(rows["id"], rows["predicted_answer"], strict=True)), score
