"""The package's Java helper jar. Indexing: ``pyterrier_cpdae.BlobIndexer`` (one UTF-8 byte[]
per batch, no JSON) must build the same index as Anserini's own JSON entry point (``SimpleIndexer.addRawDocuments``,
the reference), and bad texts deep in a batch must still be named by their input position. Search:
``pyterrier_cpdae.FlatHits`` must give the frame that reading Anserini's hits one by one gives. And the shipped jar
must be built from the shipped source."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import pandas as pd
import pytest

import pyterrier_cpdae.bm25.index as bm25_module
import pyterrier_cpdae.bm25.retrieval as bm25_retrieval
from pyterrier_cpdae.bm25 import BM25Index, BM25Indexer
from pyterrier_cpdae.bm25.java import JAR, SOURCE_HASH_ENTRY, source_hash

REPO = Path(__file__).resolve().parents[4]

# texts that exercise the byte transfer: multi-byte UTF-8 (2, 3 and 4 bytes: a non-BMP emoji is a surrogate pair
# in Java), JSON-looking text, line breaks, tabs, and a long document
UNICODE_DOCS = [
    {"docno": "e", "text": "apple 😀 pie 🍎🍏 café naïve"},
    {"docno": "cjk", "text": "苹果 apple 香蕉 日本語のテキスト"},
    {"docno": "json", "text": '{"id": "x", "contents": "apple"} \\ "quoted" apple'},
    {"docno": "ws", "text": "  banana\n\napple\tcherry  "},
    {"docno": "long", "text": "banana " * 3000 + "apple"},
    {"docno": "é-docno", "text": "cherry apple"},
    {"docno": "plain", "text": "grape"},
]
QUERIES = pd.DataFrame({"qid": ["1", "2", "3", "4"], "query": ["apple", "banana cherry", "café pie", "grape"]})


def _sinks_used(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records the class name of each sink BM25Indexer opens."""
    used: list[str] = []
    original = BM25Indexer._open_sink

    def spy(self, *args, **kwargs):
        sink = original(self, *args, **kwargs)
        used.append(type(sink).__name__)
        return sink

    monkeypatch.setattr(BM25Indexer, "_open_sink", spy)
    return used


