"""Golden files: what ``python -m evaluate.report`` and ``python -m evaluate.report.leaderboard`` write, byte for byte.

Each scenario writes finished runs with tests/fixtures/runs/builder.py, runs the command line and compares every
file it writes, its printed page, the data each plot draws (the calls made on matplotlib's axes) and what the
wandb summary logs, with tests/fixtures/golden/{scenario}/. Temporary paths read ``<TMP>``.

The golden files were generated from the code before the results layer was rebuilt on pandas, so these tests
pin its output. After an intended change of output, regenerate them and review the diff:

    PRESSBENCH_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_results_golden.py
"""

import json
import os
import shutil
import sys
import types
from pathlib import Path

import matplotlib.axes
import matplotlib.figure
import numpy as np
import pytest
import yaml

from evaluate.report import cli as report
from evaluate.report import leaderboard
from tests.fixtures.runs.builder import LLAMA, ruler_benchmark, uniform, write_run

GOLDEN = Path(__file__).parent / "fixtures" / "golden"
UPDATE = os.environ.get("PRESSBENCH_UPDATE_GOLDEN") == "1"
QWEN = "Qwen/Qwen3-8B"
RULER_TASKS = tuple(
    "niah_single_1 niah_single_2 niah_single_3 niah_multikey_1 niah_multikey_2 niah_multikey_3 niah_multivalue "
    "niah_multiquery vt cwe fwe qa_1 qa_2".split()
)
# A few resamples keep the scenarios fast; the intervals still depend on every row.
RESAMPLES = "60"


def ruler_synth_benchmark(num_samples: int) -> dict:
    return {
        "_target_": "evaluate.benchmarks.ruler_synth.RulerSynth",
        "name": "ruler_synth",
        "tasks": list(RULER_TASKS),
        "max_seq_length": 4096,
        "seed": 42,
        "num_samples": num_samples,
        "qa_path": None,
    }


def loogle_benchmark(**extra) -> dict:
    fields = {"tasks": None, "path": None, "bertscore": False, "dataset": "simonjegou/loogle", "split": "test"}
    return {"_target_": "evaluate.benchmarks.loogle.Loogle", "name": "loogle", **fields, **extra}


def longbench_benchmark(**extra) -> dict:
    fields = {"protocol": "kvpress", "max_length": 31500, "tasks": None, "path": None}
    fields |= {"dataset": "Xnhyacinth/LongBench", "split": "test"}
    return {"_target_": "evaluate.benchmarks.longbench.LongBench", "name": "longbench", **fields, **extra}


