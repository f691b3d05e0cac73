"""``budget=N``: N KV pairs kept of each context's cache, instead of a fraction removed (``cr``).

Every number below is worked out by hand from kvpress's rounding, ``int(L * (1 - ratio))`` pairs of an L-token
context (``compute_n_kept``), on the tiny random Llama (2 layers, 2 KV heads): the shared-context benchmark's contexts
are 426 tokens as the pipeline prefills them.
"""

import json
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from kvpress.utils import compute_n_kept
from transformers import DynamicCache

from evaluate import rundir
from evaluate.errors import ConfigError
from evaluate.models.loading import Models
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.budget import apply_budget, ratio_keeping
from evaluate.points.config import fingerprint, result_config, run_dir, validate
from evaluate.points.overrides import check_overrides
from evaluate.points.resolve import typed
from evaluate.report.build import build_report
from evaluate.report.plots import plot_all
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run, run_sweep
from tests.kvpress_reference import ruler_rows
from tests.support import compose_config, evaluate_cli, with_shared_context

CONTEXT = 426  # tokens of each shared-context benchmark context, as the pipeline prefills it (chat template in)
LIVELY = "+model.source.weight_scale=3.0"  # a random model whose answers depend on what the press kept


def test_the_ratio_keeps_exactly_the_budget_as_kvpress_rounds_it():
    naive_misses = 0
    for length in range(1, 700):
        for budget in range(1, length):
            ratio = ratio_keeping(length, budget)
            assert int(length * (1 - ratio)) == compute_n_kept(length, ratio) == budget, (length, budget)
            naive_misses += int(length * (1 - (1 - budget / length))) != budget
        assert ratio_keeping(length, length) == ratio_keeping(length, length + 1) == 0.0  # kept whole
    # 1 - N/L is the ratio on paper, but its float keeps N - 1 in 44,799 of these 243,951 cases: 3 tokens at budget 1
    # keep 0.
    assert int(3 * (1 - (1 - 1 / 3))) == 0 and naive_misses == 44_799
    for length in (4096, 32_768, 131_072, 1_048_576):
        for budget in (1, 64, 256, 1024, length - 1):
            assert int(length * (1 - ratio_keeping(length, budget))) == budget
    assert ratio_keeping(CONTEXT, 16) == 1 - 16.5 / 426  # the middle of the ratios that keep 16 of 426


@pytest.fixture(scope="module")
def tiny_llama():
    return TinyRandomModel().load_model("cpu", "float32", "sdpa")


def prefill(model, press, length: int) -> DynamicCache:
    cache = DynamicCache()
    input_ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad(), press(model):
        model(input_ids, past_key_values=cache)
    return cache


@pytest.mark.parametrize(
    "overrides",
    [("press=topk", "scorer=knorm"), ("press=topk", "scorer=snapkv"), ("press=eg_chunkkv", "scorer=knorm")],
)
def test_a_context_keeps_exactly_its_budget_per_head(tmp_path, tiny_llama, overrides):
    # Top-k keeps N pairs of every head; EG-ChunkKV N of every layer, one selection for both heads.
    press = instantiate(compose_config(tmp_path, *overrides, "budget=8").press.press)
    for length, budget in [(100, 8), (100, 99), (333, 64), (97, 1)]:
        apply_budget(press, length, budget)
        cache = prefill(tiny_llama, press, length)
        assert [tuple(layer.keys.shape[1:3]) for layer in cache.layers] == [(2, budget), (2, budget)]
    apply_budget(press, 100, 100)  # a context no longer than the budget is kept whole: ratio 0
    assert [layer.keys.shape[2] for layer in prefill(tiny_llama, press, 100).layers] == [100, 100]


def test_adakv_keeps_the_budget_of_every_head_in_total(tmp_path, tiny_llama):
    press = instantiate(compose_config(tmp_path, "press=adakv", "scorer=knorm", "budget=8").press.press)
    apply_budget(press, 100, 12)
    cache = prefill(tiny_llama, press, 100)
    assert [layer.keys.shape[2] for layer in cache.layers] == [100, 100]  # masked, not removed
    for layer in tiny_llama.model.layers:
        masked = torch.bincount(layer.self_attn.masked_key_indices[1], minlength=2)
        assert (100 - masked).sum().item() == 2 * 12  # 12 pairs a head on average, shared as AdaKV scores them


def budget_config(tmp_path: Path, *overrides: str):
    return with_shared_context(compose_config(tmp_path, LIVELY, *overrides))


def rows_of(cfg) -> list[dict]:
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert rows and not [row for row in rows if row.get("error")]
    return rows


