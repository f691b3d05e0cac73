"""Every entry of kvpress 0.5.5's press registry, by its name: ``python -m evaluate method=<name>``.

PressBench's ``PRESS_REGISTRY`` is kvpress's, entry for entry (compared with the release's own file); every entry
that can run here runs on the tiny model, as a single run and in one sweep, and each prediction equals the one
kvpress's runner gives (tests/kvpress_reference.py); every other entry is refused in one line, before any model
loads, with its reason; docs/registry.md lists each entry's status as the code decides it.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from kvpress import DecodingPress

from evaluate import rundir
from evaluate.models.random_models import TinyRandomModel
from evaluate.points.config import ConfigError, method_name, result_config, run_dir
from evaluate.press_profile import (
    downloads,
    kvpress_defect,
    needs_eager,
    needs_query_aware,
    why_not_shared_prefill,
)
from evaluate.registry import PRESS_REGISTRY, build, knobs_read
from evaluate.report.leaderboard import leaderboard_method
from evaluate.report.runs import collect_runs
from evaluate.run.entry import run, run_sweep
from tests.kvpress_reference import UNEVEN_LAYERS, kvpress_predictions, ruler_rows, set_runner_knobs
from tests.support import compose_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parent.parent
CR = 0.5
# The knobs kvpress's runner takes besides the ratio, where an entry needs them; DecodingPress's are small enough for
# it to compress a few times within these short answers.
KNOBS = {"think": {"key_channel_compression_ratio": 0.5}, "snap_think": {"key_channel_compression_ratio": 0.5}}
DECODING_KNOBS = {"compression_interval": 3, "target_size": 96, "hidden_states_buffer_size": 80}
# SnapKV scores with the buffered queries, at least its 64-query window of them: this entry compresses once, when the
# question (longer than the target size) is fed, with the question's queries.
KNOBS["decoding_adakv_snapkv"] = {"compression_interval": 100, "target_size": 60, "hidden_states_buffer_size": 256}
# Lively weights, and head_dim 128: AdaKV's fake key must be orthogonal to every query of a question, which a random
# model allows only for fewer queries than head dimensions, while SnapKV inside a decoding press needs more than its
# 64-query window.
MODEL = {"weight_scale": 3.0, "num_attention_heads": 2, "num_key_value_heads": 1}
REFUSED = {
    "duo_attention": "DuoAttention's attention patterns",
    "duo_attention_on_the_fly": "kmfoda/booksum",
    "fastkvzip": "Fast-KVzip's gates",
    "kvzap_linear": "KVzap's scorer weights",
    "kvzap_mlp": "KVzap's scorer weights",
    "kvzap_mlp_head": "KVzap's scorer weights",
    "kvzap_mlp_layer": "KVzap's scorer weights",
    "lukv": "budget curve",
    "qfilter": "Q-filters",
    "RestoreKV": "RestoreKV's embeddings",
    "RestoreKV_plus": "RestoreKV's embeddings",
    "cam_adakv_snapkv": "AdaKVPress does not have",
    "decoding_qfilter": "Q-filters",
    "merging_kvzap_mlp": "KVzap's scorer weights",
}
RUNNABLE = [name for name in PRESS_REGISTRY if name not in REFUSED]


def knobs(name: str) -> dict:
    if isinstance(PRESS_REGISTRY[name](), DecodingPress):
        return KNOBS.get(name, DECODING_KNOBS)
    # DMS and DuoAttention entries are refused offline, but a run must still name their knob to get that far.
    required = {"threshold": 0.5, "head_compression_ratio": 0.5}
    read = knobs_read(PRESS_REGISTRY[name]())
    return KNOBS.get(name, {knob: value for knob, value in required.items() if knob in read} if name in REFUSED else {})


def query_aware(name: str) -> bool:
    return needs_query_aware(PRESS_REGISTRY[name]())


def registry_rows() -> list[dict]:
    """One context asked three questions, two asked one each. Questions are long enough for windowed scorers inside
    decoding presses (SnapKV's 64 queries) to find their window."""
    return ruler_rows("Read the report again carefully, then answer with the number only, nothing else: ", 3, 2)


@pytest.fixture(scope="module")
def ruler_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("registry") / "test.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in registry_rows()))
    return path


def entry_config(tmp_path: Path, path: Path, name: str):
    overrides = [f"{knob}={value}" for knob, value in knobs(name).items()]
    return compose_config(
        tmp_path,
        f"method={name}",
        "benchmark=ruler",
        f"benchmark.path={path}",
        "limit=null",
        *(f"+model.source.{key}={value}" for key, value in MODEL.items()),
        f"cr={CR}",
        f"query_aware={query_aware(name)}",
        *overrides,
    )


def predictions(cfg) -> dict[str, str]:
    rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
    assert not [row for row in rows if row.get("error")], [row["error"] for row in rows if row.get("error")]
    return {row["id"]: row["prediction"] for row in rows}


@pytest.fixture(scope="module")
def reference(ruler_file):
    answers = {}
    for name in RUNNABLE:
        press = set_runner_knobs(PRESS_REGISTRY[name](), CR, **knobs(name))
        answers[name] = kvpress_predictions(
            ruler_file, press, query_aware(name), TinyRandomModel(**MODEL), fit_layers=name in UNEVEN_LAYERS
        )
    return answers


def test_the_registry_is_kvpress_0_5_5s_entry_for_entry():
    # kvpress_registry.tsv: written by tests/fixtures/reference_registry.py from the release's evaluate_registry.py.
    expected = [tuple(line.split("\t")) for line in (FIXTURES / "kvpress_registry.tsv").read_text().splitlines()]
    assert [(name, repr(factory())) for name, factory in PRESS_REGISTRY.items()] == expected


@pytest.mark.parametrize("name", sorted(PRESS_REGISTRY))
def test_build_sets_the_knobs_kvpress_runner_sets(name):
    given = {"threshold": 0.3, "head_compression_ratio": 0.4, "key_channel_compression_ratio": 0.6, **DECODING_KNOBS}
    expected = set_runner_knobs(PRESS_REGISTRY[name](), 0.7, **given)
    assert repr(build(name, 0.7, **given)) == repr(expected)


@pytest.mark.parametrize(
    ("name", "knob"),
    [("think", "key_channel_compression_ratio"), ("snap_think", "key_channel_compression_ratio"),
     ("kvzap_mlp", "threshold"), ("duo_attention", "head_compression_ratio")],
)  # fmt: skip
def test_a_missing_runner_knob_is_refused_in_one_line(tmp_path, name, knob):
    with pytest.raises(ConfigError, match=f"method={name} needs {knob}=") as error:
        run(compose_config(tmp_path, f"method={name}"))
    assert "\n" not in str(error.value)


def test_runner_knobs_belong_to_registry_entries_and_split_runs_only_when_set(tmp_path):
    with pytest.raises(ConfigError, match="key_channel_compression_ratio set the knobs.*use method=<entry>"):
        run(compose_config(tmp_path, "press=topk", "key_channel_compression_ratio=0.5"))
    unset = compose_config(tmp_path, "method=decoding_knorm")
    set_ = compose_config(tmp_path, "method=decoding_knorm", "target_size=8")
    assert run_dir(unset) != run_dir(set_)
    assert "target_size" not in result_config(unset) and result_config(set_)["target_size"] == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("method=knorm", "key_channel_compression_ratio=0.5"),
            "method=knorm does not read key_channel_compression_ratio=0.5; drop it (it would only duplicate the run "
            "without it)",
        ),
        (
            ("method=think", "key_channel_compression_ratio=1.5"),
            "key_channel_compression_ratio=1.5 is not the fraction of key channels removed, in [0, 1)",
        ),
        (
            ("method=decoding_knorm", "compression_interval=0"),
            "compression_interval=0 is not a whole number of decoding steps, at least 1",
        ),
        (("method=decoding_knorm", "target_size=-3"), "target_size=-3 is not a whole number of KV pairs, at least 1"),
        (("method=decoding_knorm", "target_size=2.5"), "target_size=2.5 is not a whole number or null"),
        (("method=duo_attention", "head_compression_ratio=1.0"), "head_compression_ratio=1.0 is not the fraction of "
         "heads compressed, in [0, 1)"),
    ],
)  # fmt: skip
def test_a_knob_the_entry_does_not_read_or_out_of_its_range_is_refused_before_anything_is_written(
    tmp_path, overrides, message
):
    with pytest.raises(ConfigError) as error:
        run(compose_config(tmp_path / "runs", *overrides))
    assert str(error.value) == message
    assert not (tmp_path / "runs").exists()


