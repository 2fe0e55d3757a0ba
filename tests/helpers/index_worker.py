"""Subprocess used by the kill/resume test: indexes a deterministic synthetic stream, slowly.

Usage: python tests/helpers/index_worker.py PATH MODE NUM_DOCS DIM SLEEP_PER_DOC CHECKPOINT_EVERY
"""
from __future__ import annotations

import sys
import time

import numpy as np


def synthetic_docs(num_docs: int, dim: int, sleep: float = 0.0):
    """Record i is a pure function of i, so a restarted stream regenerates exactly the same records."""
    for i in range(num_docs):
        if sleep:
            time.sleep(sleep)
        vec = np.random.default_rng(i).standard_normal(dim).astype(np.float32)
        yield {"docno": f"doc-{i}", "doc_vec": vec}


def main() -> None:
    path, mode, num_docs, dim, sleep, every = sys.argv[1:7]
    from pyterrier_cpdae.dense import DenseIndex

    index = DenseIndex(path)
    index.indexer(mode=mode, batch_size=16, checkpoint_every=int(every)).index(
        synthetic_docs(int(num_docs), int(dim), float(sleep)))
    print("done", flush=True)


if __name__ == "__main__":
    main()
