"""One cost schema (evaluate/cost_schema.py): run.json's cost keys, the report's cost columns, the wandb summary and
the docs' table are its fields, in its order; any of them drifting fails here."""

import csv
from pathlib import Path

from evaluate import rundir
from evaluate.cost_schema import COST_KEYS, cost_metadata, docs_table
from evaluate.points.config import run_dir
from evaluate.report.build import build_report, write_report
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run
from evaluate.run.tracking import Tracker
from evaluate.score.rescore import score_rows
from tests.support import REPO, SharedContextBenchmark, compose_config


def test_the_docs_table_is_the_schema():
    assert docs_table() in (REPO / "docs" / "run-directory.md").read_text(encoding="utf-8")


def test_a_run_records_every_cost_key_and_the_report_shows_each(tmp_path):
    cfg = compose_config(
        tmp_path / "runs", "press=topk", "limit=1", "benchmark.tasks=[niah_single_1]", "diagnostics=attention"
    )
    run(cfg)
    record = rundir.read_json(run_dir(cfg) / rundir.RUN)
    assert [key for key in record if key in COST_KEYS] == list(COST_KEYS)
    # Every key but those only some runs measure (prefills per conversation: this run has no conversations; the
    # diagnostics' under diagnostics=attention).
    diagnostics = ("retention_seconds", "attention_recall_seconds")
    measured = [key for key in COST_KEYS if not cost_metadata(key)["optional"] or key in diagnostics]
    assert [key for key in COST_KEYS if record[key] is not None] == measured

    runs, skipped = collect_runs(tmp_path / "runs")
    written = write_report(build_report(runs, skipped, 0, 0), tmp_path / "report", tmp_path / "runs", 0)
    [cost_csv] = [Path(path) for path in written if Path(path).name == "cost.csv"]
    header = next(csv.reader(cost_csv.open(encoding="utf-8")))
    assert header[-len(measured) :] == measured
    cost_md = cost_csv.with_suffix(".md").read_text(encoding="utf-8")
    shown = [cost_metadata(key)["column"] or key for key in measured]
    assert f"| score | {' | '.join(shown)} |" in cost_md


class _Summary(dict):
    pass


class _FakeRun:
    def __init__(self):
        self.summary = _Summary()

    def log(self, *args, **kwargs):
        pass


class _FakeWandb:
    @staticmethod
    def Table(**kwargs):  # noqa: N802 (wandb's name)
        return kwargs


def test_the_wandb_summary_logs_every_cost_key_run_json_holds():
    fake = _FakeRun()
    rows = [{"id": "doc-0-0", "task": "t", "question": "Q?", "answers": ["1000"], "prediction": "1000"}]
    record = {key: float(index + 1) for index, key in enumerate(COST_KEYS)} | {"errors": 0}
    Tracker(fake, _FakeWandb()).log_metrics(score_rows(SharedContextBenchmark(), rows), rows, None, record)
    assert {key: fake.summary[key] for key in COST_KEYS} == {key: record[key] for key in COST_KEYS}
