"""Reliability of load_dataset's parsers.

The promise (docs/datasets.md, "Test collections"; docs/reliability.md): every parser yields exactly what its file holds, or
raises a ``ValueError`` naming the file and the line. Each test below is one malformed-input case
that used to lose data silently or fail with an error that named no file.
"""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re
from pathlib import Path

import pytest

from pyterrier_cpdae.datasets import load_dataset
from tests.helpers.tiny_sets import write_beir, write_trec

QRELS = "1 0 D1 1\n"
TOPICS = "<top>\n<num> 1 </num>\n<title> a query </title>\n</top>\n"


def _trec(folder: Path, docs: str = "<DOC>\n<DOCNO>D1</DOCNO>\nsome text\n</DOC>\n", topics: str = TOPICS,
          qrels: str = QRELS):
    return load_dataset(f"trec:{write_trec(folder, docs, topics, qrels)}")


def _docs(folder: Path, docs: str) -> list[dict]:
    return list(_trec(folder, docs=docs).get_corpus_iter())


def _where(path: Path, line: int) -> str:
    """The ``file:line`` prefix every parser error starts with, as a regex."""
    return re.escape(f"{path}:{line}")


# ------------------------------------------------------------------ TREC topics (item 12)

def test_trec_topics_last_title_never_closed_is_refused_not_dropped(tmp_path: Path) -> None:
    topics = TOPICS + "<top>\n<num> 2 </num>\n<title> the last query, cut off\n"
    ds = _trec(tmp_path, topics=topics)
    with pytest.raises(ValueError, match=_where(tmp_path / "topics.trec", 5) + r".*never closed"):
        ds.get_topics()


def test_trec_topics_old_style_unclosed_tags_still_parse(tmp_path: Path) -> None:
    topics = ("<top>\n<num> Number: 401\n<title> Topic: foreign minorities\n<desc> Description:\nWhat?\n</top>\n"
              "<top>\n<num>402<title>\nlast one\n</top>\n")
    assert _trec(tmp_path, topics=topics).get_topics().values.tolist() == [["401", "foreign minorities"],
                                                                            ["402", "last one"]]


def test_trec_topic_with_two_titles_is_refused(tmp_path: Path) -> None:
    topics = TOPICS + "<top>\n<num>2</num>\n<title>first</title>\n<title>second</title>\n</top>\n"
    with pytest.raises(ValueError, match=_where(tmp_path / "topics.trec", 5) + r".*2 <title>"):
        _trec(tmp_path, topics=topics).get_topics()


def test_trec_topic_nested_in_unclosed_topic_is_refused(tmp_path: Path) -> None:
    topics = "<top>\n<num>1</num><title>one</title>\n" + TOPICS
    with pytest.raises(ValueError, match=_where(tmp_path / "topics.trec", 1) + r".*</top>"):
        _trec(tmp_path, topics=topics).get_topics()


def test_trec_text_outside_topics_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=_where(tmp_path / "topics.trec", 5) + r".*outside"):
        _trec(tmp_path, topics=TOPICS + "<num>2</num><title>stray</title>\n").get_topics()


# ------------------------------------------------------------------ TREC documents (item 14)

def test_trec_one_document_per_line_parses(tmp_path: Path) -> None:
    docs = "<DOC><DOCNO>D1</DOCNO>first text</DOC>\n<DOC><DOCNO>D2</DOCNO>second <P>text</P></DOC>\n"
    assert _docs(tmp_path, docs) == [{"docno": "D1", "text": "first text"}, {"docno": "D2", "text": "second text"}]


def test_trec_close_tag_on_the_text_line_parses(tmp_path: Path) -> None:
    docs = "<DOC>\n<DOCNO>D1</DOCNO>\nfirst text</DOC>\n<DOC>\n<DOCNO>D2</DOCNO>\nsecond\n</DOC>\n"
    assert _docs(tmp_path, docs) == [{"docno": "D1", "text": "first text"}, {"docno": "D2", "text": "second"}]


