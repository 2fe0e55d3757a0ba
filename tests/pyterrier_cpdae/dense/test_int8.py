"""DenseIndex(dtype="int8"): the int8 scan with its per-query proof returns the float32 index's ranking (ties by
docid included) on adversarial near ties and on vectors with one huge dimension, on both backends, sharded and
merged; the calibration is keyed in pt_meta.json; builds resume, lock, package and check their producer as the float
index's do."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pyterrier_cpdae._locking import ConcurrentBuildError
from pyterrier_cpdae.dense import DenseIndex
from pyterrier_cpdae.dense import codes as qcodes
from pyterrier_cpdae.dense import format as io
from pyterrier_cpdae.dense.int8 import quantise_queries
from tests.helpers.dense import vector_frame as frame

ROOT = Path(__file__).parents[3]


def pair(tmp_path, vecs, name="", **kw):
    """The float32 index and the int8 index of the same vectors."""
    f32 = DenseIndex(tmp_path / f"f32{name}")
    f32.indexer().index(frame(vecs))
    i8 = DenseIndex(tmp_path / f"i8{name}")
    i8.indexer(dtype="int8", **kw).index(frame(vecs))
    return f32, i8


def assert_same_ranking(f32, i8, queries, ks=(1, 7, 50)):
    for k in ks:
        s0, i0 = f32.search(queries, k, backend="numpy")
        for backend, scan in (("numpy", "numpy"), ("torch", "torch"), ("numpy", None)):
            s1, i1 = i8.search(queries, k, backend=backend, scan=scan)
            np.testing.assert_array_equal(i1, i0, err_msg=f"k={k} backend={backend}")
            tol = 1e-5 * (1 + np.abs(s0))
            assert np.all(np.abs(s1 - s0) <= tol), (k, backend)


def near_ties(n=3000, dim=48, seed=0):
    """Blocks of identical vectors, copies one float32 ulp apart, and copies differing in one coordinate by less
    than the int8 step (same code, other float32 score)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n // 6, dim)).astype(np.float32)
    same = base.copy()
    ulp = np.nextafter(base, np.float32(np.inf))
    step = base.copy()
    step[:, 0] += np.float32(1e-3)
    noise = rng.standard_normal((n - 4 * len(base), dim)).astype(np.float32)
    vecs = np.concatenate([base, ulp, same, step, noise])
    return vecs[rng.permutation(len(vecs))]


def test_near_ties_equal_float32_ranking(tmp_path):
    vecs = near_ties()
    f32, i8 = pair(tmp_path, vecs)
    rng = np.random.default_rng(1)
    queries = np.concatenate([rng.standard_normal((20, vecs.shape[1])).astype(np.float32),
                              vecs[:10],  # a query equal to a stored vector (its copies tie at the top)
                              np.zeros((1, vecs.shape[1]), np.float32)])  # every score 0: ids in order
    assert_same_ranking(f32, i8, queries)
    stats = {}
    i8.search(queries[:20], 7, stats=stats)
    assert stats["rescored"] < 20 * len(vecs) / 4  # the proof cut the work: not every document was rescored
    # every rescored document was a candidate of the scan, and at least the k best of each query were rescored
    assert 20 * 7 <= stats["rescored"] <= stats["candidates"] <= 20 * len(vecs)
    assert stats["scan_s"] > 0 and stats["rescore_s"] > 0 and stats["retries"] == 0


def test_one_huge_dimension(tmp_path):
    """One dimension a million times larger in a few documents: its scale makes every other document's code of that
    dimension 0, an error the bound must cover (queries that weigh that dimension a little)."""
    rng = np.random.default_rng(2)
    vecs = rng.standard_normal((2000, 32)).astype(np.float32) * 0.1
    vecs[::400, 3] = 1e5
    vecs[:, 5] += np.float32(1e-3) * rng.standard_normal(2000).astype(np.float32)
    f32, i8 = pair(tmp_path, vecs)
    queries = rng.standard_normal((25, 32)).astype(np.float32)
    queries[:, 3] *= 1e-4
    assert_same_ranking(f32, i8, queries, ks=(1, 10, 100))
    scales = np.load(tmp_path / "i8" / qcodes.CALIBRATION_FILE)["scales"]
    assert scales[3] == pytest.approx(1e5 / 127, rel=1e-6)  # per-dimension absmax: nothing clipped


