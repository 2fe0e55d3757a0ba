"""Data of the paper pipeline: the MS MARCO sample's query split, materialised subsets, held-out texts.

Every training or evaluation set of a config is ``{"spec": <load_dataset spec>, "queries":
"split:<file>:<part>" (optional), "max_queries": N (optional), "max_docs": N (optional)}``. A set
with a query split or a size limit is written once as a BEIR folder under ``<work>/data/<name>``
(``beir:<dir>:train``, so that ``python -m pretrain finetune`` and the evaluation read the very same
queries, qrels and documents); a plain set is used by its spec.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from itertools import islice
from pathlib import Path
from typing import Any, Optional

from .config import ROOT, under_work

MSMARCO_SPLIT = ROOT / "experiments" / "configs" / "msmarco_sample_split.json"


def use_irds_home(cfg: dict[str, Any], stand_ins: Optional[Path] = None, dry_run: bool = False) -> Optional[str]:
    """Point ``IR_DATASETS_HOME`` where the config says (before ir_datasets is imported).

    ``irds_copy_from``: a folder in ir_datasets' cache layout, copied once to ``<work>/irds`` (ir_datasets
    writes caches beside the files, so the shared folder itself is never used). Stand-ins: ``DIR/irds``.
    """
    if stand_ins is not None and (Path(stand_ins) / "irds").is_dir():
        home = str((Path(stand_ins) / "irds").resolve())
    elif cfg.get("irds_copy_from"):
        home = str(Path(cfg["work_dir"]) / "irds")
        if not dry_run:
            copy_irds(cfg["irds_copy_from"], Path(home), "irds_copy_from")
    else:
        return os.environ.get("IR_DATASETS_HOME")
    os.environ["IR_DATASETS_HOME"] = home
    return home


def copy_irds(source: str, home: Path, what: str) -> Path:
    """Copy a folder in ir_datasets' cache layout (relative paths: to the repository root) to ``home``, once
    (ir_datasets writes caches beside the files, so the shared folder itself is never used)."""
    if not home.exists():
        src = (ROOT / source).resolve()
        if not src.is_dir():
            raise FileNotFoundError(f"{what}: {src} is absent (a collection in ir_datasets' cache layout, see "
                                    "../shared/data/README.md)")
        tmp = home.with_name(home.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        os.replace(tmp, home)
    return home


def positive_qids(qrels) -> set[str]:
    return set(qrels[qrels["label"].astype(float) > 0]["qid"].astype(str))


def make_msmarco_split(spec: str = "irds:msmarco-passage/dev/small", seed: int = 0) -> dict[str, Any]:
    """Split the MS MARCO sample's queries with a judged positive in two halves by a seeded shuffle."""
    from pyterrier_cpdae.datasets import load_dataset

    ds = load_dataset(spec)
    qids = sorted(positive_qids(ds.get_qrels()) & set(ds.get_topics()["qid"].astype(str)), key=lambda q: (len(q), q))
    shuffled = qids[:]
    random.Random(seed).shuffle(shuffled)
    n_train = len(qids) // 2
    return {"dataset": spec, "seed": seed, "num_queries": len(qids),
            "method": "random.Random(seed).shuffle of the sorted qids with a label>0 qrel; first half = train",
            "num_train": n_train, "num_eval": len(qids) - n_train,
            "train": sorted(shuffled[:n_train], key=int), "eval": sorted(shuffled[n_train:], key=int)}


def read_split(ref: str) -> tuple[Path, dict[str, Any], str]:
    """``split:<file>:<part>`` -> (file, the split, part)."""
    if not ref.startswith("split:") or ref.count(":") < 2:
        raise ValueError(f"queries: {ref!r} is not split:<file>:<part>")
    file, part = ref[len("split:"):].rsplit(":", 1)
    path = (ROOT / file) if not os.path.isabs(file) else Path(file)
    if not path.exists():
        hint = " (create it with: python -m experiments.paper.data)" if path == MSMARCO_SPLIT else ""
        raise FileNotFoundError(f"query split {path} is absent{hint}")
    split = json.loads(path.read_text())
    if part not in split:
        raise ValueError(f"{path} has no part {part!r} (parts: {[k for k, v in split.items() if isinstance(v, list)]})")
    return path, split, part


