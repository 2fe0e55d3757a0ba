"""Benchmark: training-step cost of every pre-training objective relative to plain MLM.

Same model, same sequence length, same token data, same masking ratio for every objective.
A training step is forward + backward + AdamW step (batch construction / masking in
``collate`` is done beforehand, as DataLoader workers would). Every objective runs in a
fresh subprocess so that its peak memory can be read in isolation (CPU: extra ``ru_maxrss``
over the process's state before the first step; CUDA: ``torch.cuda.max_memory_allocated``).

Fairness: CPDAE encodes two masked views of every text. The script gives every objective
the same number of *encoder sequences* per step (``--sequences``, default 16): CPDAE
variants get ``sequences / 2`` texts (two views each), the others ``sequences`` texts.
It reports time per sequence (the issue's "step time per sequence") and time per text
(CPDAE's per-text cost is about twice its per-sequence cost). Two sequences per text also
for ``simcse`` (two dropout passes), ``ict`` (the pseudo-query sentence and its passage;
the query is shorter: on the random data below, with almost no sentence-end tokens, it is
half the text) and ``prop`` (the two ``[CLS] word set [SEP] text [SEP]`` pairs). ``X+span``
is objective ``X`` with the span-contrast add-on (``--span-contrast-weight 1``): two more
sequences per text, each about half the text long (``retromae+span`` is "SentMAE co").

Data: every text is ``length - 2`` token ids drawn uniformly from the non-special part of
the vocabulary (fixed seed), so all sequences are full length and identical across objectives.

Besides the measured times, the table gives each objective's *forward multiply-adds per
sequence* from an analytic model (:func:`forward_macs`: the Transformer layers, the
vocabulary projections at the positions that carry a loss, the decoders) and the slowdown
that model predicts. Backward costs about twice the forward for every part, so the
predicted ratio holds for a whole step as long as the step is compute-bound; what the
model leaves out (softmax/cross-entropy over ``|V|``, LayerNorms, optimizer step, CPDAE's
pairwise JS) shows up as the gap between the two columns.

Usage::

    # CPU (the recorded run): real MiniLM-L6 weights with a new MLM head, length 128, 16 sequences
    python experiments/bench/bench_objectives.py --rounds 3 --out experiments/results/bench_objectives_cpu.md
    # CPU, the papers' model shape (random-init BERT-base config, fp32); small batch, few steps
    python experiments/bench/bench_objectives.py --config bert-base --length 512 --sequences 4 --warmup 1 --steps 3 \
        --out experiments/results/bench_objectives_cpu_bertbase.md
    # GPU: random-init BERT-base, length 512, bf16 autocast
    python experiments/bench/bench_objectives.py --device cuda --config bert-base --length 512 --bf16 --sequences 32 \
        --rounds 2 --out experiments/results/bench_objectives_gpu.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # python experiments/bench/bench_objectives.py
    sys.path.insert(0, ROOT)

from experiments.bench.objective_runs import default_model, run_one, trainer_worker, worker  # noqa: E402

ALL = ["mlm", "cpdae", "cpdae_r", "cpdae_nocl", "cpdae_idfrec", "seed", "retromae", "bow", "simcse", "ict", "prop",
       "retromae+span"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objectives", default=",".join(ALL))
    ap.add_argument("--model", default=None, help="checkpoint dir/id (default: the local all-MiniLM-L6-v2); "
                    "its tokenizer is used with --config bert-base too")
    ap.add_argument("--config", default="checkpoint", choices=["checkpoint", "bert-base"],
                    help="checkpoint: --model's weights (new MLM head); bert-base: random-init BERT-base")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--sequences", type=int, default=16, help="encoder sequences per step (texts x views)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="run all objectives this many times, interleaved; "
                    "report the median over the rounds and the range of the per-round (paired) slowdown vs mlm")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast")
    ap.add_argument("--unpad", choices=["auto", "on", "off"], default=None,
                    help="the objectives' --unpad (default: the option's default, auto)")
    ap.add_argument("--length-dist", default=None, help="draw text lengths from this block-length histogram "
                    "(experiments/results/padding_share.json) instead of full-length texts")
    ap.add_argument("--out", default=None, help="write the Markdown table here")
    ap.add_argument("--compile", action="store_true", help="worker: torch.compile every encoder layer (the "
                    "trainer's --compile); the warm-up steps compile")
    ap.add_argument("--profile-out", default=None, help="worker: after the timed steps, profile two more with "
                    "torch.profiler and write the top kernels by device time to this file")
    ap.add_argument("--trainer", action="store_true", help="worker: run the steps through pretrain.training.trainer.Trainer "
                    "(python -m pretrain's loop: DataLoader, per-step checks, accelerate) instead of the bare loop")
    ap.add_argument("--num-workers", type=int, default=0, help="worker with --trainer: the DataLoader's workers")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--objective", default="mlm", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.model = args.model or default_model()
    if args.worker:
        return trainer_worker(args) if args.trainer else worker(args)
    if args.sequences % 2:
        ap.error("--sequences must be even (CPDAE encodes two views per text)")

    names = [n for n in args.objectives.split(",") if n]
    if "mlm" not in names:
        names.insert(0, "mlm")
    rounds: dict[str, list] = {n: [] for n in names}
    for _ in range(args.rounds):
        for n in names:
            rounds[n].append(run_one(n, args))
    if any("error" in r for r in rounds["mlm"]):
        raise SystemExit(f"the mlm baseline failed: {next(r for r in rounds['mlm'] if 'error' in r)['error']}")
    ref_rounds = rounds["mlm"]
    rows = []
    for n in names:
        ok = [r for r in rounds[n] if "error" not in r]
        if len(ok) < len(rounds[n]):  # an objective that failed in any round is reported as failed
            rows.append(next(r for r in rounds[n] if "error" in r))
            continue
        row = dict(ok[0])
        for key in ("step_s", "per_seq_ms", "per_text_ms", "peak_mib"):
            row[key] = statistics.median(r[key] for r in ok)
        # the slowdown is paired within a round (mlm and the objective ran minutes apart, not hours)
        ratios = [r["per_seq_ms"] / m["per_seq_ms"] for r, m in zip(ok, ref_rounds)]
        row["ratio_med"], row["ratio_lo"], row["ratio_hi"] = statistics.median(ratios), min(ratios), max(ratios)
        rows.append(row)
    ref = next(r for r in rows if r["objective"] == "mlm")
    cmd = "python experiments/bench/bench_objectives.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
    lines = ["# Training-step cost per objective vs plain MLM", "",
             f"Command: `{cmd.strip()}`",
             f"Machine: {platform.machine()}, {os.cpu_count()}-core CPU, {_ram_gb()} GB RAM"
             + (", " + _gpu_name() if args.device.startswith("cuda") else ", no GPU used") + f"; python {platform.python_version()}",
             f"Model: {'random-init BERT-base' if args.config == 'bert-base' else args.model + ' (new MLM head)'}; "
             f"length {args.length}; {args.sequences} encoder sequences per step; "
             f"{'bf16 autocast' if args.bf16 else 'fp32'}; median of {args.steps} steps after {args.warmup} warm-up; "
             f"median over {args.rounds} interleaved rounds (slowdowns: median of the per-round ratios, range in "
             "brackets).",
             "Step = forward + backward + AdamW step. Peak = extra memory during the steps (CPU: ru_maxrss delta in a fresh "
             "subprocess; CUDA: max_memory_allocated delta). MAC model = analytic forward multiply-adds per "
             "sequence (`forward_macs` in the script) and the per-sequence slowdown they predict.", "",
             "| objective | texts | sequences | step (s) | ms / sequence | ms / text | per-sequence slowdown vs mlm | "
             "per-text slowdown vs mlm | GMAC / sequence (model) | slowdown predicted by the MAC model | "
             "peak extra memory (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['objective']} | skipped: {r['error'][:120]} | | | | | | | | | |")
            continue
        lines.append(f"| {r['objective']} | {r['texts']} | {r['sequences']} | {r['step_s']:.3f} | {r['per_seq_ms']:.1f} | "
                     f"{r['per_text_ms']:.1f} | {r['ratio_med']:.2f}x ({r['ratio_lo']:.2f}-{r['ratio_hi']:.2f}) | "
                     f"{r['ratio_med'] * r['sequences'] / r['texts']:.2f}x | {r['macs_per_seq'] / 1e9:.2f} | "
                     f"{r['macs_per_seq'] / ref['macs_per_seq']:.2f}x | {r['peak_mib']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"



def _ram_gb() -> int:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)


if __name__ == "__main__":
    main()