def test_bound_holds_against_exact_arithmetic():
    """The bound of int8.py checked directly: |q.x - t (p.c)| <= |e||c| + |q||r| for random and extreme rows."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((500, 40)).astype(np.float32)
    x[0] = 0
    x[1, 7] = 1e6
    scales = qcodes.int8_scales(np.abs(x).max(axis=0))
    codes, resid, cnorm = qcodes.encode_int8(x, scales)
    q = rng.standard_normal((30, 40)).astype(np.float32)
    p, t, e, scaled = quantise_queries(q, scales)
    np.testing.assert_array_equal(scaled, q.astype(np.float64) * scales)
    exact = q.astype(np.float64) @ x.astype(np.float64).T
    approx = t[:, None] * (p.astype(np.int64) @ codes.astype(np.int64).T)
    bound = np.linalg.norm(q.astype(np.float64), axis=1)[:, None] * resid + e[:, None] * cnorm
    assert np.all(np.abs(exact - approx) <= bound)
    rnorm = np.linalg.norm(q.astype(np.float64), axis=1)[:, None] * resid  # the bound once q~ . c is known
    assert np.all(np.abs(exact - scaled @ codes.astype(np.float64).T) <= rnorm)
    assert np.abs(codes).max() <= 127


def test_scan_backends_agree_on_extreme_codes():
    """torch._int_mm (int32) and the float32 BLAS product of int8 rows give the same exact integers, also with codes at
    +-127 and more dimensions than float32 sums exactly in one product."""
    rng = np.random.default_rng(4)
    dim = 1100
    codes = np.where(rng.random((300, dim)) < 0.5, -127, 127).astype(np.int8)
    cobj = type("C", (), {})()
    cobj.codes = codes
    q = np.full((3, dim), 127, np.int8)
    q[1] = -127
    q[2] = codes[5]
    exact = q.astype(np.int64) @ codes.astype(np.int64).T
    found = {b: qcodes.scan([(cobj, 0, 1)], [q], 300, decode=lambda r: r, backend=b)[0] for b in ("numpy", "torch")}
    for b, (scores, ids) in found.items():
        got = np.empty_like(exact, dtype=np.float64)
        np.put_along_axis(got, ids, scores.astype(np.float64), axis=1)
        assert np.all(np.abs(got - exact) <= np.abs(exact) * 2.0 ** -23), b  # exact up to the float32 rounding
    np.testing.assert_array_equal(found["numpy"][1][2, :1], [5])


def test_sharded_view_and_merge(tmp_path):
    vecs = near_ties(1800, 24, seed=5)
    f32 = DenseIndex(tmp_path / "f32")
    f32.indexer().index(frame(vecs))
    view = DenseIndex(tmp_path / "view")
    for s in range(3):
        view.indexer(dtype="int8", shard=s, num_shards=3).index(frame(vecs))
    assert view.num_shards == 3 and view.dtype == "int8"
    queries = np.random.default_rng(6).standard_normal((15, 24)).astype(np.float32)
    assert_same_ranking(f32, view, queries, ks=(1, 20))
    shard_scales = np.load(tmp_path / "view" / "shards" / "0" / qcodes.CALIBRATION_FILE)["scales"]
    view.merge_shards()
    assert view.num_shards == 1 and view.meta()["format_version"] == 2
    merged = np.load(tmp_path / "view" / qcodes.CALIBRATION_FILE)["scales"]
    np.testing.assert_array_equal(merged, qcodes.int8_scales(np.abs(vecs).max(axis=0)))  # calibrated on all
    assert not np.array_equal(merged, shard_scales)
    assert_same_ranking(f32, view, queries, ks=(20,))


def test_tampered_calibration_is_refused(tmp_path):
    vecs = np.random.default_rng(7).standard_normal((200, 16)).astype(np.float32)
    _, i8 = pair(tmp_path, vecs)
    path = tmp_path / "i8" / qcodes.CALIBRATION_FILE
    with np.load(path) as npz:
        arrays = dict(npz)
    arrays["scales"] = arrays["scales"] * np.float32(0.5)  # codes would now decode to other vectors
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    with pytest.raises(ValueError, match=r"calibration.npz does not match the calibration_sha256 recorded in "
                                         r"pt_meta.json"):
        DenseIndex(tmp_path / "i8").search(vecs[:2], 3)
    (tmp_path / "i8" / qcodes.CODES_FILE).write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="codes.bin has 10 bytes"):
        DenseIndex(tmp_path / "i8").search(vecs[:2], 3)


def test_format_versions(tmp_path, monkeypatch):
    vecs = np.random.default_rng(8).standard_normal((50, 8)).astype(np.float32)
    f32, i8 = pair(tmp_path, vecs)
    assert f32.meta()["format_version"] == 1  # float indexes stay readable by older readers
    assert i8.meta()["format_version"] == 2 and i8.meta()["codes"]["kind"] == "int8"
    monkeypatch.setattr(io, "READ_VERSIONS", (1,))  # a reader of version 1 only (the one before int8)
    with pytest.raises(ValueError) as refused:
        io.read_meta(tmp_path / "i8")
    assert "\n" not in str(refused.value)
    assert "format_version 2" in str(refused.value) and "reads format_version 1 only" in str(refused.value)
    monkeypatch.undo()
    meta = json.loads((tmp_path / "i8" / "pt_meta.json").read_text())
    meta["format_version"] = 1  # a compressed dtype under the old version: refused, not misread
    (tmp_path / "i8" / "pt_meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="dtype='int8' with format_version 1"):
        io.read_meta(tmp_path / "i8")


class _Crash(Exception):
    pass


def _crashing(records, at):
    for i, r in enumerate(records):
        if i == at:
            raise _Crash()
        yield r


def test_resume_is_identical_to_one_build(tmp_path):
    vecs = np.random.default_rng(9).standard_normal((900, 12)).astype(np.float32)
    records = [{"docno": f"d{i}", "doc_vec": v} for i, v in enumerate(vecs)]
    ref = DenseIndex(tmp_path / "ref")
    ref.indexer(dtype="int8").index(records)
    ix = DenseIndex(tmp_path / "ix")
    with pytest.raises(_Crash):
        ix.indexer(dtype="int8", batch_size=32, checkpoint_every=100).index(_crashing(records, 640))
    assert not ix.built() and not (tmp_path / "ix" / qcodes.CODES_FILE).exists()
    with pytest.raises(ValueError, match="started with dtype='int8', not 'float32'"):
        ix.indexer(mode="resume", dtype="float32").index(records)
    ix.indexer(mode="resume").index(records)
    for name in ("vectors.bin", qcodes.CODES_FILE, qcodes.CALIBRATION_FILE):
        assert (tmp_path / "ix" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name
    ix.indexer(mode="overwrite").index(records[:10])  # overwrite removes the codes of the int8 build
    assert ix.dtype == "float32" and not (tmp_path / "ix" / qcodes.CODES_FILE).exists()


_HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from pyterrier_cpdae._locking import build_lock
    with build_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(60)
""")