def test_decoding_presses_keep_their_defaults_where_no_knob_is_given():
    assert repr(build("decoding_knorm", 0.5)) == repr(PRESS_REGISTRY["decoding_knorm"]())


def test_the_reference_answers_differ_between_entries(reference):
    # Equality below would prove little if every press gave the same answers.
    assert len({tuple(answers.values()) for answers in reference.values()}) >= len(RUNNABLE) // 3


@pytest.mark.parametrize("name", RUNNABLE)
def test_every_runnable_entry_equals_kvpress_evaluate(tmp_path, ruler_file, reference, name):
    cfg = entry_config(tmp_path, ruler_file, name)
    assert method_name(cfg) == name
    assert f"__{name}__" in run_dir(cfg).name
    run(cfg)
    assert predictions(cfg) == reference[name]


@pytest.mark.parametrize("decode_batch_size", [1, 32])  # kvpress's pipeline for each entry, and the decoding pool
def test_one_sweep_over_every_runnable_entry_equals_kvpress_evaluate(
    tmp_path, ruler_file, reference, decode_batch_size
):
    cfgs = [entry_config(tmp_path, ruler_file, name) for name in RUNNABLE]
    for cfg in cfgs:
        cfg.decode_batch_size = decode_batch_size
    run_sweep(cfgs)
    for name, cfg in zip(RUNNABLE, cfgs, strict=True):
        assert predictions(cfg) == reference[name], name
    # Each run reaches the report and the leaderboard export under its registry name.
    runs, problems = collect_runs(tmp_path)
    assert not problems
    assert sorted(leaderboard_method(run) for run in runs) == sorted(RUNNABLE)


