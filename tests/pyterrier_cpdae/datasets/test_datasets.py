"""load_dataset: parsers against hand-checked counts, the built-in sample, small format fixtures,
error messages, and ir_datasets (MS MARCO passage) read offline from a fixture cache."""
from __future__ import annotations

import gzip
from pathlib import Path

import pandas as pd
import pytest

from pyterrier_cpdae.datasets import load_dataset
from tests.helpers.tiny_sets import offline_msmarco, write_beir


def _check_types(ds) -> tuple[list[dict], pd.DataFrame, pd.DataFrame]:
    docs = list(ds.get_corpus_iter())
    topics, qrels = ds.get_topics(), ds.get_qrels()
    assert all(isinstance(d["docno"], str) and isinstance(d["text"], str) for d in docs)
    assert list(topics.columns) == ["qid", "query"] and list(qrels.columns) == ["qid", "docno", "label"]
    for col in ("qid", "query"):
        assert all(isinstance(x, str) for x in topics[col])
    for col in ("qid", "docno"):
        assert all(isinstance(x, str) for x in qrels[col])
    assert pd.api.types.is_integer_dtype(qrels["label"])
    return docs, topics, qrels


# ------------------------------------------------------------------ real collections (../shared/data)

@pytest.mark.slow
def test_vaswani_trec(vaswani_dir: Path) -> None:
    docs, topics, qrels = _check_types(load_dataset(f"trec:{vaswani_dir}"))
    assert (len(docs), len(topics), len(qrels)) == (11429, 93, 2083)
    assert docs[0]["docno"] == "1" and docs[0]["text"].startswith("compact memories have flexible capacities")
    assert "<" not in docs[0]["text"]
    assert topics.iloc[0].tolist() == ["1", "MEASUREMENT OF DIELECTRIC CONSTANT OF LIQUIDS BY THE USE OF MICROWAVE TECHNIQUES"]
    assert set(qrels.docno) <= {d["docno"] for d in docs}


@pytest.mark.slow
def test_cranfield_smart_with_position_qids(cranfield_dir: Path) -> None:
    docs, topics, qrels = _check_types(load_dataset(f"cranfield:{cranfield_dir}"))
    assert (len(docs), len(topics), len(qrels)) == (1400, 225, 1837)
    assert topics.qid.tolist() == [str(i) for i in range(1, 226)]
    by_docno = {d["docno"]: d for d in docs}
    # the 3rd query is ".I 004" in cran.qry; cranqrel calls it 3 and judges slab heat-conduction papers for it
    assert topics.iloc[2].query.startswith("what problems of heat conduction in composite slabs")
    judged = qrels[qrels.qid == "3"].set_index("docno").label.to_dict()
    assert judged["5"] == 2  # code 3 ("useful") -> gain 2
    assert "heat conduction" in by_docno["5"]["title"] and "slab" in by_docno["5"]["title"]
    assert judged["485"] == 0  # code -1 ("no interest")
    # Cleverdon codes 1..4 (1 = complete answer) become gains 4..1
    assert sorted(qrels.label.unique()) == [0, 1, 2, 3, 4]
    assert by_docno["1"]["text"].startswith(by_docno["1"]["title"])


@pytest.mark.slow
def test_scifact_beir_train(scifact_dir: Path) -> None:
    docs, topics, qrels = _check_types(load_dataset(f"beir:{scifact_dir}:train"))
    assert (len(docs), len(topics), len(qrels)) == (5183, 809, 919)
    assert set(topics.qid) == set(qrels.qid)  # topics restricted to the judged queries of the split
    assert all(d["text"].startswith(d["title"]) for d in docs[:50])
    with pytest.raises(FileNotFoundError, match=r"available splits: \['train'\]"):
        load_dataset(f"beir:{scifact_dir}")


# ------------------------------------------------------------------ built-in sample

def test_sample_collection() -> None:
    import importlib.resources

    docs, topics, qrels = _check_types(load_dataset("sample"))
    docnos = [d["docno"] for d in docs]
    assert 150 <= len(docs) <= 250 and len(set(docnos)) == len(docnos)
    assert 25 <= len(topics) <= 40 and topics.qid.is_unique
    assert set(qrels.docno) <= set(docnos) and set(qrels.qid) == set(topics.qid)
    per_query = qrels.groupby("qid").size()
    assert per_query.between(1, 5).all()
    assert set(qrels.label) <= {1, 2} and (qrels.groupby("qid").label.max() == 2).all()
    folder = importlib.resources.files("pyterrier_cpdae") / "data" / "sample"
    size = sum(f.stat().st_size for f in Path(str(folder)).iterdir())
    assert size <= 1_000_000
    assert all(2 <= d["text"].count(". ") + 1 <= 6 for d in docs)  # short documents, a few sentences


