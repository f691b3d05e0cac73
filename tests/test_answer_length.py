"""Answer-length drift (evaluate/score/answer_length.py): hand-made rows give hand-computed fields; both engine
paths record the same exact token ids on the tiny random model; metrics.json, rescoring and the report give the same
fields from the run directories alone; rows recorded before the column give none."""

import json
import shutil
from pathlib import Path

import pytest

from evaluate import rundir
from evaluate.models.random_models import TinyRandomModel, build_tiny_tokenizer
from evaluate.points.config import run_dir
from evaluate.points.resolve import resolve
from evaluate.report.build import build_report
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run_sweep
from evaluate.run.summary import run_summary
from evaluate.score.answer_length import CAP, EOS, NO_TOKENS, STOP, TOKENS, common_prefix, drift_metrics, own_metrics
from evaluate.score.rescore import rescore_run
from tests.kvpress_reference import ruler_rows
from tests.support import compose_config

END = 99  # the hand-made rows' end-of-sequence token


def row(sample: str, tokens: list[int] | None, stop: str | None = None, **extra) -> dict:
    columns = {} if tokens is None else {TOKENS: tokens, STOP: stop}
    return {"id": sample, "task": "qa", "max_new_tokens": 5, **columns, **extra}


BASELINE = [
    row("a", [1, 2, 3, END], EOS),
    row("b", [5, 6, 7, 8, 9], CAP),
    row("c", [4, 4, 4, END], EOS),
    row("d", [1, END], EOS),
]
POINT = [
    row("a", [1, 2, 9, 9, 9], CAP),  # shares 2 tokens, then runs to the cap: longer
    row("b", [5, 6, 7, 8, 9], CAP),  # the same answer: shares all 5
    row("c", [4, END], EOS),  # shares 1 token and stops 2 tokens earlier
    row("d", None),  # recorded before the column: left out
    row("e", [3, END], EOS, error="RuntimeError: boom"),  # a failed sample: left out
]


def test_common_prefix_counts_the_tokens_before_the_first_difference():
    assert common_prefix([1, 2, 3, END], [1, 2, 9, 9, 9]) == 2
    assert common_prefix([5, 6], [5, 6, 7]) == 2
    assert common_prefix([4], [5]) == 0
    assert common_prefix([], [1]) == 0


def test_hand_made_rows_give_the_hand_computed_drift():
    assert drift_metrics(POINT, BASELINE) == {
        "answer_tokens": (5 + 5 + 2) / 3,
        "answer_tokens_uncompressed": (4 + 5 + 4) / 3,
        "hit_cap": 2 / 3,
        "hit_cap_uncompressed": 1 / 3,
        "stopped_earlier": 1 / 3,
        "common_prefix": (2 + 5 + 1) / 3,
        "common_prefix_median": 2.0,
        "n": 3,
    }
    assert own_metrics(POINT) == {"answer_tokens": 4.0, "hit_cap": 2 / 3, "n": 3}
    assert own_metrics(BASELINE) == {"answer_tokens": 15 / 4, "hit_cap": 1 / 4, "n": 4}


def test_rows_without_the_column_give_no_fields():
    old = [row("a", None), row("b", None)]
    assert own_metrics(old) is None
    assert drift_metrics(old, BASELINE) is None
    assert drift_metrics(POINT, old) is None


# The tiny model's token that ends answers in the runs below: 242, frequent in its answers on these contexts, so that
# answers stop at different lengths on both sides and others run to their cap.
STOP_TOKEN = 242


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """The same two points (uncompressed, topk at cr 0.25) answered in the decoding pool and by kvpress's pipeline."""
    root = tmp_path_factory.mktemp("drift")
    data = root / "ruler.jsonl"
    data.write_text("".join(json.dumps(entry) + "\n" for entry in ruler_rows()))
    build = TinyRandomModel._build

    def with_stop_token(self, *args, **kwargs):
        model = build(self, *args, **kwargs)
        model.generation_config.eos_token_id = STOP_TOKEN
        return model

    found = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TinyRandomModel, "_build", with_stop_token)
        for path, batch in (("pool", 32), ("pipeline", 1)):
            cfgs = [
                compose_config(
                    root / path,
                    *point,
                    "limit=null",
                    "benchmark=ruler",
                    f"benchmark.path={data}",
                    "+model.source.weight_scale=3.0",
                    f"decode_batch_size={batch}",
                )
                for point in (("press=none",), ("press=topk", "cr=0.25"))
            ]
            found[f"{path}_metrics"] = run_sweep(cfgs)
            found[f"{path}_configs"] = cfgs
            found[path] = [run_dir(cfg) for cfg in cfgs]
    return found


def rows_of(out: Path) -> dict[str, dict]:
    return {entry["id"]: entry for entry in rundir.read_predictions(out / rundir.PREDICTIONS)}