def test_trec_doc_without_close_mid_file_is_refused(tmp_path: Path) -> None:
    docs = ("<DOC>\n<DOCNO>D1</DOCNO>\nfirst\n</DOC>\n"
            "<DOC>\n<DOCNO>D2</DOCNO>\nlost?\n"  # line 5: never closed
            "<DOC>\n<DOCNO>D3</DOCNO>\nx\n</DOC>\n")
    with pytest.raises(ValueError, match=_where(tmp_path / "docs.trec", 8) + r".*line 5.*</DOC>"):
        _docs(tmp_path, docs)


def test_trec_doc_without_close_at_eof_is_refused(tmp_path: Path) -> None:
    docs = "<DOC>\n<DOCNO>D1</DOCNO>\nfirst\n</DOC>\n<DOC>\n<DOCNO>D2</DOCNO>\ntruncated here\n"
    with pytest.raises(ValueError, match=_where(tmp_path / "docs.trec", 5) + r".*never closed"):
        _docs(tmp_path, docs)


def test_trec_second_docno_is_refused(tmp_path: Path) -> None:
    docs = "<DOC>\n<DOCNO>D1</DOCNO>\n<DOCNO>D2</DOCNO>\ntext\n</DOC>\n"
    with pytest.raises(ValueError, match=_where(tmp_path / "docs.trec", 1) + r".*2 <DOCNO>"):
        _docs(tmp_path, docs)


def test_trec_text_outside_documents_is_refused(tmp_path: Path) -> None:
    docs = "<DOC>\n<DOCNO>D1</DOCNO>\ntext\n</DOC>\nstray words\n"
    with pytest.raises(ValueError, match=_where(tmp_path / "docs.trec", 5) + r".*outside"):
        _docs(tmp_path, docs)


def test_trec_empty_docno_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=_where(tmp_path / "docs.trec", 1) + r".*empty <DOCNO>"):
        _docs(tmp_path, "<DOC>\n<DOCNO> </DOCNO>\ntext\n</DOC>\n")


def test_ids_that_an_index_cannot_store_are_refused_at_their_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=_where(tmp_path / "docs.trec", 1) + r".*line break"):
        _docs(tmp_path, "<DOC>\n<DOCNO>D1\nD2</DOCNO>\ntext\n</DOC>\n")
    beir = tmp_path / "beir"
    beir.mkdir()
    ds = _beir(beir, corpus=GOOD_DOC + '{"_id": "d\\n2", "text": "x"}\n')
    with pytest.raises(ValueError, match=_where(beir / "corpus.jsonl", 2) + r".*line break"):
        list(ds.get_corpus_iter())


def _naive_trec_docs(path: Path) -> list[dict]:
    """An independent reference for well-formed TREC files: one regex over the whole file."""
    content = path.read_text(encoding="utf-8")
    out = []
    for body in re.findall(r"<DOC>(.*?)</DOC>", content, re.DOTALL):
        m = re.search(r"<DOCNO>\s*(.*?)\s*</DOCNO>", body, re.DOTALL)
        rest = re.sub(r"<[^>]+>", " ", body[:m.start()] + body[m.end():])
        out.append({"docno": m.group(1), "text": " ".join(rest.split())})
    return out


@pytest.mark.slow
def test_vaswani_parses_to_exactly_the_documents_it_holds(vaswani_dir: Path) -> None:
    docs = list(load_dataset(f"trec:{vaswani_dir}").get_corpus_iter())
    reference = _naive_trec_docs(vaswani_dir / "corpus" / "doc-text.trec")
    assert len(reference) == len(docs) == 11429
    assert docs == reference


# ------------------------------------------------------------------ qrels

@pytest.mark.parametrize("label", ["1.5", "inf", "high"])
def test_trec_qrels_label_that_is_not_an_integer_is_refused(tmp_path: Path, label: str) -> None:
    ds = _trec(tmp_path, qrels=f"1 0 D1 1\n1 0 D2 {label}\n")
    with pytest.raises(ValueError, match=_where(tmp_path / "qrels", 2) + r".*integer"):
        ds.get_qrels()


