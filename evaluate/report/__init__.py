"""Report: every run of a results tree read into one pandas frame, then tables, plots and the leaderboard export,
without torch or kvpress; ``python -m evaluate.report`` writes them."""
