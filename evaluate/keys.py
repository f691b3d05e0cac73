"""Which settings are results: the one list of keys that never change a prediction, and the keys that choose the
press, in which alone a run differs from its uncompressed baseline.

The fingerprint leaves the first out (evaluate/points/config.py), the readers of a results tree never tell two runs
apart by them (evaluate/report/runs.py), and a run's baseline differs from it in the second alone
(evaluate/score/baseline.py); it imports nothing, so the readers stay light.
"""

# Keys that never change a prediction: where results go, how many samples, which device runs them.
NON_RESULT_KEYS = (
    "limit",
    "fraction",
    "output_dir",
    "overwrite",
    "device",
    "device_map",
    "fail_fast",
    "retry_errors",
    "wandb",
    "decode_batch_size",
    "decode_memory",
    "wait_for_locks",
    # Which processes answered which contexts: a point begun with four shards can be finished with one.
    "shard",
    # Adds the likelihood fields beside each prediction; the predictions are the same either way.
    "likelihood",
    # Which tables the report draws (an experiment preset's report: entry), not what a run computes.
    "report",
)

# Set by kvpress's runner from its command line (compression_ratio, ThinK's key_channel_compression_ratio, DMS's
# threshold, DuoAttention's head_compression_ratio, DecodingPress's interval and target size): they are the
# sweep axes, not part of what a name means.
RUNNER_KNOBS = frozenset(
    {
        "compression_ratio",
        "key_channel_compression_ratio",
        "threshold",
        "head_compression_ratio",
        "compression_interval",
        "target_size",
        "hidden_states_buffer_size",
    }
)
# What chooses the press and how much it removes (a ratio, or a token budget): a run and its uncompressed baseline
# differ in these alone.
PRESS_KEYS = frozenset({"press", "scorer", "cr", "budget", *RUNNER_KNOBS})

# conf/config.yaml's conversation settings as every run recorded before they existed ran: each question on its own.
TURN_DEFAULTS = {"turns": "independent", "history": "reference"}
# Settings, by dotted key, at the value every run recorded before they existed ran with: each generated its answers,
# and asked one question per context (ruler_synth's benchmark.turns). A reader compares a missing one as this value.
RECORDED_DEFAULTS = {"generate": True, "benchmark.turns": 1}


def without_single_turn(config: dict) -> dict:
    """A resolved config without the settings every run recorded before conversations existed ran with:
    ``benchmark.turns: 1`` (ruler_synth's one question per context) and ``turns: independent`` (with ``history``,
    which only ``turns=multi`` reads). Those runs and today's single-turn runs are one configuration to the
    fingerprint, the baseline and the report alike."""
    config = dict(config)
    if isinstance(config.get("benchmark"), dict):
        single = RECORDED_DEFAULTS["benchmark.turns"]
        config["benchmark"] = {
            key: value for key, value in config["benchmark"].items() if (key, value) != ("turns", single)
        }
    if config.get("turns", TURN_DEFAULTS["turns"]) == TURN_DEFAULTS["turns"]:
        config.pop("turns", None)
        config.pop("history", None)
    return config
