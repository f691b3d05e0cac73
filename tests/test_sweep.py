"""One model load and one prefill per context for a whole sweep: equal, point by point, to separate runs."""

import time

import pytest
import torch
from hydra.utils import instantiate
from kvpress import AdaKVPress
from transformers import DynamicCache

from evaluate import rundir
from evaluate.engine.prefill import compressed_cache
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import run_dir
from evaluate.points.resolve import resolve
from evaluate.press_profile import why_not_shared_prefill
from evaluate.run.entry import run, run_sweep
from evaluate.run.planning import make_plan
from tests.support import captured_prefill, compose_config, with_shared_context

PRESSES = ("topk", "chunkkv", "chunkkv_exact", "eg_chunkkv", "adakv")

POINTS = [
    ("press=none", "cr=0"),
    *((f"press={press}", f"scorer={scorer}", "cr=0.6") for press in PRESSES for scorer in ("snapkv", "dropkv")),
    ("press=topk", "scorer=knorm", "cr=0.3"),
    ("press=adakv", "scorer=knorm", "cr=0.9"),
]


# A random model whose answers depend on what each press kept (see TinyRandomModel).
LIVELY = "+model.source.weight_scale=3.0"


def configs(output_dir, *extra):
    return [with_shared_context(compose_config(output_dir, *point, "limit=null", LIVELY, *extra)) for point in POINTS]


@pytest.mark.parametrize(("query_aware", "points"), [("false", slice(None)), ("true", slice(0, 4))])
def test_every_sweep_point_equals_a_separate_run(tmp_path, query_aware, points):
    swept = configs(tmp_path / "sweep", f"query_aware={query_aware}")[points]
    sweep_metrics = run_sweep(swept)
    separate_configs = configs(tmp_path / "separate", f"query_aware={query_aware}")[points]
    for cfg, metrics in zip(separate_configs, sweep_metrics, strict=True):
        assert run(cfg) == metrics
        separate = (run_dir(cfg) / rundir.PREDICTIONS).read_text()
        shared = (run_dir(swept[0]).parent / run_dir(cfg).name / rundir.PREDICTIONS).read_text()
        assert shared == separate, run_dir(cfg).name
        assert len(shared.splitlines()) == 9


def test_rebuilt_caches_keep_exactly_the_indices_a_hooked_prefill_keeps(tmp_path):
    model, input_ids, captured = captured_prefill()
    layers = model.model.layers
    for point in POINTS[1:]:
        press = instantiate(compose_config(tmp_path, *point).press.press)
        reference = DynamicCache()
        with torch.no_grad(), press(model):
            model.model(input_ids=input_ids, past_key_values=reference)
        reference_masks = [layer.self_attn.masked_key_indices for layer in layers]
        with torch.no_grad():
            rebuilt = compressed_cache(press, layers, captured)
        for layer, expected, got, mask in zip(layers, reference.layers, rebuilt.layers, reference_masks, strict=True):
            assert torch.equal(expected.keys, got.keys) and torch.equal(expected.values, got.values), point
            if mask is None:
                assert layer.self_attn.masked_key_indices is None
            else:
                assert all(torch.equal(a, b) for a, b in zip(mask, layer.self_attn.masked_key_indices, strict=True))


def test_a_sweep_loads_each_model_once(tmp_path, monkeypatch):
    loads = []
    original = TinyRandomModel.load_model

    def counting(self, *args):
        loads.append(self)
        return original(self, *args)

    monkeypatch.setattr(TinyRandomModel, "load_model", counting)
    run_sweep(configs(tmp_path)[:5])
    assert len(loads) == 1


def test_points_that_cannot_share_take_the_pipeline_path(tmp_path):
    eager = with_shared_context(compose_config(tmp_path, "press=topk", "attn_implementation=eager", "limit=null"))
    shared = with_shared_context(compose_config(tmp_path, "press=topk"))
    tokenizer = TinyRandomModel().load_tokenizer()
    eager_plan, shared_plan = (
        make_plan(resolve(eager), tokenizer),
        make_plan(resolve(shared), tokenizer),
    )
    assert why_not_shared_prefill(eager_plan.press, eager_plan.spec.attention) is not None
    assert why_not_shared_prefill(shared_plan.press, shared_plan.spec.attention) is None
    metrics = run_sweep(
        [
            eager,
            with_shared_context(compose_config(tmp_path, "scorer=knorm", "attn_implementation=eager", "limit=null")),
        ]
    )
    assert all(sum(task["n"] for task in m["tasks"].values()) == 9 for m in metrics)


def test_each_points_wall_seconds_is_its_own_share_of_the_sweep(tmp_path):
    points = configs(tmp_path)[:6]
    started = time.perf_counter()
    run_sweep(points)
    elapsed = time.perf_counter() - started
    shares = [rundir.read_json(run_dir(cfg) / rundir.RUN)["wall_seconds"] for cfg in points]
    assert all(share > 0 for share in shares)
    # Had each point recorded the sweep's whole time, their sum would be about 6 times the sweep's.
    assert sum(shares) <= elapsed


def test_a_sweep_resumes_each_point_where_it_stopped(tmp_path):
    first = configs(tmp_path)[:4]
    run(first[1])
    partial = run_dir(first[2]) / rundir.PREDICTIONS
    run(with_shared_context(compose_config(tmp_path, *POINTS[2], "limit=1", LIVELY)))
    assert len(partial.read_text().splitlines()) == 2
    run_sweep(first)
    for cfg in first:
        assert len(rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)) == 9


def test_masks_of_a_compression_that_failed_part_way_do_not_reach_other_points(tmp_path, monkeypatch):
    """AdaKV fails on its second layer, after masking the first; the points batched before it are unaffected."""
    compress = AdaKVPress.compress

    def fail_on_second_layer(self, module, *args):
        keys_values = compress(self, module, *args)
        if module.layer_idx == 1:
            raise RuntimeError("no fake keys")
        return keys_values

    swept = [POINTS[1], POINTS[3], ("press=adakv", "scorer=snapkv", "cr=0.6")]
    separate = [with_shared_context(compose_config(tmp_path / "separate", *p, "limit=null", LIVELY)) for p in swept]
    expected = [run(cfg) for cfg in separate[:2]]
    monkeypatch.setattr(AdaKVPress, "compress", fail_on_second_layer)
    metrics = run_sweep(
        [with_shared_context(compose_config(tmp_path / "sweep", *p, "limit=null", LIVELY)) for p in swept]
    )
    assert metrics[:2] == expected
    for cfg in separate[:2]:
        swept_predictions = tmp_path / "sweep" / run_dir(cfg).name / rundir.PREDICTIONS
        assert swept_predictions.read_text() == (run_dir(cfg) / rundir.PREDICTIONS).read_text()
    adakv = with_shared_context(compose_config(tmp_path / "sweep", *swept[2], "limit=null", LIVELY))
    failed = run_dir(adakv) / rundir.PREDICTIONS
    assert [row["error"] for row in rundir.read_predictions(failed)] == ["RuntimeError: no fake keys"] * 9