def check_split(path: Path, split: dict[str, Any], data_qids: set[str]) -> None:
    """Refuse a split whose query ids are not exactly the data's queries with a judged positive."""
    parts = [v for v in split.values() if isinstance(v, list)]
    recorded = set().union(*map(set, parts))
    if recorded != data_qids:
        missing, extra = sorted(data_qids - recorded)[:5], sorted(recorded - data_qids)[:5]
        raise ValueError(f"{path} does not match the data: it records {len(recorded)} query ids, the data has "
                         f"{len(data_qids)} queries with a judged positive (absent from the split: {missing}; absent "
                         f"from the data: {extra}). Is this the right dataset? The split must never be remade "
                         "silently: delete the file and regenerate it only on purpose.")


def set_key(entry: dict[str, Any]) -> dict[str, Any]:
    """What defines a train/eval set's data: its spec, query split and size limits (and its own ir_datasets folder,
    ``irds_copy_from``, for a set that has one)."""
    key = {k: entry.get(k) for k in ("spec", "queries", "max_queries", "max_docs")}
    return {**key, "irds_copy_from": entry["irds_copy_from"]} if entry.get("irds_copy_from") else key


def set_spec(name: str, entry: dict[str, Any], work: Path, dry_run: bool = False) -> str:
    """The ``load_dataset`` spec of a train/eval set, materialising a BEIR folder when needed.

    The folder is written again when the set's definition (:func:`set_key`) or the data it was written from
    (:func:`experiments.paper.caches.corpus_fingerprint` of the spec's documents, topics and qrels; for a set with its own
    ``irds_copy_from``, the files of that folder) changed.

    A set with its own ``irds_copy_from`` (e.g. TREC DL 2019, whose ir_datasets folder holds another
    ``msmarco-passage/collection.tsv`` than the MARCO sample's) is always materialised, by a child process whose
    ``IR_DATASETS_HOME`` is a copy of that folder (``<work>/irds_sets/<name>``, copied again when its source
    changed): ir_datasets fixes a dataset's home when it is first imported, so one process cannot read two
    ``msmarco-passage`` folders."""
    own_irds = entry.get("irds_copy_from")
    if not (entry.get("queries") or entry.get("max_queries") or entry.get("max_docs") or own_irds):
        return entry["spec"]
    out = under_work(work, "data", name, what=f"the data of the set {name!r}")
    key = set_key(entry)
    done = out / "materialised.json"
    spec = f"beir:{out}:train"
    if dry_run:
        return spec
    from experiments.paper.caches import corpus_fingerprint, folder_digest

    digests = Path(work) / ".digests.json"
    what = f"eval/train set {name}: irds_copy_from"
    if own_irds:  # the data is the ir_datasets folder itself (read in a child process: see above)
        src = (ROOT / own_irds).resolve()
        if not src.is_dir():
            raise FileNotFoundError(f"{what}: {src} is absent (a collection in ir_datasets' cache layout, see "
                                    "../shared/data/README.md)")
        source = folder_digest(src, digests)
    else:
        source = corpus_fingerprint(entry["spec"], digests, everything=True)["digest"]
    try:
        have = json.loads(done.read_text()) if done.exists() else None
    except ValueError:
        have = None
    if have is not None and have.get("key") == key and have.get("source") == source:
        return spec
    if have is not None:
        why = ("the set's definition changed" if have.get("key") != key else
               "it records no fingerprint of the data it was written from" if "source" not in have else
               f"the data of {entry['spec']} changed since it was written")
        print(f"writing {out} again: {why}", flush=True)
    if own_irds:
        home = work / "irds_sets" / name
        if have is not None and have.get("source") != source:
            shutil.rmtree(home, ignore_errors=True)  # the copy is of the old data: copy it again
        home = copy_irds(own_irds, home, what)
        job = json.dumps({"entry": entry, "out": str(out), "key": key, "source": source})
        env = {**os.environ, "IR_DATASETS_HOME": str(home),
               "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        proc = subprocess.run([sys.executable, "-m", "experiments.paper.data", "--materialise", job], env=env,
                              cwd=str(ROOT), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"set {name}: materialising {entry['spec']} from {home} failed: "
                               f"{(proc.stderr.strip().splitlines() or ['(no message)'])[-1]}")
        return spec
    materialise(entry, out, key, source)
    return spec


