"""Why a press fails (issue 46): the kept set found against brute force, the answer's span, attention recall against
eager attention's own weights, the fields on both engine paths and every axis they cross, kept-set storage and
agreement, the report's table and pictures."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from kvpress import AdaKVPress, KnormPress, SnapKVPress, StreamingLLMPress
from transformers import DynamicCache

from evaluate import rundir
from evaluate.engine.answer_span import PrefilledText
from evaluate.engine.attention_recall import attention_mass
from evaluate.engine.cost import measure_kept_ratio
from evaluate.engine.kept_sets import KeptSet, kept_set, key_fingerprints, layer_fingerprints
from evaluate.engine.prefill import compressed_cache
from evaluate.engine.requests import hidden_keys
from evaluate.errors import ConfigError
from evaluate.kept_store import read_run_kept
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import run_dir
from evaluate.points.resolve import checked, resolve
from evaluate.report.agreement import agreement_table
from evaluate.report.build import build_report
from evaluate.report.diagnostics import spearman
from evaluate.report.runs import ReportError, collect_runs
from evaluate.run.entry import run, run_sweep
from evaluate.run.summary import run_summary
from evaluate.score.diagnostics import diagnostics_metrics
from evaluate.score.rescore import rescore_run
from tests.kvpress_reference import ruler_rows
from tests.support import captured_prefill, compose_config

NIAH = ("benchmark=ruler_synth", "benchmark.tasks=[niah_single_1,niah_multivalue]", "max_new_tokens=8", "limit=2")
FIELDS = ("answer_retention", "answer_retention_by_layer", "attention_recall", "attention_recall_by_layer")


def brute_force_mask(captured: list, cache: DynamicCache) -> torch.Tensor:
    """Each kept key found by comparing it with every original key of its head."""
    masks = []
    for (_, keys, _, _), layer in zip(captured, cache.layers, strict=True):
        mask = torch.zeros(keys.shape[1], keys.shape[2], dtype=torch.bool)
        for head in range(keys.shape[1]):
            for kept in layer.keys[0, head]:
                matches = (keys[0, head] == kept).all(dim=-1).nonzero().flatten()
                assert len(matches) == 1
                mask[head, matches[0]] = True
        masks.append(mask)
    return torch.stack(masks)


@pytest.mark.parametrize(
    "press", [SnapKVPress(0.5), KnormPress(0.7), StreamingLLMPress(0.5, n_sink=4)], ids=["snapkv", "knorm", "streaming"]
)
def test_the_kept_set_is_the_brute_force_one(press):
    model, _, captured = captured_prefill(200)
    cache = compressed_cache(press, model.model.layers, captured)
    original = [key_fingerprints(keys) for _, keys, _, _ in captured]
    found = kept_set(original, layer_fingerprints(cache))
    assert torch.equal(found.mask, brute_force_mask(captured, cache))
    assert found.mask.float().mean() == pytest.approx(measure_kept_ratio(model, cache, 200))


def test_a_masking_press_counts_what_it_masks_as_dropped():
    model, _, captured = captured_prefill(200)
    cache = compressed_cache(AdaKVPress(SnapKVPress(0.6)), model.model.layers, captured)
    hidden = hidden_keys([layer.self_attn for layer in model.model.layers])
    kept_ratio = measure_kept_ratio(model, cache, 200)
    original = [key_fingerprints(keys) for _, keys, _, _ in captured]
    found = kept_set(original, layer_fingerprints(cache), hidden)
    assert kept_ratio < 0.5  # AdaKV keeps every pair and masks 60 % of them
    assert found.mask.float().mean() == pytest.approx(kept_ratio)
    assert kept_set(original, layer_fingerprints(cache)).mask.all()  # unmasked, every pair is in the cache
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def test_keys_the_prefill_never_had_make_the_kept_set_unknown():
    model, _, captured = captured_prefill(120)
    cache = compressed_cache(SnapKVPress(0.5), model.model.layers, captured)
    original = [key_fingerprints(keys) for _, keys, _, _ in captured]
    cache.layers[1].keys = cache.layers[1].keys * 1.0001  # e.g. re-rotated keys
    assert kept_set(original, layer_fingerprints(cache)) is None
    # A decoding-time press's cache holds its question's and answer's keys: they are no context position.
    assert kept_set(original, layer_fingerprints(cache), new_keys=True).mask[1].sum() == 0


def test_fingerprints_read_each_float_type_exactly():
    keys = torch.randn(1, 2, 50, 64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        typed = keys.to(dtype)
        fingerprints = key_fingerprints(typed)
        assert fingerprints.shape == (2, 50, 2) and fingerprints.dtype == torch.int64
        assert torch.equal(fingerprints[:, 7], key_fingerprints(typed[:, :, 7:8].clone())[:, 0])
        assert len(torch.unique(fingerprints.reshape(-1, 2), dim=0)) == 100


def test_the_answer_span_is_the_tokens_the_pipeline_prefills_for_it(tiny_tokenizer):
    text = "Some haystack. The special magic number is 8675309. More hay, and 86753099 is not it."
    prefilled = PrefilledText.of(tiny_tokenizer, text, True, 10**9)
    positions = prefilled.answer_positions(["8675309"])
    covered = [prefilled.text[start:end] for start, end in prefilled.offsets[positions].tolist()]
    assert "".join(covered).strip() == "8675309"  # the whole word only: not inside 86753099
    assert prefilled.answer_positions(["A"]) is None  # a multiple-choice letter is no span
    assert prefilled.answer_positions(["absent"]) is None
    # The pipeline's own cut: an answer past max_context_length is not in the prefilled context.
    assert PrefilledText.of(tiny_tokenizer, text, True, 20).answer_positions(["8675309"]) is None
    # Both occurrences of an answer count.
    assert len(PrefilledText.of(tiny_tokenizer, "ab cd ab", False, 99).answer_positions(["ab"])) == 4


def test_attention_mass_is_eager_attentions_own_weights():
    model = TinyRandomModel(weight_scale=3).load_model("cpu", "float32", "sdpa")
    generator = torch.Generator().manual_seed(1)
    context, question, answer = (torch.randint(0, 256, (1, n), generator=generator) for n in (60, 5, 4))
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=context, past_key_values=cache)
    keys_before = cache.layers[0].keys.clone()
    mass = attention_mass(model, cache, question, answer, 60)
    assert torch.equal(cache.layers[0].keys, keys_before) and cache.get_seq_length() == 60  # left as it was
    assert model.config._attn_implementation == "sdpa"  # restored
    eager = TinyRandomModel(weight_scale=3).load_model("cpu", "float32", "eager")
    with torch.no_grad():
        weights = eager(torch.cat([context, question, answer], dim=-1), output_attentions=True).attentions
    for layer, layer_weights in enumerate(weights):
        reading = layer_weights[0, :, 64:68, :60].sum(dim=1)  # the queries that predict the answer's 4 tokens
        expected = reading.reshape(2, 2, 60).sum(dim=1)
        expected = expected / expected.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(mass[layer], expected, atol=1e-5, rtol=1e-4)
    kept = KeptSet(torch.ones(2, 2, 60, dtype=torch.bool))
    assert kept.recall(mass)[0] == pytest.approx(1.0)


def rows_of(cfg) -> dict[str, dict]:
    return {row["id"]: row for row in rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)}


@pytest.fixture(scope="module")
def ruler_file(tmp_path_factory) -> Path:
    """kvpress's RULER format: a context asked five questions, three asked one each, every answer in its context."""
    path = tmp_path_factory.mktemp("ruler") / "test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ruler_rows()))
    return path