def test_both_paths_record_the_same_exact_tokens(sweeps):
    tokenizer = build_tiny_tokenizer()
    for pool, pipeline in zip(sweeps["pool"], sweeps["pipeline"], strict=True):
        assert rundir.read_json(pipeline / rundir.RUN)["answered_by"]["path"] == "pipeline"
        assert rundir.read_json(pool / rundir.RUN)["answered_by"]["path"] == "pool"
        pooled, piped = rows_of(pool), rows_of(pipeline)
        assert {i: (r[TOKENS], r[STOP]) for i, r in pooled.items()} == {
            i: (r[TOKENS], r[STOP]) for i, r in piped.items()
        }
        for entry in pooled.values():
            tokens = entry[TOKENS]
            assert tokenizer.decode(tokens, skip_special_tokens=True) == entry["prediction"]
            if entry[STOP] == EOS:
                assert tokens[-1] == STOP_TOKEN and STOP_TOKEN not in tokens[1:-1]
            else:
                assert len(tokens) == entry["max_new_tokens"] and STOP_TOKEN not in tokens[1:]
        # The pipeline counts the tokens it generates by the language model's passes: the same count.
        for out in (pool, pipeline):
            assert rundir.read_json(out / rundir.RUN)["generated_tokens"] == sum(
                len(r[TOKENS]) for r in pooled.values()
            )
    stops = [entry[STOP] for out in sweeps["pool"] for entry in rows_of(out).values()]
    assert stops.count(EOS) >= 2 and stops.count(CAP) >= 2
    # The text does not give the tokens back: its replacement characters re-tokenize otherwise.
    retokenized = [
        tokenizer(entry["prediction"], add_special_tokens=False).input_ids == entry[TOKENS]
        for entry in rows_of(sweeps["pool"][1]).values()
    ]
    assert not all(retokenized)


def test_metrics_rescoring_and_the_report_give_the_fields_from_the_files(sweeps, tmp_path):
    baseline, point = sweeps["pool"]
    baseline_rows, point_rows = list(rows_of(baseline).values()), list(rows_of(point).values())
    # Read off the two files: the lengths below, cap 12 12 12 12 12 9 10 11; the answers share their first token in
    # vt-0 (21) and fwe-1 (101) only, and stop earlier in the three multiquery rows and fwe-1.
    lengths = {entry["id"]: len(entry[TOKENS]) for entry in point_rows}
    assert list(lengths.values()) == [12, 5, 5, 5, 12, 9, 10, 10]
    assert [len(entry[TOKENS]) for entry in baseline_rows] == [3, 12, 12, 12, 3, 9, 10, 11]
    expected = {
        "answer_tokens": 68 / 8,
        "answer_tokens_uncompressed": 72 / 8,
        "hit_cap": 4 / 8,
        "hit_cap_uncompressed": 6 / 8,
        "stopped_earlier": 4 / 8,
        "common_prefix": 2 / 8,
        "common_prefix_median": 0.0,
        "n": 8,
    }
    assert drift_metrics(point_rows, baseline_rows) == expected
    recorded = rundir.read_json(point / rundir.METRICS)["answer_length"]
    assert recorded == {**own_metrics(point_rows), "against_uncompressed": {**expected, "run": baseline.name}}
    assert rundir.read_json(baseline / rundir.METRICS)["answer_length"] == own_metrics(baseline_rows)
    summary = run_summary(resolve(sweeps["pool_configs"][1]), sweeps["pool_metrics"][1])
    assert (
        "answers, same samples: 8.50 tokens on average (uncompressed 9.00), 50.0 % hit max_new_tokens (uncompressed "
        "75.0 %), 50.0 % stopped earlier, 0.25 tokens in common before the first difference"
    ) in summary
    (point / rundir.METRICS).unlink()
    assert rescore_run(point)["answer_length"] == recorded
    assert rundir.read_json(point / rundir.METRICS)["answer_length"] == recorded
    report = build_report(*collect_runs(baseline.parent), resamples=0)
    (table,) = report.answer_length
    assert table.name == "ruler_answer_length"
    measured = table.data[table.data.method == "snapkv"].iloc[0]
    assert {name: measured[name] for name in expected if name != "n"} == pytest.approx(
        {name: value for name, value in expected.items() if name != "n"}
    )
    assert measured["n"] == 8


def test_a_run_recorded_before_the_column_reads_n_a(sweeps, tmp_path):
    baseline, point = sweeps["pool"]
    for out in (baseline, point):
        shutil.copytree(out, tmp_path / out.name)
    old = tmp_path / point.name
    rows = [{k: v for k, v in entry.items() if k not in (TOKENS, STOP)} for entry in rows_of(old).values()]
    rundir.rewrite_predictions(old / rundir.PREDICTIONS, rows)
    assert "answer_length" not in rescore_run(old)
    report = build_report(*collect_runs(tmp_path), resamples=0)
    (table,) = report.answer_length
    shown = table.sections[0][1].set_index("method")
    assert shown.loc["snapkv", "answer tokens"] == "n/a" and shown.loc["snapkv", "common prefix"] == "n/a"
    assert shown.loc["no compression", "answer tokens"] != "n/a"
    assert f"n/a: {NO_TOKENS}." in table.notes
