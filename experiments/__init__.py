"""Experiment scripts: run as ``python experiments/<name>.py`` or ``python -m experiments.<name>``."""
