"""The serving-capacity table (evaluate/report/capacity.py), checked against hand-computed counts on finished runs
written by tests/fixtures/runs/builder.py, each given the cost fields a run.json records.

The model is SmolLM2-135M-Instruct loaded in its checkpoint's bfloat16: 134,515,008 parameters x 2 bytes =
269,030,016 bytes (0.27 GB) of weights, as run.json's model_weights_bytes records them. In 80 GB =
80,000,000,000 bytes that leaves 79,730,969,984 bytes:
- the uncompressed run holds 184 MiB = 192,937,984 bytes per row: 79,730,969,984 / 192,937,984 = 413.25, 413 rows;
- snapkv at cr 0.75 holds 46 MiB = 48,234,496 bytes: 1652.99, 1652 rows, 1652 / 413 = 4.00x;
- knorm (another seed: no baseline) holds 92 MiB = 96,468,992 bytes: 826.49, 826 rows, no uncompressed count;
- tova recorded no KV bytes: '-'.
With 8 GB: 8,000,000,000 − 269,030,016 = 7,730,969,984 bytes, 40 rows uncompressed (40.07) and 160 for snapkv
(160.28), 4.00x.
"""

import csv
import io
import json
import math
import sys
from pathlib import Path

import pytest
import yaml

from evaluate import rundir
from evaluate.errors import ConfigError
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import run_dir
from evaluate.report.build import build_report
from evaluate.report.capacity import check_memory, rows_that_fit
from evaluate.report.cli import main
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run
from tests.fixtures.runs.builder import LLAMA, uniform, write_run
from tests.support import compose_config

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
MIB = 2**20


SMOLLM2_WEIGHTS = 269_030_016
LLAMA_WEIGHTS = 16_060_522_496  # 8,030,261,248 parameters x 2 bytes


def with_costs(
    run: Path, held_mib: float | None, tokens_per_second: float | None, batch: int = 32, weights: int | None = None
) -> Path:
    """``run`` with run.json's KV bytes held, decoding speed and model weights, and config.yaml's decode_batch_size."""
    record = json.loads((run / "run.json").read_text())
    record |= {"kv_bytes_held_per_context": None if held_mib is None else held_mib * MIB}
    record |= {"model_weights_bytes": weights} if weights else {}
    record |= {"decode_tokens_per_second": tokens_per_second, "device": "cuda:0"}
    (run / "run.json").write_text(json.dumps(record))
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["config"]["decode_batch_size"] = batch
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return run


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    root = tmp_path / "runs"
    outcomes = uniform([True, False], tasks=["niah_single_1"])
    with_costs(write_run(root, outcomes, method="no_press", model=SMOLLM2), 184, 100.0, weights=SMOLLM2_WEIGHTS)
    with_costs(write_run(root, outcomes, method="snapkv", cr=0.75, model=SMOLLM2), 46, 250.5, weights=SMOLLM2_WEIGHTS)
    knorm = write_run(root, outcomes, method="knorm", cr=0.5, model=SMOLLM2, seed=7)
    with_costs(knorm, 92, 180.0, weights=SMOLLM2_WEIGHTS)
    with_costs(write_run(root, outcomes, method="tova", cr=0.5, model=SMOLLM2), None, None, weights=SMOLLM2_WEIGHTS)
    return root


def rows_of(text: str) -> dict[str, dict]:
    return {row["method"]: row for row in csv.DictReader(io.StringIO(text))}


def capacity_of(runs_dir: Path, **options):
    report = build_report(*collect_runs(runs_dir), resamples=0, **options)
    (table,) = report.capacity
    return report, table


def test_a_run_records_its_models_weights(tmp_path):
    """run.json's model_weights_bytes: the bytes of the parameters as loaded, tied embeddings once."""
    cfg = compose_config(tmp_path, "press=none", "benchmark.tasks=[niah_single_1]", "likelihood=false")
    run(cfg)
    model = TinyRandomModel().load_model("cpu", "float32", "sdpa", None)
    expected = sum(parameter.numel() * 4 for parameter in model.parameters())
    assert expected > 0
    assert rundir.read_json(run_dir(cfg) / rundir.RUN)["model_weights_bytes"] == expected


