"""Choose the fine-tuning learning rate of a paper scale on held-aside *training* queries.

The cpu scale's fine-tuning recipe (``finetune.args`` of ``experiments/configs/paper_cpu.json``: the paper's
pairwise loss with 1 positive + 7 BM25 negatives, lr 5e-5, 3 epochs) was fixed a priori. This script checks that
choice without touching any evaluation query: it splits the MS MARCO sample's *training* queries (the ones the
pipeline fine-tunes on) once, seeded, into a fitting part and a held-aside development part, fine-tunes the base
checkpoint ("BERT") on the fitting part with each learning rate (the rest of the recipe unchanged, same BM25
negatives), and reports MRR@10, R@100 and nDCG@10 of exact [CLS] dot-product search on the development queries
over the whole passage pool, with BM25 beside them and a paired t-test against the first learning rate.

    python experiments/studies/finetune_lr_dev.py --work-dir /work/paper-cpu --lrs 5e-5 2e-4 1e-3 \\
        --out experiments/results/paper_cpu/finetune_lr_dev.md

It needs the pipeline's ``base`` stage, the materialised ``data/marco`` folder and ``negatives/marco.jsonl``
(``python -m experiments.paper --scale cpu --work-dir W --stages 'base,negatives:marco' --no-tables``).
Fine-tuned models go to ``<work>/lr_dev/``, run as pipeline stages: reused when finished with the same options,
resumed when unfinished.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def write_split(data: Path, path: Path, dev: int, seed: int) -> dict[str, list[str]]:
    """A query split of ``data``'s queries (a materialised pipeline set): ``dev`` of them drawn by
    ``random.Random(seed).sample`` from the sorted ids, the rest to fit on; written to ``path`` as JSON."""
    queries = [json.loads(line) for line in (data / "queries.jsonl").read_text().splitlines() if line.strip()]
    qids = sorted(q["_id"] for q in queries)
    dev_ids = set(random.Random(seed).sample(qids, dev))
    split = {"source": str(data), "seed": seed, "fit": [q for q in qids if q not in dev_ids], "dev": sorted(dev_ids)}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(split, indent=1))
    return split


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
    from experiments.paper.data import set_spec
    from experiments.paper.stages import Runner, Stage, to_argv

    work = Path(a.work_dir).resolve()
    cfg = load_config(a.scale, work_dir=work)
    os.environ.setdefault("IR_DATASETS_HOME", str(work / "irds"))
    data, negatives, base = work / "data" / "marco", work / "negatives" / "marco.jsonl", work / "base"
    for need in (data / "queries.jsonl", negatives, base / "config.json", work / "bm25" / "train_marco"):
        if not need.exists():
            raise SystemExit(f"{need} is missing: run the pipeline's base and negatives:marco stages first")
    root = work / "lr_dev"
    split = write_split(data, root / "split.json", a.dev_queries, a.seed)
    print(f"{len(split['fit'])} fitting / {len(split['dev'])} development queries (seed {a.seed}), "
          "all from the training split")
    # the pipeline's own materialisation: one BEIR folder per part, the sample's whole passage pool in each
    fit_spec, dev_spec = (set_spec(part, {"spec": f"beir:{data}:train", "queries": f"split:{root / 'split.json'}:{part}"},
                                   root) for part in ("fit", "dev"))

    runner = Runner(root)
    systems, walls, commands = {}, {}, []
    for lr in a.lrs:
        args = {**cfg["finetune"]["args"], "learning_rate": lr, "model": str(base), "train": fit_spec,
                "negatives": f"file:{negatives}", "output_dir": str(root / f"bert_lr{lr}")}
        stage = Stage(f"lr_dev:{lr}", "finetune", ["finetune", *to_argv(args)], Path(args["output_dir"]))
        commands.append(stage.command)
        walls[lr] = runner.run(stage)["wall_s"]  # done -> its recorded time; unfinished -> resumed
        systems[f"lr={lr}"] = args["output_dir"]  # build_retrievers names an index after the text before a space

    import pyterrier as pt
    from ir_measures import parse_measure

    from experiments.paper.retrievers import build_retrievers
    from pyterrier_cpdae import BM25Index, load_dataset

    ev = cfg["evaluation"]
    ds = load_dataset(dev_spec)
    topics, qrels = ds.get_topics(), ds.get_qrels()
    dense, _ = build_retrievers({k: (v, ev.get("pooling", "cls")) for k, v in systems.items()}, dev_spec,
                                doc_max_length=int(ev["doc_max_length"]), query_max_length=int(ev["query_max_length"]),
                                index_root=root / "indices", num_results=int(ev["num_results"]),
                                batch_size=int(ev["batch_size"]))
    bm25 = BM25Index(work / "bm25" / "train_marco")  # the pipeline's index of the same pool (negatives:marco)
    names = ["BM25", *dense]
    res = pt.Experiment([bm25.bm25(num_results=int(ev["num_results"])), *dense.values()], topics, qrels,
                        eval_metrics=[parse_measure(m) for m in ("RR@10", "R@100", "nDCG@10")], names=names,
                        baseline=1, verbose=False)
    table = res.round(4).to_markdown(index=False)
    print(table)
    if a.out:
        lines = [
            "# Fine-tuning learning rate, chosen on held-aside training queries (cpu scale)", "",
            f"Command: `python experiments/studies/finetune_lr_dev.py {' '.join(shlex.quote(x) for x in (argv or sys.argv[1:]))}`",
            "", f"Machine: {platform.platform()}, {os.cpu_count()} CPU cores, no GPU; recorded "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
            f"Data: the MS MARCO sample's {len(split['fit']) + len(split['dev'])} *training* queries "
            f"(`experiments/configs/msmarco_sample_split.json`, train part), split once (seed {a.seed}) into "
            f"{len(split['fit'])} fitting and {len(split['dev'])} development queries; no evaluation query is used. Passage pool: "
            f"all {json.loads((data / 'materialised.json').read_text())['num_docs']:,} passages of the sample. Model: the pipeline's base checkpoint (the BERT row). Recipe: the scale's "
            "`finetune.args` with only the learning rate changed. Significance: paired two-tailed t-test against "
            f"`{names[1]}` (p-values not corrected).", "",
            table, "", "Fine-tuning wall time (s, as recorded by the stage runner in `<work>/lr_dev/stages`): " + json.dumps(walls), "",
            "Commands:", "", "```", *commands, "```", ""]
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("\n".join(lines))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
