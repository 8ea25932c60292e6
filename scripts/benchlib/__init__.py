"""The modules behind scripts/benchmark.py: rows (declared), runner, stats, chart and machine facts."""
