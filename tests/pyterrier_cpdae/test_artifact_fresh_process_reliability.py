"""Fresh process: every artifact built by one process is loaded and searched by another.

The BM25 half of this promise (with and without ``JAVA_HOME``) is in ``tests/pyterrier_cpdae/bm25/test_bm25_reliability.py``;
this module checks the DenseIndex, through both ``DenseIndex(path)`` and ``pt.Artifact.load(path)``, and
through every exact backend and FAISS, against a brute-force top-k computed here.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytestmark = pytest.mark.multiproc

DIM, N, K = 16, 300, 10

_BUILD = textwrap.dedent("""
    import sys, numpy as np
    from pyterrier_cpdae import DenseIndex
    vecs = np.random.default_rng(7).standard_normal(({n}, {dim})).astype(np.float32)
    DenseIndex(sys.argv[1]).indexer().index([{{"docno": f"d{{i}}", "doc_vec": v}} for i, v in enumerate(vecs)])
""")

_SEARCH = textwrap.dedent("""
    import json, sys, numpy as np, pandas as pd, pyterrier as pt
    from pyterrier_cpdae import DenseIndex
    index = {load}
    q = np.random.default_rng(8).standard_normal((4, {dim})).astype(np.float32)
    topics = pd.DataFrame({{"qid": [str(i) for i in range(4)], "query_vec": list(q)}})
    run = index.{factory}(num_results={k})(topics)
    print(json.dumps(run[["qid", "docno", "score"]].values.tolist()))
""")


def _run(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def built_elsewhere(tmp_path_factory):
    path = tmp_path_factory.mktemp("fresh") / "index"
    _run(_BUILD.format(n=N, dim=DIM), str(path))
    return path


@pytest.mark.parametrize("load", ["DenseIndex(sys.argv[1])", "pt.Artifact.load(sys.argv[1])"])
@pytest.mark.parametrize("factory", ["np_retriever", "torch_retriever", "faiss_flat_retriever"])
def test_dense_index_built_by_one_process_is_searched_by_another(built_elsewhere, load, factory):
    out = json.loads(_run(_SEARCH.format(load=load, dim=DIM, k=K, factory=factory), str(built_elsewhere)))
    vecs = np.random.default_rng(7).standard_normal((N, DIM)).astype(np.float32)
    q = np.random.default_rng(8).standard_normal((4, DIM)).astype(np.float32)
    scores = q @ vecs.T
    for qi in range(4):
        got = [(docno, score) for qid, docno, score in out if qid == str(qi)]
        expected = np.argsort(-scores[qi], kind="stable")[:K]
        assert [d for d, _ in got] == [f"d{i}" for i in expected]
        np.testing.assert_allclose([s for _, s in got], scores[qi, expected], rtol=1e-5, atol=1e-5)
