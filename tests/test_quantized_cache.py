"""``cache=quantized``: a point on transformers' QuantizedCache is kvpress's pipeline called with that cache.

The reference (tests/kvpress_reference.py) drives kvpress's pipeline row by row, as kvpress's evaluate.py drives it
for a DecodingPress (its pipeline cannot ask several questions on one QuantizedCache: a test below shows why), each
call given a fresh ``QuantizedCache`` with the point's knobs, as kvpress's README combines a press with a quantized
cache. The harness must give the same predictions, without tolerance, for the PR's presses and a decoding-time
press. Also: the axis leaves every run without it as it was (names, fingerprints), refuses in one line what it cannot
run, counts the bytes the quantized storage holds, and never waits on a lock a dead build of quanto's extension left.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from kvpress import KVPressTextGenerationPipeline
from omegaconf import open_dict
from transformers import QuantizedCache

from evaluate import rundir
from evaluate.errors import ConfigError
from evaluate.kv_cache import QuantizedKVCache, stored_bytes, stored_pairs
from evaluate.points.config import fingerprint, run_dir, run_name
from evaluate.points.resolve import checked
from evaluate.quanto_build import build_directory, prepare_quanto
from evaluate.registry import PRESS_REGISTRY
from evaluate.report.build import build_report
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run
from tests.kvpress_reference import LIVELY_MODEL, kvpress_predictions, ruler_rows, set_runner_knobs
from tests.support import compose_config
from tests.test_decoding_compression import KNOBS as DECODING_KNOBS
from tests.test_kvpress_equivalence import CR, LIVELY, METHODS

REPO = Path(__file__).resolve().parent.parent
# The PR's presses and a decoding-time press (kvpress's DecodingPress re-quantizes what it keeps while decoding).
QUANTIZED_METHODS = {
    **{name: METHODS[name] for name in ("no_press", "snapkv", "adakv_snapkv", "chunkkv", "eg_chunkkv_snapkv")},
    "decoding_knorm": (
        ("method=decoding_knorm", *(f"{knob}={value}" for knob, value in DECODING_KNOBS.items())),
        lambda: set_runner_knobs(PRESS_REGISTRY["decoding_knorm"](), 0.0, **DECODING_KNOBS),
    ),
}


@pytest.fixture(scope="module")
def ruler_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ruler") / "test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ruler_rows()))
    return path


def quantized_config(tmp_path: Path, path: Path, method: str, *cache: str):
    overrides, _ = QUANTIZED_METHODS[method]
    return compose_config(
        tmp_path, "benchmark=ruler", f"benchmark.path={path}", "limit=null", LIVELY, f"cr={CR}", *overrides, *cache
    )


def predictions(cfg) -> dict[str, str]:
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert not [row for row in rows if row.get("error")]
    return {row["id"]: row["prediction"] for row in rows}


def reference_cache(backend: str, nbits: int, residual_length: int = 128):
    def make(model) -> QuantizedCache:
        prepare_quanto()  # quanto's extension from the project's build directory (evaluate/quanto_build.py)
        return QuantizedCache(backend, model.config, nbits=nbits, residual_length=residual_length)

    return make


@pytest.mark.parametrize("method", sorted(QUANTIZED_METHODS))
def test_a_quantized_point_equals_kvpress_pipeline_on_a_quantized_cache(tmp_path, ruler_file, method):
    _, factory = QUANTIZED_METHODS[method]
    expected = kvpress_predictions(
        ruler_file, set_runner_knobs(factory(), CR), False, cache=reference_cache("quanto", 4)
    )
    cfg = quantized_config(tmp_path, ruler_file, method, "cache=quantized")
    run(cfg)
    assert predictions(cfg) == expected
    record = rundir.read_json(run_dir(cfg) / rundir.RUN)
    assert record["answered_by"]["path"] == "pipeline"
    assert "cache=quantized" in record["answered_by"]["why"]


def test_kvpress_pipeline_cannot_ask_several_questions_on_one_quantized_cache():
    """Why a quantized point asks each question on its own cache (evaluate/kv_cache.py): kvpress's pipeline, asked
    several questions on one QuantizedCache, leaves each question and answer in the cache's full-precision residual.
    The second question's answer then differs from the one it gets alone (on the model's own cache it does not), and
    the fifth question fails."""
    model, tokenizer = LIVELY_MODEL.load_model("cpu", "auto", "sdpa"), LIVELY_MODEL.load_tokenizer()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=torch.device("cpu"))
    rows = ruler_rows()
    context, questions = rows[0]["context"], [row["question"] for row in rows[:5]]
    ask = {"answer_prefix": rows[0]["answer_prefix"], "max_new_tokens": 12}
    make = reference_cache("quanto", 4)
    alone = pipe(context, questions=questions[1:2], cache=make(model), **ask)["answers"][0]
    assert pipe(context, questions=questions[:2], cache=make(model), **ask)["answers"][1] != alone
    assert (
        pipe(context, questions=questions[:2], **ask)["answers"][1]
        == pipe(context, questions=questions[1:2], **ask)["answers"][0]
    )
    with pytest.raises(RuntimeError, match="must match the size"):
        pipe(context, questions=questions, cache=make(model), **ask)


@pytest.mark.parametrize(("backend", "nbits"), [("quanto", 2), ("hqq", 2), ("hqq", 8)])
def test_other_bits_backends_and_a_short_residual_are_kvpress_pipeline_too(tmp_path, ruler_file, backend, nbits):
    """With a residual of 4 tokens each answer's tokens are quantized as they are generated (and the residual is
    flushed, which kvpress's own cleanup fails on, after the answer)."""
    _, factory = QUANTIZED_METHODS["snapkv"]
    press = set_runner_knobs(factory(), CR)
    cache = reference_cache(backend, nbits, residual_length=4)
    expected = kvpress_predictions(ruler_file, press, False, cache=cache)
    knobs = (f"cache.backend={backend}", f"cache.nbits={nbits}", "cache.residual_length=4")
    cfg = quantized_config(tmp_path, ruler_file, "snapkv", "cache=quantized", *knobs)
    run(cfg)
    assert predictions(cfg) == expected
    record = rundir.read_json(run_dir(cfg) / rundir.RUN)
    assert record["kv_bytes_held_per_context"] > 0
    if nbits == 2:  # the reference is no copy of the model's own cache's answers
        assert expected != kvpress_predictions(ruler_file, set_runner_knobs(factory(), CR), False)