def test_build_is_locked(tmp_path):
    path = tmp_path / "ix"
    path.mkdir()
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(ConcurrentBuildError):
            DenseIndex(path).indexer(dtype="int8").index(frame(np.ones((3, 4), np.float32)))
    finally:
        proc.kill()
        proc.wait()
    assert not (path / qcodes.CODES_FILE).exists()


def test_package_round_trip_producer_and_retrievers(tmp_path):
    rng = np.random.default_rng(10)
    vecs = rng.standard_normal((300, 16)).astype(np.float32)
    f32 = DenseIndex(tmp_path / "f32")
    enc_a = {"encoder": "enc-a", "model": "m", "pooling": "cls", "dim": 16}
    f32.indexer(producer=enc_a).index(frame(vecs))
    i8 = DenseIndex(tmp_path / "i8")
    i8.indexer(dtype="int8", producer=enc_a).index(frame(vecs))
    with pytest.raises(ValueError, match=r"dtype=int8\) with .*dtype=float32\)"):  # never mixed with float32
        DenseIndex.merge([f32, i8], tmp_path / "mixed")
    other = DenseIndex(tmp_path / "other")
    other.indexer(dtype="int8", producer={**enc_a, "encoder": "enc-b"}).index(frame(vecs, prefix="o"))
    with pytest.raises(ValueError, match="enc-b"):  # nor with the vectors of another encoder
        DenseIndex.merge([i8, other], tmp_path / "mixed")
    topics = pd.DataFrame({"qid": ["a", "b", "c"], "query": "x",
                           "query_vec": list(rng.standard_normal((3, 16)).astype(np.float32))})
    expected = f32.np_retriever(num_results=20)(topics).drop(columns=["score"])
    for retr in (i8.np_retriever(num_results=20), i8.torch_retriever(num_results=20)):
        pd.testing.assert_frame_equal(retr(topics).drop(columns=["score"]), expected)
    flat = i8.faiss_flat_retriever(num_results=5)(topics)  # FAISS indexes built from the float copy
    assert list(flat["docno"]) == list(f32.faiss_flat_retriever(num_results=5)(topics)["docno"])
    with pytest.raises(ValueError, match="enc-b"):
        i8.search(vecs[:1], 3, producer={**enc_a, "encoder": "enc-b"})
    package = i8.build_package(str(tmp_path / "i8.tar.lz4"), verbose=False)
    assert sorted(i8.package_files()) == sorted(["calibration.npz", "codes.bin", "docnos.npids", "pt_meta.json",
                                                 "vectors.bin"])
    copy = DenseIndex.from_package(package, tmp_path / "copy")
    pd.testing.assert_frame_equal(copy.np_retriever(num_results=20)(topics).drop(columns=["score"]), expected)