@pytest.mark.parametrize(
    "press",
    [("press=topk", "scorer=snapkv", "cr=0.6"), ("press=adakv", "cr=0.5"), ("press=chunkkv", "query_aware=true")],
)
def test_both_paths_give_the_same_fields_and_diagnostics_change_no_prediction(tmp_path, ruler_file, press):
    rows = {}
    for batch, diagnostics in ((32, "attention"), (1, "attention"), (32, "none")):
        cfg = compose_config(
            tmp_path / f"{batch}{diagnostics}", "benchmark=ruler", f"benchmark.path={ruler_file}", "limit=null",
            "+model.source.weight_scale=3.0", *press, f"decode_batch_size={batch}", f"diagnostics={diagnostics}",
        )  # fmt: skip
        run(cfg)
        rows[batch, diagnostics] = rows_of(cfg)
    pooled, alone, plain = rows[32, "attention"], rows[1, "attention"], rows[32, "none"]
    # The apples' number (asked twice) and the three words are in their contexts; the other fruits' numbers are not.
    found = [row["answer_retention"] for row in pooled.values() if row["answer_retention"] is not None]
    assert len(pooled) == 8 and len(found) == 5 and all(0 <= share <= 1 for share in found)
    assert all(row["answer_retention_by_layer"] is None for row in pooled.values() if row["answer_retention"] is None)
    # Recall needs no answer in the context: where the reference answer is read, it is.
    assert all(len(row["attention_recall_by_layer"]) == 2 for row in pooled.values())
    for sample, row in pooled.items():
        assert {field: row[field] for field in FIELDS} == {field: alone[sample][field] for field in FIELDS}
        assert row["prediction"] == plain[sample]["prediction"] and not set(FIELDS) & set(plain[sample])
        for name in ("answer_nll", "answer_kl", "kept_ratio"):
            assert row[name] == plain[sample][name]


