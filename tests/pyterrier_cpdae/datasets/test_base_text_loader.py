"""``load_dataset(...).text_loader()``: PyTerrier's text-loader convention on the package's datasets, checked
against the collections' files read by hand."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pandas as pd
import pyterrier as pt
import pytest

from pyterrier_cpdae.datasets import load_dataset
from tests.helpers.tiny_sets import offline_msmarco

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "pyterrier_cpdae" / "data" / "sample" / "corpus.jsonl"


def _sample_by_hand() -> dict[str, dict]:
    """The sample corpus read with json: BEIR's text is the title and the body joined by a space."""
    docs = {}
    for line in SAMPLE.read_text(encoding="utf8").splitlines():
        if line.strip():
            d = json.loads(line)
            docs[str(d["_id"])] = {"title": d.get("title") or "",
                                   "text": f"{d.get('title') or ''} {d['text'] or ''}".strip()}
    return docs


def test_sample_text_and_title_by_docno_keeping_the_frame():
    truth = _sample_by_hand()
    ids = list(truth)
    picked = [ids[3], ids[0], ids[3], ids[-1]]  # a repeat, out of corpus order
    inp = pd.DataFrame({"qid": ["q1", "q1", "q2", "q2"], "docno": picked, "score": [4.0, 3.0, 2.0, 1.0],
                        "rank": [0, 1, 0, 1], "text": ["stale"] * 4}, index=[10, 11, 20, 21])
    ds = load_dataset("sample")
    out = ds.text_loader()(inp)
    assert list(out.index) == [10, 11, 20, 21]
    assert out[["qid", "docno", "score", "rank"]].equals(inp[["qid", "docno", "score", "rank"]])
    assert list(out["text"]) == [truth[d]["text"] for d in picked]  # the stale column is replaced
    assert list(out["title"]) == [truth[d]["title"] for d in picked]
    only = ds.text_loader("title")(inp.drop(columns="text"))
    assert list(only.columns) == ["qid", "docno", "score", "rank", "title"]
    # PyTerrier's own entry point finds the factory
    assert pt.text.get_text(ds, "text")(inp)["text"].tolist() == [truth[d]["text"] for d in picked]


def test_errors_name_the_problem():
    ds = load_dataset("sample")
    known = next(iter(_sample_by_hand()))
    with pytest.raises(ValueError, match=r"1 docno\(s\).*not documents of load_dataset\('sample'\).*'nope-42'"):
        ds.text_loader()(pd.DataFrame({"qid": ["1", "1"], "docno": [known, "nope-42"]}))
    with pytest.raises(pt.validate.InputValidationError, match="docno"):  # pta.validate: the input needs a docno
        ds.text_loader()(pd.DataFrame({"qid": ["1"], "doc_id": [known]}))
    with pytest.raises(ValueError, match=r"no document field\(s\) \['body'\].*\['text', 'title'\]"):
        ds.text_loader(["text", "body"])
    empty = ds.text_loader()(pd.DataFrame({"qid": [], "docno": []}))
    assert list(empty.columns) == ["qid", "docno", "text", "title"] and len(empty) == 0
    assert repr(ds.text_loader()) == "load_dataset('sample').text_loader()"
    assert repr(ds.text_loader("title")) == "load_dataset('sample').text_loader(['title'])"


def test_rank_cutoff_fuses_before_loading():
    ds = load_dataset("sample")
    ids = list(_sample_by_hand())[:3]
    pipe = ds.text_loader() % 2
    out = pipe(pd.DataFrame({"qid": ["q"] * 3, "docno": ids, "score": [3.0, 2.0, 1.0], "rank": [0, 1, 2]}))
    assert list(out["docno"]) == ids[:2]


def test_duplicate_docnos_in_the_collection_are_refused(tmp_path):
    folder = tmp_path / "beir"
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text('{"_id": "d1", "text": "one"}\n{"_id": "d1", "text": "two"}\n')
    (folder / "queries.jsonl").write_text('{"_id": "q1", "text": "q"}\n')
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    with pytest.raises(ValueError, match="docno 'd1' names two documents"):
        load_dataset(f"beir:{folder}").text_loader()(pd.DataFrame({"qid": ["q1"], "docno": ["d1"]}))


def test_vaswani_every_document_equals_the_file_read_by_hand(vaswani_dir):
    raw = (vaswani_dir / "corpus" / "doc-text.trec").read_text(encoding="utf8")
    truth = {m.group(1): " ".join(m.group(2).split())
             for m in re.finditer(r"<DOC>\s*<DOCNO>\s*(\S+?)\s*</DOCNO>(.*?)</DOC>", raw, re.S)}
    assert len(truth) == 11429
    ds = load_dataset(f"trec:{vaswani_dir}")
    loader = ds.text_loader()
    assert loader.fields == ["text"]
    inp = pd.DataFrame({"qid": "1", "docno": list(truth)[::-1]})
    out = loader(inp)
    assert out["text"].tolist() == [truth[d] for d in inp["docno"]]
    # the docstore is built once, kept by the dataset, and shared by its loaders: a second lookup is quick
    t0 = time.perf_counter()
    again = ds.text_loader()(inp.head(100))
    assert time.perf_counter() - t0 < 0.5
    assert again["text"].tolist() == out["text"].head(100).tolist()


@pytest.mark.multiproc
def test_irds_text_loader_uses_the_docstore_offline(tmp_path: Path) -> None:
    code = """
        import json
        import pandas as pd
        from pyterrier_cpdae.datasets import load_dataset
        ds = load_dataset("irds:msmarco-passage/dev/small")
        out = ds.text_loader()(pd.DataFrame({"qid": ["100"] * 3, "docno": ["2", "0", "2"], "score": [3, 2, 1]}))
        try:
            ds.text_loader()(pd.DataFrame({"qid": ["100"], "docno": ["77"]}))
            missing = None
        except ValueError as e:
            missing = str(e)
        print(json.dumps({"rows": out.values.tolist(), "columns": list(out.columns), "missing": missing}))
    """
    got = offline_msmarco(tmp_path, "100\twhat is the capital of france\n", "100 0 0 1\n", code, timeout=300)
    assert got["columns"] == ["qid", "docno", "score", "text"]
    assert got["rows"] == [["100", "2", 3, "Pandas."], ["100", "0", 2, "The capital of France is Paris."],
                           ["100", "2", 1, "Pandas."]]
    assert "'77'" in got["missing"] and "not documents of load_dataset('irds:msmarco-passage/dev/small')" in got["missing"]