def _without_helper(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if the JVM had been started without the package's jar: Anserini's JSON and per-hit paths."""
    monkeypatch.setattr(bm25_module, "_blob_indexer_class", lambda: None)
    monkeypatch.setattr(bm25_retrieval, "_flat_hits_class", lambda: None)


def _snapshot(index: BM25Index) -> tuple:
    run = (index.bm25(num_results=10) >> index.text_loader())(QUERIES)
    return len(index), run[["qid", "docno", "score", "rank", "text"]].values.tolist()


def test_the_jar_is_built_from_the_shipped_source() -> None:
    """Edit BlobIndexer.java without rebuilding (python -m pyterrier_cpdae.bm25.java.build) and this fails."""
    with zipfile.ZipFile(JAR) as jar:
        names = set(jar.namelist())
        recorded = jar.read(SOURCE_HASH_ENTRY).decode().strip()
    assert {"pyterrier_cpdae/BlobIndexer.class", "pyterrier_cpdae/BlobIndexer$PlainDocument.class",
            "pyterrier_cpdae/FlatHits.class"} <= names
    assert recorded == source_hash()


def test_the_jar_rebuilds_from_source(tmp_path: Path) -> None:
    from pyterrier_cpdae.bm25.java.build import build, find_javac

    if find_javac() is None:
        pytest.skip("needs a JDK 21+ (javac) to compile the helper")
    out = build(tmp_path / "helper.jar")
    with zipfile.ZipFile(out) as new, zipfile.ZipFile(JAR) as shipped:
        assert sorted(new.namelist()) == sorted(shipped.namelist())
        assert new.read(SOURCE_HASH_ENTRY) == shipped.read(SOURCE_HASH_ENTRY)
    # same source, same javac: the same bytes (fixed timestamps), so a rebuild never changes the jar needlessly
    assert build(tmp_path / "again.jar").read_bytes() == out.read_bytes()


def test_helper_builds_the_index_anserinis_json_entry_point_builds(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    used = _sinks_used(monkeypatch)
    fast = BM25Index(tmp_path / "blob")
    fast.indexer(batch_size=3).index(UNICODE_DOCS)
    with monkeypatch.context() as m:
        _without_helper(m)
        reference = BM25Index(tmp_path / "json")
        reference.indexer(batch_size=3).index(UNICODE_DOCS)
    assert used == ["_BlobSink", "_JsonSink"]
    assert _snapshot(fast) == _snapshot(reference)
    # and the texts arrive exactly, 4-byte UTF-8 included
    run = (fast.bm25() >> fast.text_loader())(QUERIES)
    original = {d["docno"]: d["text"] for d in UNICODE_DOCS}
    assert set(run.docno) == set(original)
    assert all(text == original[docno] for docno, text in zip(run.docno, run.text))


@pytest.mark.parametrize("use_helper", [True, False], ids=["helper", "json-fallback"])
@pytest.mark.parametrize("bad,expect", [
    ("apple x\x00y", r"document #5 \('bad'\): text contains a NUL"),
    ("apple \udc80 pie", r"document #5 \('bad'\): text contains a lone surrogate .* position 6"),
])
def test_a_bad_text_deep_in_a_batch_is_named_by_its_input_position(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     use_helper: bool, bad: str, expect: str) -> None:
    """Texts are checked a whole batch at a time; skipped empty texts before the bad one must not shift the
    position the error names, and the build leaves nothing behind."""
    if not use_helper:
        _without_helper(monkeypatch)
    docs = [{"docno": "a", "text": "apple"}, {"docno": "e1", "text": "  "}, {"docno": "b", "text": "banana"},
            {"docno": "c", "text": "cherry"}, {"docno": "e2", "text": "\t"}, {"docno": "bad", "text": bad},
            {"docno": "d", "text": "grape"}]
    index = BM25Index(tmp_path / "index")
    with pytest.raises(ValueError, match=expect):
        index.indexer(batch_size=3).index(docs)
    assert not index.built() and not Path(index.path).exists()


def test_a_nul_only_text_is_refused_not_skipped_as_empty(tmp_path: Path) -> None:
    """Java's trim() would make "\\x00" empty; the rule that a NUL is an error still comes first."""
    index = BM25Index(tmp_path / "index")
    with pytest.raises(ValueError, match=r"document #1 \('z'\): text contains a NUL"):
        index.indexer().index([{"docno": "a", "text": "apple"}, {"docno": "z", "text": "\x00"}])


def test_blob_indexer_checks_batches_and_flushes_before_the_commit(tmp_path: Path) -> None:
    from pyterrier_cpdae.bm25.jvm import autoclass

    simple_indexer = autoclass("io.anserini.index.SimpleIndexer")
    lucene = tmp_path / "lucene"
    writer = simple_indexer(["-input", "", "-index", str(lucene), "-collection", "JsonCollection", "-threads", "2",
                             "-storeContents"])
    helper = autoclass("pyterrier_cpdae.BlobIndexer")(writer, 2)
    try:
        assert helper.canFlush()  # it reaches SimpleIndexer's IndexWriter
        with pytest.raises(Exception, match="batch holds 3 fields, expected 4"):
            helper.addBlob(b"a\x00apple\x00b", 2)
        with pytest.raises(Exception, match="more than 2 fields"):
            helper.addBlob(b"a\x00apple\x00b\x00banana", 1)
        docs = [(f"d{i}", f"apple {i} banana") for i in range(500)]
        for start in range(0, 500, 100):  # queued; addBlob returns before they are indexed
            part = docs[start:start + 100]
            helper.addBlob("\x00".join(x for d in part for x in d).encode("utf-8"), len(part))
        helper.addBlob(b"blank\x00 \t ", 1)  # Anserini refuses a text that trims to nothing: counted and named
        assert helper.finish() == 500 and helper.firstRefused() == "blank"
        # finish() wrote the in-memory buffers as segments and committed them (segments_N) itself ...
        files = os.listdir(lucene)
        assert any(f.endswith(".si") for f in files) and any(f.startswith("segments_") for f in files)
        assert helper.flush() == 0  # ... leaving nothing in memory
        with pytest.raises(Exception, match="finish\\(\\) was called"):
            helper.addBlob(b"x\x00y", 1)
    finally:
        helper.close()
        writer.close()
    searcher = autoclass("io.anserini.search.SimpleSearcher")(str(lucene))
    try:
        assert searcher.get_total_num_docs() == 500
    finally:
        searcher.close()


def test_flat_hits_give_the_frame_reading_each_hit_gives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Repeated qids, a query without any hit, a query with one hit, an empty-result cut-off: row for row the same
    frame (values and dtypes) as the per-hit path."""
    index = BM25Index(tmp_path / "index")
    index.indexer().index(UNICODE_DOCS + [{"docno": f"n{i}", "text": f"apple filler {i}"} for i in range(40)])
    topics = pd.DataFrame({"qid": ["1", "2", "1", "3", "4", "5"],
                           "query": ["apple", "zzzunknown", "apple banana", "grape", "the of and", "filler 7"],
                           "extra": [10, 20, 30, 40, 50, 60]})
    for k in (1, 5, 1000):
        fast = index.bm25(num_results=k)(topics)
        with monkeypatch.context() as m:
            _without_helper(m)
            slow = index.bm25(num_results=k)(topics)
        pd.testing.assert_frame_equal(fast, slow)
        # "apple": 6 of UNICODE_DOCS and the 40 fillers
        assert set(fast.qid) == {"1", "3", "5"} and (fast["query"] == "apple").sum() == min(k, 46)
    one = index.bm25()(topics.iloc[3:4])  # a single hit in all: no broadcasting of a one-row column
    assert one[["qid", "docno", "rank", "extra"]].values.tolist() == [["3", "plain", 0, 40]]
    empty = index.bm25()(topics.iloc[:0])
    assert list(empty.columns) == list(slow.columns) and len(empty) == 0


@pytest.mark.multiproc
def test_a_jvm_started_without_the_helper_falls_back_to_json_with_a_warning(tmp_path: Path) -> None:
    """Another library (e.g. Pyserini) may start Java first, with Anserini's jar but not ours: indexing still
    works, through Anserini's JSON entry point, and says why it is slower."""
    code = f"""
        import os, warnings
        import jnius_config
        from pyterrier_cpdae.bm25.jvm import _anserini_jar, _find_java_home
        os.environ["JAVA_HOME"] = str(_find_java_home())
        jnius_config.add_classpath(_anserini_jar())
        import jnius  # Java starts now, without pyterrier-cpdae's jar
        from pyterrier_cpdae.bm25 import BM25Index
        index = BM25Index({str(tmp_path / "i")!r})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            index.indexer().index([{{"docno": "a", "text": "apple café"}}, {{"docno": "b", "text": "banana"}}])
        print("WARNINGS:", [str(w.message) for w in caught])
        import pandas as pd
        print("HITS:", index.bm25()(pd.DataFrame({{"qid": ["1"], "query": ["café"]}})).docno.tolist())
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "without pyterrier-cpdae's helper jar" in out.stdout and "HITS: ['a']" in out.stdout  # per-hit search