@pytest.mark.parametrize("name", sorted(UNEVEN_LAYERS))
def test_kvpress_pipeline_needs_flash_attention_for_uneven_layers(ruler_file, name):
    # Why their reference carries PressBench's mask hook: without it kvpress's own pipeline fails under sdpa.
    press = set_runner_knobs(PRESS_REGISTRY[name](), CR)
    with pytest.raises(RuntimeError, match="size of tensor"):
        kvpress_predictions(ruler_file, press, False, TinyRandomModel(**MODEL))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_entries_that_cannot_run_here_are_refused_before_the_model_loads(tmp_path, monkeypatch, name):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(TinyRandomModel, "load_model", no_model)
    overrides = [f"{knob}={value}" for knob, value in knobs(name).items()]
    with pytest.raises(ConfigError, match=re.escape(REFUSED[name])) as error:
        run(compose_config(tmp_path, f"method={name}", *overrides))
    assert "\n" not in str(error.value)


def test_finch_needs_query_aware_runs(tmp_path):
    with pytest.raises(ConfigError, match="method finch needs query-aware runs.*query_aware=true"):
        run(compose_config(tmp_path, "method=finch"))


def test_observed_attention_runs_eager_and_refuses_another_attention(tmp_path):
    assert compose_config(tmp_path, "method=observed_attention").attn_implementation is None
    with pytest.raises(ConfigError, match="only eager attention returns"):
        run(compose_config(tmp_path, "method=observed_attention", "attn_implementation=sdpa"))


def test_an_unknown_name_is_refused(tmp_path):
    with pytest.raises(Exception, match="method"):
        compose_config(tmp_path, "method=not_an_entry")


def status(name: str) -> str:
    """An entry's status as the code decides it: the words docs/registry.md must show."""
    press = PRESS_REGISTRY[name]()
    if kvpress_defect(press):
        return f"refused: {kvpress_defect(press)}"
    if downloads(press):
        return f"refused offline: needs {downloads(press)}"
    conditions = []
    if needs_query_aware(press):
        conditions.append("query_aware=true")
    if needs_eager(press):
        conditions.append("eager attention (chosen by default)")
    conditions += [f"{knob}=" for knob in KNOBS.get(name, {}) if name in ("think", "snap_think")]
    if isinstance(press, DecodingPress):
        pooled = why_not_shared_prefill(press, "sdpa") is None
        conditions.append("in the decoding pool, each row on its own schedule" if pooled else "one question at a time")
    if name in UNEVEN_LAYERS:
        conditions.append("uneven layers: kvpress's pipeline needs flash attention, PressBench fits the mask")
    return "runs" + (f"; {', '.join(conditions)}" if conditions else "")


def test_docs_list_every_entry_with_its_status():
    table = {}
    for line in (REPO / "docs" / "registry.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            table[cells[0].strip("`")] = cells[1]
    assert table == {name: status(name) for name in PRESS_REGISTRY}
    assert set(RUNNABLE) == {name for name in PRESS_REGISTRY if status(name).startswith("runs")}


def test_the_readme_groups_every_entry_by_its_status():
    groups = {"runs": set(), "refused offline": set(), "refused:": set()}
    for name in PRESS_REGISTRY:
        groups[
            next(prefix for prefix in ("refused offline", "refused:", "runs") if status(name).startswith(prefix))
        ].add(name)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    rows = {}
    for line in readme.splitlines():
        match = re.match(
            r"\| (runs|runs on GPU only|refused offline: needs a download|refused: [^(]*) \((\d+)\) \|(.*)", line
        )
        if match:
            rows[match[1].split(":")[0] if match[1] != "runs on GPU only" else match[1]] = (int(match[2]), match[3])
    expected = {"runs": groups["runs"], "refused offline": groups["refused offline"], "refused": groups["refused:"]}
    for key, names in expected.items():
        count, cell = rows[key]
        assert (count, set(re.findall(r"`([^`]+)`", cell))) == (len(names), names), key
    assert rows["runs on GPU only"][0] == 0


@pytest.mark.slow  # a python -m evaluate process: imports torch and kvpress (about 15 s on 2 cores)
def test_a_command_line_sweep_over_entries_takes_their_knobs(tmp_path, ruler_file):
    sweep = ["method=think,snap_think,knorm", "key_channel_compression_ratio=0.5"]
    command = [sys.executable, "-m", "evaluate", "-m", *sweep]
    settings = ["model=tiny_random", "device=cpu", "benchmark=ruler", f"benchmark.path={ruler_file}", "limit=1"]
    done = subprocess.run([*command, *settings, f"output_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    names = sorted(path.name.split("__")[2] for path in tmp_path.glob("ruler__*") if (path / rundir.METRICS).is_file())
    assert names == ["knorm", "snap_think", "think"]
