"""Artifact packages are unpacked within stated bounds, like safetensors' header cap and tarfile's data filter:

* without a manifest (``<package>.json``), a package unpacks at most ``MAX_UNPACKED_BYTES`` and at most
  ``MAX_RATIO`` bytes per archive byte (a 1.7 MB archive unpacked 400 MiB), and only the artifact's own files (an
  extra member was kept);
* a member listed twice refuses the package (``pt_meta.json`` written twice unpacked the second over the first);
* ``from_url`` caps the download before anything is unpacked (it streamed any size);
* an unpacking stopped midway leaves nothing behind.

References: the archives are written here member by member with ``tarfile`` + lz4 (what ``build_package`` writes),
so each test knows exactly what the archive holds.
"""
from __future__ import annotations

import functools
import http.server
import io
import json
import tarfile
import threading
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from lz4.frame import LZ4FrameFile

from pyterrier_cpdae import _artifact
from pyterrier_cpdae.dense import DenseIndex

DIM = 8


def _index(path: Path, n: int = 20) -> DenseIndex:
    path = path.parent / "sources" / path.name  # (its build lock file stays there)
    rng = np.random.default_rng(0)
    index = DenseIndex(path)
    index.indexer().index([{"docno": f"d{i}", "doc_vec": rng.standard_normal(DIM).astype(np.float32)}
                           for i in range(n)])
    return index


