"""Benchmark: the padded encoder path (``--unpad off``) against packed rows (``--unpad on``) for a pre-training step on
this machine, on texts of Wikipedia's block lengths; what ``--unpad auto`` should be on a device without its probe.

For each length (``--lengths``) and objective (``--objectives``) a training step (forward + backward + AdamW, the
batch collated beforehand as a DataLoader worker would, packed rows included) is timed on both paths, each run in a
fresh process (``experiments/bench/objective_runs.worker``), the two paths one after the other in every round
(``--rounds``), so that the machine's drift reaches both alike. The texts' lengths are drawn from the token cache's
block-length histograms (``experiments/results/padding_share.json``, written by ``bench_padding.py``), the same texts
on both paths. Reported per path: the median step's wall and CPU seconds (``time.process_time``: on a shared machine
the CPU seconds are the steadier figure), and the packed path's time over the padded one's per round (median, range).

Usage (the recorded run; ~10 minutes on 2 cores)::

    python experiments/bench/bench_unpad.py --out experiments/results/bench_unpad_cpu.md
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # python experiments/bench/bench_unpad.py
    sys.path.insert(0, str(REPO))

from experiments.bench.objective_runs import default_model, run_one  # noqa: E402

PATHS = {"off": "padded", "on": "packed rows"}


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for length, sequences in zip(args.lengths, args.sequences):
        for name in args.objectives.split(","):
            runs: dict[str, list[dict]] = {mode: [] for mode in PATHS}
            for _ in range(args.rounds):
                for mode in PATHS:
                    ns = SimpleNamespace(model=args.model, config="checkpoint", device="cpu", length=length,
                                         sequences=sequences, steps=args.steps, warmup=args.warmup,
                                         threads=args.threads, bf16=False, unpad=mode, length_dist=str(args.length_dist))
                    r = run_one(name, ns)
                    if "error" in r:
                        raise SystemExit(f"{name} at {length} tokens, --unpad {mode}: {r['error']}")
                    runs[mode].append(r)
                    print(f"{name} {length} {PATHS[mode]}: {r['step_s']:.3f} s wall, {r['step_cpu_s']:.3f} s CPU",
                          flush=True)
            first = runs["off"][0]
            row = {"objective": name, "length": length, "sequences": first["sequences"],
                   "mean_length": first["mean_length"],
                   "padding_share": 1 - first["real_tokens_per_step"] / first["padded_tokens_per_step"]}
            for mode in PATHS:
                row[f"{mode}_wall_s"] = statistics.median(r["step_s"] for r in runs[mode])
                row[f"{mode}_cpu_s"] = statistics.median(r["step_cpu_s"] for r in runs[mode])
            for kind, key in (("wall", "step_s"), ("cpu", "step_cpu_s")):
                ratios = [on[key] / off[key] for on, off in zip(runs["on"], runs["off"])]
                row[f"ratio_{kind}"] = (statistics.median(ratios), min(ratios), max(ratios))
            rows.append(row)
    return rows


def write(out: Path, args: argparse.Namespace, argv: list[str], rows: list[dict]) -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = ["# Padded vs packed rows on the CPU (`--unpad off` / `on`)", "",
             "Command: `python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO)] + argv) + "`",
             f"Machine: {cpu}, {os.cpu_count()} cores, {args.threads} torch thread(s) per run; Python "
             f"{platform.python_version()}, torch {torch.__version__}",
             f"Model: {os.path.basename(os.path.dirname(args.model.rstrip('/'))) or args.model} (new MLM head), float32; "
             f"texts of the Wikipedia sample's block lengths (`{os.path.relpath(args.length_dist, REPO)}`); step = "
             f"forward + backward + AdamW on a batch collated beforehand; median of {args.steps} steps after "
             f"{args.warmup} warm-up, median over {args.rounds} rounds with both paths in turn. Packed/padded: the "
             "per-round ratio of the packed path's step time to the padded one's, median (range).", "",
             "| objective | length | sequences / step | mean length | padding share | padded step s (wall / CPU) | "
             "packed step s (wall / CPU) | packed / padded, wall | packed / padded, CPU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['objective']} | {r['length']} | {r['sequences']} | {r['mean_length']:.1f} | {r['padding_share']:.1%} | "
            f"{r['off_wall_s']:.3f} / {r['off_cpu_s']:.3f} | {r['on_wall_s']:.3f} / {r['on_cpu_s']:.3f} | "
            + " | ".join(f"**{m:.2f}x** ({lo:.2f}-{hi:.2f})" for m, lo, hi in (r["ratio_wall"], r["ratio_cpu"])) + " |")
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objectives", default="mlm,cpdae")
    ap.add_argument("--model", default=None, help="checkpoint (default: the local all-MiniLM-L6-v2, a new MLM head)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--sequences", type=int, nargs="+", default=[32, 16],
                    help="encoder sequences per step, one per --lengths entry")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--length-dist", type=Path, default=REPO / "experiments" / "results" / "padding_share.json")
    ap.add_argument("--out", type=Path, required=True, help="the Markdown table")
    args = ap.parse_args(argv)
    if len(args.sequences) != len(args.lengths):
        ap.error(f"--sequences needs one value per --lengths entry ({len(args.lengths)}), got {len(args.sequences)}")
    args.model = args.model or default_model()
    print(write(args.out, args, argv, measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
