"""Duplicates in topics and qrels are refused or announced, never merged silently; a
qrels label beyond 64 bits is refused.

The promise (docs/datasets.md, "Duplicates"; docs/reliability.md): a query id given twice with two texts, and a
(query, document) pair judged twice with two labels, are refused naming the file, the line and the id; an exact
repeat is read once, with a warning naming both lines. Before, every topic reader yielded both rows, and
``pt.Experiment`` merged the two queries' rankings under one qid.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pandas as pd
import pytest

from pyterrier_cpdae.datasets import IRDSWrapper, load_dataset
from tests.helpers.errors import at
from tests.helpers.tiny_sets import BEIR_QRELS_HEADER, write_beir, write_trec

DOCS = "<DOC>\n<DOCNO>D1</DOCNO>\none\n</DOC>\n<DOC>\n<DOCNO>D2</DOCNO>\ntwo\n</DOC>\n"


def _topic(qid: str, title: str) -> str:
    return f"<top>\n<num>{qid}</num>\n<title>{title}</title>\n</top>\n"


def _trec(folder: Path, topics: str, qrels: str = "1 0 D1 1\n2 0 D2 1\n"):
    return load_dataset(f"trec:{write_trec(folder, DOCS, topics, qrels)}")


def _beir(folder: Path, queries: list[dict], qrels: str):
    corpus = [{"_id": d, "text": d} for d in ("D1", "D2")]
    return load_dataset(f"beir:{write_beir(folder, corpus, queries, BEIR_QRELS_HEADER + qrels)}")


def _rows(df: pd.DataFrame) -> list[list]:
    return df.values.tolist()


# ------------------------------------------------------------------ topics

def test_trec_topic_id_twice_with_two_texts_is_refused(tmp_path: Path) -> None:
    ds = _trec(tmp_path, _topic("1", "first query") + _topic("2", "other") + _topic("1", "another query"))
    # the third <top> opens at line 9; the first one with qid 1 at line 1
    with pytest.raises(ValueError, match=at(tmp_path / "topics.trec", 9) + r" query id '1' is given twice.*"
                       + re.escape(f"{tmp_path / 'topics.trec'}:1")):
        ds.get_topics()


def test_trec_topic_repeated_exactly_is_read_once_with_a_warning(tmp_path: Path) -> None:
    ds = _trec(tmp_path, _topic("1", "first query") + _topic("2", "other") + _topic("1", "first query"))
    with pytest.warns(UserWarning, match=at(tmp_path / "topics.trec", 9) + r" query '1' repeats .*topics.trec:1"):
        topics = ds.get_topics()
    # reference: the file without the repeat
    (tmp_path / "ref").mkdir()
    reference = _trec(tmp_path / "ref", _topic("1", "first query") + _topic("2", "other")).get_topics()
    assert _rows(topics) == _rows(reference) == [["1", "first query"], ["2", "other"]]


def test_beir_query_id_twice_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    queries = [{"_id": "q1", "text": "alpha"}, {"_id": "q2", "text": "beta"}, {"_id": "q1", "text": "gamma"}]
    ds = _beir(tmp_path, queries, "q1\tD1\t1\nq2\tD2\t1\n")
    with pytest.raises(ValueError, match=at(tmp_path / "queries.jsonl", 3) + r" query id 'q1' is given twice"):
        ds.get_topics()


def test_beir_query_repeated_exactly_is_read_once(tmp_path: Path) -> None:
    queries = [{"_id": "q1", "text": "alpha"}, {"_id": "q2", "text": "beta"}, {"_id": "q1", "text": "alpha"}]
    ds = _beir(tmp_path, queries, "q1\tD1\t1\nq2\tD2\t1\n")
    with pytest.warns(UserWarning, match=at(tmp_path / "queries.jsonl", 3)):
        assert _rows(ds.get_topics()) == [["q1", "alpha"], ["q2", "beta"]]


def test_smart_query_ids_that_normalise_to_one_are_refused(tmp_path: Path) -> None:
    # CISI/MEDLINE ids lose their leading zeros: ".I 01" and ".I 1" are one qid
    (tmp_path / "CISI.ALL").write_text(".I 1\n.T\nDoc one\n.W\ntext\n")
    (tmp_path / "CISI.QRY").write_text(".I 01\n.W\nfirst question\n.I 1\n.W\nsecond question\n")
    (tmp_path / "CISI.REL").write_text("1 1 0 0.000000\n")
    with pytest.raises(ValueError, match=at(tmp_path / "CISI.QRY", 4) + r" query id '1' is given twice"):
        load_dataset(f"cisi:{tmp_path}").get_topics()


# ------------------------------------------------------------------ qrels

def test_beir_pair_judged_twice_with_two_labels_is_refused(tmp_path: Path) -> None:
    ds = _beir(tmp_path, [{"_id": "q1", "text": "alpha"}], "q1\tD1\t1\nq1\tD2\t0\nq1\tD1\t0\n")
    qrels = tmp_path / "qrels" / "test.tsv"  # the header is line 1
    with pytest.raises(ValueError, match=at(qrels, 4) + r" query 'q1' judges document 'D1' twice, with label 0 "
                       r"here and 1 at " + re.escape(f"{qrels}:2")):
        ds.get_qrels()
    with pytest.raises(ValueError, match=at(qrels, 4)):  # the topics read the qrels too
        ds.get_topics()


def test_trec_pair_judged_twice_with_two_labels_is_refused(tmp_path: Path) -> None:
    ds = _trec(tmp_path, _topic("1", "q"), "1 0 D1 1\n1 0 D2 0\n1 0 D1 2\n")
    with pytest.raises(ValueError, match=at(tmp_path / "qrels", 3) + r" query '1' judges document 'D1' twice"):
        ds.get_qrels()


def test_exact_repeated_judgement_counts_once_with_a_warning(tmp_path: Path) -> None:
    ds = _beir(tmp_path, [{"_id": "q1", "text": "alpha"}], "q1\tD1\t1\nq1\tD2\t0\nq1\tD1\t1\n")
    qrels = tmp_path / "qrels" / "test.tsv"
    with pytest.warns(UserWarning, match=at(qrels, 4) + r" the judgement of document 'D1' for query 'q1' repeats "
                      + re.escape(f"{qrels}:2")):
        assert _rows(ds.get_qrels()) == [["q1", "D1", 1], ["q1", "D2", 0]]


def test_smart_qrels_repeat_counts_once(tmp_path: Path) -> None:
    (tmp_path / "CISI.ALL").write_text(".I 1\n.T\nDoc one\n.W\ntext\n")
    (tmp_path / "CISI.QRY").write_text(".I 1\n.W\nfirst question\n")
    (tmp_path / "CISI.REL").write_text("1 1 0 0.000000\n1 1 0 0.000000\n")
    with pytest.warns(UserWarning, match=at(tmp_path / "CISI.REL", 2)):
        assert _rows(load_dataset(f"cisi:{tmp_path}").get_qrels()) == [["1", "1", 1]]


def test_the_real_collections_have_no_duplicates(vaswani_dir: Path, cranfield_dir: Path, scifact_dir: Path) -> None:
    """The checks refuse nothing in the shared real collections (and warn about nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for spec, n_topics, n_qrels in ((f"trec:{vaswani_dir}", 93, 2083), (f"cranfield:{cranfield_dir}", 225, 1837),
                                        (f"beir:{scifact_dir}:train", 809, 919)):
            ds = load_dataset(spec)
            assert (len(ds.get_topics()), len(ds.get_qrels())) == (n_topics, n_qrels), spec


class _Query:
    def __init__(self, query_id: str, text: str) -> None:
        self.query_id, self.text = query_id, text


class _Irds:
    """Stands in for an ir_datasets dataset: queries and qrels with a repeated id."""

    def __init__(self, queries: list[tuple[str, str]], qrels: list[tuple[str, str, int]]) -> None:
        self.queries, self.qrels = queries, qrels

    def irds_ref(self) -> "_Irds":
        return self

    def has_queries(self) -> bool:
        return True

    def queries_iter(self):
        return (_Query(*q) for q in self.queries)

    def get_qrels(self, variant=None) -> pd.DataFrame:
        return pd.DataFrame(self.qrels, columns=["qid", "docno", "label"])


def _irds(queries, qrels) -> IRDSWrapper:
    ds = IRDSWrapper.__new__(IRDSWrapper)
    ds.irds_id, ds._dataset = "stub/test", _Irds(queries, qrels)
    return ds


def test_irds_topics_and_qrels_are_checked_too() -> None:
    ds = _irds([("1", "a"), ("2", "b"), ("1", "c")], [("1", "D1", 1), ("1", "D1", 2)])
    with pytest.raises(ValueError, match=r"irds:stub/test query 3: query id '1' is given twice.*query 1"):
        ds.get_topics()
    with pytest.raises(ValueError, match=r"irds:stub/test judgement 2: query '1' judges document 'D1' twice"):
        ds.get_qrels()
    ok = _irds([("1", "a"), ("2", "b")], [("1", "D1", 1), ("2", "D1", 0)])
    assert _rows(ok.get_topics()) == [["1", "a"], ["2", "b"]]
    assert _rows(ok.get_qrels()) == [["1", "D1", 1], ["2", "D1", 0]]


# ------------------------------------------------------------------ a label beyond 64 bits (class 6)

@pytest.mark.parametrize("label", ["100000000000000000000", "1e20", "-9223372036854775809"])
def test_a_label_beyond_64_bits_names_file_and_line(tmp_path: Path, label: str) -> None:
    ds = _trec(tmp_path, _topic("1", "q"), f"1 0 D1 1\n1 0 D2 {label}\n")
    with pytest.raises(ValueError, match=at(tmp_path / "qrels", 2) + r".*relevance label .* is out of range"):
        ds.get_qrels()


def test_the_largest_64_bit_label_is_read() -> None:
    from pyterrier_cpdae.datasets.records import _label
    assert _label("9223372036854775807") == 2**63 - 1 and _label("-9223372036854775808") == -2**63
    assert _label("2.0") == 2
