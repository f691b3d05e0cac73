"""PressBench's SLURM launcher: hydra-submitit-launcher's, with the sweep sharded by context (``shards: N``)."""
