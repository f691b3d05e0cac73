"""Which settings are results: the one list of keys that never change a prediction.

The fingerprint leaves them out (evaluate/spec/config.py), and the readers of a results tree never tell two runs
apart by them (evaluate/report/runs.py); it imports nothing, so the readers stay light.
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
