"""Shared by the paper pipeline's end-to-end test files: Table 1's rows and columns, and
``python -m experiments.paper`` run as a subprocess (the tests are split over files so that pytest-xdist's
``--dist loadfile`` can run the long ones on both workers)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers.warm_python import warm_python

REPO = Path(__file__).resolve().parents[2]


TABLE1_ROWS = ["BM25", "BERT", "MLM", "SimCSE", "ICT", "PROP", "SEED", "RetroMAE", "BoW", "CPDAE_R", "CPDAE"]
TABLE1_COLS = ["MARCO MRR@10", "MARCO R@100", "MARCO nDCG@10", "SciFact nDCG@10", "SciFact R@100",
               "Vaswani nDCG@10", "Vaswani MAP", "Cranfield nDCG@10", "Cranfield MAP"]


def run_paper(args: list[str], timeout: int = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([warm_python(), "-m", "experiments.paper", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
