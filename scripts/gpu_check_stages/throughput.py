"""The throughput stage: prefill and decode steps of a random-weight model of an 8B model's shape, against the GPU's
ceilings and an 8B model's reference work, and one profiled decode step (-> OUT/throughput.csv)."""

import argparse
import csv
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpu_check_stages.common import median_seconds, save_fragment, synchronize

# The work of an 8B model, against which the throughput stage sets its timings: a prefill of 4096 tokens and a
# decoding step's weight reads. Their reference times are these over the GPU's ceilings (--peak-tflops, --peak-tbs).
REFERENCE_PREFILL_TFLOP = 70.0
REFERENCE_DECODE_GB = 16.0

SMOKE_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 1024,
    "vocab_size": 8192,
}


def profiler_summary(profile, device: str) -> tuple[str, list[str]]:
    """One line for a profiled step (kernel time, CPU time, launches, top op) and the top rows of its table."""
    averages = profile.key_averages()

    def device_time(event) -> float:
        return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0))

    cpu_ms = sum(event.self_cpu_time_total for event in averages) / 1e3
    if device.startswith("cuda"):
        kernels = [e for e in profile.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
        kernel_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
        device_ms = sum(device_time(event) for event in averages) / 1e3
        top = max(averages, key=device_time)
        line = (
            f"{kernel_ms:.2f} ms in {len(kernels)} CUDA kernels ({device_ms:.2f} ms self CUDA over all ops), "
            f"{cpu_ms:.2f} ms CPU (self, all ops); top: {top.key} {device_time(top) / 1e3:.2f} ms"
        )
        table = profile.key_averages().table(sort_by="self_cuda_time_total", row_limit=8)
    else:
        top = max(averages, key=lambda event: event.self_cpu_time_total)
        line = f"{cpu_ms:.2f} ms CPU (self, all ops); top: {top.key} {top.self_cpu_time_total / 1e3:.2f} ms"
        table = profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
    return line, table.splitlines()


@dataclass
class Setup:
    """The random-weight model on the device, and the sizes the throughput fractions are computed from."""

    source: object
    model: object
    device: str
    dtype: str
    shape: dict
    tokens: int
    head_dim: int
    build_seconds: float
    weight_bytes: int
    kv_bytes_per_token: int


def build(args: argparse.Namespace) -> Setup:
    import torch

    from evaluate.models.random_models import RandomModel

    device = args.device
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    shape = SMOKE_SHAPE if args.smoke else {}
    source = RandomModel(**shape)
    start = time.perf_counter()
    model = source.load_model(device, dtype, "sdpa")
    synchronize(device)
    build_seconds = time.perf_counter() - start
    element = torch.finfo(getattr(torch, dtype)).bits // 8
    head_dim = source.hidden_size // source.num_attention_heads
    return Setup(
        source=source,
        model=model,
        device=device,
        dtype=dtype,
        shape=shape,
        tokens=512 if args.smoke else 4096,
        head_dim=head_dim,
        build_seconds=build_seconds,
        weight_bytes=source.parameter_count() * element,
        kv_bytes_per_token=2 * source.num_hidden_layers * source.num_key_value_heads * head_dim * element,
    )


def run_prefill(setup: Setup, input_ids):
    from transformers import DynamicCache

    cache = DynamicCache()
    setup.model.model(input_ids=input_ids, past_key_values=cache)
    return cache


def prefill_row(setup: Setup, input_ids, peak_tflops: float) -> dict:
    """The bare decoder's prefill, median of 3, against the GPU's ceiling and an 8B model's reference."""
    source, tokens = setup.source, setup.tokens
    layers, heads, head_dim = source.num_hidden_layers, source.num_attention_heads, setup.head_dim
    prefill_seconds = median_seconds(lambda: run_prefill(setup, input_ids), setup.device, 1, 3)
    # Dense FLOPs without the output layer (kvpress's prefill runs the bare decoder), plus causal attention.
    flops = (
        2 * source.parameter_count(embeddings=False) * tokens
        + 2 * 2 * layers * heads * head_dim * tokens * (tokens + 1) / 2
    )
    reference_tflop, reference_seconds = REFERENCE_PREFILL_TFLOP, REFERENCE_PREFILL_TFLOP / peak_tflops
    return {
        "measure": "prefill",
        "batch": 1,
        "tokens": tokens,
        "ms": prefill_seconds * 1e3,
        "tflops": flops / prefill_seconds / 1e12,
        "tb_per_s": "",
        "fraction_of_peak": flops / prefill_seconds / 1e12 / peak_tflops,
        "fraction_of_reference": reference_seconds / prefill_seconds,
        "note": f"{flops / 1e12:.1f} TFLOP; reference {reference_tflop} TFLOP in {reference_seconds:.3g} s",
    }


def decode_step(setup: Setup, cache, batch: int, cached: int) -> Callable[[], None]:
    """One decoding step of ``batch`` rows over the first ``cached`` tokens of the prefill, cropped back after."""
    import torch
    from transformers import DynamicCache

    step_cache = DynamicCache()
    for index, layer in enumerate(cache.layers):
        step_cache.update(
            layer.keys[:, :, :cached].expand(batch, -1, -1, -1).contiguous(),
            layer.values[:, :, :cached].expand(batch, -1, -1, -1).contiguous(),
            index,
        )
    step_ids = torch.randint(0, setup.source.vocab_size - 3, (batch, 1), device=setup.device)
    positions = torch.full((batch, 1), setup.tokens, device=setup.device)

    def step(c=step_cache, i=step_ids, p=positions, n=cached):
        setup.model(input_ids=i, past_key_values=c, position_ids=p)
        c.crop(n)

    return step


def decode_row(setup: Setup, batch: int, cached: int, seconds: float, peak_tbs: float) -> dict:
    """A decoding step's bytes read (weights plus cache) per second, against the GPU's ceiling and the reference."""
    moved = setup.weight_bytes + batch * cached * setup.kv_bytes_per_token
    reference_gb, reference_step = REFERENCE_DECODE_GB, REFERENCE_DECODE_GB / 1e3 / peak_tbs
    return {
        "measure": "decode step",
        "batch": batch,
        "tokens": cached,
        "ms": seconds * 1e3,
        "tflops": "",
        "tb_per_s": moved / seconds / 1e12,
        "fraction_of_peak": moved / seconds / 1e12 / peak_tbs,
        "fraction_of_reference": reference_step / seconds,
        "note": f"{moved / 1e9:.2f} GB read (weights + cache); reference {reference_gb} GB in "
        f"{reference_step * 1e3:.2g} ms",
    }


def profile_step(step: Callable[[], None], device: str) -> tuple[str, list[str]]:
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        step()
        synchronize(device)
    return profiler_summary(profile, device)


def decode_rows(setup: Setup, cache, args: argparse.Namespace) -> tuple[list[dict], str, list[str]]:
    """Decode steps at each batch size over the whole prefill and a tenth of it; the profiled step at batch 1."""
    batches = (1, 4) if args.smoke else (1, 4, 16)
    tokens = setup.tokens
    rows, profile_line, profile_table = [], "", []
    for cached in (tokens, max(1, int(tokens * 0.1))):
        for batch in batches:
            step = decode_step(setup, cache, batch, cached)
            seconds = median_seconds(step, setup.device, 3, 10 if args.smoke else 20)
            rows.append(decode_row(setup, batch, cached, seconds, args.peak_tbs))
            if cached == tokens and batch == 1:
                profile_line, profile_table = profile_step(step, setup.device)
    return rows, profile_line, profile_table


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({key: f"{value:.4g}" if isinstance(value, float) else value for key, value in row.items()})


def cell(value, digits=3):
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def summary_lines(setup: Setup, args: argparse.Namespace, rows: list[dict], peak: float | None) -> list[str]:
    """The model, the ceilings and the reference, and the measurements' table."""
    name = "Llama-3.1-8B's shape" if not args.smoke else f"smoke shape {setup.shape}"
    return [
        f"Random-weight model of {name} ({setup.source.parameter_count() / 1e9:.2f} B parameters, {setup.dtype}, "
        f"sdpa), built on {setup.device} in {setup.build_seconds:.1f} s"
        + (f"; peak {peak:.1f} GiB allocated" if peak else "")
        + ".",
        f"Ceilings (--peak-tflops, --peak-tbs): {args.peak_tflops:.0f} TFLOP/s bf16, {args.peak_tbs} TB/s. "
        f"`of reference`: an 8B model's work at those ceilings (prefill of 4096 tokens, {REFERENCE_PREFILL_TFLOP:.0f} "
        f"TFLOP: {REFERENCE_PREFILL_TFLOP / args.peak_tflops * 1e3:.0f} ms; decode step, {REFERENCE_DECODE_GB:.0f} GB "
        f"of weights: {REFERENCE_DECODE_GB / args.peak_tbs:.1f} ms) over the measured time.",
        "",
        "| measure | batch | tokens | ms | TFLOP/s | TB/s | of peak | of reference |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {r['measure']} | {r['batch']} | {r['tokens']} | {r['ms']:.2f} | {cell(r['tflops'])} | "
            f"{cell(r['tb_per_s'])} | {cell(r['fraction_of_peak'])} | {cell(r['fraction_of_reference'])} |"
            for r in rows
        ),
    ]


def stage_throughput(args: argparse.Namespace) -> int:
    import torch

    setup = build(args)
    input_ids = torch.randint(0, setup.source.vocab_size - 3, (1, setup.tokens), device=setup.device)
    with torch.no_grad():
        rows = [prefill_row(setup, input_ids, args.peak_tflops)]
        decoding, profile_line, profile_table = decode_rows(setup, run_prefill(setup, input_ids), args)
        rows += decoding
    peak = torch.cuda.max_memory_allocated() / 2**30 if setup.device.startswith("cuda") else None
    write_csv(args.out / "throughput.csv", rows)
    lines = [
        *summary_lines(setup, args, rows, peak),
        "",
        f"torch.profiler, one decode step (batch 1, {setup.tokens} cached tokens): {profile_line}",
        "",
        "```",
        *profile_table,
        "```",
    ]
    save_fragment(args.work, "throughput", {"lines": lines})
    print("\n".join(lines))
    return 0
