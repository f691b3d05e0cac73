"""The env stage: versions, the GPU, imports of every harness module, and ruler_synth's offline data."""

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from gpu_check_stages.common import save_fragment

PACKAGES = (
    "torch transformers tokenizers huggingface-hub safetensors accelerate kvpress hydra-core omegaconf "
    "antlr4-python3-runtime datasets pyarrow pandas numpy fsspec dill multiprocess fire cachetools wonderwords nltk "
    "needlehaystack pressbench"
).split()
IMPORTS = (
    "evaluate.engine.pipeline_engine",
    "evaluate.run.entry",
    "evaluate.engine.decoding_pool",
    "evaluate.models.random_models",
    "evaluate.benchmarks.ruler_synth",
    "presses.eg_chunkkv",
    "scorers.dropkv",
    "hydra_plugins.pressbench_gpus_launcher.gpus_launcher",
)


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "missing"
    return versions


def gpu_description() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none"
    props = torch.cuda.get_device_properties(0)
    return (
        f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
        f"capability {props.major}.{props.minor}, CUDA {torch.version.cuda}"
    )


def nvidia_smi() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi not available"


def machine_lines() -> list[str]:
    """Python, CPUs, platform, torch, the GPU and every package's version."""
    versions = package_versions()
    import torch

    gpu = gpu_description()
    smi = nvidia_smi()
    return [
        f"- python {platform.python_version()} ({sys.executable}), {os.cpu_count()} CPUs, {platform.platform()}",
        f"- torch {torch.__version__}; GPU: {gpu}; nvidia-smi: {smi or 'n/a'}",
        "- packages: " + ", ".join(f"{name} {version}" for name, version in versions.items()),
    ]


def import_lines() -> tuple[list[str], int]:
    """Every failing import of IMPORTS and of datasets (not only the first), and where kvpress comes from."""
    lines, failures = [], 0
    for module in IMPORTS:
        try:
            __import__(module)
        except Exception as error:  # report every failing import, not only the first
            failures += 1
            lines.append(f"- **import {module} failed**: {type(error).__name__}: {error}")
    try:
        import datasets

        if getattr(datasets, "STUB", False):
            lines.append("- datasets did not import on this machine and is a stub (kvpress only needs the name)")
    except Exception as error:
        failures += 1
        lines.append(f"- **import datasets failed**: {type(error).__name__}: {error}")
    import kvpress
    import transformers

    lines.append(
        f"- transformers from {Path(transformers.__file__).parent}, kvpress from {Path(kvpress.__file__).parent}"
    )
    return lines, failures


def ruler_synth_lines() -> tuple[list[str], int]:
    """ruler_synth's offline data: essays (needlehaystack), Punkt (nltk) and word keys (wonderwords)."""
    try:
        from hydra.utils import instantiate

        from evaluate.models.random_models import build_tiny_tokenizer
        from tests.support import compose_config

        tokenizer = build_tiny_tokenizer()
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as scratch:
            cfg = compose_config(
                Path(scratch), "benchmark.max_seq_length=4096", "benchmark.tasks=[niah_single_2,niah_single_1]"
            )
            samples = instantiate(cfg.benchmark).load(tokenizer, 1)
        line = (
            f"- ruler_synth data: {len(samples)} samples ({', '.join(sample.task for sample in samples)}) generated "
            f"offline in {time.perf_counter() - start:.1f} s"
        )
        return [line], int(len(samples) != 2)
    except Exception as error:
        return [f"- **ruler_synth data check failed**: {type(error).__name__}: {error}"], 1


def stage_env(args: argparse.Namespace) -> int:
    lines = machine_lines()
    imports, import_failures = import_lines()
    data, data_failures = ruler_synth_lines()
    lines += imports + data
    save_fragment(args.work, "env", {"lines": lines})
    print("\n".join(lines))
    return 1 if import_failures + data_failures else 0