@pytest.mark.parametrize("generate", [True, False])
def test_a_quantized_point_keeps_its_token_budget_with_and_without_generating(tmp_path, ruler_file, generate):
    """Where the axes meet: budget=N on a quantized cache keeps N pairs of every context, whose likelihood fields are
    teacher-forced on the dequantized cache; generate=false gives those fields alone."""
    overrides, _ = QUANTIZED_METHODS["snapkv"]
    cfg = compose_config(
        tmp_path, "benchmark=ruler", f"benchmark.path={ruler_file}", "limit=null", LIVELY, *overrides,
        "budget=16", "cache=quantized", f"generate={str(generate).lower()}",
    )  # fmt: skip
    run(cfg)
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert rows and not [row for row in rows if row.get("error")]
    assert [row["kept_ratio"] * row["context_length"] for row in rows] == pytest.approx([16] * len(rows))
    assert all(row["answer_nll"] is not None for row in rows)
    assert all(bool(row.get("prediction")) == generate for row in rows)


def test_the_axis_leaves_every_run_without_it_as_it_was(tmp_path):
    dynamic = compose_config(tmp_path, "press=topk", "cr=0.5")
    before_the_axis = dynamic.copy()
    with open_dict(before_the_axis):
        del before_the_axis["cache"]  # a configuration composed before conf/cache/ existed
    assert dynamic.cache._target_ == "evaluate.kv_cache.DynamicKVCache"
    assert fingerprint(dynamic) == fingerprint(before_the_axis)
    assert run_name(dynamic) == run_name(before_the_axis)
    quantized = compose_config(tmp_path, "press=topk", "cr=0.5", "cache=quantized", "cache.nbits=2")
    assert fingerprint(quantized) != fingerprint(dynamic)
    assert run_name(quantized).split("__")[-2] == "quanto2bit"


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (("cache.nbits=3",), "cache.nbits=3 is not one of 2, 4 for cache.backend=quanto"),
        (("cache.backend=int8",), "cache.backend=int8 is not one of quanto, hqq"),
        (("turns=multi",), "turns=multi does not run on cache=quantized yet"),
    ],
)
def test_what_the_quantized_cache_cannot_run_is_refused_in_one_line(tmp_path, overrides, words):
    cfg = compose_config(tmp_path, "cache=quantized", *overrides)
    with pytest.raises(ConfigError, match=words) as refusal:
        checked([cfg])
    assert "\n" not in str(refusal.value)


def test_a_sweep_over_both_caches_runs_its_dynamic_point_once_and_a_single_run_refuses_the_unread_knob(tmp_path):
    cfgs = [
        compose_config(tmp_path, "press=topk", f"cache={cache}", f"cache.nbits={bits}")
        for cache in ("dynamic", "quantized")
        for bits in (2, 4)
    ]
    outs = [spec.out.name for spec in checked(cfgs)]
    assert outs[0] == outs[1] == run_name(compose_config(tmp_path, "press=topk"))
    assert len(set(outs)) == 3 and outs[2].split("__")[-2] == "quanto2bit" and outs[3].split("__")[-2] == "quanto4bit"
    with pytest.raises(ConfigError, match=r"^cache=dynamic reads no cache.nbits=2; drop it or use cache=quantized"):
        checked(cfgs[:1], single=True)


class OneLayerModel:
    """What a QuantizedCache reads of a model: its text config's number of layers."""

    class config:  # noqa: N801
        num_hidden_layers = 1

        @classmethod
        def get_text_config(cls, decoder=True):
            return cls