def test_trec_qrels_integral_float_labels_still_parse(tmp_path: Path) -> None:
    assert _trec(tmp_path, qrels="1 0 D1 2.0\n1 0 D2 -1\n").get_qrels().label.tolist() == [2, -1]


# ------------------------------------------------------------------ BEIR (item 27)

def _beir(folder: Path, corpus: str = '{"_id": "d1", "title": "T", "text": "body"}\n',
          queries: str = '{"_id": "q1", "text": "query"}\n', qrels: str = "query-id\tcorpus-id\tscore\nq1\td1\t1\n"):
    return load_dataset(f"beir:{write_beir(folder, corpus, queries, qrels)}")


def _everything(ds) -> None:
    list(ds.get_corpus_iter())
    ds.get_topics()
    ds.get_qrels()


GOOD_DOC = '{"_id": "d1", "text": "body"}\n'


@pytest.mark.parametrize("file, line, content, problem", [
    ("corpus.jsonl", 2, GOOD_DOC + '{"title": "no id", "text": "x"}\n', r"no '_id'"),
    ("corpus.jsonl", 2, GOOD_DOC + '{"_id": "d2", "title": "no text"}\n', r"no 'text'"),
    ("corpus.jsonl", 2, GOOD_DOC + '["d2", "a list"]\n', r"not a JSON object"),
    ("corpus.jsonl", 2, GOOD_DOC + '{"_id": null, "text": "x"}\n', r"'_id'"),
    ("queries.jsonl", 1, '{"_id": "q1"}\n', r"no 'text'"),
    ("queries.jsonl", 1, '"q1 query"\n', r"not a JSON object"),
    ("queries.jsonl", 1, '{"_id": "q1", "text": null}\n', r"'text' must be a string"),
    ("qrels/test.tsv", 2, "query-id\tcorpus-id\tscore\nq1\td1\trelevant\n", r"integer"),
    ("qrels/test.tsv", 2, "query-id\tcorpus-id\tscore\nq1\td1\t0.5\n", r"integer"),
], ids=["doc-without-id", "doc-without-text", "doc-not-object", "doc-null-id", "query-without-text",
        "query-not-object", "query-null-text", "qrels-word-score", "qrels-fraction-score"])
def test_beir_malformed_line_names_file_and_line(tmp_path: Path, file: str, line: int, content: str,
                                                 problem: str) -> None:
    kwargs = {"corpus.jsonl": "corpus", "queries.jsonl": "queries", "qrels/test.tsv": "qrels"}
    ds = _beir(tmp_path, **{kwargs[file]: content})
    with pytest.raises(ValueError, match=_where(tmp_path / file, line) + ".*" + problem):
        _everything(ds)


def test_beir_judged_query_missing_from_queries_is_refused(tmp_path: Path) -> None:
    ds = _beir(tmp_path, qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq9\td1\t1\n")
    with pytest.raises(ValueError, match=r"queries\.jsonl.*'q9'"):
        ds.get_topics()


# ------------------------------------------------------------------ empty files (item 29)

@pytest.mark.parametrize("empty", ["corpus", "queries", "qrels"])
def test_beir_empty_file_is_refused(tmp_path: Path, empty: str) -> None:
    ds = _beir(tmp_path, **{empty: "" if empty != "qrels" else "query-id\tcorpus-id\tscore\n"})
    with pytest.raises(ValueError, match=r"no (documents|queries|judgements)"):
        _everything(ds)


@pytest.mark.parametrize("empty", ["cran.all.1400", "cran.qry", "cranqrel"])
def test_cranfield_empty_file_is_refused(tmp_path: Path, empty: str) -> None:
    files = {"cran.all.1400": ".I 1\n.T\ntitle\n.W\nbody\n", "cran.qry": ".I 001\n.W\nquery\n", "cranqrel": "1 1 2\n"}
    for name, text in files.items():
        (tmp_path / name).write_text("" if name == empty else text)
    ds = load_dataset(f"cranfield:{tmp_path}")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / empty)) + r".*no (documents|queries|judgements)"):
        _everything(ds)


