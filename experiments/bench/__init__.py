"""Benchmarks: speed and memory of the package and the objectives against references (commands in each script's
docstring; recorded under ``experiments/results/``).  ``objective_runs.py`` is a library module the benchmarks share."""