def test_rows_by_hand():
    assert rows_that_fit(80e9, 269_030_016, 46 * MIB) == 1652
    assert rows_that_fit(80e9, 269_030_016, 184 * MIB) == 413
    assert rows_that_fit(80e9, None, 46 * MIB) is None and rows_that_fit(80e9, 269_030_016, None) is None
    assert rows_that_fit(8e9, 16_060_522_496, 46 * MIB) == 0  # the weights alone overflow: none fit, never fewer


def test_capacity_table_holds_hand_computed_counts(runs_dir):
    report, table = capacity_of(runs_dir)
    assert table in report.tables()  # so the files, the page and the wandb summary (tracking.py) all carry it
    rows = rows_of(table.csv)
    assert set(rows) == {"no_press", "snapkv", "knorm", "tova"}
    snapkv = rows["snapkv"]
    assert (snapkv["memory_gb"], snapkv["weights_gb"]) == ("80.0", "0.269")
    assert (snapkv["kv_bytes_held_per_context"], snapkv["rows_that_fit"]) == (str(46.0 * MIB), "1652")
    assert (snapkv["uncompressed_rows_that_fit"], snapkv["rows_ratio"]) == ("413", "4.0")
    assert (snapkv["decode_tokens_per_second"], snapkv["decode_batch_size"], snapkv["device"]) == (
        "250.5",
        "32",
        "cuda:0",
    )
    # The uncompressed run is its own baseline.
    assert (rows["no_press"]["rows_that_fit"], rows["no_press"]["uncompressed_rows_that_fit"]) == ("413", "413")
    assert rows["no_press"]["rows_ratio"] == "1.0"
    # No baseline: its own count, none to compare with.
    knorm = rows["knorm"]
    assert (knorm["rows_that_fit"], knorm["uncompressed_rows_that_fit"], knorm["rows_ratio"]) == ("826", "", "")
    # No KV bytes recorded: nothing counted, its baseline's count still shown.
    tova = rows["tova"]
    assert (tova["kv_bytes_held_per_context"], tova["rows_that_fit"], tova["rows_ratio"]) == ("", "", "")
    assert tova["uncompressed_rows_that_fit"] == "413"

    page = table.page()
    assert table.title == "Serving capacity: rows whose KV cache fits in 80 GB less the model's weights"
    assert "| ruler | snapkv | cr=0.75 | 0.27 | 46.00 | 1652 | 413 | 4.00× | 250.50 (batch ≤32, cuda:0) |" in page
    assert (
        "| ruler | no compression | cr=0.00 | 0.27 | 184.00 | 413 | 413 | 1.00× | 100.00 (batch ≤32, cuda:0) |" in page
    )
    assert "| ruler | tova | cr=0.50 | 0.27 | - | - | 413 | - | - |" in page
    assert "| ruler | knorm | cr=0.50 | 0.27 | 92.00 | 826 | - | - | 180.00 (batch ≤32, cuda:0) |" in page
    assert "no activations, no fragmentation" in page and "not a serving throughput" in page
    assert "No uncompressed run to compare with for ruler knorm cr=0.50:" in page
    assert "`-` KV MiB held" in page
    assert table.page() in report.page(runs_dir, 0)


def test_a_run_kvpress_pipeline_answered_decoded_one_row_at_a_time_whatever_its_batch_size(runs_dir):
    snapkv = next(runs_dir.glob("*snapkv*"))
    record = json.loads((snapkv / "run.json").read_text())
    (snapkv / "run.json").write_text(json.dumps(record | {"answered_by": {"path": "pipeline", "why": "..."}}))
    _, table = capacity_of(runs_dir)
    assert rows_of(table.csv)["snapkv"]["decode_batch_size"] == "1"
    assert "250.50 (batch ≤1, cuda:0)" in table.page()
    assert rows_of(table.csv)["no_press"]["decode_batch_size"] == "32"


