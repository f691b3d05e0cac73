"""Decoding-time presses keyed by what they keep: their axis is ``target_size`` (and ``compression_interval``), never
the ``cr`` they ignore; a run whose press never compressed says so; a window clash is refused before the model loads;
and every command a run's closing lines suggest runs.

kvpress's ``DecodingPress`` compresses each row's cache to ``target_size`` pairs every ``compression_interval``
steps, and builds its base press's ratio from them (``_find_target_compression_ratio``): ``cr`` is never read.
"""

import logging
import shlex

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from evaluate import rundir
from evaluate.errors import ConfigError
from evaluate.points.config import (
    fingerprint,
    recorded_config,
    result_config,
    run_dir,
    run_name,
    warn_uncompressed_decoding,
)
from evaluate.points.overrides import check_overrides
from evaluate.points.resolve import checked, resolve
from evaluate.run.entry import run
from evaluate.run.summary import run_summary
from evaluate.score.decoding import DECODING_COMPRESSED
from tests.support import CONF_DIR, compose_config

NIAH = ("benchmark=ruler_synth", "benchmark.tasks=[niah_single_1]", "likelihood=false", "max_new_tokens=12")


def decoding(tmp_path, *overrides):
    return compose_config(tmp_path, *NIAH, "limit=1", "method=decoding_knorm", *overrides)


def test_a_decoding_press_reads_no_cr_a_single_run_refuses_one(tmp_path):
    assert checked([decoding(tmp_path, "target_size=64")], single=True)  # the default cr is no choice of the user's
    with pytest.raises(ConfigError, match=r"method=decoding_knorm keeps target_size=64 pairs .* never reads cr=0.9"):
        checked([decoding(tmp_path, "target_size=64", "cr=0.9")], single=True)


def test_its_run_is_named_and_fingerprinted_by_its_target_never_by_cr(tmp_path):
    cfg = decoding(tmp_path, "target_size=64", "compression_interval=8")
    assert "__decoding_knorm__target64_interval8__" in run_name(cfg)
    assert "cr" not in result_config(cfg) and result_config(cfg)["target_size"] == 64
    # The registry's defaults are its target when none is given.
    assert "__target2048_interval512__" in run_name(decoding(tmp_path))
    at_other_cr = decoding(tmp_path, "target_size=64", "compression_interval=8", "cr=0.9")
    assert fingerprint(at_other_cr) == fingerprint(cfg)


def test_a_sweep_over_ratios_runs_a_decoding_press_once_and_refuses_ratios_nothing_reads(tmp_path, caplog):
    points = [decoding(tmp_path, "target_size=64", f"cr={cr}") for cr in (0.5, 0.9)]
    snapkv = [compose_config(tmp_path, *NIAH, "limit=1", "method=snapkv", f"cr={cr}") for cr in (0.5, 0.9)]
    with caplog.at_level(logging.WARNING):
        resolved = checked(points + snapkv)
    assert resolved[0].out == resolved[1].out and resolved[2].out != resolved[3].out
    assert "decoding_knorm keeps target_size pairs while decoding and read no cr: cr=0.5,0.9 is ignored" in caplog.text
    with pytest.raises(ConfigError, match="never reads cr=0.9"):
        checked([decoding(tmp_path, "target_size=64", "cr=0.9"), decoding(tmp_path, "target_size=32", "cr=0.9")])


def test_a_sweep_over_targets_runs_a_prefill_press_once_and_refuses_targets_nothing_reads(tmp_path, caplog):
    """The crossing the other way: knorm reads no target_size, so a sweep over targets is one knorm run, fingerprinted
    as knorm alone (the registry entry's copy of the knob included), where it used to be one run per target."""
    knorm = [compose_config(tmp_path, *NIAH, "limit=1", "method=knorm", f"target_size={size}") for size in (64, 32)]
    points = [decoding(tmp_path, f"target_size={size}") for size in (64, 32)]
    alone = compose_config(tmp_path, *NIAH, "limit=1", "method=knorm")
    assert fingerprint(knorm[0]) == fingerprint(knorm[1]) == fingerprint(alone)
    with caplog.at_level(logging.WARNING):
        resolved = checked(knorm + points)
    assert resolved[0].out == resolved[1].out == run_dir(alone)
    assert resolved[2].out != resolved[3].out
    assert "knorm reads no target_size: target_size=32,64 is ignored and the sweep runs it once" in caplog.text
    # config.yaml records it as the run without the knob: no report tells two knorm runs apart by it.
    recorded = recorded_config(knorm[0])
    assert recorded["target_size"] is None and recorded["press"]["press"]["target_size"] is None
    assert recorded_config(points[0])["target_size"] == 64
    with pytest.raises(ConfigError, match="^method=knorm does not read target_size=64; drop it"):
        checked(knorm)