def test_default_retention_only_rescoring_keeps_it_and_an_uncompressed_run_keeps_all(tmp_path):
    cfgs = [compose_config(tmp_path, *NIAH, *press) for press in (("press=none",), ("press=topk", "cr=0.75"))]
    run_sweep(cfgs)
    uncompressed, compressed = rows_of(cfgs[0]), rows_of(cfgs[1])
    assert all(row["answer_retention"] == 1.0 and "attention_recall" not in row for row in uncompressed.values())
    assert all(row["answer_retention_by_layer"] == [1.0, 1.0] for row in uncompressed.values())
    assert any(row["answer_retention"] < 1 for row in compressed.values())
    metrics = rundir.read_json(run_dir(cfgs[1]) / rundir.METRICS)
    assert metrics["diagnostics"] == diagnostics_metrics(compressed.values())
    assert set(metrics["diagnostics"]) == {"answer_retention"}
    assert rescore_run(run_dir(cfgs[1]))["diagnostics"] == metrics["diagnostics"]
    cost = rundir.read_json(run_dir(cfgs[1]) / rundir.RUN)
    assert cost["retention_seconds"] > 0 and cost["attention_recall_seconds"] is None
    share = 100 * metrics["diagnostics"]["answer_retention"]["mean"]
    assert f"% of the KV pairs kept on average, answer retention {share:.1f} %" in run_summary(
        resolve(cfgs[1]), metrics
    )


def test_a_decoding_time_press_is_measured_on_what_its_answer_left_on_both_paths(tmp_path):
    rows = {}
    for batch in (32, 1):
        cfg = compose_config(
            tmp_path / str(batch), *NIAH, "method=decoding_knorm", "target_size=64", "compression_interval=4",
            "dtype=float64", f"decode_batch_size={batch}", "save_kept=true",
        )  # fmt: skip
        run(cfg)
        rows[batch] = rows_of(cfg)
        stored = read_run_kept(run_dir(cfg))
        # What the answer's last compression left of the context: at most target_size pairs per head.
        assert all(kept.mask.sum(axis=-1).max() <= 64 for kept in stored.values())
    assert all(row["answer_retention"] is not None for row in rows[32].values())
    for sample, row in rows[32].items():
        assert row["answer_retention"] == rows[1][sample]["answer_retention"]


