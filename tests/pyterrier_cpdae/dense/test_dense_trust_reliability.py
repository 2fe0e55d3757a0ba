"""An index answers for what it holds: a corrupt stored vector is refused by the mining API as by the retrievers;
packages unpack only what their manifest lists (caches dropped, sizes bounded, nothing left by a killed unpack); an
unknown format version is refused; the index checks the producer of the query vectors wherever they meet it."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae import DenseIndex
from pyterrier_cpdae.dense import format as io

DIM = 8


def _index(path, n=30, **kw):
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((n, DIM)).astype(np.float32)
    index = DenseIndex(path)
    index.indexer(**kw).index([{"docno": f"d{i}", "doc_vec": vecs[i]} for i in range(n)])
    return index, vecs


def test_search_refuses_a_stored_nan_vector_naming_the_document(tmp_path):
    index, vecs = _index(tmp_path / "i")
    raw = np.memmap(tmp_path / "i" / io.VECTORS_FILE, dtype="<f4", mode="r+", shape=vecs.shape)
    raw[7] = np.nan
    raw.flush()
    del raw
    q = vecs[:3] + 0.1
    topics = pd.DataFrame({"qid": ["a", "b", "c"], "query_vec": list(q)})
    with pytest.raises(ValueError, match="not finite"):
        index.np_retriever(num_results=30)(topics)
    for backend in ("numpy", "torch"):
        with pytest.raises(ValueError) as info:
            index.search(q, 30, backend=backend)
        msg = str(info.value)
        assert "'d7'" in msg and "\n" not in msg and "overwrite" in msg


# -- packages and formats -------------------------------------------------------------------------------------
def _topics(vecs):
    return pd.DataFrame({"qid": [f"q{i}" for i in range(5)], "query_vec": list(vecs[:5] + 0.05)})


def test_a_crafted_faiss_cache_in_a_package_is_never_unpacked_or_served(tmp_path, monkeypatch):
    import json
    import shutil
    other, _ = _index(tmp_path / "other", n=30)
    other.faiss_flat_retriever(num_results=5)(_topics(np.ones((5, DIM), np.float32)))  # a FAISS cache of other vectors
    index, vecs = _index(tmp_path / "idx", n=30)
    index.faiss_flat_retriever(num_results=5)(_topics(vecs))
    shutil.rmtree(tmp_path / "idx" / "faiss")
    shutil.copytree(tmp_path / "other" / "faiss", tmp_path / "idx" / "faiss")
    for info in (tmp_path / "idx" / "faiss").glob("*.json"):  # its fingerprint rewritten to this index's build
        data = json.loads(info.read_text())
        data["fingerprint"]["build_id"] = index.meta()["build_id"]
        info.write_text(json.dumps(data))
    monkeypatch.setattr(DenseIndex, "PACKAGE_EXCLUDE", ())  # the crafted package carries faiss/ (its manifest too)
    package = index.build_package(str(tmp_path / "p.tar.lz4"), verbose=False)
    monkeypatch.undo()
    assert any(e["path"].startswith("faiss/") for e in json.loads(open(package + ".json").read())["contents"])
    copy = DenseIndex.from_package(package, tmp_path / "copy")
    assert not (copy.path / "faiss").exists()
    exact = copy.np_retriever(num_results=5)(_topics(vecs))
    pd.testing.assert_frame_equal(copy.faiss_flat_retriever(num_results=5)(_topics(vecs))[["qid", "docno"]],
                                  exact[["qid", "docno"]])


def test_a_faiss_cache_carried_in_beside_an_index_is_rebuilt_not_served(tmp_path):
    """The same crafted cache put beside an index by any other route (PyTerrier's own from_url): its fingerprint
    names another vectors file, so the structure is rebuilt from this index's vectors."""
    import json
    import shutil
    index, vecs = _index(tmp_path / "idx", n=30)
    other = DenseIndex(tmp_path / "other")
    rng = np.random.default_rng(9)
    other_vecs = rng.standard_normal((30, DIM)).astype(np.float32)
    other.indexer().index([{"docno": f"d{i}", "doc_vec": other_vecs[i]} for i in range(30)])
    other.faiss_flat_retriever(num_results=5)(_topics(vecs))
    shutil.copytree(tmp_path / "other" / "faiss", tmp_path / "idx" / "faiss")
    for info in (tmp_path / "idx" / "faiss").glob("*.json"):
        data = json.loads(info.read_text())
        data["fingerprint"]["build_id"] = index.meta()["build_id"]
        info.write_text(json.dumps(data))
    exact = index.np_retriever(num_results=5)(_topics(vecs))
    got = DenseIndex(tmp_path / "idx").faiss_flat_retriever(num_results=5)(_topics(vecs))
    assert got["docno"].tolist() == exact["docno"].tolist()


def _craft(tmp_path, members, manifest_members):
    """An archive of ``members`` (name -> bytes) and a manifest with its true SHA-256 listing ``manifest_members``."""
    import hashlib
    import io as _io
    import json
    import tarfile
    from lz4.frame import LZ4FrameFile
    path = tmp_path / "crafted.tar.lz4"
    with open(path, "wb") as raw, LZ4FrameFile(raw, "wb") as lz, tarfile.open(fileobj=lz, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, _io.BytesIO(data))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    (tmp_path / "crafted.tar.lz4.json").write_text(json.dumps(
        {"expected_sha256": sha, "total_size": sum(manifest_members.values()),
         "contents": [{"path": p, "size": s} for p, s in manifest_members.items()]}))
    return str(path)


def test_unpacking_writes_only_the_members_the_manifest_lists_at_their_sizes(tmp_path, monkeypatch):
    import tarfile
    index, vecs = _index(tmp_path / "idx", n=20)
    real = {p: (index.path / p).read_bytes() for p in index.package_files()}
    sizes = {p: len(b) for p, b in real.items()}
    written = []
    extract = tarfile.TarFile.extract

    def counting(self, member, path="", **kw):
        written.append(member.size)
        return extract(self, member, path, **kw)

    monkeypatch.setattr(tarfile.TarFile, "extract", counting)
    bomb = dict(real, **{"junk.bin": bytes(20 << 20)})  # 20 MiB of zeros: a few kB compressed
    package = _craft(tmp_path, bomb, sizes)
    with pytest.raises(ValueError, match="'junk.bin' is not listed in its manifest"):
        DenseIndex.from_package(package, tmp_path / "copy")
    assert sum(written) < 1 << 20  # the bomb was never written
    grown = dict(real, **{"vectors.bin": real["vectors.bin"] + bytes(20 << 20)})
    written.clear()
    with pytest.raises(ValueError, match=r"'vectors.bin' holds \d+ bytes, its manifest lists"):
        DenseIndex.from_package(_craft(tmp_path, grown, sizes), tmp_path / "copy")
    assert sum(written) < 1 << 20
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".copy") or p.name == "copy"]
    # a tampered archive is refused by its hash before anything is unpacked
    good = index.build_package(str(tmp_path / "good.tar.lz4"), verbose=False)
    data = bytearray(open(good, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(good, "wb").write(bytes(data))
    written.clear()
    with pytest.raises(ValueError, match="SHA-256"):
        DenseIndex.from_package(good, tmp_path / "copy")
    assert written == [] and not (tmp_path / "copy").exists()
    # and a faithful package unpacks
    ok = DenseIndex.from_package(_craft(tmp_path, real, sizes), tmp_path / "copy")
    assert len(ok) == 20


def test_a_killed_unpack_leaves_nothing_once_unpacked_again(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    index, vecs = _index(tmp_path / "idx", n=50000)  # 1.6 MB of random vectors
    package = index.build_package(str(tmp_path / "p.tar.lz4"), verbose=False)
    script = textwrap.dedent(f"""
        import sys, time, tarfile
        extract = tarfile.TarFile.extract
        def slow(self, member, path="", **kw):
            extract(self, member, path, **kw)
            print("extracted", flush=True)
            time.sleep(60)
        tarfile.TarFile.extract = slow
        from pyterrier_cpdae import DenseIndex
        DenseIndex.from_package({package!r}, {str(tmp_path / 'copy')!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    try:
        assert proc.stdout.readline().strip() == "extracted"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".copy.")]
    assert left and not (tmp_path / "copy").exists()  # killed midway: a temporary, no folder
    copy = DenseIndex.from_package(package, tmp_path / "copy")
    assert len(copy) == 50000
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".copy.")] == []


def test_an_unknown_format_version_is_refused_in_one_line(tmp_path):
    import json
    index, vecs = _index(tmp_path / "idx", n=10)
    meta = json.loads((index.path / "pt_meta.json").read_text())
    meta["format_version"] = 99
    (index.path / "pt_meta.json").write_text(json.dumps(meta))
    fresh = DenseIndex(tmp_path / "idx")
    for use in (lambda: fresh.np_retriever(num_results=3)(_topics(vecs)), lambda: fresh.search(vecs[:2], 3),
                lambda: len(fresh)):
        with pytest.raises(ValueError) as info:
            use()
        assert "format_version 99" in str(info.value) and "\n" not in str(info.value)