# ------------------------------------------------------------------ format fixtures

def test_trec_fixture_old_style_topics_and_gzip(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    with gzip.open(tmp_path / "docs" / "part1.gz", "wt") as f:
        f.write("<DOC>\n<DOCNO> FT-1 </DOCNO>\n<HEADLINE>Big news</HEADLINE>\n<TEXT>\nSome text\nhere.\n</TEXT>\n</DOC>\n")
    (tmp_path / "docs" / "part2").write_text("<doc>\n<docno>FT-2</docno>\nplain body\n</doc>\n")
    (tmp_path / "topics.401-402").write_text(
        "<top>\n<num> Number: 401\n<title> Topic: foreign minorities, Germany\n\n<desc> Description:\nWhat?\n</top>\n\n"
        "<top>\n<num> Number: 402 <title> behavioral genetics\n<desc> Description:\nx\n</top>\n")
    (tmp_path / "qrels.401-402.txt").write_text("401 0 FT-1 1\n402 0 FT-2 0\n")
    docs, topics, qrels = _check_types(load_dataset(f"trec:{tmp_path}"))
    assert docs == [{"docno": "FT-1", "text": "Big news Some text here."}, {"docno": "FT-2", "text": "plain body"}]
    assert topics.values.tolist() == [["401", "foreign minorities, Germany"], ["402", "behavioral genetics"]]
    assert qrels.values.tolist() == [["401", "FT-1", 1], ["402", "FT-2", 0]]


def test_cisi_and_medline_fixtures(tmp_path: Path) -> None:
    cisi = tmp_path / "cisi"
    cisi.mkdir()
    (cisi / "CISI.ALL").write_text(".I 1\n.T\nDewey Decimal\nClassification\n.A\nSmith, J.\n.W\nA history of\nthe"
                                   " classification.\n.X\n1\t5\t1\n.I 2\n.T\nIndexing\n.W\nOn indexes.\n")
    (cisi / "CISI.QRY").write_text(".I 1\n.W\nWhat problems arise in classification?\n.I 2\n.T\nIndexes\n.A\nX"
                                   "\n.W\nHow are indexes built?\n.B\nsome ref\n")
    (cisi / "CISI.REL").write_text("     1     1 0 0.000000\n     2     2\t0\t0.000000\n")
    docs, topics, qrels = _check_types(load_dataset(f"cisi:{cisi}"))
    assert docs[0] == {"docno": "1", "text": "Dewey Decimal Classification A history of the classification.",
                       "title": "Dewey Decimal Classification"}
    assert topics.values.tolist() == [["1", "What problems arise in classification?"],
                                      ["2", "Indexes How are indexes built?"]]
    assert qrels.values.tolist() == [["1", "1", 1], ["2", "2", 1]]

    med = tmp_path / "med"
    med.mkdir()
    (med / "MED.ALL").write_text(".I 1\n.W\ncorrelation between maternal and fetal plasma levels\n.I 2\n.W\nother\n")
    (med / "MED.QRY").write_text(".I 1\n.W\nthe crystalline lens in vertebrates\n")
    (med / "MED.REL").write_text("1 0 2 1\n1 0 1 1\n")
    docs, topics, qrels = _check_types(load_dataset(f"medline:{med}"))
    assert [d["docno"] for d in docs] == ["1", "2"] and docs[1]["text"] == "other"
    assert qrels.values.tolist() == [["1", "2", 1], ["1", "1", 1]]


def _tsv_collection(folder: Path, corpus: str, queries: str = "q1\tdense vectors\nq2\tword weights\n",
                    qrels: str = "q1 0 d1 1\nq2 0 d2 2\n", qrels_name: str = "qrels.txt") -> str:
    folder.mkdir()
    (folder / "corpus.tsv").write_text(corpus)
    (folder / "queries.tsv").write_text(queries)
    (folder / qrels_name).write_text(qrels)
    return f"tsv:{folder}"


def test_tsv_folder_reads_what_the_files_hold_and_equals_the_beir_layout(tmp_path: Path) -> None:
    spec = _tsv_collection(tmp_path / "tsv", "docno\ttitle\ttext\n"                    # a header line
                                             "d1\tVectors\tDense retrieval encodes text.\n"
                                             "\n"                                        # a blank line
                                             "d2\t\tBM25 weighs words.\r\n")           # no title, CRLF
    docs, topics, qrels = _check_types(load_dataset(spec))
    assert docs == [{"docno": "d1", "text": "Vectors Dense retrieval encodes text.", "title": "Vectors"},
                    {"docno": "d2", "text": "BM25 weighs words.", "title": ""}]
    assert topics.values.tolist() == [["q1", "dense vectors"], ["q2", "word weights"]]
    assert qrels.values.tolist() == [["q1", "d1", 1], ["q2", "d2", 2]]
    # the same collection in the BEIR layout (qrels with BEIR's header line) reads the same
    beir = write_beir(tmp_path / "beir",
                      '{"_id": "d1", "title": "Vectors", "text": "Dense retrieval encodes text."}\n'
                      '{"_id": "d2", "title": "", "text": "BM25 weighs words."}\n',
                      '{"_id": "q1", "text": "dense vectors"}\n{"_id": "q2", "text": "word weights"}\n',
                      "query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t2\n")
    b_docs, b_topics, b_qrels = _check_types(load_dataset(f"beir:{beir}"))
    assert b_docs == docs and b_topics.equals(topics) and b_qrels.equals(qrels)


def test_tsv_two_columns_compressed_names_and_every_query_kept(tmp_path: Path) -> None:
    folder = tmp_path / "marco"
    folder.mkdir()
    with gzip.open(folder / "collection.tsv.gz", "wt") as f:      # MS MARCO's names, compressed
        f.write("0\tThe presence of communication.\n1\tThe Manhattan Project.\n")
    (folder / "topics.tsv").write_text("qid\tquery\n7\twhat was the manhattan project\n8\tunjudged query\n")
    (folder / "qrels.dev.tsv").write_text("7\t0\t1\t1\n")    # TREC qrels may be tab-separated too
    docs, topics, qrels = _check_types(load_dataset(f"tsv:{folder}"))
    assert docs == [{"docno": "0", "text": "The presence of communication."},
                    {"docno": "1", "text": "The Manhattan Project."}]
    assert topics.qid.tolist() == ["7", "8"]                     # every query of the file, judged or not
    assert qrels.values.tolist() == [["7", "1", 1]]


@pytest.mark.parametrize("corpus, queries, qrels, error", [
    ("d1\ta\nd2\tb\tc\n", None, None, r"corpus.tsv:2: expected 2 tab-separated columns \(docno, text\) as on the "
                                         r"first line, got 3"),
    ("d1\n", None, None, r"corpus.tsv:1: expected 2 tab-separated columns \(docno, text\) or 3"),
    ("\ttext\n", None, None, r"corpus.tsv:1: bad docno"),
    ("", None, None, r"corpus.tsv: no documents found"),
    ("d1\ta\nd2\tb\n", "q1\tx\tmore\n", None, r"queries.tsv:1: expected 2 tab-separated columns \(qid, query\)"),
    ("d1\ta\nd2\tb\n", "q1\tdense vectors\n", None, r"queries.tsv: 1 queries judged in .*qrels.txt are missing, "
                                                       r"e.g. \['q2'\]"),
    ("d1\ta\nd2\tb\n", None, "q1 0 d1 1\nq2 0 d2 1.5\n", r"qrels.txt:2: cannot parse qrels line"),
])
def test_tsv_errors_name_the_file_and_line(tmp_path: Path, corpus, queries, qrels, error) -> None:
    kwargs = {k: v for k, v in (("queries", queries), ("qrels", qrels)) if v is not None}
    ds = load_dataset(_tsv_collection(tmp_path / "c", corpus, **kwargs))
    with pytest.raises(ValueError, match=error):
        list(ds.get_corpus_iter())
        ds.get_topics()
        ds.get_qrels()


def test_tsv_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tsv:.*: no corpus file in .* \(expected corpus.tsv or "
                                                r"collection.tsv"):
        load_dataset(f"tsv:{tmp_path}")
    spec = _tsv_collection(tmp_path / "c", "d1\ta\n")
    (tmp_path / "c" / "qrels.test").write_text("q1 0 d1 1\n")
    with pytest.raises(ValueError, match=r"several qrels files in .*: \['qrels.test', 'qrels.txt'\]; keep one"):
        load_dataset(spec)
    (tmp_path / "c" / "qrels.test").unlink()
    (tmp_path / "c" / "collection.tsv").write_text("d1\ta\n")
    with pytest.raises(ValueError, match=r"several corpus files .*\['collection.tsv', 'corpus.tsv'\]"):
        load_dataset(spec)


@pytest.mark.parametrize("header", ["query-id\tcorpus-id\tscore\n", ""])
def test_beir_qrels_read_with_or_without_the_header_line(tmp_path: Path, header: str) -> None:
    write_beir(tmp_path, '{"_id": "d1", "text": "x"}\n', '{"_id": "q1", "text": "y"}\n', header + "q1\td1\t1\n")
    assert load_dataset(f"beir:{tmp_path}").get_qrels().values.tolist() == [["q1", "d1", 1]]
    (tmp_path / "qrels" / "test.tsv").write_text("q1\td1\t1\n" + "query-id\tcorpus-id\tscore\n")  # not first
    with pytest.raises(ValueError, match=r"test.tsv:2: cannot parse qrels line .*not an integer"):
        load_dataset(f"beir:{tmp_path}").get_qrels()


def test_each_format_is_one_reader_module() -> None:
    """Every module of pyterrier_cpdae/datasets/ but the shared ones is a format: it gives KINDS and load_dataset
    lists it, so a new format is one new module named in FORMATS."""
    import pyterrier_cpdae.datasets as datasets

    shared = {"__init__", "base", "records", "sample"}
    modules = {p.stem for p in Path(datasets.__file__).parent.glob("*.py")} - shared
    assert modules == {m.__name__.rsplit(".", 1)[1] for m in datasets.FORMATS} == {"irds", "trec", "beir", "tsv",
                                                                                   "smart"}
    kinds = [kind for m in datasets.FORMATS for kind in m.KINDS]
    assert len(kinds) == len(set(kinds))
    with pytest.raises(ValueError) as e:
        load_dataset("nothing")
    assert all(form in str(e.value) for m in datasets.FORMATS for form, _ in m.KINDS.values())


def test_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset spec"):
        load_dataset("vaswani")
    with pytest.raises(ValueError, match="unknown dataset kind 'foo'"):
        load_dataset(f"foo:{tmp_path}")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset(f"trec:{tmp_path / 'missing'}")
    with pytest.raises(FileNotFoundError, match="cran.all.1400 is missing"):
        load_dataset(f"cranfield:{tmp_path}")
    with pytest.raises(FileNotFoundError, match="no documents found"):
        load_dataset(f"trec:{tmp_path}")
    with pytest.raises(FileNotFoundError, match="corpus.jsonl is missing"):
        load_dataset(f"beir:{tmp_path}")
    (tmp_path / "cran.all.1400").write_text("stray text\n.I 1\n.W\nx\n")
    (tmp_path / "cran.qry").write_text(".I 1\n.W\nq\n")
    (tmp_path / "cranqrel").write_text("1 1 7\n")
    ds = load_dataset(f"cranfield:{tmp_path}")
    with pytest.raises(ValueError, match="text outside a .I record"):
        list(ds.get_corpus_iter())
    with pytest.raises(ValueError, match="cranqrel:1: .*relevance code 7"):
        ds.get_qrels()
    with pytest.raises(ValueError, match="unknown ir_datasets id"):
        load_dataset("irds:no-such-dataset/at-all")


# ------------------------------------------------------------------ ir_datasets, offline

@pytest.mark.multiproc
def test_irds_msmarco_passage_from_fixture_cache(tmp_path: Path) -> None:
    base = tmp_path / "msmarco-passage"
    code = """
        import json
        from pyterrier_cpdae.datasets import load_dataset
        ds = load_dataset("irds:msmarco-passage/dev/small")
        print(json.dumps({"docs": list(ds.get_corpus_iter()), "topics": ds.get_topics().values.tolist(),
                          "qrels": ds.get_qrels().values.tolist()}))
    """
    got = offline_msmarco(tmp_path, "100\twhat is the capital of france\n200\tbanana colour\n",
                          "100 0 0 1\n200 0 1 1\n", code, timeout=120)
    assert got["docs"] == [{"docno": "0", "text": "The capital of France is Paris."},
                           {"docno": "1", "text": "Bananas are yellow."}, {"docno": "2", "text": "Pandas."}]
    assert got["topics"] == [["100", "what is the capital of france"], ["200", "banana colour"]]
    assert got["qrels"] == [["100", "0", 1], ["200", "1", 1]]
    assert (base / "collection.tsv").exists()
