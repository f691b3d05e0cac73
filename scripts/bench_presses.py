"""Time score + compress of one attention layer for every press x scorer of the config tree.

    python scripts/bench_presses.py                      # cuda if available, else cpu (smaller default shapes)
    python scripts/bench_presses.py --device cpu --tokens 2048 --repeats 5

Each press is built from its real Hydra config (conf/press/*.yaml x conf/scorer/*.yaml) and called as kvpress's
forward hook calls it, ``press.compress(module, hidden_states, keys, values, None, kwargs)``, on one Llama
attention layer with random weights: the prefill of ``--tokens`` tokens, its post-RoPE keys and its values.
Each scorer's ``score`` is also timed alone. Calls are interleaved round-robin over the cases, so drift in machine
load spreads evenly over them, and each time is the median over ``--repeats`` after ``--warmup`` untimed rounds.
Writes results/bench/presses_{device}.md and .csv.
"""

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, apply_rotary_pos_emb

ROOT = Path(__file__).resolve().parent.parent
# tests/test_presses.py loads this file by its path, where scripts/ is not on sys.path.
sys.path.insert(0, str(ROOT / "scripts"))

from bench_common import synchronize, table_head, table_row, time_interleaved, write_csv, write_report  # noqa: E402

CONF_DIR = ROOT / "conf"
# Llama-3-8B's attention on GPU; on CPU the same 4096 tokens (so the same number of chunks for the chunk
# presses) with a quarter of the heads, to keep the run to minutes on a laptop-class CPU.
SHAPES = {"cuda": (4096, 32, 8, 128), "cpu": (4096, 8, 2, 128)}
TARGETS = "DropKV score <= 1.5x SnapKV score; EG-ChunkKV compress <= 1.2x ChunkKV compress (same scorer)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda or cuda:N")
    parser.add_argument("--tokens", type=int, help="context length (default 4096)")
    parser.add_argument("--heads", type=int, help="query heads (default: 32 on cuda, 8 on cpu)")
    parser.add_argument("--kv-heads", type=int, help="KV heads (default: 8 on cuda, 2 on cpu)")
    parser.add_argument("--head-dim", type=int, help="head dimension (default 128)")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--cr", type=float, default=0.5, help="compression ratio (default 0.5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds before timing (default 3)")
    parser.add_argument("--repeats", type=int, help="timed rounds (default: 20 on cuda, 7 on cpu)")
    parser.add_argument("--presses", nargs="*", help="conf/press names (default: every press that compresses)")
    parser.add_argument("--scorers", nargs="*", help="conf/scorer names (default: all)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "results" / "bench")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(args.device).type
    if kind not in SHAPES:
        parser.error(f"--device {args.device}: only cpu and cuda are supported")
    tokens, heads, kv_heads, head_dim = SHAPES[kind]
    args.tokens = args.tokens or tokens
    args.heads = args.heads or heads
    args.kv_heads = args.kv_heads or kv_heads
    args.head_dim = args.head_dim or head_dim
    args.dtype = args.dtype or ("bfloat16" if kind == "cuda" else "float32")
    args.repeats = args.repeats or (20 if kind == "cuda" else 7)
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    return args


def build_layer(args: argparse.Namespace) -> tuple[LlamaAttention, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """One Llama attention layer with random weights, and the prefill inputs its forward hook would see."""
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(
        hidden_size=args.heads * args.head_dim,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=max(args.tokens, 8192),
    )
    # AdaKV refuses eager attention; the harness runs sdpa.
    config._attn_implementation = "sdpa"
    module = LlamaAttention(config, layer_idx=0).to(args.device, dtype).eval()
    # kvpress attaches the model's rotary embedding to every attention layer (ExpectedAttention reads it).
    module.rotary_emb = LlamaRotaryEmbedding(config).to(args.device)
    hidden_states = torch.randn(1, args.tokens, config.hidden_size, device=args.device, dtype=dtype)
    position_ids = torch.arange(args.tokens, device=args.device).unsqueeze(0)
    cos, sin = module.rotary_emb(hidden_states, position_ids)
    with torch.no_grad():
        shape = (1, args.tokens, args.kv_heads, args.head_dim)
        keys = module.k_proj(hidden_states).view(shape).transpose(1, 2)
        values = module.v_proj(hidden_states).view(shape).transpose(1, 2).contiguous()
        queries = torch.empty(1, args.heads, args.tokens, args.head_dim, device=args.device, dtype=dtype)
        _, keys = apply_rotary_pos_emb(queries, keys, cos, sin)
    kwargs = {"position_embeddings": (cos, sin), "cache_position": position_ids[0], "attention_mask": None}
    return module, hidden_states, keys.contiguous(), values, kwargs


def compose_press(press: str, scorer: str, cr: float):
    """The (press, scorer) pair as the harness builds it, and the run's method name."""
    cfg = compose(config_name="config", overrides=[f"press={press}", f"scorer={scorer}", f"cr={cr}"])
    return instantiate(cfg.press.press), instantiate(cfg.scorer.press), cfg.press.method


def peak_extra_mib(fn: Callable[[], object], device: str) -> float:
    """Peak memory allocated by one call above what was allocated before it (outputs included), in MiB.

    CUDA: the caching allocator's ``max_memory_allocated``. CPU: torch's CPU allocator events recorded by the
    profiler (each allocation and free of a tensor, in order), so only torch tensors count, not the Python heap.
    """
    if device.startswith("cuda"):
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        fn()
    with tempfile.TemporaryDirectory() as directory:
        trace = Path(directory) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted(
        (event["ts"], event["args"]["Bytes"])
        for event in events
        if event.get("name") == "[memory]" and event["args"].get("Device Type") == 0
    )
    current = peak = 0
    for _, size in memory:
        current += size
        peak = max(peak, current)
    return peak / 2**20


def ratio(numerator: float, denominator: float | None) -> float | None:
    return None if denominator is None else numerator / denominator


def fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


# A Layer: the attention module, then the hidden states, keys, values and kwargs its forward hook sees.
Layer = tuple[LlamaAttention, torch.Tensor, torch.Tensor, torch.Tensor, dict]


def case_names(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The conf/press and conf/scorer names to time: those given, else every press that compresses and every scorer."""
    # press=none compresses nothing, so it has nothing to time; press=registry is kvpress's entries by method=, which
    # hold no inner scorer to pair with the scorers below.
    presses = args.presses or sorted(
        path.stem
        for path in (CONF_DIR / "press").glob("*.yaml")
        if OmegaConf.to_container(OmegaConf.load(path))["press"] is not None and path.stem != "registry"
    )
    scorers = args.scorers or sorted(path.stem for path in (CONF_DIR / "scorer").glob("*.yaml"))
    return presses, scorers


def setting_text(args: argparse.Namespace) -> str:
    """The shapes, device and timing rule, as the printout and the table's introduction name them."""
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    return (
        f"{args.tokens} tokens, {args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, "
        f"{args.dtype}, cr {args.cr}, device {args.device} ({device_name}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads; median of {args.repeats} after {args.warmup} warm-up rounds"
    )


def build_cases(
    args: argparse.Namespace, presses: list[str], scorers: list[str], layer: Layer
) -> tuple[dict[tuple[str, str], Callable[[], object]], dict[tuple[str, str], str]]:
    """Every (press, scorer) pair's compress call on ``layer``, and each scorer's score alone (as press "score"), by
    (press, scorer); and each case's method name."""
    module, hidden_states, keys, values, kwargs = layer
    cases: dict[tuple[str, str], Callable[[], object]] = {}
    methods: dict[tuple[str, str], str] = {}
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for scorer in scorers:
            for press_name in presses:
                press, scorer_press, method = compose_press(press_name, scorer, args.cr)
                methods[press_name, scorer] = method
                cases[press_name, scorer] = lambda p=press: p.compress(
                    module, hidden_states, keys, values, None, kwargs
                )
            # The bare scorer's score alone, for the scoring-cost comparison.
            cases["score", scorer] = lambda s=scorer_press: s.score(module, hidden_states, keys, values, None, kwargs)
            methods["score", scorer] = f"{scorer} (score only)"
    return cases, methods


def result_rows(
    methods: dict[tuple[str, str], str],
    medians: dict[str, float],
    minima: dict[str, float],
    memory: dict[tuple[str, str], float],
) -> list[dict]:
    """A row per case, in the cases' order: its times, its ratios to SnapKV and ChunkKV, and its peak extra memory."""
    rows = []
    snapkv = medians.get("topk/snapkv")
    snapkv_score = medians.get("score/snapkv")
    for press_name, scorer in methods:
        seconds = medians[f"{press_name}/{scorer}"]
        is_score = press_name == "score"
        rows.append(
            {
                "press": press_name,
                "scorer": scorer,
                "method": methods[press_name, scorer],
                "ms": seconds * 1e3,
                "min_ms": minima[f"{press_name}/{scorer}"] * 1e3,
                "vs_snapkv": ratio(seconds, snapkv_score if is_score else snapkv),
                "vs_chunkkv": None if is_score else ratio(seconds, medians.get(f"chunkkv/{scorer}")),
                "peak_extra_mib": memory[press_name, scorer],
            }
        )
    return rows


def target_rows(
    scorers: list[str], medians: dict[str, float], minima: dict[str, float]
) -> list[tuple[str, float, float, float]]:
    """Each of TARGETS's ratios that the timed cases allow: its name, of medians, of minima, and its bound."""
    comparisons = [("DropKV score / SnapKV score", "score/dropkv", "score/snapkv", 1.5)]
    for scorer in scorers:
        for press_name in ("eg_chunkkv", "eg_chunkkv_upstream"):
            comparisons.append(
                (f"{press_name} / chunkkv compress, {scorer}", f"{press_name}/{scorer}", f"chunkkv/{scorer}", 1.2)
            )
    return [
        (name, medians[a] / medians[b], minima[a] / minima[b], bound)
        for name, a, b, bound in comparisons
        if a in medians and b in medians
    ]


def report_lines(
    argv: list[str] | None, device_kind: str, setting: str, targets: list[tuple], rows: list[dict]
) -> list[str]:
    """The Markdown: the command, the setting, the targets' table and every case's row."""
    return [
        f"# Press overhead on {device_kind}",
        "",
        f"`{' '.join(['python scripts/bench_presses.py', *(sys.argv[1:] if argv is None else argv)])}`",
        "",
        f"One attention layer's `score` + `compress` (prefill): {setting}.",
        "Ratios are of medians. `vs snapkv`: time over `topk/snapkv` compress (score-only rows: over SnapKV's"
        " score). `vs chunkkv`: time over `chunkkv` compress with the same scorer. Peak extra: memory allocated"
        " during the call above what was allocated before it, outputs included"
        + (" (CUDA max_memory_allocated)." if device_kind == "cuda" else " (torch CPU allocator events)."),
        "",
        f"## Targets ({TARGETS})",
        "",
        *table_head(["ratio", "of medians", "of minima", "target", "met (medians)"], "lrrrl"),
        *(
            table_row(name, f"{value:.2f}", f"{lowest:.2f}", bound, "yes" if value <= bound else "no")
            for name, value, lowest, bound in targets
        ),
        "",
        "## All presses",
        "",
        *table_head(
            ["press", "scorer", "method", "median ms", "min ms", "vs snapkv", "vs chunkkv", "peak extra MiB"],
            "lllrrrrr",
        ),
        *(
            table_row(
                r["press"],
                r["scorer"],
                r["method"],
                f"{r['ms']:.2f}",
                f"{r['min_ms']:.2f}",
                fmt(r["vs_snapkv"]),
                fmt(r["vs_chunkkv"]),
                f"{r['peak_extra_mib']:.1f}",
            )
            for r in rows
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    presses, scorers = case_names(args)
    layer = build_layer(args)
    setting = setting_text(args)
    print(setting, flush=True)
    cases, methods = build_cases(args, presses, scorers, layer)
    with torch.no_grad():
        times = time_interleaved(
            {f"{p}/{s}": fn for (p, s), fn in cases.items()}, args.device, args.warmup, args.repeats
        )
        memory = {key: peak_extra_mib(fn, args.device) for key, fn in cases.items()}
    medians = {name: statistics.median(values) for name, values in times.items()}
    # On a shared machine the median carries other processes' load; the minimum is closer to the call's own cost.
    minima = {name: min(values) for name, values in times.items()}
    rows = result_rows(methods, medians, minima, memory)

    device_kind = torch.device(args.device).type
    csv_path = args.out_dir / f"presses_{device_kind}.csv"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    cells = [{key: fmt(v, 4) if isinstance(v, float) or v is None else v for key, v in row.items()} for row in rows]
    write_csv(csv_path, cells)
    lines = report_lines(argv, device_kind, setting, target_rows(scorers, medians, minima), rows)
    md_path = args.out_dir / f"presses_{device_kind}.md"
    write_report(md_path, "\n".join(lines))
    # The printout leaves out the title, the command and the setting (printed first), and ends with a blank line.
    print("\n".join(lines[7:]) + "\n")
    print(f"wrote {md_path} and {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
