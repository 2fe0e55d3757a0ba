"""The smoke scale's own collections (``experiments/smoke_data``, made by ``experiments/paper/smoke_data.py``): the
shipped files are what the generator makes, the smoke sizes read nothing else, and each collection loads through the
project's loaders with every judged query answerable (the whole pipeline on them: tests/experiments/paper/test_paper_smoke.py)."""
from __future__ import annotations

import json
import re
from pathlib import Path

from experiments.paper.config import load_config
from experiments.paper.data import check_split, positive_qids, read_split
from experiments.paper.smoke_data import OUT, make
from pyterrier_cpdae import load_dataset

REPO = Path(__file__).resolve().parents[3]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_shipped_smoke_collections_are_what_the_generator_makes(tmp_path):
    made = _files(make(tmp_path / "smoke_data"))
    shipped = _files(OUT)
    assert sorted(made) == sorted(shipped)
    changed = [name for name in made if made[name] != shipped[name]]
    assert not changed, f"run python -m experiments.paper.smoke_data again: {changed} differ"


def _values(cfg):
    """The config without its prose (descriptions, notes, labels), which may mention the real data."""
    if isinstance(cfg, dict):
        return {k: _values(v) for k, v in cfg.items() if k not in ("description", "what_it_shows", "note", "label")}
    return [_values(v) for v in cfg] if isinstance(cfg, list) else cfg


def test_the_smoke_sizes_read_only_the_shipped_collections(tmp_path):
    """The smoke scale, and any scale at smoke sizes, names no path under ../shared; each data path it names is
    under experiments/smoke_data and exists."""
    for scale, sizes in (("smoke", None), ("gpu", "smoke"), ("cpu", "smoke")):
        cfg = load_config(scale, sizes=sizes, work_dir=tmp_path / "w")
        text = json.dumps(_values({k: v for k, v in cfg.items() if k not in ("config_file", "work_dir")}))
        assert not re.search(r"\.\./shared|shared/data", text), (scale, sizes)
        paths = re.findall(r"experiments/smoke_data/[\w./-]+", text)
        assert len(paths) >= 10
        for p in paths:
            assert (REPO / p.split(":")[0]).exists(), p
        assert cfg["corpus"].startswith("wiki:experiments/smoke_data/") and cfg["irds_copy_from"].startswith(
            "experiments/smoke_data/")
        assert cfg["eval_sets"]["dl19"]["irds_copy_from"].startswith("experiments/smoke_data/")


def test_each_smoke_collection_loads_with_an_answer_for_every_query(monkeypatch):
    monkeypatch.chdir(REPO)   # the configs' paths are relative to the repository root, where the pipeline runs
    cfg = load_config("smoke")
    sets = {**cfg["finetune_sets"], **cfg["eval_sets"]}
    for name in ("scifact", "scifact_dev", "vaswani", "cranfield"):
        ds = load_dataset(sets[name]["spec"])
        docs = {d["docno"] for d in ds.get_corpus_iter()}
        qrels, topics = ds.get_qrels(), ds.get_topics()
        assert len(docs) >= 50 and set(qrels["docno"].astype(str)) <= docs, name
        assert positive_qids(qrels) == set(topics["qid"].astype(str)), name
        assert all(q.strip() for q in topics["query"]), name
        if sets[name].get("queries"):
            path, split, part = read_split(sets[name]["queries"])
            check_split(path, split, positive_qids(qrels))       # the split covers exactly the judged queries
    # Cranfield's quirk, as in the real files: queries are numbered by position, not by their .I
    cran = load_dataset(sets["cranfield"]["spec"])
    assert sorted(cran.get_topics()["qid"], key=int) == [str(i) for i in range(1, 11)]
    numbers = re.findall(r"^\.I (\d+)$", (REPO / "experiments/smoke_data/cranfield/cran.qry").read_text(), re.M)
    assert [int(n) for n in numbers] != list(range(1, 11))
    # MS MARCO's halves and DL19's graded judgements (read from the files: ir_datasets is tested by the smoke run)
    marco = REPO / "experiments/smoke_data/msmarco-dev-sample/irds/msmarco-passage"
    qids = {line.split()[0] for line in (marco / "dev/small/qrels").read_text().splitlines()}
    path, split, _ = read_split(cfg["finetune_sets"]["marco"]["queries"])
    check_split(path, split, qids)
    assert len(split["train"]) == len(split["eval"]) >= 16
    dl19 = REPO / "experiments/smoke_data/msmarco-dl19-judged/irds/msmarco-passage/trec-dl-2019/qrels"
    labels = [int(line.split()[3]) for line in dl19.read_text().splitlines()]
    assert set(labels) == {0, 1, 2, 3}
