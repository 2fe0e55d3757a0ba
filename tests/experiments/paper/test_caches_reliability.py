"""A cached result is keyed by the data it came from, not only by the model.

Every index and saved run that ``experiments/main.py`` and the paper pipeline reuse is checked against the
fingerprint of the documents (and, for runs, of the queries) it was computed from; the reference each time is a
fresh run of the same command in an empty work directory. The collections are a few TREC documents written here;
the edits keep every docno and the file's size and modification time (two documents swap their texts), which only
the content digest (re-read when the file's ctime changes) can see.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from tests.helpers.warm_python import warm_python
from tests.helpers.main_job import load_main

REPO = Path(__file__).resolve().parents[3]

TEXTS = ["photon energy of light in a vacuum", "the roman empire and its history", "a recipe for bread and butter",
         "energy levels of the hydrogen atom", "football results of the season", "the photon as a light quantum"]
OTHER = ["stock markets fell on monday", "a photon of high energy light", "rivers of northern europe",
         "light and energy of a photon beam", "the senate of ancient rome", "bread baking at home"]
TOPICS = [("1", "photon energy"), ("2", "roman history"), ("3", "bread recipe")]
QRELS = [("1", "d0"), ("1", "d5"), ("2", "d1"), ("3", "d2")]


def _write_trec(folder: Path, texts: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.trec").write_text("".join(f"<DOC>\n<DOCNO>d{i}</DOCNO>\n{t}\n</DOC>\n" for i, t in enumerate(texts)))
    (folder / "query-text.trec").write_text("".join(f"<top>\n<num>{q}</num>\n<title>{t}</title>\n</top>\n"
                                                    for q, t in TOPICS))
    (folder / "qrels").write_text("".join(f"{q} 0 {d} 1\n" for q, d in QRELS))
    return folder


def _swap_in_place(folder: Path, i: int, j: int, texts: list[str]) -> None:
    """Rewrite the documents with texts ``i`` and ``j`` swapped: same docnos, same size, same mtime."""
    f = folder / "docs.trec"
    st = f.stat()
    swapped = list(texts)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with open(f, "r+") as out:  # in place: the same inode
        out.write("".join(f"<DOC>\n<DOCNO>d{k}</DOCNO>\n{t}\n</DOC>\n" for k, t in enumerate(swapped)))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_ino == st.st_ino


def _load_main():
    return load_main("cpdae_main_job_caches")


# ----------------------------------------------------------------------------- the fingerprints themselves
def test_corpus_fingerprint_sees_an_in_place_edit_and_ignores_the_folder_path(tmp_path):
    from experiments.paper.caches import corpus_fingerprint, file_digests

    a = _write_trec(tmp_path / "a", TEXTS)
    cache = tmp_path / "digests.json"
    first = corpus_fingerprint(f"trec:{a}", cache)
    assert set(first["files"]) == {"docs.trec", "query-text.trec"}            # documents (and topics), no qrels
    (a / "qrels").write_text("1 0 d1 1\n")
    assert corpus_fingerprint(f"trec:{a}", cache)["digest"] == first["digest"]  # judgements are not the corpus
    b = _write_trec(tmp_path / "b", TEXTS)                                      # a copy elsewhere: same documents
    assert corpus_fingerprint(f"trec:{b}", cache)["digest"] == first["digest"]
    _swap_in_place(a, 0, 1, TEXTS)
    after = corpus_fingerprint(f"trec:{a}", cache)
    assert after["digest"] != first["digest"]
    import hashlib                                                             # independent reference: sha256
    assert after["files"]["docs.trec"] == hashlib.sha256((a / "docs.trec").read_bytes()).hexdigest()
    # the cache holds each file's digest under (size, mtime, inode, ctime): an unchanged file is not read again
    stamp = json.loads(cache.read_text())[os.path.realpath(a / "docs.trec")]
    st = (a / "docs.trec").stat()
    assert stamp[:4] == [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
    entry = json.loads(cache.read_text())
    entry[os.path.realpath(a / "docs.trec")][4] = "0" * 64                       # a planted digest is served ...
    cache.write_text(json.dumps(entry))
    assert file_digests([a / "docs.trec"], cache)[str(a / "docs.trec")] == "0" * 64
    _swap_in_place(a, 0, 1, TEXTS)                                               # ... until the file is rewritten
    assert file_digests([a / "docs.trec"], cache)[str(a / "docs.trec")] == hashlib.sha256(
        (a / "docs.trec").read_bytes()).hexdigest()


def test_tsv_fingerprint_covers_its_corpus_file_only(tmp_path):
    import hashlib

    from experiments.paper.caches import corpus_fingerprint

    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "collection.tsv").write_text("d1\tone\nd2\ttwo\n")
    (folder / "queries.tsv").write_text("q1\tone\n")
    (folder / "qrels.txt").write_text("q1 0 d1 1\n")
    fp = corpus_fingerprint(f"tsv:{folder}", tmp_path / "d.json")
    assert fp["files"] == {"collection.tsv": hashlib.sha256((folder / "collection.tsv").read_bytes()).hexdigest()}
    assert set(corpus_fingerprint(f"tsv:{folder}", tmp_path / "d.json", everything=True)["files"]) == {
        "collection.tsv", "queries.tsv", "qrels.txt"}


def test_beir_sample_and_irds_fingerprints_cover_their_documents(tmp_path, shared_data):
    import subprocess

    from experiments.paper.caches import corpus_fingerprint

    sample = corpus_fingerprint("sample", tmp_path / "d.json")
    assert list(sample["files"]) == ["corpus.jsonl"]
    assert set(corpus_fingerprint("sample", tmp_path / "d.json", everything=True)["files"]) == {
        "corpus.jsonl", "queries.jsonl", "qrels.tsv"}
    beir = corpus_fingerprint(f"beir:{shared_data / 'scifact'}:train", tmp_path / "d.json")
    assert list(beir["files"]) == ["corpus.jsonl"]
    # irds: the document file ir_datasets reads (ir_datasets fixes its home on import: a fresh interpreter)
    home = tmp_path / "irds"
    import shutil
    shutil.copytree(shared_data / "msmarco-dev-sample" / "irds", home)
    code = ("import json; from experiments.paper.caches import corpus_fingerprint as f; "
            f"print(json.dumps(f('irds:msmarco-passage/dev/small', {str(tmp_path / 'd.json')!r})))")
    out = subprocess.run([warm_python(), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "IR_DATASETS_HOME": str(home), "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    irds = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(irds["files"]) == ["msmarco-passage/collection.tsv"]
    import hashlib
    assert irds["files"]["msmarco-passage/collection.tsv"] == hashlib.sha256(
        (home / "msmarco-passage" / "collection.tsv").read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- experiments/main.py
_COMMON = ["--no-pretrain", "--pooling", "mean", "--doc-max-length", "32", "--num-results", "10"]


def _main_run(capsys, tmp_path: Path, model: str, dataset: Path, work: str) -> tuple[pd.DataFrame, str]:
    capsys.readouterr()
    table = _load_main().main(_COMMON + ["--model", model, "--dataset", f"trec:{dataset}", "--work-dir",
                                         str(tmp_path / work), "--results-dir", str(tmp_path / f"results-{work}")])
    return table, capsys.readouterr().out


def test_main_job_rebuilds_after_the_collection_was_edited_in_place(tmp_path, tiny_bert_dir, capsys):
    """A second run after the collection was edited in place (same docnos, file size, mtime and inode) reported the
    first run's figures with exit 0. It must give what a fresh run in an empty work directory gives, say that it
    rebuilt and why, and reuse everything once nothing changed."""
    b = _write_trec(tmp_path / "b", TEXTS)
    before, _ = _main_run(capsys, tmp_path, tiny_bert_dir, b, "work")
    _swap_in_place(b, 0, 1, TEXTS)                   # two documents swap their texts
    edited, out = _main_run(capsys, tmp_path, tiny_bert_dir, b, "work")
    fresh, _ = _main_run(capsys, tmp_path, tiny_bert_dir, b, "fresh")
    pd.testing.assert_frame_equal(edited, fresh)
    assert before.iloc[0]["AP"] != edited.iloc[0]["AP"]              # BM25 too
    assert "Rebuilding the BM25 index" in out and "docs.trec changed" in out and "Rebuilding the dense index" in out
    assert "0 of 2 reused" in (tmp_path / "results-work" / "table.md").read_text()
    again, out = _main_run(capsys, tmp_path, tiny_bert_dir, b, "work")     # unchanged since: all reused, and said
    pd.testing.assert_frame_equal(again, edited)
    assert "Reusing the BM25 index" in out and "2 of 2 reused" in (tmp_path / "results-work" / "table.md").read_text()


def test_main_job_gives_a_second_collection_its_own_indexes_in_the_same_work_dir(tmp_path, tiny_bert_dir, capsys):
    """A second collection (same docnos, other texts) run into the same --work-dir was given the first one's BM25 and
    dense indexes, which carried no dataset identity."""
    a, b = _write_trec(tmp_path / "a", TEXTS), _write_trec(tmp_path / "b", OTHER)
    first, _ = _main_run(capsys, tmp_path, tiny_bert_dir, a, "work")
    other, out = _main_run(capsys, tmp_path, tiny_bert_dir, b, "work")
    fresh, _ = _main_run(capsys, tmp_path, tiny_bert_dir, b, "fresh")
    pd.testing.assert_frame_equal(other, fresh)
    assert first.iloc[0]["AP"] != other.iloc[0]["AP"]
    assert "Rebuilding the BM25 index" in out and "built from another collection" in out
    assert "Rebuilding the dense index" in out
    built_from = json.loads((tmp_path / "work" / "bm25.built_from.json").read_text())
    assert built_from["spec"] == f"trec:{b}" and set(built_from["files"]) == {"docs.trec", "query-text.trec"}


# ----------------------------------------------------------------------------- the paper pipeline's evaluation
def _plan(work: Path, entry: dict):
    return type("P", (), {"cfg": {"eval_sets": {"extra": {"metrics": ["nDCG@10", "AP"], **entry}},
                                  "evaluation": {"pooling": "cls", "query_max_length": 16, "doc_max_length": 32,
                                                 "num_results": 10, "batch_size": 8}},
                          "work": work})()


def _means(tmp_path: Path, model: str, spec: Path, work: str) -> dict:
    from experiments.paper.evaluation import evaluate

    return evaluate(_plan(tmp_path / work, {"spec": f"trec:{spec}"}), "extra", "zero-shot", {"bert": model}, {},
                    log=lambda _: None)["means"]


def test_paper_eval_set_of_the_same_name_and_another_spec_is_evaluated_again(tmp_path, tiny_bert_dir):
    """``--eval-set NAME=SPEC`` with a NAME evaluated before from another SPEC reused that SPEC's BM25 index and saved
    run by name. Reference: the same evaluation in a fresh work directory."""
    a, b = _write_trec(tmp_path / "a", TEXTS), _write_trec(tmp_path / "b", OTHER)
    first = _means(tmp_path, tiny_bert_dir, a, "w")
    second = _means(tmp_path, tiny_bert_dir, b, "w")             # same NAME, another SPEC
    assert second == _means(tmp_path, tiny_bert_dir, b, "fresh")
    assert second["bm25"] != first["bm25"]


def test_paper_eval_set_edited_in_place_is_evaluated_again(tmp_path, tiny_bert_dir):
    """The same SPEC edited in place reused every index and saved run (the dense index by its spec string)."""
    b = _write_trec(tmp_path / "b", TEXTS)
    before = _means(tmp_path, tiny_bert_dir, b, "w")
    _swap_in_place(b, 0, 1, TEXTS)
    edited = _means(tmp_path, tiny_bert_dir, b, "w")
    assert edited == _means(tmp_path, tiny_bert_dir, b, "fresh")
    assert edited["bm25"] != before["bm25"] and edited["bert"] != before["bert"]
    assert edited == _means(tmp_path, tiny_bert_dir, b, "w")     # unchanged since: reused, same figures


def test_paper_materialised_subset_is_written_again_when_its_source_changes(tmp_path, capsys):
    """A set with a size limit is written once under <work>/data/<name>; it was reused by its definition alone after
    the collection it came from was edited."""
    from experiments.paper.data import set_spec
    from pyterrier_cpdae import load_dataset

    b = _write_trec(tmp_path / "b", OTHER)
    entry = {"spec": f"trec:{b}", "max_queries": 2}
    work = tmp_path / "w"

    def docs() -> dict:
        return {d["docno"]: d["text"] for d in load_dataset(set_spec("extra", entry, work)).get_corpus_iter()}

    before = docs()
    _swap_in_place(b, 1, 3, OTHER)
    capsys.readouterr()
    after = docs()
    assert "changed since it was written" in capsys.readouterr().out
    assert after == {d["docno"]: d["text"] for d in load_dataset(set_spec("extra", entry, tmp_path / "fresh"))
                     .get_corpus_iter()}
    assert after["d1"] == before["d3"] and after["d3"] == before["d1"]


# ----------------------------------------------------------------------------- fine-tuning's BM25 negatives
def test_a_folder_digest_follows_content_not_place(tmp_path):
    """The fingerprint of a set's own ir_datasets folder (``irds_copy_from``, e.g. TREC DL 2019): a copy elsewhere
    keeps it, an edit in place (same size) or an added file changes it, hidden files do not count."""
    import hashlib
    import shutil

    from experiments.paper.caches import folder_digest

    src = tmp_path / "irds" / "msmarco-passage"
    src.mkdir(parents=True)
    (src / "collection.tsv").write_text("0\tfirst passage\n1\tsecond passage\n")
    (src / "irds_version.txt").write_text("v2")
    cache = tmp_path / "digests.json"
    d0 = folder_digest(tmp_path / "irds", cache)
    # the reference, computed by hand: names relative to the folder, contents by sha256
    h = hashlib.sha256(b"folder\n")
    for name in ("msmarco-passage/collection.tsv", "msmarco-passage/irds_version.txt"):
        h.update(f"{name}\0{hashlib.sha256((tmp_path / 'irds' / name).read_bytes()).hexdigest()}\n".encode())
    assert d0 == h.hexdigest()
    shutil.copytree(tmp_path / "irds", tmp_path / "copy")
    assert folder_digest(tmp_path / "copy", cache) == d0
    (tmp_path / "irds" / ".hidden").write_text("x")
    assert folder_digest(tmp_path / "irds", cache) == d0
    (src / "collection.tsv").write_text("0\tfirst passagE\n1\tsecond passage\n")  # same size, other text
    assert folder_digest(tmp_path / "irds", cache) != d0
    (src / "extra.tsv").write_text("")
    assert len({folder_digest(tmp_path / "irds", cache), d0}) == 2
