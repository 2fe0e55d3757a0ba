"""Reliability promises of DenseIndex: one test per promise, each reproducing a failure found by an
adversarial pass.

Bad input is refused naming the record, before anything is written; a process killed at any point of a build
or merge leaves something that a rerun finishes; a second writer is refused; nothing is deleted that a user
still needs.  Kills are real (``os._exit`` in a subprocess at a chosen point of the code, see ``_KILL_AT``).
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae.dense.format import write_json_atomic
from pyterrier_cpdae._locking import ConcurrentBuildError
from pyterrier_cpdae.dense import DenseIndex, IncompleteIndexError

from tests.helpers import REPO, index_worker
from tests.helpers.index_worker import synthetic_docs

DIM = 8
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
WORKER = index_worker.__file__


def docs_frame(docnos, seed=0):
    vecs = np.random.default_rng(seed).standard_normal((len(docnos), DIM)).astype(np.float32)
    return pd.DataFrame({"docno": docnos, "doc_vec": list(vecs)}), vecs


def files(path: Path) -> list:
    return sorted(p.name for p in path.iterdir())


def query(docnos):
    return pd.DataFrame({"qid": "q", "query_vec": [np.ones(DIM, np.float32)] * len(docnos), "docno": docnos})


# A subprocess that runs one build/merge step and dies (os._exit, like kill -9: no cleanup runs) at a chosen point.
_KILL_AT = textwrap.dedent("""
    import os, shutil, sys
    from pathlib import Path
    point, action, path = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    meta = str(path / "pt_meta.json")
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace(src, dst, *a, **k):
        if point == "inside the commit" and str(dst) == meta:
            os._exit(137)
        real_replace(src, dst, *a, **k)
        if point == "just after the commit" and str(dst) == meta:
            os._exit(137)

    def rmtree(p, *a, **k):
        if point == "while deleting shards/" and Path(p) == path / "shards":
            real_rmtree(Path(p) / "0")
            os._exit(137)
        real_rmtree(p, *a, **k)

    os.replace, shutil.rmtree = replace, rmtree
    import pyterrier_cpdae.dense.format as io
    if point == "while writing the merged files":
        io.build_docno_lookup = lambda *a, **k: os._exit(137)
    sys.path.insert(0, sys.argv[4])
    from tests.helpers.index_worker import synthetic_docs
    from pyterrier_cpdae.dense import DenseIndex
    if action == "index":
        DenseIndex(path).indexer(batch_size=16, checkpoint_every=64).index(synthetic_docs(300, 8))
    else:
        DenseIndex(path).merge_shards()
    print("not killed", flush=True)