def edit(run: Path, *, config: dict | None = None, error_rows: int = 0) -> Path:
    """Change a written run: config keys (``fraction``, ...), or the first rows marked as failed samples."""
    record = yaml.safe_load((run / "config.yaml").read_text())
    record["config"].update(config or {})
    (run / "config.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    if error_rows:
        rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
        for row in rows[:error_rows]:
            row["error"] = "CUDA out of memory"
        (run / "predictions.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        metrics = json.loads((run / "metrics.json").read_text())
        metrics["n_errors"] = error_rows
        (run / "metrics.json").write_text(json.dumps(metrics, indent=2))
    return run


def pr_runs(root: Path) -> None:
    """The EG-ChunkKV PR's shape: one model, RULER with two inner scorers, ruler_synth, LOOGLE and LongBench."""
    eg_at_90 = {task: [True, True] if i < 6 else [True, False] for i, task in enumerate(RULER_TASKS)}
    write_run(root, uniform([True, True]), method="no_press")
    write_run(root, uniform([True, True]), method="chunkkv_snapkv", cr=0.85)
    write_run(root, uniform([True, False]), method="chunkkv_snapkv", cr=0.9)
    write_run(root, uniform([True, True]), method="eg_chunkkv_snapkv", cr=0.85)
    write_run(root, eg_at_90, method="eg_chunkkv_snapkv", cr=0.9)
    write_run(root, uniform([True, False, False]), method="chunkkv_tova", cr=0.9)
    write_run(root, uniform([True, True, False, True]), method="eg_chunkkv_tova", cr=0.9)  # one sample more
    write_run(root, uniform([True, False, True]), method="chunkkv_upstream_snapkv", cr=0.9)
    write_run(root, uniform([True, True, True]), method="eg_chunkkv_upstream_snapkv", cr=0.9)
    write_run(root, uniform([True, False, True]), method="snapkv", cr=0.9, limit=3)
    write_run(root, uniform([True]), method="snapkv", cr=0.5, status="running")
    synth = ruler_synth_benchmark(num_samples=2)
    # ruler_synth's runs record answer token ids: its answer-length table and plot.
    write_run(root, uniform([True, True]), method="no_press", benchmark=synth, answer_tokens=True)
    write_run(root, uniform([True, False]), method="eg_chunkkv_snapkv", cr=0.7, benchmark=synth, answer_tokens=True)
    write_run(root, uniform([False, True]), method="chunkkv_snapkv", cr=0.7, benchmark=synth)
    write_run(root, uniform([True, True]), method="chunkkv_snapkv", cr=0.9, benchmark=ruler_synth_benchmark(500))
    loogle_tasks = {"shortdep_qa": [True, False, True], "longdep_qa": [True, True, False]}
    write_run(root, loogle_tasks, method="eg_chunkkv_snapkv", cr=0.8, benchmark=loogle_benchmark())
    write_run(root, {"shortdep_qa": [True, True, False]}, method="chunkkv_snapkv", cr=0.8, benchmark=loogle_benchmark())
    longbench_tasks = {"narrativeqa": [True, False], "qasper": [True, True]}
    write_run(root, longbench_tasks, method="snapkv", cr=0.7, benchmark=longbench_benchmark(path="/data/longbench"))


def mixed_runs(root: Path) -> None:
    """Two models, query-aware runs, variants, a duplicate, failed samples and every partial reason; no no_press."""
    write_run(root, uniform([True, True, False]), method="snapkv", cr=0.5, model=QWEN, seed=1)
    write_run(root, uniform([True, False, False]), method="snapkv", cr=0.5, model=QWEN, seed=2)
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5)
    write_run(root, uniform([True, True]), method="snapkv", cr=0.5, query_aware=True)
    write_run(root, uniform([False, True]), method="snapkv", cr=0.75, query_aware=True)
    write_run(root, {task: [True, False] for task in RULER_TASKS[:7]}, method="knorm", cr=0.5)
    write_run(root, uniform([True, True]), method="knorm", cr=0.25, benchmark=ruler_benchmark(path="/data/ruler"))
    write_run(root, uniform([False, True]), method="knorm", cr=0.75, benchmark=ruler_benchmark(dataset="me/ruler"))
    write_run(root / "first", uniform([True]), method="adakv_snapkv", cr=0.5)
    write_run(root / "second", uniform([True, False]), method="adakv_snapkv", cr=0.5)
    write_run(root / "third", uniform([True, True]), method="adakv_snapkv", cr=0.5, model=QWEN)
    edit(write_run(root, uniform([True, False]), method="tova", cr=0.5, status="complete_with_errors"), error_rows=3)
    edit(write_run(root, uniform([True, True]), method="tova", cr=0.5, model=QWEN), config={"fraction": 0.5})
    write_run(root, uniform([True]), method="streaming_llm", cr=0.5)
    write_run(root, uniform([True, False]), method="keydiff", cr=0.9)
    write_run(root, uniform([False]), method="streaming_llm", cr=0.25, status="interrupted")


REFERENCE_SCORES = (
    "benchmark,benchmark_settings,model,method,query_aware,compression_ratio,score,metric,source\n"
    f"ruler,data_dir=4096,{LLAMA},eg_chunkkv_snapkv,false,0.90,36.45,mean of 13,PR\n"
    f"ruler,data_dir=4096,{LLAMA},eg_chunkkv_snapkv,true,0.90,50.00,mean of 13,no such run\n"
    f"ruler,data_dir=8192,{LLAMA},chunkkv_snapkv,false,0.90,20.00,mean of 13,other data\n"
    "ruler,,/models/Llama-3.1-8B-Instruct,no_press,false,0.0,95.7,mean of 13,leaderboard\n"
    f"ruler_synth,,{LLAMA},eg_chunkkv_snapkv,false,0.7,41.5,mean of 13,synthetic\n"
    f"ruler,,{QWEN},snapkv,false,0.5,61.0,mean of 13,both Qwen variants\n"
    f"ruler,,{LLAMA},snapkv,true,0.75,44.0,mean of 13,query-aware\n"
)
REFERENCE_DELTAS = (
    "benchmark,benchmark_settings,model,method_a,method_b,query_aware,compression_ratio,delta,source\n"
    f"ruler,data_dir=4096,{LLAMA},eg_chunkkv_snapkv,chunkkv_snapkv,false,0.90,4.85,PR comment\n"
    f"ruler,data_dir=4096,{LLAMA},eg_chunkkv_tova,chunkkv_tova,false,0.90,3.94,PR comment\n"
    f"ruler,,{LLAMA},snapkv,no_press,false,0.90,-30.0,made up\n"
    f"ruler,,{QWEN},tova,snapkv,false,0.5,1.5,two variants\n"
)

# Several runs (or pairs of runs) match one published figure: the Qwen3-8B snapkv variants.
MIXED_REFERENCE_SCORES = (
    "benchmark,benchmark_settings,model,method,query_aware,compression_ratio,score,source\n"
    f"ruler,,{QWEN},snapkv,false,0.5,61.0,both variants\n"
    "ruler,data_dir=4096,Llama-3.1-8B-Instruct,snapkv,true,0.75,44.0,by the model's last component\n"
    f"ruler,,{LLAMA},knorm,false,0.5,30.0,a partial run\n"
    "ruler,,other/model,snapkv,false,0.5,1.0,no such model\n"
)
MIXED_REFERENCE_DELTAS = (
    "benchmark,benchmark_settings,model,method_a,method_b,query_aware,compression_ratio,delta,source\n"
    f"ruler,,{QWEN},snapkv,adakv_snapkv,false,0.5,2.0,both variants\n"
    f"ruler,,{LLAMA},tova,snapkv,false,0.5,1.5,failed samples\n"
    f"ruler,,{LLAMA},snapkv,no_press,false,0.5,-3.0,no no_press run\n"
)


def plain(value):
    """JSON-ready copy of a matplotlib call argument."""
    if isinstance(value, np.ndarray | np.generic):
        return plain(value.tolist())
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return type(value).__name__


@pytest.fixture
def drawn(monkeypatch) -> list:
    """Every data-carrying call on matplotlib axes and figures, in order, with the file each figure is saved to."""
    calls = []

    def recorder(owner, name):
        original = getattr(owner, name)

        def record(self, *args, **kwargs):
            calls.append([name, plain(args), plain(kwargs)])
            return original(self, *args, **kwargs)

        monkeypatch.setattr(owner, name, record)

    axes_methods = "plot fill_between errorbar axhline axhspan set_title set_xlabel set_ylabel set_xticks"
    for name in (axes_methods + " set_xticklabels set_xlim set_ylim set_visible").split():
        recorder(matplotlib.axes.Axes, name)
    for name in ("legend", "text", "suptitle", "savefig"):
        recorder(matplotlib.figure.Figure, name)
    return calls


class FakeWandb(types.ModuleType):
    """The parts of wandb that the report's summary run uses, recording what is logged."""

    def __init__(self, root: Path):
        super().__init__("wandb")
        self.logged: dict = {}
        self.root = root
        self.plot = types.SimpleNamespace(line=self._line)

    def init(self, **kwargs):
        self.logged["init"] = {key: plain(value) for key, value in kwargs.items() if key not in ("name", "dir")}
        wandb = self

        class Run:
            url = "https://wandb.example/run"
            dir = str(wandb.root / "wandb" / "run-1" / "files")

            def log(self, record):
                wandb.logged["log"] = {key: value for key, value in record.items()}

            def finish(self):
                wandb.logged["finished"] = True

        return Run()

    def Table(self, columns, data=None, allow_mixed_types=False):  # noqa: N802 (wandb's name)
        return {"columns": plain(columns), "data": plain(data), "allow_mixed_types": allow_mixed_types}

    def Image(self, path):  # noqa: N802 (wandb's name)
        return {"image": str(path)}

    def _line(self, table, x, y, stroke=None, title=None):
        return {"line": table, "x": x, "y": y, "stroke": stroke, "title": title}


def normalized(text: str, tmp_path: Path) -> str:
    return text.replace(str(tmp_path), "<TMP>")


def tree(folder: Path, tmp_path: Path, skip_suffix: str = ".png") -> dict[str, str]:
    return {
        str(path.relative_to(folder)): normalized(path.read_text(encoding="utf-8"), tmp_path)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.name.endswith(skip_suffix)
    }


def check(name: str, files: dict[str, str]) -> None:
    """Compare ``files`` (relative path -> text) with tests/fixtures/golden/{name}/, or rewrite it under UPDATE."""
    folder = GOLDEN / name
    if UPDATE:
        shutil.rmtree(folder, ignore_errors=True)
        for relative, text in files.items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_text(text, encoding="utf-8")
    golden = {str(p.relative_to(folder)): p.read_text(encoding="utf-8") for p in folder.rglob("*") if p.is_file()}
    assert sorted(files) == sorted(golden)
    for relative, text in files.items():
        assert text == golden[relative], f"{name}/{relative} differs from its golden file"


def report_outputs(tmp_path: Path, capsys, drawn: list, arguments: list[str], wandb: bool = False) -> dict[str, str]:
    """Run the report command line; return its tables, printed page, skipped runs, plot data (and wandb log)."""
    tables, plots = Path("tables"), Path("plots")
    argv = ["runs", "--out", str(tables), "--plots", str(plots), "--bootstrap", RESAMPLES, *arguments]
    report.main(argv + (["--wandb", "offline"] if wandb else []))
    out, err = capsys.readouterr()
    files = {f"tables/{name}": text for name, text in tree(tables, tmp_path).items()}
    files["stdout.txt"] = normalized(out, tmp_path)
    files["stderr.txt"] = normalized(
        "".join(line for line in err.splitlines(True) if line.startswith("skipped ")), tmp_path
    )
    files["plots.jsonl"] = normalized("".join(json.dumps(call, ensure_ascii=False) + "\n" for call in drawn), tmp_path)
    files["plot_files.txt"] = "".join(f"{path.name}\n" for path in sorted(plots.iterdir()))
    return files


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """The scenarios run in a temporary working directory with relative paths: a run directory's name hashes
    its config, output_dir included, so an absolute temporary path would rename the runs at every test."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_report_of_the_pr_scenario_is_unchanged(workdir, capsys, drawn, monkeypatch):
    pr_runs(Path("runs"))
    reference = Path("reference")
    reference.mkdir()
    (reference / "scores.csv").write_text(REFERENCE_SCORES)
    (reference / "deltas.csv").write_text(REFERENCE_DELTAS)
    fake = FakeWandb(Path("."))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    arguments = ["--diff", "chunkkv_snapkv", "no_press", "--diff", "eg_chunkkv_snapkv", "chunkkv_snapkv", "--compare"]
    files = report_outputs(workdir, capsys, drawn, [*arguments, "--reference", str(reference)], wandb=True)
    files["wandb.json"] = normalized(json.dumps(fake.logged, indent=1, ensure_ascii=False), workdir) + "\n"
    check("report_pr", files)


def test_report_of_the_mixed_scenario_is_unchanged(workdir, capsys, drawn):
    mixed_runs(Path("runs"))
    reference = Path("reference")
    reference.mkdir()
    (reference / "scores.csv").write_text(MIXED_REFERENCE_SCORES)
    (reference / "deltas.csv").write_text(MIXED_REFERENCE_DELTAS)
    arguments = ["--diff", "tova", "snapkv", "--diff", "snapkv", "knorm", "--compare", "--reference", str(reference)]
    files = report_outputs(workdir, capsys, drawn, arguments)
    check("report_mixed", files)


def test_report_errors_are_unchanged(workdir, capsys):
    mixed_runs(Path("runs"))
    messages = []
    for arguments in (["--diff", "dropkv", "no_press"], ["--diff", "keydiff", "knorm"], ["--compare"]):
        argv = ["runs", "--out", "t", "--no-plots", "--bootstrap", "0", *arguments, "--reference", "no_reference"]
        with pytest.raises(SystemExit) as error:
            report.main(argv)
        messages.append(str(error.value))
    write_run(Path("empty"), uniform([True]), method="snapkv", status="interrupted")
    with pytest.raises(SystemExit) as error:
        report.main(["empty", "--out", "t", "--no-plots"])
    messages.append(str(error.value))
    capsys.readouterr()
    check("report_errors", {"messages.txt": normalized("\n".join(messages) + "\n", workdir)})


def leaderboard_runs(root: Path) -> None:
    mixed = {task: [True, True] if i < 7 else [False, True] for i, task in enumerate(RULER_TASKS)}
    write_run(root, mixed, method="adakv_dropkv", cr=0.875, model=QWEN, query_aware=True)
    write_run(root, uniform([True, True]), method="no_press", model=QWEN)
    write_run(root, uniform([True, False]), method="snapkv", cr=0.5, model=QWEN, seed=1)
    write_run(root, uniform([True, True]), method="snapkv", cr=0.5, model=QWEN, seed=2)
    write_run(root, uniform([True]), method="snapkv", cr=0.25, model=QWEN, limit=1)
    write_run(root, {task: [True] for task in RULER_TASKS[:6]}, method="knorm", cr=0.25, model=QWEN)
    write_run(root, uniform([True]), method="knorm", cr=0.75, model=QWEN, benchmark=ruler_benchmark(dataset="me/r"))
    write_run(root, uniform([True]), method="knorm", cr=0.5, model=QWEN, benchmark=ruler_benchmark(path="/data/r"))
    write_run(root, uniform([True]), method="knorm", cr=0.6, model=QWEN, benchmark=ruler_benchmark(data_dir="8192"))
    extra = {**uniform([True]), "niah_extra": [True]}
    write_run(root, extra, method="tova", cr=0.5, model=QWEN)
    edit(write_run(root, uniform([True, True]), method="tova", cr=0.75, model=QWEN), error_rows=2)
    edit(write_run(root, uniform([True, True]), method="tova", cr=0.25, model=QWEN), config={"fraction": 0.5})
    write_run(root, uniform([True]), method="snapkv", cr=0.5, model="/models/Qwen3-8B")
    write_run(root, uniform([True]), method="snapkv", cr=0.5, model=QWEN, benchmark=ruler_synth_benchmark(1))
    write_run(root, uniform([True]), method="snapkv", cr=0.4, model=QWEN, status="running")


@pytest.mark.parametrize("allow_partial", [False, True], ids=["full", "allow_partial"])
def test_leaderboard_export_is_unchanged(workdir, capsys, allow_partial):
    leaderboard_runs(Path("runs"))
    out = Path("submission")
    leaderboard.main(["runs", "--out", str(out), *(["--allow-partial"] if allow_partial else [])])
    stdout, stderr = capsys.readouterr()
    files = {f"submission/{name}": text for name, text in tree(out, workdir).items()}
    files["stdout.txt"] = normalized(stdout, workdir)
    files["stderr.txt"] = normalized(stderr, workdir)
    check(f"leaderboard_{'allow_partial' if allow_partial else 'full'}", files)