def materialise(entry: dict[str, Any], out: Path, key: dict[str, Any], source: str) -> None:
    """Write the set's queries (those with a judged positive, split and limits applied), qrels and documents as a
    BEIR folder ``out`` with ``materialised.json`` (``key``, the ``source`` data's fingerprint, counts)."""
    from pyterrier_cpdae.datasets import load_dataset

    ds = load_dataset(entry["spec"])
    topics, qrels = ds.get_topics(), ds.get_qrels()
    topics = topics.assign(qid=topics["qid"].astype(str))
    qrels = qrels.assign(qid=qrels["qid"].astype(str), docno=qrels["docno"].astype(str))
    keep = positive_qids(qrels) & set(topics["qid"])
    if entry.get("queries"):
        path, split, part = read_split(entry["queries"])
        check_split(path, split, keep)
        order = [str(q) for q in split[part]]
    else:
        order = sorted(keep, key=lambda q: (len(q), q))
    if entry.get("max_queries"):
        order = order[:int(entry["max_queries"])]
    wanted = set(order)
    topics = topics[topics["qid"].isin(wanted)]
    qrels = qrels[qrels["qid"].isin(wanted)]
    needed = set(qrels["docno"])
    max_docs = entry.get("max_docs")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "qrels").mkdir(parents=True)
    n_docs, n_other = 0, 0
    with open(tmp / "corpus.jsonl", "w") as f:
        for doc in ds.get_corpus_iter():
            docno = str(doc["docno"])
            if docno not in needed:
                if max_docs and n_other >= int(max_docs) - len(needed):
                    continue
                n_other += 1
            f.write(json.dumps({"_id": docno, "title": "", "text": doc.get("text", "")}) + "\n")
            n_docs += 1
    with open(tmp / "queries.jsonl", "w") as f:
        for qid, query in zip(topics["qid"], topics["query"]):
            f.write(json.dumps({"_id": qid, "text": query}) + "\n")
    with open(tmp / "qrels" / "train.tsv", "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for q, d, l in zip(qrels["qid"], qrels["docno"], qrels["label"]):
            f.write(f"{q}\t{d}\t{int(l)}\n")
    (tmp / "materialised.json").write_text(json.dumps({"key": key, "source": source, "num_queries": len(topics),
                                                        "num_docs": n_docs, "num_qrels": len(qrels)}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def held_out_texts(corpus: str, start: int, n: int) -> list[str]:
    """``n`` documents of the pre-training corpus after its first ``start`` (those pre-training used)."""
    from pretrain.data.readers import iter_texts

    return list(islice(iter_texts(corpus), start, start + n))


def head_texts(corpus: str, n: int) -> list[str]:
    """The first ``n`` documents of the pre-training corpus (for its token frequencies)."""
    from pretrain.data.readers import iter_texts

    return list(islice(iter_texts(corpus), n))


def main(argv: Optional[list[str]] = None) -> None:
    """Create ``experiments/configs/msmarco_sample_split.json`` from ../shared/data/msmarco-dev-sample (once).

    ``--materialise JOB`` (used by :func:`set_spec`): materialise one set, JOB a JSON ``{"entry", "out", "key", "source"}``,
    with this process's ``IR_DATASETS_HOME``."""
    import tempfile

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--materialise"] and len(argv) == 2:
        job = json.loads(argv[1])
        materialise(job["entry"], Path(job["out"]), job["key"], job["source"])
        return

    if MSMARCO_SPLIT.exists():
        raise SystemExit(f"{MSMARCO_SPLIT} exists; it is never remade silently (delete it first on purpose)")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(ROOT.parent / "shared" / "data" / "msmarco-dev-sample" / "irds", Path(tmp) / "irds")
        os.environ["IR_DATASETS_HOME"] = str(Path(tmp) / "irds")
        split = make_msmarco_split()
    MSMARCO_SPLIT.write_text(json.dumps(split, indent=1) + "\n")
    print(f"wrote {MSMARCO_SPLIT}: {split['num_train']} train / {split['num_eval']} eval queries")


if __name__ == "__main__":
    main()
