"""Does the answer KL rank presses as accuracy does, at a fraction of the cost? One run on one machine.

    python scripts/likelihood_evidence.py                        # SmolLM2, ruler_synth at 2,048 tokens
    python scripts/likelihood_evidence.py --model tiny_random --max-seq-length 512 --limit 1   # a check of the script

Runs one sweep of presses x scorers x ratios (plus the uncompressed model) twice, as one ``python -m evaluate -m``
each: with ``generate=false`` (the likelihood fields alone) and generating (accuracy and the fields). Then reads
both through the report (``python -m evaluate.report``, its bootstrap intervals included) and prints, per point, the
accuracy drop from the uncompressed model and the mean answer KL; the Spearman correlation between the two across
points; each measure's bootstrap interval width as a fraction of its range across the points; and the wall time of
each sweep. Writes the tables to results/bench/likelihood_evidence_{device}.md and .csv (``--out-dir``).
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from evaluate.results.tables import markdown_table  # noqa: E402


def timed(command: list[str]) -> tuple[float, str]:
    """Wall seconds of ``command``, and what it printed."""
    start = time.perf_counter()
    printed = subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.PIPE, text=True).stdout
    return time.perf_counter() - start, printed


def report(runs: Path, tables: Path, resamples: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The report's run table (scores with intervals) and likelihood table of ``runs``."""
    command = [sys.executable, "-m", "evaluate.report", str(runs), "--out", str(tables), "--no-plots"]
    subprocess.run([*command, "--bootstrap", str(resamples)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return pd.read_csv(tables / "runs.csv"), pd.read_csv(tables / "likelihood.csv")


def spearman(first: pd.Series, second: pd.Series) -> float:
    """Spearman's rank correlation: Pearson's on the ranks (pandas' own needs scipy)."""
    return float(first.rank().corr(second.rank()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--presses", default="topk,chunkkv")
    parser.add_argument("--scorers", default="snapkv,knorm,streaming_llm")
    parser.add_argument("--crs", default="0.25,0.5,0.75")
    parser.add_argument("--max-seq-length", type=int, default=2048)
    parser.add_argument("--limit", type=int, default=2, help="contexts per task")
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out-dir", type=Path, default=REPO / "results" / "bench")
    args = parser.parse_args(argv)
    common = [
        f"model={args.model}",
        "benchmark=ruler_synth",
        f"benchmark.max_seq_length={args.max_seq_length}",
        f"limit={args.limit}",
        f"device={args.device}",
    ]
    grid = [f"press={args.presses}", f"scorer={args.scorers}", f"cr={args.crs}"]
    python = [sys.executable, "-m", "evaluate"]
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        # Dequantize/cache the model and generate the data once, outside both timings.
        subprocess.run([*python, *common, "limit=1", "press=none", f"output_dir={scratch}/warm"], cwd=REPO, check=True)
        walls, sweep_tables = {}, {}
        for way, extra in (("measured", ["generate=false"]), ("generated", [])):
            out = scratch / way
            walls[way], printed = timed([*python, "-m", *common, *grid, *extra, f"output_dir={out}"])
            # The table the sweep ends with (evaluate/summary.py), as the README shows it.
            sweep_tables[way] = printed[printed.rindex("sweep of ") :]
            walls[way] += timed([*python, *common, "press=none", *extra, f"output_dir={out}"])[0]
            print(f"{way}: {walls[way]:.1f} s")
        runs, likelihood = report(scratch / "generated", scratch / "tables", args.bootstrap)
        _, measured = report(scratch / "measured", scratch / "tables_measured", args.bootstrap)
    points = summarize(runs, likelihood, measured)
    write(points, walls, sweep_tables, args)


def summarize(runs: pd.DataFrame, likelihood: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """One row per compressed point: its accuracy and drop, its answer KL (generating and generate=false sweeps),
    and each one's interval."""
    reference = runs[runs.method == "no_press"].score.iloc[0]
    keys = ["method", "compression_ratio"]
    scores = runs[runs.method != "no_press"][[*keys, "score", "ci_low", "ci_high"]].rename(
        columns={"ci_low": "score_low", "ci_high": "score_high"}
    )
    kl = likelihood[likelihood.method != "no_press"][[*keys, "answer_kl", "answer_kl_low", "answer_kl_high"]]
    kl_alone = measured[measured.method != "no_press"][[*keys, "answer_kl"]].rename(
        columns={"answer_kl": "answer_kl_generate_false"}
    )
    points = scores.merge(kl, on=keys).merge(kl_alone, on=keys)
    return points.assign(drop=reference - points.score).sort_values(keys).reset_index(drop=True)


def write(
    points: pd.DataFrame, walls: dict[str, float], sweep_tables: dict[str, str], args: argparse.Namespace
) -> None:
    span = {name: points[name].max() - points[name].min() for name in ("score", "answer_kl")}
    width = {
        "score": ((points.score_high - points.score_low) / span["score"]).median(),
        "answer_kl": ((points.answer_kl_high - points.answer_kl_low) / span["answer_kl"]).median(),
    }
    rho = spearman(points.answer_kl, points["drop"])
    lines = [
        f"Likelihood evidence: {args.model}, ruler_synth at {args.max_seq_length} tokens, {args.limit} contexts per "
        f"task; presses {args.presses} x scorers {args.scorers} x cr {args.crs} ({len(points)} points) and the "
        f"uncompressed model; {args.bootstrap} bootstrap resamples; {args.device}.",
        "",
        markdown_table(points.round(4).astype(str)),
        "",
        f"Spearman correlation of mean answer KL with the accuracy drop across the {len(points)} points: {rho:.3f}.",
        f"Median bootstrap 95% interval width as a fraction of the range across points: accuracy "
        f"{width['score']:.2f}, answer KL {width['answer_kl']:.2f}.",
        f"Wall time: generate=false {walls['measured']:.1f} s, generating {walls['generated']:.1f} s "
        f"({walls['generated'] / walls['measured']:.2f}x).",
        "answer_kl_generate_false is the same field from the generate=false sweep.",
        "",
        "The generate=false sweep ended with:",
        "",
        "```text",
        sweep_tables["measured"].strip(),
        "```",
    ]
    text = "\n".join(lines)
    print(text)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"likelihood_evidence_{args.device}.md").write_text(text + "\n")
    points.to_csv(args.out_dir / f"likelihood_evidence_{args.device}.csv", index=False)


if __name__ == "__main__":
    main()
