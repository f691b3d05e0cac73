"""Does the answer KL rank presses as accuracy does, at a fraction of the cost? One run on one machine.

    python scripts/likelihood_evidence.py                        # SmolLM2, ruler_synth at 2,048 tokens
    python scripts/likelihood_evidence.py --limit 5                             # 5 contexts per task
    python scripts/likelihood_evidence.py --max-seq-length 1024 --limit 1 --scorers knorm --crs 0.5   # a quick check

Runs one sweep of presses x scorers x ratios (plus the uncompressed model) three times, as one
``python -m evaluate -m`` each: with ``generate=false`` (the likelihood fields alone), generating (accuracy and the
fields), and generating with ``likelihood=false`` (accuracy alone, for its wall time). Then reads the first two
through the report (``python -m evaluate.report``, its bootstrap intervals included) and prints, per point, the
accuracy drop from the uncompressed model and the mean answer KL; the Spearman correlation between the two across
points; each measure's bootstrap interval width as a fraction of its range across the points; and the wall time of
each sweep. Writes the tables to results/bench/likelihood_evidence_{device}_limit{limit}.md and .csv (``--out-dir``).

The sweeps' runs, their wall times and printed tables stay in ``--work-dir``: a rerun with the same arguments reuses
every sweep that finished there (so a change to the summary costs no sweep), and one killed midway resumes where it
stopped (its wall time then counts only the rerun; delete the work folder to time it afresh).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import warm_up, write_report  # noqa: E402

from evaluate.report.tables import markdown_table  # noqa: E402


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
    parser.add_argument("--work-dir", type=Path, help="default: outputs/likelihood_evidence_{device}_limit{limit}")
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
    scratch = args.work_dir or REPO / "outputs" / f"likelihood_evidence_{args.device}_limit{args.limit}"
    warm_up([*python, *common], scratch)  # it also generates the data once, outside the timings
    walls, sweep_tables = {}, {}
    ways = (("measured", ["generate=false"]), ("generated", []), ("generated_alone", ["likelihood=false"]))
    for way, extra in ways:
        out, record = scratch / way, scratch / f"{way}.json"
        sweep = [*python, "-m", *common, *grid, *extra, f"output_dir={out}"]
        if not record.exists() or json.loads(record.read_text())["command"] != sweep:
            wall, printed = timed(sweep)
            wall += timed([*python, *common, "press=none", *extra, f"output_dir={out}"])[0]
            # The table the sweep ends with (evaluate/run/summary.py), as the README shows it.
            table = printed[printed.rindex("sweep of ") :]
            record.write_text(json.dumps({"command": sweep, "wall": wall, "table": table}))
        finished = json.loads(record.read_text())
        walls[way], sweep_tables[way] = finished["wall"], finished["table"]
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
    by_ratio = {cr: spearman(at.answer_kl, at["drop"]) for cr, at in points.groupby("compression_ratio")}
    lines = [
        f"Likelihood evidence: {args.model}, ruler_synth at {args.max_seq_length} tokens, {args.limit} contexts per "
        f"task; presses {args.presses} x scorers {args.scorers} x cr {args.crs} ({len(points)} points) and the "
        f"uncompressed model; {args.bootstrap} bootstrap resamples; {args.device}.",
        "",
        markdown_table(points.round(4).astype(str)),
        "",
        f"Spearman correlation of mean answer KL with the accuracy drop across the {len(points)} points: {rho:.3f}; "
        "among the methods at one ratio: "
        + ", ".join(f"cr {cr:g} {value:.3f}" for cr, value in by_ratio.items())
        + ".",
        f"Median bootstrap 95% interval width as a fraction of the range across points: accuracy "
        f"{width['score']:.2f}, answer KL {width['answer_kl']:.2f}.",
        f"Wall time: generate=false {walls['measured']:.1f} s; generating with the fields {walls['generated']:.1f} s "
        f"({walls['generated'] / walls['measured']:.2f}x); generating without them (likelihood=false) "
        f"{walls['generated_alone']:.1f} s ({walls['generated_alone'] / walls['measured']:.2f}x).",
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
    name = f"likelihood_evidence_{args.device}_limit{args.limit}"
    write_report(args.out_dir / f"{name}.md", text)
    points.to_csv(args.out_dir / f"{name}.csv", index=False)


if __name__ == "__main__":
    main()