""")


def run_and_kill(point: str, action: str, path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _KILL_AT, point, action, str(path), str(REPO)],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 137, (out.returncode, out.stdout, out.stderr)


# ------------------------------------------------------------------------------------------------- bad input
def test_docno_with_nul_is_refused_naming_the_record(tmp_path):
    """Item 6: npids stored "b\\x00" as "b" (and reported ["nul\\x00", "nul"] as duplicates)."""
    frame, _ = docs_frame(["a", "b\x00"])
    with pytest.raises(ValueError, match=r"record 1 of the input: docno 'b\\x00' contains a NUL character"):
        DenseIndex(tmp_path / "ix").indexer().index(frame)
    assert not (tmp_path / "ix").exists()  # nothing was written


def test_lone_surrogate_docno_is_refused_and_leaves_nothing(tmp_path):
    """Item 22: a lone surrogate raised UnicodeEncodeError after vectors were written, leaving a partial index."""
    records = docs_frame([f"d{i}" for i in range(6)])[0].to_dict("records")
    records[5]["docno"] = "bad\ud800"  # (pandas' arrow strings cannot even hold it: records as dicts)
    with pytest.raises(ValueError, match=r"record 5 of the input: docno 'bad\\ud800' is not valid Unicode"):
        DenseIndex(tmp_path / "ix").indexer().index(records)
    assert not (tmp_path / "ix").exists()


def test_bad_docno_after_indexed_batches_leaves_a_resumable_build(tmp_path):
    """Records before a bad one stay a resumable build; after fixing the input, resume finishes it."""
    docnos = [f"d{i}" for i in range(40)]
    frame, vecs = docs_frame(docnos)
    bad = frame.copy()
    bad.loc[33, "docno"] = "d33\x00"
    index = DenseIndex(tmp_path / "ix")
    with pytest.raises(ValueError, match="record 33 of the input"):
        index.indexer(batch_size=8, checkpoint_every=8).index(bad)
    with pytest.raises(IncompleteIndexError, match="mode='resume'"):
        index.meta()
    index.indexer(mode="resume", batch_size=8).index(frame)
    np.testing.assert_array_equal(np.asarray(index.vectors()), vecs)
    assert list(index.docnos.fwd) == docnos


def test_vectors_of_dimension_zero_are_refused(tmp_path):
    """Item 5: empty vectors built an index of dim 0 that returned nothing."""
    frame = pd.DataFrame({"docno": ["a", "b"], "doc_vec": [np.zeros(0, np.float32)] * 2})
    with pytest.raises(ValueError, match=r"doc_vec of docno 'a' is empty \(dimension 0\)"):
        DenseIndex(tmp_path / "ix").indexer().index(frame)
    assert not (tmp_path / "ix").exists()
    # a pt_meta.json claiming dim 0 is refused when opened, naming the file and field
    built = DenseIndex(tmp_path / "built")
    built.indexer().index(docs_frame(["a"])[0])
    meta = json.loads((tmp_path / "built" / "pt_meta.json").read_text())
    (tmp_path / "built" / "pt_meta.json").write_text(json.dumps({**meta, "dim": 0}))
    with pytest.raises(ValueError, match=r"corrupt .*pt_meta.json: dim=0"):
        DenseIndex(tmp_path / "built").meta()


@pytest.mark.parametrize("cut", ["last byte", "last 100 bytes", "half"])
def test_truncated_docno_lookup_is_refused_at_open(tmp_path, cut):
    """Item 4: a truncated docnos.npids opened fine and scorer() later failed with a bare IndexError."""
    index = DenseIndex(tmp_path / "ix")
    index.indexer().index(docs_frame([f"d{i}" for i in range(1000)])[0])
    path = tmp_path / "ix" / "docnos.npids"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate({"last byte": size - 1, "last 100 bytes": size - 100, "half": size // 2}[cut])
    with pytest.raises(ValueError, match=r"corrupt dense index .*docnos\.npids.*(truncated|cannot read)"):
        DenseIndex(tmp_path / "ix").scorer()(query(["d999"]))


# ------------------------------------------------------------------------------------------------- resume
class _Crash(Exception):
    pass


def crash_after(frame, n):
    for i, rec in enumerate(frame.to_dict("records")):
        if i == n:
            raise _Crash()
        yield rec


def test_resume_with_another_encoder_is_refused(tmp_path):
    """Item 7: resume with another model of the same dimension silently mixed two models' vectors."""
    docnos = [f"d{i}" for i in range(600)]
    frame, vecs = docs_frame(docnos, seed=0)
    index = DenseIndex(tmp_path / "ix")
    with pytest.raises(_Crash):
        index.indexer(batch_size=32, checkpoint_every=64).index(crash_after(frame, 500))
    other, _ = docs_frame(docnos, seed=1)  # same docnos, same dimension, another "encoder"
    with pytest.raises(ValueError, match=r"record 0 \(docno 'd0'\) differs from the stored one .*another encoder"):
        index.indexer(mode="resume").index(other)
    # the same encoder run in bf16 (vectors rounded to 8 mantissa bits) is the same model: resume proceeds
    import torch
    bf16 = frame.assign(doc_vec=[torch.tensor(v).bfloat16().float().numpy() for v in vecs])
    index.indexer(mode="resume").index(bf16)
    assert len(index) == 600
    np.testing.assert_allclose(np.asarray(index.vectors()), vecs, rtol=1e-2, atol=1e-2)


def test_resume_without_progress_record_refuses_foreign_files(tmp_path):
    """Item 16: resume on a directory with no progress record truncated and overwrote a foreign vectors.bin."""
    target = tmp_path / "ix"
    target.mkdir()
    (target / "vectors.bin").write_bytes(b"somebody else's data")
    with pytest.raises(FileExistsError, match=r"no progress record \(_build.json\) but is not empty \(vectors.bin\)"):
        DenseIndex(target).indexer(mode="resume").index(docs_frame(["a"])[0])
    assert (target / "vectors.bin").read_bytes() == b"somebody else's data"
    assert files(target) == ["vectors.bin"]