def test_the_bytes_of_a_quantized_layer_are_its_packed_bits_scales_shifts_and_residual():
    prepare_quanto()
    heads, positions, head_dim, group = 2, 96, 32, 64
    cache = QuantizedKVCache(nbits=4, residual_length=128, q_group_size=group).make(OneLayerModel())
    keys, values = torch.randn(2, 1, heads, positions, head_dim).unbind(0)
    cache.update(keys, values, 0)  # the first update quantizes the whole context, as a prefill does
    cache.update(keys[:, :, :3], values[:, :, :3], 0)  # three tokens into the full-precision residual
    layer = cache.layers[0]
    elements = heads * positions * head_dim
    # Per tensor: 4 bits a value, and a float32 scale and shift per group of 64 values.
    quantized = elements // 2 + 2 * (elements // group) * 4
    residual = 2 * heads * 3 * head_dim * 4
    assert stored_pairs(layer) == (heads, positions + 3)
    assert stored_bytes(layer) == 2 * quantized + residual


def test_the_report_sets_eviction_and_quantization_against_bytes(tmp_path, ruler_file):
    """Uncompressed and snapkv, each on the model's own cache and on a 4-bit one: the quantized runs record the bytes
    their storage holds, their labels name the cache, and the bytes table stars the fewest bytes within δ."""
    cfgs = [
        quantized_config(tmp_path, ruler_file, method, *cache)
        for method in ("no_press", "snapkv")
        for cache in ((), ("cache=quantized",))
    ]
    for cfg in cfgs:
        run(cfg)
    held = [rundir.read_json(run_dir(cfg) / rundir.RUN)["kv_bytes_held_per_context"] for cfg in cfgs]
    assert 0 < held[1] < held[0] / 4 and 0 < held[3] < held[2] / 4
    rows = [rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS) for cfg in cfgs]
    # The press scores the dequantized keys, and keeps as many pairs.
    assert [row["kept_ratio"] for row in rows[2]] == [row["kept_ratio"] for row in rows[3]]
    assert all(row["answer_nll"] is not None for row in rows[3])
    runs, _ = collect_runs(tmp_path)
    report = build_report(runs, [], resamples=50, iso_delta=100)
    table = next(table for table in report.iso if table.name == "bytes_at_iso_quality")
    data = table.data.sort_values("kv_bytes_held_per_context", kind="stable")
    assert sorted(data.method) == sorted(
        ["no compression", "no compression (quanto 4-bit)", "snapkv", "snapkv (quanto 4-bit)"]
    )
    # δ = 100 holds every score: the star goes to the fewest bytes, the 4-bit snapkv run.
    assert data.fewest_bytes_within_delta.tolist() == [True, False, False, False]
    assert data.method.iloc[0] == "snapkv (quanto 4-bit)"
    assert data.bytes_share.iloc[-1] == 1.0


def test_a_lock_a_dead_build_left_never_hangs_a_run(tmp_path):
    """An interrupted build leaves torch's lock file in the build directory, on which torch's loader waits forever:
    with the project's build directory and its flock, the next run removes it and goes on."""
    prepare_quanto()  # built (or loaded) once
    (build_directory() / "lock").write_text("")  # what a build killed halfway leaves
    script = (
        "import torch\n"
        "from evaluate.quanto_build import prepare_quanto\n"
        "from transformers import QuantizedCache\n"
        "prepare_quanto()\n"
        "class C:\n"
        "    num_hidden_layers = 1\n"
        "    def get_text_config(self, decoder=True): return self\n"
        "cache = QuantizedCache('quanto', C(), nbits=2)\n"
        "keys = torch.randn(1, 2, 64, 32)\n"
        "cache.update(keys, keys, 0)\n"
        "print(cache.update(keys[:, :, :1], keys[:, :, :1], 0)[0].shape[2])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "65"
    assert "removing" in done.stderr and not (build_directory() / "lock").exists()


@pytest.mark.slow  # the embedded SmolLM2-135M on 1k-token contexts, each row on its own quantized cache: about 2 min
@pytest.mark.parametrize("method", ["eg_chunkkv_snapkv"])
def test_smollm2_on_a_quantized_cache_equals_kvpress_pipeline(tmp_path, method):
    rows = ruler_rows()
    for row in rows:
        row["context"] = row["context"] * 3  # about 1,000 tokens for SmolLM2's tokenizer
    path = tmp_path / "smollm2.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides, factory = QUANTIZED_METHODS[method]
    quantized = ("cache=quantized", "cache.nbits=2")
    settings = ("model=smollm2_135m", "benchmark=ruler", f"benchmark.path={path}", "limit=null", "cr=0.5")
    cfg = compose_config(tmp_path, *settings, *overrides, *quantized)
    run(cfg)
    source, press = instantiate(cfg.model.source), set_runner_knobs(factory(), CR)
    expected = kvpress_predictions(path, press, False, source=source, cache=reference_cache("quanto", 2))
    assert predictions(cfg) == expected
    assert any(answer.strip() for answer in expected.values())
    assert expected != kvpress_predictions(path, set_runner_knobs(factory(), CR), False, source=source)