def _write_archive(package: Path, members: list[tuple[str, bytes]]) -> Path:
    """An lz4 tar of ``members`` (name, bytes) in this order, without a manifest."""
    with open(package, "wb") as raw, LZ4FrameFile(raw, "wb") as lz, tarfile.open(fileobj=lz, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return package


def _members_of(index: DenseIndex) -> list[tuple[str, bytes]]:
    return [(rel, (Path(index.path) / rel).read_bytes()) for rel in index.package_files()]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_package_without_manifest_keeps_only_the_artifacts_own_files(tmp_path):
    index = _index(tmp_path / "idx")
    members = _members_of(index) + [("run.sh", b"rm -rf ~\n"), ("notes/readme.txt", b"hello")]
    package = _write_archive(tmp_path / "extra.tar.lz4", members)
    copy = DenseIndex.from_package(package, tmp_path / "copy")
    assert sorted(p.relative_to(copy.path).as_posix() for p in Path(copy.path).rglob("*")) == \
        sorted(index.package_files())
    topics = pd.DataFrame({"qid": ["q"], "query": ["x"], "query_vec": [np.ones(DIM, dtype=np.float32)]})
    pd.testing.assert_frame_equal(copy.retriever(num_results=5)(topics), index.retriever(num_results=5)(topics))


def test_an_archive_bomb_without_manifest_is_refused_before_it_is_written(tmp_path):
    """A 400 MiB member of zeros compresses to ~1.6 MB with lz4: 250 bytes per archive byte."""
    index = _index(tmp_path / "idx")
    members = _members_of(index)
    bomb = [m for m in members if m[0] != "vectors.bin"] + [("vectors.bin", bytes(400 << 20))]
    package = _write_archive(tmp_path / "bomb.tar.lz4", bomb)
    size = package.stat().st_size
    assert size < 2 << 20
    with pytest.raises(ValueError, match=r"bomb\.tar\.lz4 unpacks to more than 100 times") as e:
        DenseIndex.from_package(package, tmp_path / "dest" / "out")
    assert "\n" not in str(e.value) and "max_ratio" in str(e.value)
    assert _leftovers(tmp_path / "dest") == []  # no folder, no temporary


def test_the_byte_and_member_limits_are_named(tmp_path):
    index = _index(tmp_path / "idx")
    package = _write_archive(tmp_path / "p.tar.lz4", _members_of(index))
    with pytest.raises(ValueError, match=r"more than 100 bytes .*max_bytes"):
        DenseIndex.from_package(package, tmp_path / "dest" / "a", max_bytes=100)
    with pytest.raises(ValueError, match=r"more than 2 members .*max_members"):
        DenseIndex.from_package(package, tmp_path / "dest" / "b", max_members=2)
    assert _leftovers(tmp_path / "dest") == []
    assert DenseIndex.from_package(package, tmp_path / "dest" / "c").built()  # the defaults let a real index through


@pytest.mark.parametrize("manifest", [False, True])
def test_a_member_listed_twice_refuses_the_package(tmp_path, manifest):
    index = _index(tmp_path / "idx")
    members = _members_of(index)
    meta = dict(members)["pt_meta.json"]
    forged = json.loads(meta)
    forged["doc_count"] = 3  # written a second time, with other content
    twice = members + [("pt_meta.json", json.dumps(forged).encode())]
    package = _write_archive(tmp_path / "twice.tar.lz4", twice)
    if manifest:  # a manifest that lists it twice too
        listed = [{"path": n, "size": len(d)} for n, d in twice]
        (tmp_path / "twice.tar.lz4.json").write_text(json.dumps({"contents": listed}))
        match = r"lists 'pt_meta.json' twice"
    else:
        match = r"holds the member 'pt_meta.json' twice"
    with pytest.raises(ValueError, match=match):
        DenseIndex.from_package(package, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # the same name spelled ./pt_meta.json is the same member
    package = _write_archive(tmp_path / "dot.tar.lz4", members + [("./pt_meta.json", meta)])
    with pytest.raises(ValueError, match=r"twice"):
        DenseIndex.from_package(package, tmp_path / "out")


def test_an_interrupted_unpack_leaves_nothing_behind(tmp_path, monkeypatch):
    index = _index(tmp_path / "idx")
    package = index.build_package(str(tmp_path / "p.tar.lz4"), verbose=False)
    calls = []
    real = tarfile.TarFile.extract

    def interrupted(self, member, *args, **kwargs):
        calls.append(member.name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, member, *args, **kwargs)

    monkeypatch.setattr(tarfile.TarFile, "extract", interrupted)
    with pytest.raises(KeyboardInterrupt):
        DenseIndex.from_package(package, tmp_path / "dest" / "out")
    assert len(calls) == 2 and _leftovers(tmp_path / "dest") == []


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A loopback HTTP server of ``tmp_path / "served"``, PyTerrier's home under ``tmp_path``."""
    folder = tmp_path / "served"
    folder.mkdir()
    monkeypatch.setenv("PYTERRIER_HOME", str(tmp_path / "pt_home"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_from_url_caps_the_download_before_unpacking(tmp_path, served, monkeypatch):
    folder, root = served
    index = _index(tmp_path / "idx", n=2000)
    index.build_package(str(folder / "idx.tar.lz4"), verbose=False)
    for suffix in ("", ".json"):
        (folder / f"again.tar.lz4{suffix}").write_bytes((folder / f"idx.tar.lz4{suffix}").read_bytes())
    copy = DenseIndex.from_url(f"{root}/idx.tar.lz4")  # within its cap: unpacked as PyTerrier does
    assert isinstance(copy, DenseIndex) and len(copy) == 2000
    size = (folder / "idx.tar.lz4").stat().st_size
    unpacked = []
    monkeypatch.setattr(tarfile.TarFile, "extract", lambda *a, **k: unpacked.append(a))
    with pytest.raises(ValueError, match=rf"passed {size // 2} bytes .*nothing was unpacked"):
        DenseIndex.from_url(f"{root}/again.tar.lz4", max_download_bytes=size // 2)
    assert unpacked == []
    home = tmp_path / "pt_home" / "artifacts"
    assert len(_leftovers(home)) == 2  # the first copy and its record: nothing of the refused download


def test_from_url_caps_a_package_without_manifest_and_one_whose_manifest_understates_it(tmp_path, served):
    folder, root = served
    index = _index(tmp_path / "idx", n=4000)  # 128 kB of random vectors: an archive of about that size
    members = _members_of(index)
    _write_archive(folder / "plain.tar.lz4", members)
    with pytest.raises(ValueError, match=r"passed 10000 bytes"):
        DenseIndex.from_url(f"{root}/plain.tar.lz4", max_download_bytes=10_000)
    _write_archive(folder / "lies.tar.lz4", members)  # its manifest lists one small file: the cap follows it
    (folder / "lies.tar.lz4.json").write_text(json.dumps({"contents": [{"path": "pt_meta.json", "size": 100}]}))
    with pytest.raises(ValueError, match=r"what its manifest's listed sizes can compress to"):
        DenseIndex.from_url(f"{root}/lies.tar.lz4")
    assert _leftovers(tmp_path / "pt_home" / "artifacts") == []


def test_the_limits_are_the_documented_ones():
    text = (Path(__file__).resolve().parents[2] / "docs" / "reliability.md").read_text()
    for name in ("MAX_MEMBERS", "MAX_UNPACKED_BYTES", "MAX_RATIO", "RATIO_FLOOR", "MAX_DOWNLOAD_BYTES"):
        assert f"`{name}`" in text, name
    assert (_artifact.MAX_MEMBERS, _artifact.MAX_RATIO) == (100_000, 100)


def test_a_download_killed_midway_is_removed_by_the_next_one(tmp_path, served):
    import hashlib
    import subprocess
    import sys

    folder, root = served
    _index(tmp_path / "idx").build_package(str(folder / "idx.tar.lz4"), verbose=False)
    url = f"{root}/idx.tar.lz4"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # the pid of a process that has ended
    home = tmp_path / "pt_home" / "artifacts"
    home.mkdir(parents=True)
    name = hashlib.sha256(url.encode()).hexdigest()
    left = home / f".{name}.download-{dead}.0badf00d.tmp.tar.lz4"
    left.write_bytes(b"half an archive")
    assert DenseIndex.from_url(url).built()
    assert not left.exists() and _leftovers(home) == [name, f"{name}.json"]