@pytest.mark.multiproc
@pytest.mark.parametrize("point", ["inside the commit", "just after the commit"])
def test_kill_around_the_final_commit_leaves_nothing_behind(tmp_path, point):
    """Item 8: leftovers of a kill in/just after the commit (_build.json, _docnos.txt, .pt_meta.*.tmp.json)
    stayed forever; resume said "already built" and cleaned nothing."""
    ref = DenseIndex(tmp_path / "ref")
    ref.indexer(batch_size=16).index(synthetic_docs(300, DIM))
    for opener in ("resume", "open"):
        path = tmp_path / opener
        run_and_kill(point, "index", path)
        assert len(files(path)) > 3  # what the kill left behind
        if opener == "resume":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                DenseIndex(path).indexer(mode="resume").index(synthetic_docs(300, DIM))
        elif point == "inside the commit":  # not committed: the index is not built (and says how to resume)
            with pytest.raises(IncompleteIndexError, match="mode='resume'"):
                DenseIndex(path).scorer()(query(["doc-1"]))
            continue
        else:  # committed: opening the index for search finishes the cleanup
            DenseIndex(path).scorer()(query(["doc-1"]))
        assert files(path) == ["docnos.npids", "pt_meta.json", "vectors.bin"]
        for name in ("vectors.bin", "docnos.npids"):
            assert (path / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_metadata_files_respect_the_umask(tmp_path):
    """Item 13: pt_meta.json and _build.json were world-writable (0666, from pyterrier-alpha's finalized_open)."""
    old = os.umask(0o022)
    try:
        index = DenseIndex(tmp_path / "ix")
        index.indexer().index(docs_frame(["a", "b"])[0])
        assert stat.S_IMODE((tmp_path / "ix" / "pt_meta.json").stat().st_mode) == 0o644
        with pytest.raises(_Crash):
            DenseIndex(tmp_path / "partial").indexer(batch_size=1, checkpoint_every=1).index(
                crash_after(docs_frame(["a", "b", "c"])[0], 2))
        assert stat.S_IMODE((tmp_path / "partial" / "_build.json").stat().st_mode) == 0o644
        os.umask(0o077)  # the one atomic JSON writer (BM25Index's pt_meta.json too) follows any umask
        write_json_atomic(tmp_path / "private.json", {"a": 1})
        assert stat.S_IMODE((tmp_path / "private.json").stat().st_mode) == 0o600
        assert json.loads((tmp_path / "private.json").read_text()) == {"a": 1}
    finally:
        os.umask(old)


# ------------------------------------------------------------------------------------------------- merging
def test_merge_into_one_of_its_sources_is_refused(tmp_path):
    """Item 15: merge(["a", "b"], "a", mode="overwrite") deleted a before reading it."""
    a, b = DenseIndex(tmp_path / "a"), DenseIndex(tmp_path / "b")
    frame_a, vecs_a = docs_frame([f"a{i}" for i in range(1000)])
    a.indexer().index(frame_a)
    b.indexer().index(docs_frame(["b0"])[0])
    (tmp_path / "link").symlink_to(tmp_path / "a")
    for dest in (tmp_path / "a", tmp_path / "link", str(tmp_path / "x" / ".." / "a")):
        with pytest.raises(ValueError, match=r"cannot merge into .*: it is the source index"):
            DenseIndex.merge([a, b], dest, mode="overwrite")
    with pytest.raises(ValueError, match=r"it contains the source index"):
        DenseIndex.merge([a, b], tmp_path, mode="overwrite")
    assert len(DenseIndex(tmp_path / "a")) == 1000
    np.testing.assert_array_equal(np.asarray(DenseIndex(tmp_path / "a").vectors()), vecs_a)


def sharded_view(path: Path, n_docs: int = 301, num_shards: int = 3) -> None:
    for s in range(num_shards):
        DenseIndex(path).indexer(shard=s, num_shards=num_shards, batch_size=16).index(synthetic_docs(n_docs, DIM))


@pytest.mark.multiproc
@pytest.mark.parametrize("point", ["while writing the merged files", "just after the commit", "while deleting shards/"])
def test_merge_shards_killed_midway_is_finished_by_a_rerun(tmp_path, point):
    """Item 26: after a kill inside merge_shards(), merge_shards() ("not a sharded view") and
    indexer(mode="resume") ("merge it with merge_shards()") sent the user round in circles."""
    ref = DenseIndex(tmp_path / "ref")
    ref.indexer(batch_size=16).index(synthetic_docs(301, DIM))
    for rerun in ("merge_shards", "resume"):
        path = tmp_path / rerun
        sharded_view(path)
        run_and_kill(point, "merge_shards", path)
        index = DenseIndex(path)
        if rerun == "merge_shards":
            index.merge_shards()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    index.indexer(mode="resume").index(synthetic_docs(301, DIM))
                except FileExistsError as ex:  # killed before the commit: the sharded view is intact
                    assert point == "while writing the merged files" and "merge_shards()" in str(ex)
                    assert DenseIndex(path).num_shards == 3
                    index.merge_shards()
        assert files(path) == ["docnos.npids", "pt_meta.json", "vectors.bin"]
        for name in ("vectors.bin", "docnos.npids"):
            assert (path / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


# ------------------------------------------------------------------------------------------------- concurrency
def test_resuming_a_built_shard_writes_the_missing_top_level_metadata(tmp_path):
    """A kill between the last shard's commit and the top-level pt_meta.json left every shard built but no view;
    the advice "finish the missing shards with mode='resume'" then only answered "already built"."""
    path = tmp_path / "ix"
    sharded_view(path, n_docs=30)
    (path / "pt_meta.json").unlink()  # the state that kill leaves
    with pytest.raises(IncompleteIndexError, match=r"0: built, 1: built, 2: built.*mode='resume'"):
        DenseIndex(path).meta()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        DenseIndex(path).indexer(shard=2, num_shards=3, mode="resume").index(synthetic_docs(30, DIM))
    assert DenseIndex(path).num_shards == 3 and len(DenseIndex(path)) == 30


_HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from pyterrier_cpdae._locking import build_lock
    with build_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(60)
""")


@pytest.mark.multiproc
def test_second_writer_is_refused_while_a_build_runs(tmp_path):
    """Item 17: two processes indexing into one path both reported success; the index held one writer's data."""
    path, n = tmp_path / "ix", 1500
    proc = subprocess.Popen([sys.executable, WORKER, str(path), "create", str(n), str(DIM), "0.003", "64"], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not (path / "_build.json").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert proc.poll() is None, proc.communicate()
        for mode in ("create", "overwrite", "resume"):
            with pytest.raises(ConcurrentBuildError, match=rf"the dense index at .*ix is being built by pid {proc.pid} "
                                                           r"on host .* since ") as refused:
                DenseIndex(path).indexer(mode=mode).index(docs_frame(["x"])[0])
            assert "overwrite" not in str(refused.value)  # never advise clobbering the live build
        # A reader meeting the build is told it is in progress, not that it was interrupted
        with pytest.raises(IncompleteIndexError, match=rf"being built by pid {proc.pid} on host .* since ") as e:
            DenseIndex(path).search(np.ones((1, DIM), dtype=np.float32), 3)
        assert "interrupted" not in str(e.value)
        with pytest.raises(ConcurrentBuildError):
            DenseIndex.merge([DenseIndex(tmp_path / "other")], path, mode="overwrite")
        assert proc.wait(timeout=120) == 0, proc.communicate()
    finally:
        proc.kill()
        proc.wait()
    assert len(DenseIndex(path)) == n  # the first writer's build is complete and untouched
    assert list(DenseIndex(path).docnos.fwd[[0, n - 1]]) == ["doc-0", f"doc-{n - 1}"]


@pytest.mark.multiproc
def test_merge_shards_is_refused_while_another_process_holds_the_index(tmp_path):
    path = tmp_path / "ix"
    sharded_view(path, n_docs=30)
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(path)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(ConcurrentBuildError):
            DenseIndex(path).merge_shards()
        with pytest.raises(ConcurrentBuildError):
            DenseIndex.merge([DenseIndex(tmp_path / "other")], path, mode="overwrite")
    finally:
        proc.kill()
        proc.wait()
    assert DenseIndex(path).num_shards == 3  # untouched
    DenseIndex(path).merge_shards()
    assert len(DenseIndex(path)) == 30
