"""One-off studies behind figures and notes in ``docs/`` and ``experiments/results/`` (commands in each script's
docstring).  ``common.py`` is a library module the studies share; no study imports another."""
