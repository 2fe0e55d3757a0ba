"""Choose the fine-tuning learning rate of a paper scale on held-aside *training* queries (issue 12).

The cpu scale's fine-tuning recipe (``finetune.args`` of ``experiments/configs/paper_cpu.json``: the paper's
pairwise loss with 1 positive + 7 BM25 negatives, lr 5e-5, 3 epochs) was fixed a priori. This script checks that
choice without touching any evaluation query: it splits the MS MARCO sample's *training* queries (the ones the
pipeline fine-tunes on) once, seeded, into a fitting part and a held-aside development part, fine-tunes the base
checkpoint ("BERT") on the fitting part with each learning rate (the rest of the recipe unchanged, same BM25
negatives), and reports MRR@10, R@100 and nDCG@10 of exact [CLS] dot-product search on the development queries
over the whole passage pool, with BM25 beside them and a paired t-test against the first learning rate.

    python experiments/finetune_lr_dev.py --work-dir /work/paper-cpu --lrs 5e-5 2e-4 1e-3 \\
        --out experiments/results/paper_cpu/finetune_lr_dev.md

It needs the pipeline's ``base`` stage, the materialised ``data/marco`` folder and ``negatives/marco.jsonl``
(``python -m experiments.paper --scale cpu --work-dir W --stages 'base,negatives:marco' --no-tables``).
Fine-tuned models go to ``<work>/lr_dev/`` and are reused when finished.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def split_train_queries(data: Path, out: Path, dev: int, seed: int) -> tuple[list[str], list[str]]:
    """Write ``out`` as a BEIR folder holding the fitting queries (split ``train``) and the development queries
    (split ``dev``), sharing ``data``'s corpus. Returns (fit qids, dev qids)."""
    queries = [json.loads(line) for line in (data / "queries.jsonl").read_text().splitlines() if line.strip()]
    qids = sorted(q["_id"] for q in queries)
    rng = random.Random(seed)
    dev_ids = set(rng.sample(qids, dev))
    fit_ids = [q for q in qids if q not in dev_ids]
    out.mkdir(parents=True, exist_ok=True)
    (out / "qrels").mkdir(exist_ok=True)
    corpus = out / "corpus.jsonl"
    if not corpus.exists():
        os.symlink((data / "corpus.jsonl").resolve(), corpus)
    (out / "queries.jsonl").write_text((data / "queries.jsonl").read_text())
    lines = (data / "qrels" / "train.tsv").read_text().splitlines()
    header, rows = lines[0], [r for r in lines[1:] if r.strip()]
    for split, keep in (("train", set(fit_ids)), ("dev", dev_ids)):
        (out / "qrels" / f"{split}.tsv").write_text("\n".join([header] + [r for r in rows if r.split("\t")[0] in keep]) + "\n")
    return fit_ids, sorted(dev_ids)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, help="the paper pipeline's work dir (base, data/marco, negatives)")
    p.add_argument("--scale", default="cpu", help="the config whose fine-tuning recipe is checked (default: cpu)")
    p.add_argument("--lrs", nargs="+", default=["5e-5", "2e-4", "1e-3"])
    p.add_argument("--dev-queries", type=int, default=70, help="training queries held aside (default: 70 of 270)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fit/dev split (default: 0)")
    p.add_argument("--out", default=None, help="Markdown record (default: print only)")
    a = p.parse_args(argv)

    from experiments.paper.config import load_config
    from experiments.paper.stages import to_argv

    work = Path(a.work_dir).resolve()
    cfg = load_config(a.scale, work_dir=work)
    os.environ.setdefault("IR_DATASETS_HOME", str(work / "irds"))
    data, negatives, base = work / "data" / "marco", work / "negatives" / "marco.jsonl", work / "base"
    for need in (data / "queries.jsonl", negatives, base / "config.json"):
        if not need.exists():
            raise SystemExit(f"{need} is missing: run the pipeline's base and negatives:marco stages first")
    root = work / "lr_dev"
    fit, dev = split_train_queries(data, root / "data", a.dev_queries, a.seed)
    print(f"{len(fit)} fitting / {len(dev)} development queries (seed {a.seed}), all from the training split")

    systems, walls, commands = {}, {}, []
    for lr in a.lrs:
        out = root / f"bert_lr{lr}"
        args = {**cfg["finetune"]["args"], "learning_rate": lr, "model": str(base),
                "train": f"beir:{root / 'data'}:train", "negatives": f"file:{negatives}", "output": str(out)}
        cmd = [sys.executable, "-m", "pretrain", "finetune", *to_argv(args)]
        commands.append("python -m pretrain finetune " + " ".join(shlex.quote(x) for x in to_argv(args)))
        done = (out / "training_args.json").exists() and json.loads((out / "training_args.json").read_text()).get("finished")
        t0 = time.perf_counter()
        if not done:
            subprocess.run(cmd + (["--resume"] if (out / "training_args.json").exists() else []), check=True, cwd=ROOT)
        walls[lr] = None if done else round(time.perf_counter() - t0, 1)
        systems[f"lr={lr}"] = str(out)  # build_retrievers names an index after the text before a space

    import pyterrier as pt
    from ir_measures import parse_measure

    from experiments.scifact_finetune import build_retrievers
    from pyterrier_cpdae import BM25Index, load_dataset

    ev = cfg["evaluation"]
    spec = f"beir:{root / 'data'}:dev"
    ds = load_dataset(spec)
    topics, qrels = ds.get_topics(), ds.get_qrels()
    topics = topics[topics["qid"].astype(str).isin(set(dev))]
    dense, _ = build_retrievers({k: (v, ev.get("pooling", "cls")) for k, v in systems.items()}, spec,
                                doc_max_length=int(ev["doc_max_length"]), query_max_length=int(ev["query_max_length"]),
                                index_root=root / "indices", num_results=int(ev["num_results"]),
                                batch_size=int(ev["batch_size"]))
    bm25_dir = root / "bm25"
    bm25 = BM25Index(bm25_dir)
    if not bm25.built():
        bm25.indexer().index(ds.get_corpus_iter())
    names = ["BM25", *dense]
    res = pt.Experiment([bm25.bm25(num_results=int(ev["num_results"])), *dense.values()], topics, qrels,
                        eval_metrics=[parse_measure(m) for m in ("RR@10", "R@100", "nDCG@10")], names=names,
                        baseline=1, verbose=False)
    table = res.round(4).to_markdown(index=False)
    print(table)
    if a.out:
        lines = [
            "# Fine-tuning learning rate, chosen on held-aside training queries (cpu scale, issue 12)", "",
            f"Command: `python experiments/finetune_lr_dev.py {' '.join(shlex.quote(x) for x in (argv or sys.argv[1:]))}`",
            "", f"Machine: {platform.platform()}, {os.cpu_count()} CPU cores, no GPU; recorded "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
            f"Data: the MS MARCO sample's {len(fit) + len(dev)} *training* queries "
            f"(`experiments/configs/msmarco_sample_split.json`, train part), split once (seed {a.seed}) into "
            f"{len(fit)} fitting and {len(dev)} development queries; no evaluation query is used. Passage pool: "
            f"all {json.loads((data / 'materialised.json').read_text())['num_docs']:,} passages of the sample. Model: the pipeline's base checkpoint (the BERT row). Recipe: the scale's "
            "`finetune.args` with only the learning rate changed. Significance: paired two-tailed t-test against "
            f"`{names[1]}` (p-values not corrected).", "",
            table, "", "Fine-tuning wall time (s; None = reused): " + json.dumps(walls), "",
            "Commands:", "", "```", *commands, "```", ""]
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(lines))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
