"""Results of finished runs, in layers that only import downwards: runs (run directories read back) → frame (one
tidy DataFrame, a row per run x task) → tables → differences → compare (each a pivot, merge or groupby over the
frame) → report (every table, as files and one page). The command lines, plots and wandb summary read these
modules; nothing here reads them."""
