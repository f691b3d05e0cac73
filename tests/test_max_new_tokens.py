"""The top-level ``max_new_tokens`` (kvpress's ``max_new_tokens``): set, it replaces every row's own; null keeps
them, and the fingerprints of the runs recorded before the key existed."""

import pytest
from omegaconf import OmegaConf, open_dict

from evaluate import rundir
from evaluate.errors import ConfigError
from evaluate.points.config import fingerprint, run_dir, run_name
from evaluate.points.resolve import checked
from evaluate.run.entry import run
from evaluate.score.baseline import baseline_key
from tests.support import compose_config, evaluate_cli, with_shared_context


def config(output_dir, *overrides, native: int | None = None):
    """The shared-context benchmark (9 samples, 6 new tokens each unless ``native`` says otherwise)."""
    cfg = with_shared_context(compose_config(output_dir, "press=topk", "limit=null", *overrides))
    if native is not None:
        cfg.benchmark = OmegaConf.create({**OmegaConf.to_container(cfg.benchmark), "max_new_tokens": native})
    return cfg


def rows_of(cfg) -> list[dict]:
    return rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)


def without_key(cfg):
    """``cfg`` as composed before the key existed."""
    before = cfg.copy()
    with open_dict(before):
        del before["max_new_tokens"]
    return before


@pytest.mark.parametrize(
    "point",
    [("press=topk",), ("press=none",), ("method=decoding_knorm", "compression_interval=4", "target_size=8")],
)
def test_null_keeps_the_fingerprint_and_name_of_runs_recorded_before_the_key(tmp_path, point):
    cfg = compose_config(tmp_path, *point)
    assert cfg.max_new_tokens is None
    assert fingerprint(cfg) == fingerprint(without_key(cfg))
    assert run_name(cfg) == run_name(without_key(cfg))
    capped = compose_config(tmp_path, *point, "max_new_tokens=3")
    assert fingerprint(capped) != fingerprint(cfg)
    assert fingerprint(capped) != fingerprint(compose_config(tmp_path, *point, "max_new_tokens=4"))


def test_generate_false_reads_no_max_new_tokens(tmp_path):
    measured = compose_config(tmp_path, "press=topk", "generate=false")
    in_sweep = compose_config(tmp_path, "press=topk", "generate=false", "max_new_tokens=3")
    # A sweep's generate=false point runs without it: one run, under the name it had before the key existed.
    assert run_dir(in_sweep) == run_dir(measured) == run_dir(without_key(measured))
    assert checked([in_sweep])[0].max_new_tokens is None
    with pytest.raises(ConfigError) as refused:
        checked([in_sweep], single=True)
    assert str(refused.value) == (
        "generate=false decodes nothing, so max_new_tokens=3 is never read; drop it (it would only duplicate the run "
        "without it)"
    )


def test_a_run_recorded_before_the_key_is_the_baseline_of_one_with_it_null():
    recorded = {"model": {"name": "tiny-random"}, "seed": 42, "cr": 0.0}
    assert baseline_key({**recorded, "max_new_tokens": None}) == baseline_key(recorded)
    assert baseline_key({**recorded, "max_new_tokens": 3}) != baseline_key(recorded)
    assert baseline_key({**recorded, "max_new_tokens": 3, "generate": False}) == baseline_key(
        {**recorded, "generate": False}
    )


@pytest.mark.parametrize(("value", "line"), [
    (0, "max_new_tokens=0 must be a positive number of tokens, or null to keep each row's own"),
    (-5, "max_new_tokens=-5 must be a positive number of tokens, or null to keep each row's own"),
    (2.5, "max_new_tokens=2.5 is not a whole number or null"),
])  # fmt: skip
def test_a_value_that_is_no_positive_whole_number_is_refused(tmp_path, value, line):
    with pytest.raises(ConfigError) as refused:
        checked([compose_config(tmp_path, f"max_new_tokens={value}")])
    assert str(refused.value) == line


@pytest.mark.slow  # a python -m evaluate process (~8 s on 2 CPU cores)
def test_the_command_line_refuses_zero_in_one_line_before_any_folder(tmp_path):
    out = tmp_path / "runs"
    result = evaluate_cli("model=tiny_random", "device=cpu", f"output_dir={out}", "limit=1", "max_new_tokens=0")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "error: max_new_tokens=0 must be a positive number of tokens, or null to keep each row's own"
    )
    assert "Traceback" not in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("decode_batch_size", [32, 1])  # the decoding pool, and kvpress's pipeline path
def test_the_key_answers_as_rows_that_carry_the_value_themselves(tmp_path, decode_batch_size):
    batch = f"decode_batch_size={decode_batch_size}"
    capped = config(tmp_path / "capped", batch, "max_new_tokens=3")  # rows of 6 new tokens, the key 3
    native = config(tmp_path / "native", batch, native=3)  # rows of 3 new tokens
    uncapped = config(tmp_path / "uncapped", batch)  # rows of 6, as they are
    run(capped), run(native), run(uncapped)
    capped_rows, native_rows, uncapped_rows = rows_of(capped), rows_of(native), rows_of(uncapped)
    assert len(capped_rows) == 9
    assert [row["max_new_tokens"] for row in capped_rows] == [3] * 9
    assert [row["max_new_tokens"] for row in uncapped_rows] == [6] * 9
    answered = ["id", "max_new_tokens", "prediction", "kept_ratio", "context_length"]
    assert [[row[key] for key in answered] for row in capped_rows] == [
        [row[key] for key in answered] for row in native_rows
    ]
    # The cap bites: an uncapped answer runs past the capped one, which is its start.
    assert any(len(u["prediction"]) > len(c["prediction"]) for c, u in zip(capped_rows, uncapped_rows, strict=True))
    assert all(u["prediction"].startswith(c["prediction"]) for c, u in zip(capped_rows, uncapped_rows, strict=True))
    assert rundir.read_yaml(run_dir(capped) / rundir.CONFIG)["config"]["max_new_tokens"] == 3


def test_a_capped_run_resumes_and_its_rows_keep_the_cap(tmp_path):
    first = config(tmp_path, "max_new_tokens=3", "limit=1")  # 2 samples
    run(first)
    assert [row["max_new_tokens"] for row in rows_of(first)] == [3, 3]
    whole = config(tmp_path, "max_new_tokens=3")  # limit changes no prediction: the same run, resumed
    assert run_dir(whole) == run_dir(first)
    run(whole)
    rows = rows_of(whole)
    assert len(rows) == 9 and {row["max_new_tokens"] for row in rows} == {3}
    assert rundir.read_json(run_dir(whole) / rundir.RUN)["sessions"] == 2
    # Another value is another run, beside it.
    assert run_dir(config(tmp_path, "max_new_tokens=4")) != run_dir(whole)


def test_the_key_makes_rows_too_long_for_the_model_fit(tmp_path):
    # Rows of 100000 new tokens cannot fit in the tiny model's 8192 positions (tests/test_new_user_runs.py); capped
    # at 3, they run.
    cfg = config(tmp_path, "max_new_tokens=3", "limit=1", native=100000)
    run(cfg)
    assert [row["max_new_tokens"] for row in rows_of(cfg)] == [3, 3]