@pytest.mark.parametrize("press", ["press=topk", "press=adakv", "press=eg_chunkkv"])
def test_both_engine_paths_keep_the_budget_and_answer_alike(tmp_path, press):
    answers = {}
    for decode_batch_size in (1, 32):  # kvpress's pipeline path, and the shared prefill with the decoding pool
        cfg = budget_config(tmp_path / str(decode_batch_size), press, "scorer=knorm", "budget=16")
        cfg.decode_batch_size = decode_batch_size
        run(cfg)
        assert "__budget16__" in run_dir(cfg).name
        rows = rows_of(cfg)
        for row in rows:
            assert row["context_length"] == CONTEXT and row["compression_ratio"] is None
            assert row["kept_ratio"] * CONTEXT == pytest.approx(16, abs=1e-9)  # 16 of 426 pairs in every head
        answers[decode_batch_size] = [(row["id"], row["prediction"]) for row in rows]
        record = rundir.read_yaml(run_dir(cfg) / rundir.CONFIG)
        assert record["budget"] == 16 and record["compression_ratio"] is None
        assert rundir.read_json(run_dir(cfg) / rundir.RUN)["budget"] == 16
    assert answers[1] == answers[32]


def test_a_budget_has_its_own_fingerprint_and_leaves_those_of_cr_runs_alone(tmp_path):
    at_ratio = typed(compose_config(tmp_path, "cr=0.5"))
    at_budget = typed(compose_config(tmp_path, "budget=64"))
    assert "budget" not in result_config(at_ratio) and result_config(at_ratio)["cr"] == 0.5
    assert result_config(at_budget)["budget"] == 64 and "cr" not in result_config(at_budget)
    assert fingerprint(at_budget) != fingerprint(typed(compose_config(tmp_path, "budget=65")))
    # press=none is one run whatever the budget: the baseline of every budget.
    assert run_dir(typed(compose_config(tmp_path, "press=none", "budget=64"))) == run_dir(
        typed(compose_config(tmp_path, "press=none"))
    )


def test_a_sweep_over_budgets_gets_its_own_table_and_plot(tmp_path):
    # RULER-format rows of three contexts of different lengths: budget=400 keeps 400 pairs of the longer ones and
    # the one shorter than 400 tokens whole.
    data = tmp_path / "ruler.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ruler_rows(shared_questions=2, single_contexts=2)))
    out = tmp_path / "runs"
    common = ("benchmark=ruler", f"benchmark.path={data}", "limit=null", LIVELY)
    points = [compose_config(out, *common, "scorer=knorm", f"budget={budget}") for budget in (8, 400)]
    points += [compose_config(out, *common, "scorer=knorm", "cr=0.5"), compose_config(out, *common, "press=none")]
    run_sweep(points)
    for budget, point in zip((8, 400), points, strict=False):
        kept = {row["context_length"]: row["kept_ratio"] * row["context_length"] for row in rows_of(point)}
        assert min(kept) < 400 < max(kept)
        assert kept == pytest.approx({length: min(budget, length) for length in kept}, abs=1e-9)
    # kvpress's pipeline path gives each context its own ratio as the shared prefill does.
    alone = compose_config(tmp_path / "alone", *common, "scorer=knorm", "budget=400", "decode_batch_size=1")
    run(alone)
    assert [row["prediction"] for row in rows_of(alone)] == [row["prediction"] for row in rows_of(points[1])]
    runs, skipped = collect_runs(out)
    assert not skipped and len(runs) == 4
    report = build_report(runs, skipped, resamples=0)
    (table,) = report.budgets
    assert table.name == "ruler_budget"
    body = table.sections[0][1]
    assert list(body.columns) == ["benchmark", "method", "budget=8", "budget=400"]
    assert list(body.method) == ["no compression", "knorm"]  # the uncompressed run beside every budget
    scores = [next(run.score for run in runs if run.budget == budget) for budget in (8, 400)]
    knorm = table.data[table.data.method == "knorm"]
    assert knorm[["budget=8", "budget=400", "budget=8 n", "budget=400 n"]].values.tolist() == [[*scores, 5, 5]]
    # The table by cr holds the cr run and its baseline only.
    (headline,) = report.headline
    assert [column for column in headline.sections[0][1].columns if column.startswith("cr=")] == ["cr=0.50"]
    lines = next(t for t in report.tables() if t.name == "runs").csv.splitlines()
    assert lines[0].split(",")[6:8] == ["compression_ratio", "budget"]
    assert sorted(line.split(",")[7] for line in lines[1:]) == ["", "", "400", "8"]
    # Iso-quality in budgets: the knorm series from its largest budget down, against the press=none baseline.
    (iso,) = [t for t in report.iso if t.name == "iso_quality_budget"]
    assert iso.data.budgets.tolist() == ["400 8"] and iso.data.baseline_score.notna().all()
    assert iso.data.iso_mark_absolute.isin(["interpolated", "measured", "≤", ">"]).all()
    plots = plot_all(report.frame, tmp_path / "plots", report.iso_series, report.iso_budget_series)
    assert {tmp_path / "plots" / "ruler_budget.png", tmp_path / "plots" / "ruler_iso_budget.png"} <= set(plots)