def test_two_digit_bound_holds_against_exact_arithmetic():
    """The two-digit bound of int8.py: |q.x - (t1 p1.c + t2 p2.c)| <= |e||c| + |q||r|, checked in exact integer and
    float64 arithmetic on random rows, a zero row, a huge coordinate and queries with one dominant dimension; the
    second digit leaves far less of the query's error than one digit does."""
    from pyterrier_cpdae.dense.int8 import split_queries

    rng = np.random.default_rng(11)
    x = rng.standard_normal((400, 48)).astype(np.float32) * np.exp(rng.normal(0, 1, 48)).astype(np.float32)
    x[0] = 0
    x[1, 9] = 1e6
    scales = qcodes.int8_scales(np.abs(x).max(axis=0))
    codes, resid, cnorm = qcodes.encode_int8(x, scales)
    q = rng.standard_normal((40, 48)).astype(np.float32)
    q[:5, 3] *= 1e4  # one dimension dominating the query
    q[5] = 0
    p1, t1, p2, t2, e, scaled = split_queries(q, scales)
    assert p1.dtype == np.int8 and p2.dtype == np.int8 and np.abs(p1).max() <= 127 and np.abs(p2).max() <= 127
    np.testing.assert_array_equal(t1.astype(np.float32).astype(np.float64), t1)  # scales float32 holds exactly
    exact = q.astype(np.float64) @ x.astype(np.float64).T
    c64 = codes.astype(np.int64)
    approx = t1[:, None] * (p1.astype(np.int64) @ c64.T) + t2[:, None] * (p2.astype(np.int64) @ c64.T)
    bound = np.linalg.norm(q.astype(np.float64), axis=1)[:, None] * resid + e[:, None] * cnorm
    assert np.all(np.abs(exact - approx) <= bound)
    one = quantise_queries(q, scales)[2]
    assert np.all(e[6:] < one[6:] / 50)  # the second digit removes most of the query's share of the bound