def test_trec_empty_qrels_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "qrels")) + r".*no judgements"):
        _trec(tmp_path, qrels="\n").get_qrels()


# ------------------------------------------------------------------ SMART

def test_smart_record_id_with_spaces_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cran.all.1400").write_text(".I 1\n.W\nbody\n.I 2 3\n.W\nother\n")
    (tmp_path / "cran.qry").write_text(".I 001\n.W\nquery\n")
    (tmp_path / "cranqrel").write_text("1 1 2\n")
    with pytest.raises(ValueError, match=_where(tmp_path / "cran.all.1400", 4) + r".*\.I"):
        list(load_dataset(f"cranfield:{tmp_path}").get_corpus_iter())


def test_smart_qrels_with_extra_columns_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cran.all.1400").write_text(".I 1\n.W\nbody\n")
    (tmp_path / "cran.qry").write_text(".I 001\n.W\nquery\n")
    (tmp_path / "cranqrel").write_text("1 1 2\n1 1 2 9\n")
    with pytest.raises(ValueError, match=_where(tmp_path / "cranqrel", 2) + r".*columns"):
        load_dataset(f"cranfield:{tmp_path}").get_qrels()


# ------------------------------------------------------------------ compressed files (item 28)

@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_corrupt_compressed_file_is_named(tmp_path: Path, suffix: str) -> None:
    (tmp_path / "qrels").write_text(QRELS)
    (tmp_path / "topics.trec").write_text(TOPICS)
    (tmp_path / f"docs{suffix}").write_bytes(b"<DOC>\n<DOCNO>D1</DOCNO>\nnot compressed at all\n</DOC>\n")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / f"docs{suffix}")) + r".*(corrupt|not a)"):
        list(load_dataset(f"trec:{tmp_path}").get_corpus_iter())


def test_truncated_gzip_is_named(tmp_path: Path) -> None:
    (tmp_path / "qrels").write_text(QRELS)
    (tmp_path / "topics.trec").write_text(TOPICS)
    whole = gzip.compress(("<DOC>\n<DOCNO>D1</DOCNO>\n" + "word " * 20000 + "\n</DOC>\n").encode())
    (tmp_path / "docs.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "docs.gz"))):
        list(load_dataset(f"trec:{tmp_path}").get_corpus_iter())


@pytest.mark.parametrize("suffix, compress", [(".gz", gzip.compress), (".bz2", bz2.compress), (".xz", lzma.compress)])
def test_compressed_trec_files_are_read(tmp_path: Path, suffix: str, compress) -> None:
    (tmp_path / "qrels").write_text(QRELS)
    (tmp_path / "topics.trec").write_text(TOPICS)
    (tmp_path / f"docs{suffix}").write_bytes(compress(b"<DOC>\n<DOCNO>D1</DOCNO>\ncompressed text\n</DOC>\n"))
    assert list(load_dataset(f"trec:{tmp_path}").get_corpus_iter()) == [{"docno": "D1", "text": "compressed text"}]


# ------------------------------------------------------------------ undecodable text (item 22)

def test_invalid_utf8_names_file_and_line(tmp_path: Path) -> None:
    _trec(tmp_path)
    lines = [b"<DOC>", b"<DOCNO>D1</DOCNO>"] + [b"plain line"] * 5000 + [b"caf\xe9 latin-1", b"</DOC>", b""]
    (tmp_path / "docs.trec").write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=_where(tmp_path / "docs.trec", 5003) + r".*UTF-8"):
        list(load_dataset(f"trec:{tmp_path}").get_corpus_iter())


def test_encoded_surrogate_in_a_file_names_file_and_line(tmp_path: Path) -> None:
    _trec(tmp_path)
    (tmp_path / "docs.trec").write_bytes(b"<DOC>\n<DOCNO>D1</DOCNO>\nbad \xed\xa0\x80 here\n</DOC>\n")
    with pytest.raises(ValueError, match=_where(tmp_path / "docs.trec", 3) + r".*UTF-8"):
        list(load_dataset(f"trec:{tmp_path}").get_corpus_iter())