@pytest.mark.parametrize(
    "press", [("press=topk", "cr=0.5"), ("method=decoding_knorm", "target_size=64", "history=model")]
)
def test_turns_multi_carries_the_fields_on_both_paths(tmp_path, press):
    fields = {}
    for batch in (32, 1):
        multi = compose_config(
            tmp_path / str(batch), "benchmark=ruler_synth", "benchmark.turns=2", "benchmark.tasks=[niah_single_1]",
            "turns=multi", "limit=1", "max_new_tokens=6", *press, "diagnostics=attention", f"decode_batch_size={batch}",
        )  # fmt: skip
        run(multi)
        turns = sorted(rows_of(multi).values(), key=lambda row: row["turn"])
        fields[batch] = [{field: row[field] for field in FIELDS} for row in turns]
    assert fields[32] == fields[1]
    assert [turn["answer_retention"] is not None for turn in fields[32]] == [True, True]
    # A later turn's question follows the earlier turns' history: its recall is not the first turn's pass.
    assert [turn["attention_recall"] is not None for turn in fields[32]] == [True, False]


def test_generate_false_and_a_token_budget_carry_the_fields(tmp_path):
    generating = [override for override in NIAH if not override.startswith("max_new_tokens")]
    scored = compose_config(tmp_path / "nogen", *generating, "press=topk", "generate=false", "budget=64")
    run(scored)
    assert all(row["answer_retention"] is not None for row in rows_of(scored).values())


def test_kept_sets_are_stored_and_two_runs_agree_by_layer(tmp_path):
    cfgs = {
        name: compose_config(tmp_path / name, *NIAH, *press, "save_kept=true", f"decode_batch_size={batch}")
        for name, press, batch in (
            ("pool", ("press=topk", "cr=0.5"), 32),
            ("alone", ("press=topk", "cr=0.5"), 1),
            ("knorm", ("press=topk", "scorer=knorm", "cr=0.5"), 32),
        )
    }
    for cfg in cfgs.values():
        run(cfg)
    pool, alone, knorm = (run_dir(cfg) for cfg in cfgs.values())
    stored = read_run_kept(pool)
    rows = rows_of(cfgs["pool"])
    assert stored.keys() == rows.keys()
    for sample, kept in stored.items():
        assert kept.mask.shape == (2, 2, rows[sample]["context_length"])
        assert kept.mask.mean() == pytest.approx(rows[sample]["kept_ratio"])
        if kept.answer_positions.size:
            assert kept.mask[:, :, kept.answer_positions].mean() == pytest.approx(rows[sample]["answer_retention"])
    table = agreement_table(pool, alone)
    assert list(table.data.jaccard) == [1.0, 1.0, 1.0]  # the pool keeps what kvpress's pipeline keeps
    other = agreement_table(pool, knorm).data
    assert list(other.layer) == ["0", "1", "all"] and 0 < other.jaccard.iloc[-1] < 1
    # Different samples, or a run that stored none, are refused in one line.
    next((pool / "kept").glob("*.npz")).unlink()
    with pytest.raises(ReportError, match="different samples"):
        agreement_table(pool, alone)
    plain = compose_config(tmp_path / "plain", *NIAH, "press=topk", "cr=0.5")
    run(plain)
    with pytest.raises(ReportError, match="stored no kept sets: rerun it with save_kept=true"):
        agreement_table(run_dir(plain), alone)


def test_shards_store_every_rows_kept_set_in_the_points_directory(tmp_path):
    whole = compose_config(tmp_path / "whole", *NIAH, "press=topk", "cr=0.5", "save_kept=true")
    run(whole)
    for index in range(2):
        run(compose_config(tmp_path / "sharded", *NIAH, "press=topk", "cr=0.5", "save_kept=true", f"shard={index}/2"))
    sharded = run_dir(compose_config(tmp_path / "sharded", *NIAH, "press=topk", "cr=0.5", "save_kept=true"))
    assert sorted(rows_of(whole)) == sorted(read_run_kept(sharded)) and len(read_run_kept(sharded)) == 4
    assert list(agreement_table(run_dir(whole), sharded).data.jaccard) == [1.0, 1.0, 1.0]
    rows = {row["id"]: row for row in rundir.read_predictions(sharded / rundir.PREDICTIONS)}
    assert {sample: row["answer_retention"] for sample, row in rows.items()} == {
        sample: row["answer_retention"] for sample, row in rows_of(whole).items()
    }