def test_candidates_threshold_against_naive():
    """_Candidates' tau is each query's k-th largest lower bound over everything added (entries dropped on the way
    included), and every entry whose upper bound reaches the final tau is kept: the naive computation over all
    entries at once."""
    from pyterrier_cpdae.dense.int8 import _Candidates

    rng = np.random.default_rng(12)
    num_q, k, n = 6, 5, 400
    mid = rng.standard_normal((num_q, n))
    mid[2, :50] = 1.0  # a block of equal bounds at the cut
    eps = rng.random((num_q, n)) * 0.3
    upper, lower = mid + eps, mid - eps
    cand = _Candidates(num_q, k)
    cand.refresh = 7  # recompute often: every add
    for a in range(0, n, 37):  # blocks, each filtered against the current tau as the scan does
        r, c = np.nonzero(upper[:, a:a + 37] >= cand.tau[:, None])
        cand.add(r, (c + a).astype(np.int64), upper[r, c + a], lower[r, c + a])
    rows, ids, up, _ = cand.update()
    tau = -np.sort(-lower, axis=1)[:, k - 1]
    np.testing.assert_array_equal(cand.tau, tau)
    for i in range(num_q):
        np.testing.assert_array_equal(np.sort(ids[rows == i]), np.flatnonzero(upper[i] >= tau[i]))


@pytest.mark.parametrize("digits_from", [1, 10 ** 9])
def test_one_and_two_digits_many_blocks_equal_float32(tmp_path, monkeypatch, digits_from):
    """Both scans (one and two query digits), over many small blocks (a short first one), on near ties and sharded:
    the float32 index's ranking at k = 1, 30 and 200."""
    from pyterrier_cpdae.dense import int8 as int8_search

    monkeypatch.setattr(int8_search, "TWO_DIGITS_FROM", digits_from)
    monkeypatch.setattr(int8_search, "CANDIDATE_MACS", 0)  # below TWO_DIGITS_FROM: one digit, whatever the data
    vecs = near_ties(2400, 40, seed=13)
    f32 = DenseIndex(tmp_path / "f32")
    f32.indexer().index(frame(vecs))
    view = DenseIndex(tmp_path / "view")
    for s in range(2):
        view.indexer(dtype="int8", shard=s, num_shards=2).index(frame(vecs))
    rng = np.random.default_rng(14)
    queries = np.concatenate([rng.standard_normal((12, 40)).astype(np.float32), vecs[:4]])
    for k in (1, 30, 200):
        _, i0 = f32.search(queries, k, backend="numpy")
        for scan in ("numpy", "torch"):
            stats = {}
            _, i1 = view.search(queries, k, scan=scan, chunk_size=97, stats=stats)
            np.testing.assert_array_equal(i1, i0, err_msg=f"k={k} scan={scan}")
            assert stats["retries"] == 0 and stats["rescored"] >= k * len(queries)
            assert stats["digits"] == (2 if k >= digits_from else 1)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_the_float_copy_of_a_compressed_index_is_mapped_for_random_reads(tmp_path):
    """A compressed index reads its float copy only to rescore: no readahead around each row (MADV_RANDOM), while
    a float32 index, scanned in sequence, keeps the default."""
    vecs = np.random.default_rng(3).standard_normal((500, 16)).astype(np.float32)
    f32, i8 = pair(tmp_path, vecs)
    q = vecs[:3]
    f32.search(q, 5, backend="numpy")
    i8.search(q, 5, backend="numpy")
    by_dir, current = {}, None  # index folder -> the VmFlags of each mapping of its vectors.bin ("rr": MADV_RANDOM)
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and "-" in parts[0] and parts[-1].endswith("/" + io.VECTORS_FILE):
            current = parts[-1]
        elif line.startswith("VmFlags:") and current is not None:
            by_dir.setdefault(Path(current).parent.name, []).append(parts[1:])
            current = None
    assert by_dir.get("i8") and all("rr" in f for f in by_dir["i8"]), by_dir
    assert by_dir.get("f32") and not any("rr" in f for f in by_dir["f32"]), by_dir


