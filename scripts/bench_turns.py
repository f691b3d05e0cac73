"""Multi-turn reuse against answering each turn from scratch, timed in one run on one machine.

    python scripts/bench_turns.py                                              # SmolLM2, 4 conversations of 4 turns
    python scripts/bench_turns.py --model tiny_random --max-seq-length 1024    # a quick check of the script itself

The same conversations (``ruler_synth`` with ``benchmark.turns=K``) are answered two ways under one press, each as
one ``python -m evaluate`` process:

1. ``turns=multi`` (docs/benchmarks.md#conversations): each conversation's context prefilled and compressed once,
   its turns asked in order on that cache, each turn's question and reference answer kept for the next;
2. from scratch, as a server without cache reuse answers: each turn a sample of its own whose context is the
   conversation so far (the context, then each earlier turn's question, answer prefix and reference answer),
   prefilled and compressed for that turn alone (RULER's columns in a local file, ``turns=independent``).

Prints each way's wall time, prefills per answered turn, prompt tokens prefilled per answered turn, forward passes
per answered turn (run.json's ``forward_passes_per_question``) and score, and the speed-up of reuse; writes the
table to results/bench/turns_{device}.md. The two ways' predictions differ by design (the from-scratch prompt
holds the earlier turns as context text, not as chat turns): the point is their cost.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import table_head, table_row, timed, write_report  # noqa: E402

from evaluate import rundir  # noqa: E402
from evaluate.benchmarks import Sample  # noqa: E402
from evaluate.engine.teacher_forcing import answer_text  # noqa: E402


def conversations(args: argparse.Namespace) -> tuple[list[Sample], object]:
    """The run's conversation samples, as ``ruler_synth`` generates them for the model's tokenizer, and the
    tokenizer."""
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = compose("config", [f"model={args.model}", "benchmark=ruler_synth", *benchmark_overrides(args)])
    tokenizer = instantiate(cfg.model.source).load_tokenizer()
    return instantiate(cfg.benchmark).load(tokenizer, args.conversations), tokenizer


def benchmark_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"benchmark.tasks=[{args.task}]",
        f"benchmark.turns={args.turns}",
        f"benchmark.max_seq_length={args.max_seq_length}",
    ]


def from_scratch_rows(samples: list[Sample]) -> list[dict]:
    """Each turn as a RULER row of its own whose context is its conversation so far."""
    rows, history = [], {}
    for sample in sorted(samples, key=lambda sample: (sample.conversation, sample.turn)):
        earlier = history.setdefault(sample.conversation, "")
        rows.append(
            {
                "context": sample.context + earlier,
                "question": sample.question,
                "answer_prefix": sample.answer_prefix,
                "answer": list(sample.answers),
                "task": sample.task,
                "max_new_tokens": sample.max_new_tokens,
            }
        )
        reference = answer_text(", ".join(sample.answers), sample.answer_prefix)
        history[sample.conversation] = earlier + sample.question + sample.answer_prefix + reference + "\n"
    return rows


def measured(command: list[str], out: Path) -> dict:
    """One way's wall time and peak memory, and its run's record and score."""
    wall, peak = timed([*command, f"output_dir={out}"])
    [run_directory] = [path for path in out.iterdir() if (path / rundir.METRICS).exists()]
    record = rundir.read_json(run_directory / rundir.RUN)
    metrics = rundir.read_json(run_directory / rundir.METRICS)
    return {"wall": wall, "peak": peak, "record": record, "score": metrics.get("score")}


# The two ways, as the table names them.
MULTI = "turns=multi (one prefill per conversation)"
FROM_SCRATCH = "from scratch (one prefill per turn)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--task", default="niah_multikey_1")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--max-seq-length", type=int, default=2048)
    parser.add_argument("--press", nargs="*", default=["press=eg_chunkkv", "cr=0.75"], help="the press's overrides")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out-dir", type=Path, default=REPO / "results" / "bench")
    return parser.parse_args(argv)


def time_both_ways(args: argparse.Namespace, samples: list[Sample]) -> tuple[dict[str, dict], list[dict]]:
    """Both ways' measurements (``measured``) by the table's names, and the rows the from-scratch way answered."""
    common = [
        sys.executable, "-m", "evaluate", f"model={args.model}", f"device={args.device}", "likelihood=false",
        *args.press,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "from_scratch.jsonl"
        rows = from_scratch_rows(samples)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        multi = [
            *common,
            "benchmark=ruler_synth",
            *benchmark_overrides(args),
            f"limit={args.conversations}",
            "turns=multi",
        ]
        ways = {
            MULTI: measured(multi, Path(scratch) / "multi"),
            FROM_SCRATCH: measured(
                [*common, "benchmark=ruler", f"benchmark.path={path}", f"limit={len(samples)}"],
                Path(scratch) / "scratch",
            ),
        }
    return ways, rows


def prompt_tokens(samples: list[Sample], rows: list[dict], tokenizer) -> dict[str, int]:
    """The context tokens each way prefills: each conversation's context once, or each turn's conversation so far."""
    return {
        MULTI: sum(len(tokenizer.encode(sample.context)) for sample in samples if sample.turn == 0),
        FROM_SCRATCH: sum(len(tokenizer.encode(row["context"])) for row in rows),
    }


def report_lines(args: argparse.Namespace, ways: dict[str, dict], tokens: dict[str, int], turns: int) -> list[str]:
    """The table of both ways, per answered turn, and the speed-up of reuse."""
    lines = [
        f"Conversations: {args.model}, ruler_synth {args.task}, {args.conversations} conversations of {args.turns} "
        f"turns, max_seq_length {args.max_seq_length}, {' '.join(args.press)}, {args.device}; {turns} turns in all.",
        "",
        *table_head(
            [
                "way",
                "wall s",
                "prefills per turn",
                "context tokens prefilled per turn",
                "forward passes per turn",
                "score",
                "peak RSS MiB",
            ],
            "lrrrrrr",
        ),
    ]
    for name, way in ways.items():
        record = way["record"]
        prefills = (record.get("totals") or {}).get("prefills", 0) / turns
        lines.append(
            table_row(
                name,
                f"{way['wall']:.1f}",
                f"{prefills:.2f}",
                f"{tokens[name] / turns:.0f}",
                f"{record['forward_passes_per_question']:.2f}",
                f"{way['score']:.2f}",
                f"{way['peak']:.0f}",
            )
        )
    return [*lines, "", f"Speed-up of reuse: {ways[FROM_SCRATCH]['wall'] / ways[MULTI]['wall']:.2f}x."]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    samples, tokenizer = conversations(args)
    ways, rows = time_both_ways(args, samples)
    report = "\n".join(report_lines(args, ways, prompt_tokens(samples, rows, tokenizer), len(samples)))
    print(report)
    write_report(args.out_dir / f"turns_{args.device.split(':')[0]}.md", report)


if __name__ == "__main__":
    main()