def refusal(tmp_path: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as refused:
        validate(typed(compose_config(tmp_path, *overrides)))
    return str(refused.value)


def test_bad_budgets_are_refused_in_one_line(tmp_path):
    assert refusal(tmp_path, "budget=0") == (
        "budget=0 must be a positive number of tokens kept per context, e.g. budget=256"
    )
    assert refusal(tmp_path, "budget=-4").startswith("budget=-4 must be a positive number")
    with pytest.raises(ConfigError, match=r"^budget=2.5 is not a whole number or null$"):
        typed(compose_config(tmp_path, "budget=2.5"))
    assert refusal(tmp_path, "budget=512", "max_context_length=512") == (
        "budget=512 keeps every context whole: none is longer than max_context_length=512; give a smaller budget "
        "(or press=none for the uncompressed run)"
    )


def test_presses_that_cannot_keep_a_budget_are_refused_saying_why(tmp_path):
    assert refusal(tmp_path, "press=chunkkv", "budget=64") == (
        "method chunkkv_snapkv cannot keep a token budget: kvpress's ChunkKVPress keeps whole chunks, "
        "int(n_chunks * (1 - cr)), so no ratio keeps exactly N tokens; use press=chunkkv_exact, its exact budget"
    )
    assert refusal(tmp_path, "method=decoding_knorm", "budget=64") == (
        "method decoding_knorm cannot keep a token budget: it compresses while decoding, not the context; its own "
        "token budget is target_size: give target_size=N instead of budget=N"
    )
    assert refusal(tmp_path, "method=pyramidkv", "budget=64").startswith(
        "method pyramidkv cannot keep a token budget: PyramidKVPress does not keep int(L * (1 - cr)) pairs"
    )
    for overrides in (("press=chunkkv_exact",), ("press=eg_chunkkv_upstream",), ("method=snapkv",), ("press=none",)):
        validate(typed(compose_config(tmp_path, *overrides, "budget=64")))


def test_cr_beside_a_budget_is_refused_on_the_command_line(tmp_path):
    message = (
        "budget={} and cr={} both say how much is kept; give one: budget=N keeps N tokens of each context, cr=X "
        "removes the fraction X of them"
    )
    for overrides, values in [
        (("budget=64", "cr=0.5"), ("64", "0.5")),
        (("cr=0.9", "budget=64,256"), ("64,256", "0.9")),
    ]:
        with pytest.raises(ConfigError) as refused:
            check_overrides(overrides)
        assert str(refused.value) == message.format(*values)
    check_overrides(["budget=null", "cr=0.5"])  # no budget given
    check_overrides(["budget=64,256"])
    result = evaluate_cli("budget=64", "cr=0.5", f"output_dir={tmp_path}")
    assert (result.returncode, result.stderr) == (2, "error: " + message.format("64", "0.5") + "\n")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("truncation", ["pipeline", "head"])
def test_a_budget_that_keeps_every_context_whole_is_refused_before_the_model_loads(tmp_path, monkeypatch, truncation):
    cfg = budget_config(tmp_path / "runs", "scorer=knorm", f"budget={CONTEXT}", f"truncation={truncation}")
    with monkeypatch.context() as patched:
        patched.setattr(Models, "model", lambda *args: pytest.fail("the model loaded before the refusal"))
        with pytest.raises(ConfigError) as refused:
            run(cfg)
    assert str(refused.value) == (
        f"budget={CONTEXT} keeps every context of {run_dir(cfg).name} whole: the longest has {CONTEXT} tokens as the "
        f"model receives it (chat template included); give a budget below {CONTEXT}, or press=none for the "
        "uncompressed run"
    )
    assert not (tmp_path / "runs").exists()
    cfg = budget_config(tmp_path / "runs", "scorer=knorm", f"budget={CONTEXT - 1}", f"truncation={truncation}")
    run(cfg)  # keeps all but one pair of each context
    assert [row["kept_ratio"] * CONTEXT for row in rows_of(cfg)] == pytest.approx([CONTEXT - 1] * 6)
