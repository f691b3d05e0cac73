"""Run: the one entry for single runs, sweeps and launchers; it plans each point, drives the engine, and hands what
the engine finished to the recorder, the only writer of a run directory."""
