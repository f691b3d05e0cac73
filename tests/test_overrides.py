"""Unknown keys and options are refused in one line naming the fix, ``+key`` included, before any folder exists;
the ``+`` arguments the docs and tests use still compose."""

import pytest

from evaluate.errors import ConfigError
from evaluate.points.overrides import check_command_line, check_overrides
from tests.support import CONF_DIR, compose_config
from tests.support import evaluate_cli as cli

REPO = CONF_DIR.parent


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # Hydra's hint for a typo is "+compresion_ratio=0.5", which would run at the default cr under a new hash.
        (["+compresion_ratio=0.5"], "unknown setting compresion_ratio; did you mean cr=0.5?"),
        (["compresion_ratio=0.5"], "unknown setting compresion_ratio; did you mean cr=0.5?"),
        (["limt=3"], "unknown setting limt; did you mean limit=3?"),
        (["+foo=1"], "unknown setting foo; the settings are listed in docs/configuration.md"),
        (["benchmark.max_seq_lenght=2048"], "unknown setting benchmark.max_seq_lenght; did you mean "
         "benchmark.max_seq_length=2048?"),
        (["+scorer.window=8"], "unknown setting scorer.window; did you mean scorer.press.window_size=8?"),
        (["model.source.weight_scale=3.0"], "unknown setting model.source.weight_scale; "
         "+model.source.weight_scale=3.0 passes weight_scale to the constructor of model.source"),
        (["+cr=0.5"], "cr is a setting already; give it without the +: cr=0.5"),
        (["press=eg_chunkv"], "press=eg_chunkv is not an option of press; did you mean press=eg_chunkkv?"),
        (["press=none,nosuch"], "press=nosuch is not an option of press; the options are adakv, chunkkv, "
         "chunkkv_exact, eg_chunkkv, eg_chunkkv_upstream, none, registry, topk"),
        (["method=snapk"], "method=snapk is not an option of method; did you mean method=snapkv?"),
        (["+experiment=smok"], "experiment=smok is not an option of experiment; did you mean experiment=smoke?"),
    ],
)  # fmt: skip
def test_unknown_keys_and_options_are_refused_naming_the_closest_known_one(overrides, message):
    with pytest.raises(ConfigError) as refused:
        check_overrides(overrides)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        # tests/test_likelihood.py and others: a constructor argument of the model source.
        ["+model.source.weight_scale=3.0"],
        # conf/benchmark/*.yaml: "+benchmark.dataset=ID reads another".
        ["+benchmark.dataset=someone/ruler"],
        # A press's own argument the config does not list (here kvpress ChunkKVPress's), under press.press.
        ["press=chunkkv", "+press.press.chunk_length_extra=1"],
        # docs/configuration.md: a press knob the config lists, swept.
        ["-m", "press=eg_chunkkv", "press.press.entropy_threshold=0.2,0.5", "cr=0.9"],
        # tests/test_launchers.py: an in-code benchmark in place of the configured one.
        ["~benchmark", "+benchmark._target_=tests.support.SharedContextBenchmark", "+benchmark.name=shared_context"],
        # Hydra's own settings are Hydra's to check.
        ["-m", "hydra/launcher=gpus", "hydra.sweeper.dry_run=true", "+experiment=smoke", "--cfg", "job"],
    ],
)
def test_documented_additions_and_hydra_settings_pass(overrides):
    check_command_line(overrides)


def test_a_documented_addition_still_composes(tmp_path):
    cfg = compose_config(tmp_path, "+model.source.weight_scale=3.0", "+benchmark.dataset=someone/ruler")
    assert cfg.model.source.weight_scale == 3.0
    assert cfg.benchmark.dataset == "someone/ruler"


@pytest.mark.slow  # a python -m evaluate process each (~7 s on 2 CPU cores)
@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (["+compresion_ratio=0.5"], "error: unknown setting compresion_ratio; did you mean cr=0.5?"),
        # Without the +, Hydra would refuse it over several lines with exit code 1, suggesting the + form.
        (["compresion_ratio=0.5"], "error: unknown setting compresion_ratio; did you mean cr=0.5?"),
        (["-m", "press=none,eg_chunkv"], "error: press=eg_chunkv is not an option of press; did you mean "
         "press=eg_chunkkv?"),
    ],
)  # fmt: skip
def test_the_command_refuses_an_unknown_key_in_one_line_before_any_folder_exists(tmp_path, arguments, line):
    out = tmp_path / "runs"
    result = cli(*arguments, "model=tiny_random", f"output_dir={out}")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [line]
    assert not out.exists()


@pytest.mark.slow  # a python -m evaluate process each (~8 s on 2 CPU cores)
@pytest.mark.parametrize("launcher", ["shared_prefill", "gpus"])
def test_a_sweep_that_runs_one_configuration_twice_is_refused_and_leaves_no_folder(tmp_path, launcher):
    # device is no result key, and auto is the CPU here: two points, one run directory.
    out = tmp_path / "runs"
    result = cli("-m", f"hydra/launcher={launcher}", "model=tiny_random", "press=chunkkv", "device=cpu,auto",
                 f"output_dir={out}")  # fmt: skip
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: the sweep runs the same configuration twice: {out}/ruler_synth__tiny-random__")
    assert line.endswith("; drop the repeats (limit, device and the like make no other run)")
    assert not out.exists()