def naive_digits(vecs, scales_codes, queries, k, rows):
    """query_digits' rule written out query by query and document by document from the bounds of the module
    docstring: ``A = t1 (p1 . c) [+ t2 (p2 . c)]``, ``eps = e |c| + |q| |r|``; the documents whose one-digit upper
    bound reaches the two-digit lower bound of rank ceil(k rows / N), less those whose two-digit upper bound does, as
    a share."""
    import math
    from pyterrier_cpdae.dense import int8 as int8_search

    codes = scales_codes
    one = two = 0
    for q in queries.astype(np.float64):
        p1, t1, p2, t2, e2, _ = int8_search.split_queries(q[None].astype(np.float32), codes.scales)
        e1 = int8_search.quantise_queries(q[None].astype(np.float32), codes.scales)[2][0]
        bounds = []
        for i in range(rows):
            c = codes.codes[i].astype(np.int64)
            a1 = t1[0] * int(p1[0].astype(np.int64) @ c)
            a2 = a1 + t2[0] * int(p2[0].astype(np.int64) @ c)
            rq = np.linalg.norm(q) * float(codes.residual_norms[i])
            bounds.append((a1 + e1 * float(codes.code_norms[i]) + rq, a2 - e2[0] * float(codes.code_norms[i]) - rq,
                           a2 + e2[0] * float(codes.code_norms[i]) + rq))
        rank = min(k, max(1, math.ceil(k * rows / len(vecs))))
        tau = sorted((b[1] for b in bounds), reverse=True)[rank - 1]
        one += sum(b[0] >= tau for b in bounds)
        two += sum(b[2] >= tau for b in bounds)
    return (one - two) / (rows * len(queries))


def test_query_digits_against_the_rule_written_out(tmp_path, monkeypatch):
    """Below TWO_DIGITS_FROM the probe decides as the rule written out says: two wide dimensions every document shares
    make the scaled queries uneven, and one digit's bound lets through a larger share of the documents than on even
    vectors; with the candidates' cost set between the two shares, one digit on the even vectors, two on the others."""
    from pyterrier_cpdae.dense import int8 as int8_search

    monkeypatch.setattr(int8_search, "PROBE_ROWS", 300)
    rng = np.random.default_rng(21)
    even = rng.standard_normal((500, 32)).astype(np.float32)
    uneven = even + np.r_[np.zeros(30), 60.0, 60.0].astype(np.float32)  # two dimensions shared and 60x wider (the
    # anisotropy of BERT's outputs): they set the query's one-digit scale, and add nothing to the scores' spread
    queries = rng.standard_normal((6, 32)).astype(np.float32)
    shares, parts = {}, {}
    for name, vecs in (("even", even), ("uneven", uneven)):
        index = DenseIndex(tmp_path / name)
        index.indexer(dtype="int8").index(frame(vecs))
        parts[name] = index
        for k in (5, 40):
            shares[name, k] = naive_digits(vecs, index.store.code_parts()[0][0], queries, k, 300)
    assert shares["uneven", 5] > 2 * shares["even", 5] > 0
    macs = 32 / (shares["even", 5] * shares["uneven", 5]) ** 0.5  # (between the two: the cost decides)
    monkeypatch.setattr(int8_search, "CANDIDATE_MACS", macs)
    for (name, k), share in shares.items():
        expected = 2 if share * macs > 32 else 1
        store = parts[name].store
        for backend in ("torch", "numpy"):
            assert int8_search.query_digits(store.code_parts(), queries, k, backend) == expected, (name, k, share)
        stats = {}
        store.search(queries, k, stats=stats)
        assert stats["digits"] == expected
    assert int8_search.query_digits(parts["even"].store.code_parts(), queries, 5) == 1
    assert int8_search.query_digits(parts["uneven"].store.code_parts(), queries, 5) == 2
    for index in parts.values():  # two digits from TWO_DIGITS_FROM, whatever the data
        assert int8_search.query_digits(index.store.code_parts(), queries, int8_search.TWO_DIGITS_FROM) == 2
    monkeypatch.setattr(int8_search, "PROBE_ROWS", 5)  # a probe no larger than k: one digit, nothing to look at
    assert int8_search.query_digits(parts["uneven"].store.code_parts(), queries, 5) == 1