def test_save_kept_without_diagnostics_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="save_kept=true stores the kept sets the diagnostics find"):
        checked([compose_config(tmp_path, "save_kept=true", "diagnostics=none")], single=True)


def test_overwrite_drops_the_stored_kept_sets(tmp_path):
    cfg = compose_config(tmp_path, *NIAH, "press=topk", "cr=0.5", "save_kept=true", "limit=1")
    run(cfg)
    (run_dir(cfg) / "kept" / "stale.npz").write_bytes(b"")
    run(compose_config(tmp_path, *NIAH, "press=topk", "cr=0.5", "save_kept=true", "limit=1", "overwrite=true"))
    assert not (run_dir(cfg) / "kept" / "stale.npz").exists() and len(read_run_kept(run_dir(cfg))) == 2


def test_spearman_is_pearson_on_average_ranks():
    assert spearman(pd.Series([1, 2, 3, 4]), pd.Series([10, 30, 20, 40])) == pytest.approx(0.8)
    assert spearman(pd.Series([1, 2, 2, 3]), pd.Series([1, 2, 2, 3])) == pytest.approx(1.0)
    assert spearman(pd.Series([1, 2, 3]), pd.Series([5, 5, 5])) is None


def test_the_report_tables_score_against_retention_and_draws_the_pictures(tmp_path):
    cfgs = [
        compose_config(tmp_path, *NIAH, *press, "diagnostics=attention", "save_kept=true")
        for press in (("press=none",), *(("press=topk", f"cr={cr}") for cr in (0.3, 0.6, 0.9)))
    ]
    run_sweep(cfgs)
    runs, _ = collect_runs(tmp_path)
    report = build_report(runs, [], resamples=0)
    (table,) = report.diagnostics
    assert table.name == "ruler_synth_diagnostics"
    assert list(table.data.columns[-2:]) == ["answer_retention", "attention_recall"]
    assert len(table.data) == 4 and "Spearman's ρ(score, answer retention) across 3 compressed points" in table.page()
    from evaluate.report.plots import plot_kept_map

    path = plot_kept_map(run_dir(cfgs[-1]), None, tmp_path / "map.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ReportError, match="no kept set of sample nope"):
        plot_kept_map(run_dir(cfgs[-1]), "nope", tmp_path / "none.png")


def test_a_kept_set_file_is_small(tmp_path):
    """The size the docs state: a row's kept set at 4096 tokens for SmolLM2-135M's 30 layers x 3 KV heads."""
    from evaluate.kept_store import write_kept

    mask = np.random.default_rng(0).random((30, 3, 4096)) < 0.1
    path = write_kept(tmp_path, "row", mask, np.arange(5))
    assert path.stat().st_size < 30 * 3 * 4096 / 8 * 1.02  # at most the packed bits, and a header
    assert json.dumps(np.load(path)["sample_id"].item()) == '"row"'


def test_a_decoding_rows_keys_are_fingerprinted_only_for_the_diagnostics():
    from kvpress import DecodingPress

    from evaluate.engine.decoding_compression import compression_policy

    class Store:
        host_lengths = np.array([[5], [5]])

        def row(self, layer_idx, slot):
            keys = torch.randn(1, 2, 5, 8)
            return keys, keys

    press = DecodingPress(KnormPress(), compression_interval=4, target_size=64)
    for fingerprinted in (False, True):
        row = compression_policy(press, fingerprinted=fingerprinted).start(2)
        *_, keys = row.final_state(Store(), 0)
        assert (keys is not None) == fingerprinted
    assert [tuple(layer.shape) for layer in keys] == [(2, 5, 2), (2, 5, 2)]