def test_budget_runs_are_rows_labelled_by_their_budget(runs_dir):
    """snapkv at budget=256 holding 23 MiB a row and at budget=1024 holding 92 MiB, beside the cr runs, against the
    same uncompressed 184 MiB: 80 GB less 269,030,016 bytes of weights is 79,730,969,984 bytes, so
    79,730,969,984 / (23 x 2^20 = 24,117,248) = 3305.97 → 3305 rows, / (92 x 2^20) = 826.49 → 826, uncompressed
    / (184 x 2^20) = 413.25 → 413; × rows 3305 / 413 = 8.0024 and 826 / 413 = 2.0. knorm at budget=64 has another
    seed: no baseline."""
    outcomes = uniform([True, False], tasks=["niah_single_1"])
    for budget, held in ((256, 23), (1024, 92)):
        run = write_run(runs_dir, outcomes, method="snapkv", budget=budget, model=SMOLLM2)
        with_costs(run, held, 300.0, weights=SMOLLM2_WEIGHTS)
    knorm = write_run(runs_dir, outcomes, method="knorm", budget=64, model=SMOLLM2, seed=7)
    with_costs(knorm, 10, 300.0, weights=SMOLLM2_WEIGHTS)
    memory = 80 * 10**9 - SMOLLM2_WEIGHTS
    assert (memory // (23 * MIB), memory // (92 * MIB), memory // (184 * MIB)) == (3305, 826, 413)
    _, table = capacity_of(runs_dir)
    data = table.data.astype(object).where(table.data.notna(), None)
    rows = {(row["method"], row["budget"]): row for row in data.to_dict("records")}
    snapkv = rows["snapkv", 256]
    assert (snapkv["rows_that_fit"], snapkv["uncompressed_rows_that_fit"]) == (3305, 413)
    assert snapkv["rows_ratio"] == 3305 / 413 and snapkv["compression_ratio"] is None
    assert (rows["snapkv", 1024]["rows_that_fit"], rows["snapkv", 1024]["rows_ratio"]) == (826, 2.0)
    assert rows["snapkv", None]["compression_ratio"] == 0.75  # the cr run: no budget
    assert rows["knorm", 64]["uncompressed_rows_that_fit"] is None
    header = table.csv.splitlines()[0].split(",")
    assert header[header.index("compression_ratio") + 1] == "budget"
    written = {(row["method"], row["budget"]): row for row in csv.DictReader(io.StringIO(table.csv))}
    assert (written["snapkv", "256"]["compression_ratio"], written["snapkv", "256"]["rows_that_fit"]) == ("", "3305")
    assert written["snapkv", ""]["compression_ratio"] == "0.75"
    page = table.page()
    # The budgets from the largest down, after the cr runs of the same method.
    assert "| ruler | snapkv | cr=0.75 | - | 0.27 | 46.00 | 1652 | 413 | 4.00× |" in page
    assert "| ruler | snapkv | - | 1024 | 0.27 | 92.00 | 826 | 413 | 2.00× |" in page
    assert "| ruler | snapkv | - | 256 | 0.27 | 23.00 | 3305 | 413 | 8.00× |" in page
    assert page.index("| ruler | snapkv | - | 1024 |") < page.index("| ruler | snapkv | - | 256 |")
    assert "No uncompressed run to compare with for ruler knorm cr=0.50, ruler knorm budget=64:" in page


def test_the_memory_is_an_option(runs_dir):
    _, table = capacity_of(runs_dir, serving_memory_gb=8)
    rows = rows_of(table.csv)
    assert (rows["snapkv"]["rows_that_fit"], rows["snapkv"]["uncompressed_rows_that_fit"]) == ("160", "40")
    assert rows["snapkv"]["rows_ratio"] == "4.0" and rows["snapkv"]["memory_gb"] == "8.0"
    assert "fits in 8 GB" in table.title


def test_weights_beyond_the_memory_fit_no_row_and_an_unknown_model_says_so(tmp_path):
    root = tmp_path / "runs"
    outcomes = uniform([True], tasks=["niah_single_1"])
    with_costs(write_run(root, outcomes, method="no_press", model=LLAMA), 128, 50.0, weights=LLAMA_WEIGHTS)
    with_costs(write_run(root, outcomes, method="no_press", model="org/tiny-random"), 1, 50.0)  # recorded no weights
    _, table = capacity_of(root, serving_memory_gb=16)  # Llama's 16.06 GB of weights exceed 16 GB
    rows = {row["model"]: row for row in csv.DictReader(io.StringIO(table.csv))}
    assert (rows["Llama-3.1-8B-Instruct"]["weights_gb"], rows["Llama-3.1-8B-Instruct"]["rows_that_fit"]) == (
        "16.0605",
        "0",
    )
    assert rows["Llama-3.1-8B-Instruct"]["rows_ratio"] == ""  # 0 over 0 rows: no ratio
    assert (rows["tiny-random"]["weights_gb"], rows["tiny-random"]["rows_that_fit"]) == ("", "")
    page = table.page()
    assert "| ruler | tiny-random | no compression | cr=0.00 | unknown | 1.00 | - | - | - |" in page
    assert "Weights unknown for tiny-random" in page and "0 rows: the weights alone fill 16 GB." in page


def test_no_table_without_kv_bytes(tmp_path):
    root = tmp_path / "runs"
    write_run(root, uniform([True], tasks=["niah_single_1"]), method="no_press")
    report = build_report(*collect_runs(root), resamples=0)
    assert report.capacity == [] and "capacity" not in {table.name for table in report.tables()}


@pytest.mark.parametrize("value", ["0", "-80", "nan", "inf"])
def test_the_report_refuses_a_memory_that_is_not_above_zero_and_finite(runs_dir, tmp_path, capsys, value):
    out = tmp_path / "tables"
    with pytest.raises(SystemExit) as ended:
        main([str(runs_dir), "--out", str(out), "--serving-memory-gb", value, "--no-plots"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --serving-memory-gb {float(value):g}: must be a finite number of GB above 0")
    assert err.count("\n") == 1 and not out.exists()


def test_check_memory():
    assert check_memory(80.0) == 80.0 and check_memory(0.5) == 0.5
    for value in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ConfigError):
            check_memory(value)


def test_the_report_command_writes_the_capacity_files(runs_dir, tmp_path, capsys):
    out = tmp_path / "tables"
    main([str(runs_dir), "--out", str(out), "--bootstrap", "0", "--no-plots", "--serving-memory-gb", "40"])
    assert "### Serving capacity: rows whose KV cache fits in 40 GB" in (out / "report.md").read_text()
    assert (out / "capacity.md").exists()
    rows = rows_of((out / "capacity.csv").read_text())
    # 40,000,000,000 − 269,030,016 = 39,730,969,984 bytes: 823.70 → 823 rows at 46 MiB, 205.92 → 205 at 184 MiB.
    assert (rows["snapkv"]["rows_that_fit"], rows["snapkv"]["uncompressed_rows_that_fit"]) == ("823", "205")
    assert "tables:" in capsys.readouterr().out


def test_the_wandb_summary_logs_the_capacity_table(runs_dir, tmp_path, monkeypatch):
    from evaluate.report.tracking import log_report
    from tests.test_results_golden import FakeWandb

    fake = FakeWandb(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    report, _ = capacity_of(runs_dir)
    log_report(report, [], mode="offline", dir=tmp_path)
    logged = fake.logged["log"]["tables/capacity"]
    rows = {
        row[logged["columns"].index("method")]: dict(zip(logged["columns"], row, strict=True)) for row in logged["data"]
    }
    assert (rows["snapkv"]["rows_that_fit"], rows["snapkv"]["uncompressed_rows_that_fit"]) == ("1652", "413")