@pytest.mark.parametrize("file, content", [
    ("corpus.jsonl", GOOD_DOC + json.dumps({"_id": "d2", "text": "lone \ud800 surrogate"}) + "\n"),
    ("corpus.jsonl", GOOD_DOC + json.dumps({"_id": "d\udc00", "text": "x"}) + "\n"),
    ("queries.jsonl", '{"_id": "q0", "text": "x"}\n' + json.dumps({"_id": "q1", "text": "\udfff"}) + "\n"),
], ids=["doc-text", "doc-id", "query-text"])
def test_lone_surrogate_in_json_names_file_and_line(tmp_path: Path, file: str, content: str) -> None:
    ds = _beir(tmp_path, **{"corpus" if file == "corpus.jsonl" else "queries": content})
    with pytest.raises(ValueError, match=_where(tmp_path / file, 2) + r".*surrogate"):
        _everything(ds)


def test_surrogate_pairs_in_json_are_kept(tmp_path: Path) -> None:
    ds = _beir(tmp_path, corpus='{"_id": "d1", "text": "smile \\ud83d\\ude00"}\n')
    assert list(ds.get_corpus_iter()) == [{"docno": "d1", "text": "smile \U0001F600", "title": ""}]


@pytest.mark.parametrize("name, data", [
    ("part1", gzip.compress(b"<DOC>\n<DOCNO>D2</DOCNO>\nhidden\n</DOC>\n")),
    ("fr940104.0z", b"\x1f\x9d\x90<DOC>"),  # Unix compress, as on the TREC disks
    ("part2.zst", b"\x28\xb5\x2f\xfd\x00\x00"),
], ids=["gzip-without-suffix", "unix-compress", "zstd"])
def test_compressed_file_under_another_name_is_named_not_skipped(tmp_path: Path, name: str, data: bytes) -> None:
    _trec(tmp_path)
    (tmp_path / name).write_bytes(data)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / name)) + r".*compressed"):
        list(load_dataset(f"trec:{tmp_path}").get_corpus_iter())


def test_bare_less_than_sign_in_text_and_title_is_kept(tmp_path: Path) -> None:
    docs = "<DOC>\n<DOCNO>D1</DOCNO>\n<TEXT>if a < b and c > d then</TEXT>\n</DOC>\n"
    topics = "<top>\n<num> 1 </num>\n<title> x < y </title>\n</top>\n"
    ds = _trec(tmp_path, docs=docs, topics=topics)
    assert list(ds.get_corpus_iter()) == [{"docno": "D1", "text": "if a < b and c > d then"}]
    assert ds.get_topics().values.tolist() == [["1", "x < y"]]


def test_irds_lone_surrogate_names_the_document() -> None:
    from collections import namedtuple

    from pyterrier_cpdae.datasets import IRDSWrapper

    Doc = namedtuple("Doc", ["doc_id", "text"])

    class FakeIrds:
        def has_docs(self) -> bool:
            return True

        def docs_iter(self):
            return iter([Doc("0", "fine"), Doc("1", "broken \ud800 text")])

    wrapper = IRDSWrapper.__new__(IRDSWrapper)
    wrapper.irds_id, wrapper.irds_ref = "fake/ds", FakeIrds
    it = wrapper.get_corpus_iter()
    assert next(it) == {"docno": "0", "text": "fine"}
    with pytest.raises(ValueError, match=r"irds:fake/ds document 2.*'1'.*surrogate"):
        next(it)


def test_local_collection_refuses_a_topics_variant_it_does_not_have(tmp_path: Path) -> None:
    ds = _trec(tmp_path)
    with pytest.raises(ValueError, match=r"no variant 'desc'"):
        ds.get_topics("desc")
    with pytest.raises(ValueError, match=r"no variant 'dev'"):
        ds.get_qrels("dev")
    assert ds.get_topics().values.tolist() == [["1", "a query"]]