def test_an_uncompressed_run_refuses_a_press_knob(tmp_path):
    cfg = compose_config(tmp_path, *NIAH, "press=none", "target_size=128", "compression_interval=2")
    with pytest.raises(ConfigError, match="reads no press knob: drop compression_interval=2 target_size=128"):
        checked([cfg], single=True)


def test_snapkvs_window_clash_is_refused_before_the_model_loads(tmp_path):
    cfg = compose_config(tmp_path, *NIAH, "method=decoding_adakv_snapkv", "target_size=64", "compression_interval=4")
    with pytest.raises(ConfigError, match=r"a compression after the first holds 4 .* window size 64"):
        checked([cfg])
    fits = ("target_size=96", "compression_interval=70", "hidden_states_buffer_size=80")
    assert checked([compose_config(tmp_path, *NIAH, "method=decoding_adakv_snapkv", *fits)])


@pytest.mark.slow  # three runs of two 12-token answers on the tiny model
def test_a_press_that_never_compresses_says_so_and_both_paths_agree_on_each_row(tmp_path, caplog):
    cfg = decoding(tmp_path, "target_size=100000", "compression_interval=4", "limit=2")
    with caplog.at_level(logging.WARNING):
        metrics = run(cfg)
    assert "decoding_knorm will never compress here" in caplog.text
    assert "target_size=100000 holds every row whole" in caplog.text
    assert rundir.read_json(run_dir(cfg) / rundir.RUN)["decoding"] == {"rows_compressed": 0, "rows": 2}
    config = rundir.read_yaml(run_dir(cfg) / rundir.CONFIG)
    assert config["compression_ratio"] is None
    assert config["decoding"] == {"target_size": 100000, "compression_interval": 4}
    assert "decoding_knorm never compressed: no answer's cache outgrew target_size=100000" in run_summary(
        resolve(cfg), metrics
    )

    # Whether each row was compressed, as the pool and kvpress's pipeline path count it.
    flags = {}
    for batch in (32, 1):
        cfg = decoding(tmp_path / str(batch), "target_size=64", "compression_interval=4", "limit=2", "dtype=float64")
        metrics = run(replace_key(cfg, "decode_batch_size", batch))
        rows = rundir.read_predictions(run_dir(cfg) / rundir.PREDICTIONS)
        flags[batch] = {row["id"]: row[DECODING_COMPRESSED] for row in rows}
    assert flags[32] == flags[1] and len(flags[1]) == 2 and all(flags[1].values())
    assert "decoding_knorm compressed 2 of 2 answers" in run_summary(resolve(cfg), metrics)


def replace_key(cfg, key: str, value):
    cfg[key] = value
    return cfg


def test_an_interval_no_answer_reaches_is_warned_about_before_the_model_loads(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        warn_uncompressed_decoding(
            resolve(decoding(tmp_path, "target_size=256", "compression_interval=16")), 900, 40, 12
        )
    assert "compression_interval=16 is more than every answer's max_new_tokens (at most 12)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a question of at least target_size tokens compresses on its own pass
        warn_uncompressed_decoding(
            resolve(decoding(tmp_path, "target_size=32", "compression_interval=16")), 900, 40, 12
        )
    assert caplog.text == ""


def suggested_commands(summary: str) -> list[list[str]]:
    """The overrides of every ``python -m evaluate`` command a run's closing lines suggest, each sweep expanded into
    its points as Hydra's basic sweeper expands it."""
    commands = []
    for line in summary.splitlines():
        _, found, command = line.partition("python -m evaluate ")
        if not found:
            continue
        arguments = shlex.split(command.split("   (")[0])
        if arguments[0] == "-m":
            parsed = OverridesParser.create().parse_overrides(arguments[1:])
            commands += [list(point) for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]
        else:
            commands.append(arguments)
    return commands


@pytest.mark.slow  # three runs on the tiny model
@pytest.mark.parametrize(
    "overrides",
    [
        ("method=decoding_knorm", "target_size=64", "compression_interval=2"),
        ("press=none",),
        ("press=topk", "budget=64"),
    ],
    ids=["decoding", "uncompressed", "budget"],
)
def test_every_command_a_runs_closing_lines_suggest_is_accepted(tmp_path, overrides):
    command_line = ["model=tiny_random", f"output_dir={tmp_path}", *NIAH, "limit=1", *overrides]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="config", overrides=command_line)
        metrics = run(cfg)
        suggested = suggested_commands(run_summary(resolve(cfg), metrics, command_line))
        assert len(suggested) >= 3  # the uncompressed run or a report, and a sweep's points
        for arguments in suggested:
            check_overrides(arguments)
            checked([compose(config_name="config", overrides=arguments)], single=True)
