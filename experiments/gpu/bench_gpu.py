"""GPU throughput against the card's limits: encoding, exact search and pre-training.

Every figure is printed as a ratio in the same run and written with the GPU's name and the command:

* ``encode``: a BERT-base-shape and a MiniLM-shape model (``--encode-shapes``) with random weights (:mod:`synthetic_bert`) encodes synthetic documents of
  exactly 128/256/512 tokens, and of MS MARCO-like lengths (mean ~70 tokens; there also CPDAE's padded
  text-count path, ``batch_tokens=0, unpad=False``, beside its default), with ``CPDAE.doc_encoder()`` in bf16;
  docs/s, real tokens/s and model FLOP utilisation (MFU: ``2 x forward multiply-adds`` of each document at its
  real length, from ``experiments/bench/objective_runs.forward_macs``, over the peak), against
  sentence-transformers' ``encode`` on the same weights in fp32 and in bf16, and the vectors' agreement (cosine);
  the time to encode MS MARCO's 8.8M passages at each length is extrapolated.
* ``search``: exact top-k with the project's ``torch_search`` (the kernel of ``DenseIndex.torch_retriever``) over
  a synthetic fp16 index held in host memory and streamed to the device in chunks, queries/s against the bounds
  of the card (bytes of the index over the measured HBM and host-to-device bandwidths; ``2 x N x D`` FLOPs per
  query over the measured matmul peak); an index-resident reference (plain torch: fp16 matmul + top-k with the
  whole index on the device) shows what the card reaches without streaming.
* ``pretrain``: ``objective_runs.run_one`` per objective (forward + backward + AdamW, bf16 autocast) at the
  given shape; sequences/s, MFU (``6 x forward multiply-adds`` per sequence) and the cost per sequence relative
  to MLM. Then ``--unpad-objectives`` (MLM and CPDAE) on texts of Wikipedia's real block lengths
  (``--length-dist``), the padded path (``--unpad off``) beside the unpadded one (``on``) in the same run: real
  tokens/s, MFU counting the real tokens only (the MLM head at the masked share of them) on the measured and the
  datasheet peak, the padded path's MFU counting its padded work too, and the unpadded path's speed-up.
  The unpadded rows run packed rows laid out by the collate on the host (``pretrain/data/packing.py``).
  Last, ``--trainer-objectives`` (MLM) through ``pretrain.training.trainer.Trainer``, the loop ``python -m pretrain`` runs
  (DataLoader, per-step checks, accelerate), on the same length distribution, once per ``--trainer-unpad`` mode
  (``auto``: the probe times both paths on the first batch and keeps the faster, recorded with its times; ``on``:
  packed rows): its real tokens/s, MFU and share of the bare loop's row of the path it ran (``vs_loop``).

Peaks are *measured* in the same run (a large bf16 / fp32 matmul, a device-to-device copy, a pinned
host-to-device copy) and, where the card is known, also given as the datasheet figure.

Usage::

    python experiments/gpu/bench_gpu.py --out OUT                 # on the GPU, full sizes
    python experiments/gpu/bench_gpu.py --cpu-smoke --out OUT     # tiny sizes on the CPU (tested in CI)
    python experiments/gpu/bench_gpu.py --only search --out OUT   # one part (to fit a 10-minute command limit)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE), str(HERE.parent)]

from synthetic_bert import BERT_BASE, MINILM, TINY, make_bert_dir, synthetic_texts  # noqa: E402
from experiments.bench.objective_runs import encode_flops  # noqa: E402

SHAPES = {"bert-base": BERT_BASE, "minilm": MINILM, "tiny": TINY}

MSMARCO_PASSAGES = 8_841_823
#: datasheet dense bf16 tensor-core peaks (FLOP/s) and HBM bandwidths (B/s) of the SXM parts
DATASHEET = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "A100": (312e12, 2.0e12)}
SMOKE = dict(encode_shapes="tiny", lengths=[16, 32], docs=32, stream_docs=96, batch_size=16, size=20_000, dim=64, queries=64, k=100, chunk_size=4096,
             seq_length=32, sequences=4, steps=1, warmup=1, objectives="mlm,cpdae,bow", repeats=1,
             unpad_objectives="mlm,cpdae", compile_objectives="", trainer_objectives="mlm", trainer_workers=0,
             trainer_unpad="auto")
FULL = dict(encode_shapes="bert-base,minilm", lengths=[128, 256, 512], docs=4096, stream_docs=65536, batch_size=256, size=MSMARCO_PASSAGES, dim=768, queries=1000,
            k=1000, chunk_size=None, seq_length=512, sequences=32, steps=5, warmup=2,
            objectives="mlm,cpdae,cpdae_r,cpdae_nocl,cpdae_idfrec,seed,retromae,bow", repeats=2,
            unpad_objectives="mlm,cpdae", compile_objectives="mlm", trainer_objectives="mlm", trainer_workers=0,
            trainer_unpad="auto,on,off+compile")


def sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], object], dev, repeats: int) -> float:
    """Median wall time of ``repeats`` calls after one warm-up."""
    return timed_in_turn({"fn": fn}, dev, repeats)["fn"]


def timed_in_turn(fns: Dict[str, Callable[[], object]], dev, repeats: int) -> Dict[str, float]:
    """Median wall time of each of ``fns`` over ``repeats`` rounds, every round calling each once in turn (after one
    warm-up round), so that a drift of the host or the card during the run reaches every system alike rather than
    whichever was timed at that moment (timed each in its own block, two systems running the same code measured up
    to 1.45x apart: experiments/results/gpu/h200/fp16_search_compiled_mlm/README.md)."""
    for fn in fns.values():
        fn()
    times: Dict[str, list] = {label: [] for label in fns}
    for _ in range(repeats):
        for label, fn in fns.items():
            sync(dev)
            t0 = time.perf_counter()
            fn()
            sync(dev)
            times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(t) for label, t in times.items()}


def device_info(dev) -> Dict[str, object]:
    import torch

    info = {"device": str(dev), "torch": torch.__version__, "python": platform.python_version(),
            "cpu": f"{os.cpu_count()} cores {platform.machine()}"}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    else:
        info["gpu"] = "none (CPU run)"
    return info


def measure_peaks(dev, smoke: bool) -> Dict[str, float]:
    """Measured limits: bf16 and fp32 matmul FLOP/s, device copy B/s (read + write), pinned host-to-device B/s."""
    import torch

    n = 512 if smoke else 8192
    out: Dict[str, float] = {}
    for name, dtype in (("bf16_flops", torch.bfloat16), ("fp32_flops", torch.float32)):
        a = torch.randn(n, n, device=dev, dtype=dtype)
        b = torch.randn(n, n, device=dev, dtype=dtype)
        t = timed(lambda: a @ b, dev, 3 if smoke else 10)
        out[name] = 2 * n ** 3 / t
    nbytes = (8 << 20) if smoke else (2 << 30)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    out["device_copy_Bps"] = 2 * nbytes / timed(lambda: dst.copy_(src), dev, 3 if smoke else 10)
    if dev.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        out["host_to_device_Bps"] = nbytes / timed(lambda: src.copy_(host, non_blocking=True), dev, 10)
        name = torch.cuda.get_device_name(dev)
        for key, (flops, bw) in DATASHEET.items():
            if key in name:
                out["datasheet_bf16_flops"], out["datasheet_hbm_Bps"] = flops, bw
    return out


# --------------------------------------------------------------------------------------------- encoding
#: MS MARCO-like passage lengths in word pieces (a log-normal with a mean of ~70 tokens, [CLS]/[SEP] included)
VARIED_MEDIAN, VARIED_SIGMA, VARIED_MIN = 62, 0.5, 8


def varied_lengths(n: int, longest: int, seed: int = 0) -> np.ndarray:
    """``n`` token counts ([CLS]/[SEP] included) drawn MS MARCO-like (mean ~70), cut to ``[VARIED_MIN, longest]``."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(VARIED_MEDIAN), VARIED_SIGMA, size=n)), VARIED_MIN, longest).astype(int)


def bench_encode(args, dev, peaks, model_dir: str, shape: dict, shape_name: str = "bert-base") -> Dict[str, object]:
    """Per maximum length: documents of exactly that many tokens (``fixed``), and once MS MARCO-like lengths
    (``varied``, cut at the largest length), where CPDAE's default (token-budget batches, unpadded where the
    varlen kernel runs) is timed beside its padded text-count path (``batch_tokens=0, unpad=False``).  Throughput
    is texts/s and real tokens/s; MFU counts the FLOPs of the real tokens only."""
    import pandas as pd
    import torch
    from sentence_transformers import SentenceTransformer

    from pyterrier_cpdae.encoder import CPDAE

    V = shape["vocab_size"]
    cases = [("fixed", length) for length in args.lengths] + [("varied", max(args.lengths))]
    rows = []
    for dist, length in cases:
        texts = synthetic_texts(args.docs, length - 2, V, seed=length)
        if dist == "varied":
            texts = [" ".join(t.split()[:n - 2]) for t, n in zip(texts, varied_lengths(args.docs, length, seed=length))]
        frame = pd.DataFrame({"docno": [str(i) for i in range(len(texts))], "text": texts})
        common = dict(pooling="mean", normalize=False, doc_max_length=length, batch_size=args.batch_size,
                      device=str(dev), dtype="bf16")
        encoder = CPDAE.from_pretrained(model_dir, **common)
        lengths = np.array([len(x) for x in encoder.tokenizer(texts, truncation=True, max_length=length)["input_ids"]])
        systems = {"cpdae_bf16": encoder.doc_encoder()}
        if dist == "varied":
            rest = {k: v for k, v in common.items() if k not in ("device", "pooling")}
            systems["cpdae_padded_bf16"] = CPDAE(encoder.model, encoder.tokenizer, batch_tokens=0, unpad=False,
                                                 pooling="mean", **rest).doc_encoder()
            # [CLS] pooling (CPDAE's own): the last layer at [CLS] only (default) beside the full last layer, in the
            # default (packed where the kernel runs) batches and in padded text-count batches
            for suffix, batching in (("", {}), ("_padded", {"batch_tokens": 0, "unpad": False})):
                for layer, trim in (("", None), ("_full", False)):
                    systems[f"cpdae_cls{suffix}{layer}_bf16"] = CPDAE(
                        encoder.model, encoder.tokenizer, pooling="cls", cls_last_layer=trim, **batching,
                        **rest).doc_encoder()
        vecs: Dict[str, np.ndarray] = {}
        fns: Dict[str, Callable[[], object]] = {}
        for label, stage in systems.items():
            def ours(stage=stage, label=label):
                vecs[label] = np.stack(stage(frame)["doc_vec"].tolist())
            fns[label] = ours
        unpadded = encoder._packing_kernel(encoder.model) is not None
        for label, dtype in (("st_fp32", torch.float32), ("st_bf16", torch.bfloat16)):
            st = SentenceTransformer(model_dir, device=str(dev), trust_remote_code=False)
            st.max_seq_length = length
            st.to(dtype)

            def run(st=st, label=label):
                vecs[label] = np.asarray(st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True),
                                         dtype=np.float32)
            fns[label] = run
        times = timed_in_turn(fns, dev, args.repeats)
        del fns
        flops = encode_flops(lengths, shape)
        t_ours = times["cpdae_bf16"]
        rate = args.docs / t_ours
        ref = vecs["st_fp32"]
        cos = np.sum(vecs["cpdae_bf16"] * ref, 1) / (np.linalg.norm(vecs["cpdae_bf16"], axis=1) * np.linalg.norm(ref, axis=1))
        budget = encoder.token_budget(length)
        row = {"shape": shape_name, "tokens": length, "lengths": dist, "real_tokens_per_doc": float(lengths.mean()),
               "docs": args.docs, "batch_size": args.batch_size, "batch_tokens": budget if budget else 0,
               "unpadded": unpadded, "cpdae_bf16_docs_per_s": rate,
               "cpdae_bf16_real_tokens_per_s": float(lengths.sum()) / t_ours,
               "mfu_vs_measured_bf16": flops / t_ours / peaks["bf16_flops"],
               "gflop_per_doc": flops / args.docs / 1e9,
               "st_fp32_docs_per_s": args.docs / times["st_fp32"], "st_bf16_docs_per_s": args.docs / times["st_bf16"],
               "speedup_vs_st_fp32": times["st_fp32"] / t_ours, "speedup_vs_st_bf16": times["st_bf16"] / t_ours,
               "min_cosine_cpdae_bf16_vs_st_fp32": float(cos.min()),
               "msmarco_8.8M_minutes": MSMARCO_PASSAGES / rate / 60}
        if "datasheet_bf16_flops" in peaks:
            row["mfu_vs_datasheet"] = flops / t_ours / peaks["datasheet_bf16_flops"]
        if "cpdae_padded_bf16" in times:
            t_pad = times["cpdae_padded_bf16"]
            row.update(padded_docs_per_s=args.docs / t_pad, padded_real_tokens_per_s=float(lengths.sum()) / t_pad,
                       padded_mfu_vs_measured_bf16=flops / t_pad / peaks["bf16_flops"],
                       speedup_vs_padded=t_pad / t_ours)
        if "cpdae_cls_bf16" in times:
            a, b = vecs["cpdae_cls_bf16"], vecs["cpdae_cls_full_bf16"]
            cls_cos = np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
            row.update(cls_docs_per_s=args.docs / times["cpdae_cls_bf16"],
                       cls_full_layer_docs_per_s=args.docs / times["cpdae_cls_full_bf16"],
                       cls_speedup_of_trimmed_last_layer=times["cpdae_cls_full_bf16"] / times["cpdae_cls_bf16"],
                       cls_min_cosine_trimmed_vs_full=float(cls_cos.min()),
                       cls_padded_docs_per_s=args.docs / times["cpdae_cls_padded_bf16"],
                       cls_padded_full_layer_docs_per_s=args.docs / times["cpdae_cls_padded_full_bf16"])
            print(f"encode {shape_name} {dist} {length} tokens, [CLS] pooling: last layer at [CLS] only "
                  f"{row['cls_docs_per_s']:.1f} docs/s, full last layer {row['cls_full_layer_docs_per_s']:.1f} "
                  f"({row['cls_speedup_of_trimmed_last_layer']:.2f}x); padded batches: "
                  f"{row['cls_padded_docs_per_s']:.1f} / {row['cls_padded_full_layer_docs_per_s']:.1f} docs/s; "
                  f"min cosine {cls_cos.min():.5f}", flush=True)
        rows.append(row)
        extra = (f", padded path {row['padded_docs_per_s']:.1f} docs/s ({row['speedup_vs_padded']:.2f}x)"
                 if "padded_docs_per_s" in row else "")
        print(f"encode {shape_name} {dist} {length} tokens (real {row['real_tokens_per_doc']:.1f}/doc, "
              f"{'unpadded' if unpadded else 'padded'}): {rate:.1f} docs/s, "
              f"{row['cpdae_bf16_real_tokens_per_s']:.0f} real tokens/s, MFU {row['mfu_vs_measured_bf16']:.1%} of "
              f"measured bf16 (real tokens){extra}, {row['speedup_vs_st_fp32']:.2f}x ST fp32, "
              f"{row['speedup_vs_st_bf16']:.2f}x ST bf16, min cosine {row['min_cosine_cpdae_bf16_vs_st_fp32']:.5f}, "
              f"MS MARCO {row['msmarco_8.8M_minutes']:.1f} min", flush=True)
        if dist == "varied" and args.stream_docs:
            row.update(stream_row(args, dev, peaks, encoder, model_dir, shape, length))
        del systems, encoder
    return {"model": {k: shape[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")},
            "rows": rows}


def stream_row(args, dev, peaks, encoder, model_dir: str, shape: dict, length: int) -> Dict[str, object]:
    """The indexing path at the encoder's defaults: ``--stream-docs`` MS MARCO-like records through
    ``(doc_encoder() >> indexer).index(...)`` with an indexer that keeps nothing (PyTerrier hands the encoder chunks
    of ``STREAM_WINDOWS`` sorting windows on CUDA; within a chunk the next window is read and tokenized while the
    device encodes this one) beside sentence-transformers' bf16 ``encode`` of the same texts; one timed pass each,
    after the row's systems have warmed the model and the allocator."""
    import torch
    from sentence_transformers import SentenceTransformer

    n = args.stream_docs
    texts = synthetic_texts(n, length - 2, shape["vocab_size"], seed=length + 1)
    texts = [" ".join(t.split()[:m - 2]) for t, m in zip(texts, varied_lengths(n, length, seed=length + 1))]
    lengths = np.array([len(x) for x in encoder.tokenizer(texts, truncation=True, max_length=length)["input_ids"]])
    import pyterrier as pt

    class Drain(pt.Indexer):  # an indexer that keeps nothing: the pipeline's cost is the encoder's
        def index(self, it):
            for _ in it:
                pass

    pipeline = encoder.doc_encoder() >> Drain()

    def ours():  # as `(enc >> index.indexer()).index(corpus)`: PyTerrier's Compose.index chunks by the stage's batch_size
        pipeline.index({"docno": str(i), "text": t} for i, t in enumerate(texts))
    st = SentenceTransformer(model_dir, device=str(dev), trust_remote_code=False)
    st.max_seq_length = length
    st.to(torch.bfloat16)
    times = timed_in_turn({"ours": ours, "st": lambda: st.encode(texts, batch_size=args.batch_size)}, dev, 1)
    flops = encode_flops(lengths, shape)
    out = {"stream_docs": n, "stream_windows": -(-n // (encoder.batch_size * encoder.sort_window)),
           "stream_docs_per_s": n / times["ours"], "stream_real_tokens_per_s": float(lengths.sum()) / times["ours"],
           "stream_mfu_vs_measured_bf16": flops / times["ours"] / peaks["bf16_flops"],
           "stream_st_bf16_docs_per_s": n / times["st"], "stream_speedup_vs_st_bf16": times["st"] / times["ours"]}
    print(f"encode streamed, {n} records in {out['stream_windows']} windows: {out['stream_docs_per_s']:.1f} docs/s, "
          f"MFU {out['stream_mfu_vs_measured_bf16']:.1%}, {out['stream_speedup_vs_st_bf16']:.2f}x ST bf16", flush=True)
    return out


# --------------------------------------------------------------------------------------------- search
def bench_search(args, dev, peaks) -> Dict[str, object]:
    """Exact search over a synthetic fp16 index: the project's ``torch_search`` streamed from pageable host memory,
    from a page-locked host copy, and held on the device, each in float16 with the proof of the float32 ranking
    (``precision="fp16"``, the CUDA default) and, held on the device, in float32 (the kernel before); a plain torch
    fp16 reference (not exact). Rankings are compared in the same run. ``streamed_default``: the streamed path a
    ``torch_retriever()`` takes by default with this index on this host (``pinned=None``, ``store.pin_on_host``)."""
    import torch

    from pyterrier_cpdae.dense.kernels import torch_search

    n, d, q, k = args.size, args.dim, args.queries, args.k
    # the index: fp16 in host memory (generated on the device in slices: fast even for 8.8M x 768)
    index = np.empty((n, d), dtype=np.float16)
    g = torch.Generator(device=dev).manual_seed(0)
    step = 1 << 20
    for s in range(0, n, step):
        m = min(step, n - s)
        index[s:s + m] = torch.randn(m, d, device=dev, generator=g).half().cpu().numpy()
    queries = np.random.default_rng(1).standard_normal((q, d)).astype(np.float32)
    kw = {} if args.chunk_size is None else {"chunk_size": args.chunk_size}
    results: Dict[str, Dict[str, np.ndarray]] = {}
    row: Dict[str, object] = {"docs": n, "dim": d, "dtype": "float16", "queries": q, "k": k,
                              "index_gib": index.nbytes / 2**30}

    def search(name, parts, **extra):
        stats: Dict[str, int] = {}
        out: Dict[str, np.ndarray] = {}

        def run():
            stats.clear()
            out.update(zip(("s", "i"), torch_search(parts, queries, k, device=dev, stats=stats, **kw, **extra)))
        t = timed(run, dev, args.repeats)
        results[name] = out
        row[f"{name}_qps"] = q / t
        row[f"{name}_s"] = t
        if stats:
            row[f"{name}_retried"] = stats.get("retried", 0)
            row[f"{name}_fp32_fallback"] = stats.get("fp32", 0)
        print(f"search {name}: {q / t:.1f} queries/s {stats}", flush=True)

    # bounds: one pass over the index per query batch (query_batch_size 4096 >= queries) and 2*N*D FLOPs a query
    batches = -(-q // 4096)
    t_hbm = batches * index.nbytes / (peaks["device_copy_Bps"] / 2)  # copy counts read + write
    t_flops = 2 * n * d * q / peaks["bf16_flops"]
    row.update(bound_hbm_qps=q / t_hbm, bound_compute_qps=q / t_flops)
    row["tighter_bound_qps"] = min(row["bound_hbm_qps"], row["bound_compute_qps"])
    row["bound_fp32_compute_qps"] = q / (2 * n * d * q / peaks["fp32_flops"]) if "fp32_flops" in peaks else None
    if "host_to_device_Bps" in peaks:
        row["bound_host_to_device_qps"] = q / (batches * index.nbytes / peaks["host_to_device_Bps"])
    search("streamed", [(index, 0, 1)], precision="fp16")  # pageable numpy: threads copy chunks into pinned buffers
    row["streamed_vs_tighter_bound"] = row["streamed_qps"] / row["tighter_bound_qps"]
    # where a streamed pass's host time goes: the copy of every chunk into a pinned buffer, one thread vs the kernel's
    from pyterrier_cpdae.dense.kernels import MAX_COPY_THREADS, _ChunkStager

    chunk_rows = max(1, (1 << 30) // (2 * d)) if dev.type == "cuda" else max(1, (64 << 20) // (4 * d))
    row["chunk_rows"] = args.chunk_size or chunk_rows
    buf = torch.empty((chunk_rows, d), dtype=torch.float16)
    if dev.type == "cuda":
        buf = buf.pin_memory()
    for threads in (1, MAX_COPY_THREADS):
        stager = _ChunkStager(dev, chunk_rows, d, pinned=dev.type == "cuda", copy_threads=threads)

        def host_copy():
            for s in range(0, n, chunk_rows):
                m = min(chunk_rows, n - s)
                stager._fill(buf[:m].numpy(), index[s:s + m])
        row[f"host_copy_{threads}_threads_s"] = timed(host_copy, dev, 1)
        stager.close()
    del buf
    if dev.type == "cuda":  # a page-locked host copy of the index: chunks are sent from it, no host copy
        t0 = time.perf_counter()
        pinned = torch.from_numpy(index).pin_memory()
        row["pinned_copy_s"] = time.perf_counter() - t0  # once per build, at the first search
        search("streamed_pinned", [(pinned, 0, 1)], precision="fp16")
        del pinned
    # what a streamed torch_retriever() does by default with this index on this host (pinned=None: pin_on_host)
    from pyterrier_cpdae.dense.store import pins_by_default

    row["streamed_default"] = "streamed_pinned" if pins_by_default(index.nbytes, dev) else "streamed"
    row["streamed_default_qps"] = row.get(f"{row['streamed_default']}_qps")
    for name in ("streamed", "streamed_pinned", "streamed_default"):
        if row.get(f"{name}_qps") and row.get("bound_host_to_device_qps"):
            row[f"{name}_vs_host_to_device_bound"] = row[f"{name}_qps"] / row["bound_host_to_device_qps"]
    free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else float("inf")
    max_norm = None
    if index.nbytes < 0.6 * free:
        resident = torch.from_numpy(index).to(dev)
        search("resident", [(resident, 0, 1)], precision="fp16")  # torch_retriever(resident=True): fp16, proved
        search("resident_fp32", [(resident, 0, 1)], precision="fp32")  # the kernel before: every score in fp32
        qd = torch.from_numpy(queries).to(dev, torch.float16 if dev.type == "cuda" else torch.float32)
        res_idx = resident if dev.type == "cuda" else resident.float()
        sl = max(k, (1 << 30) // (2 * q)) if dev.type == "cuda" else max(k, row["chunk_rows"])

        def resident_search():
            best_s = best_i = None
            with torch.no_grad():
                for s in range(0, n, sl):
                    sc, ix = (qd @ res_idx[s:s + sl].T).float().topk(min(k, min(sl, n - s)), dim=1)
                    ix = ix + s
                    if best_s is not None:
                        sc, sel = torch.cat([best_s, sc], 1).topk(k, dim=1)
                        ix = torch.cat([best_i, ix], 1).gather(1, sel)
                    best_s, best_i = sc, ix
            return best_i
        top = resident_search()
        t_res = timed(resident_search, dev, args.repeats)
        row["reference_fp16_not_exact_qps"] = q / t_res
        row["top10_overlap_reference_vs_exact"] = float(np.mean(
            [len(set(a[:10]) & set(b[:10])) / 10 for a, b in zip(results["resident"]["i"], top.cpu().numpy())]))
        row["resident_vs_tighter_bound"] = row["resident_qps"] / row["tighter_bound_qps"]
        row["resident_vs_resident_fp32"] = row["resident_qps"] / row["resident_fp32_qps"]
        if args.search_sweep:  # the resident fp16 kernel's two knobs: float16 scores per chunk, block width
            from pyterrier_cpdae.dense import certified, kernels

            saved = (kernels.RESIDENT_FP16_SCORE_BYTES, certified.BLOCK)
            sweep = []
            try:
                for gib in (2, 8):
                    for block in (16, 32, 64):
                        kernels.RESIDENT_FP16_SCORE_BYTES, certified.BLOCK = gib << 30, block
                        out: Dict[str, np.ndarray] = {}
                        t = timed(lambda: out.update(zip(("s", "i"), torch_search(
                            [(resident, 0, 1)], queries, k, device=dev, precision="fp16"))), dev, args.repeats)
                        sweep.append({"score_gib": gib, "block": block, "qps": q / t,
                                      "ids_equal_resident": bool(np.array_equal(out["i"], results["resident"]["i"]))})
                        print(f"search sweep: {sweep[-1]}", flush=True)
            finally:
                kernels.RESIDENT_FP16_SCORE_BYTES, certified.BLOCK = saved
            row["sweep"] = json.dumps(sweep)
        if args.out is not None and dev.type == "cuda":  # where the resident fp16 search's time goes
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                torch_search([(resident, 0, 1)], queries, k, device=dev, precision="fp16")
                torch.cuda.synchronize()
            (args.out / "profile_search_resident_fp16.txt").write_text(
                "resident fp16 search, 1,000 queries, sorted by self CUDA time\n"
                + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25) + "\n")
        max_norm = float(torch.linalg.vector_norm(resident, dim=1, dtype=torch.float32).max())
        del resident, res_idx
    # exactness in the same run: every path's ids against the float32 kernel's (held) or the streamed fp16 one
    base = results.get("resident_fp32", results["streamed"])
    if max_norm is None:
        max_norm = float(np.linalg.norm(index.astype(np.float32), axis=1).max())
    # two float32 sums of the same 768 products in different orders differ by at most ~2 D u |q| max|d|
    tol = (2 * d * 2.0 ** -24 * np.linalg.norm(queries, axis=1) * max_norm)[:, None]
    for name, out in results.items():
        differ = out["i"] != base["i"]
        row[f"{name}_positions_differing"] = int(differ.sum())
        row[f"{name}_differing_beyond_fp32_order"] = int((differ & (np.abs(out["s"] - base["s"]) > tol)).sum())
        # the same documents in each top-k except where the k-th scores are within the summation tolerance
        row[f"{name}_sets_differ"] = int(sum(set(a) != set(b) for a, b in zip(out["i"], base["i"])))
        row[f"{name}_ids_equal_fp32"] = bool(np.array_equal(out["i"], base["i"]))
        # a GPU's float32 sums in another order may swap two scores equal to the last bits: not counted here
        differ = (out["i"] != base["i"]) & (np.abs(out["s"] - base["s"]) > 4e-7 * np.abs(base["s"]).max())
        row[f"{name}_ids_equal_fp32_up_to_ulp_ties"] = not bool(differ.any())
        row[f"{name}_max_score_diff"] = float(np.abs(out["s"] - base["s"]).max())
    print("search: " + ", ".join(f"{k_}={v:.4g}" if isinstance(v, float) else f"{k_}={v}" for k_, v in row.items()),
          flush=True)
    return {"rows": [row]}


# --------------------------------------------------------------------------------------------- pre-training
def bench_pretrain(args, dev, peaks, model_dir: str, smoke: bool,
                   partial: Optional[Callable[[Dict[str, object]], None]] = None) -> Dict[str, object]:
    """The pre-training rows (see the module's docstring); ``partial(result so far)`` is called after each group of
    rows, so that the rows finished before a deadline are on disk."""
    from experiments.bench import objective_runs as bench_objectives

    ns = SimpleNamespace(model=model_dir, config="checkpoint", device=str(dev), length=args.seq_length,
                         sequences=args.sequences, steps=args.steps, warmup=args.warmup, threads=0,
                         bf16=True)
    rows = []
    for name in args.objectives.split(","):
        if smoke:  # in this process: a subprocess per objective (peak-memory isolation) costs seconds each
            r = in_process(bench_objectives.worker, name, ns)
        else:
            r = bench_objectives.run_one(name, ns)
        if "error" not in r:
            seq_per_s = r["sequences"] / r["step_s"]
            r["sequences_per_s"] = seq_per_s
            r["mfu_vs_measured_bf16"] = seq_per_s * 6 * r["macs_per_seq"] / peaks["bf16_flops"]
            if "datasheet_bf16_flops" in peaks:
                r["mfu_vs_datasheet"] = seq_per_s * 6 * r["macs_per_seq"] / peaks["datasheet_bf16_flops"]
        rows.append(r)
        print(f"pretrain {name}: " + (r["error"] if "error" in r else
              f"{r['sequences_per_s']:.2f} seq/s, MFU {r['mfu_vs_measured_bf16']:.1%}"), flush=True)
    ref = next((r for r in rows if r["objective"] == "mlm" and "error" not in r), None)
    for r in rows:
        if ref is not None and "error" not in r:
            r["cost_per_sequence_vs_mlm"] = r["per_seq_ms"] / ref["per_seq_ms"]
    result = {"length": args.seq_length, "sequences_per_step": args.sequences, "bf16": True, "rows": rows,
              "unpad_rows": [], "trainer_rows": []}
    for key, fn in (("unpad_rows", lambda: bench_unpad(args, ns, peaks, smoke) if args.unpad_objectives else []),
                    ("trainer_rows", lambda: bench_trainer(args, ns, peaks, result["unpad_rows"], smoke)
                     if args.trainer_objectives else [])):
        if partial is not None:
            partial(result)
        result[key] = fn()
    return result


def in_process(worker: Callable[[SimpleNamespace], None], name: str, run: SimpleNamespace) -> Dict[str, object]:
    """One row of the CPU smoke run: ``worker`` (``objective_runs.worker`` or ``trainer_worker``, which print their
    row as the last line of JSON) on objective ``name`` in this process; an exception becomes the row's error."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            worker(SimpleNamespace(**vars(run), objective=name))
        return json.loads(buf.getvalue().strip().splitlines()[-1])
    except Exception as e:
        return {"objective": name, "error": f"{type(e).__name__}: {e}"}


def bench_trainer(args, ns, peaks, unpad_rows: List[Dict[str, object]], smoke: bool = False) -> List[Dict[str, object]]:
    """``--trainer-objectives`` through ``pretrain.training.trainer.Trainer`` (``python -m pretrain``'s loop: DataLoader with
    ``--trainer-workers`` workers, collate, the per-step finite checks, accelerate's bf16 autocast, the schedule) on
    texts of the same length distribution as the rows of :func:`bench_unpad`, not compiled, once per
    ``--trainer-unpad`` mode (``auto``, the option's default: on CUDA the probe picks the path, recorded as ``unpad``
    with ``unpad_probe_s_per_step``; ``on``: packed rows; a mode with ``+compile``, e.g. ``off+compile``: the
    Trainer's ``--compile`` too, with the graphs its steps compiled, ``compiled_graphs``): real tokens/s and MFU
    counted as there, and the share of the bare loop's speed on the same path it keeps (``vs_loop``: against the
    padded, unpadded or compiled padded row) -- what a user's run gets of the figures above."""
    from experiments.bench import objective_runs as bench_objectives

    rows: List[Dict[str, object]] = []
    for name in args.trainer_objectives.split(","):
        for option in [m for m in (args.trainer_unpad or "auto").split(",") if m]:
            mode, compiled = option.removesuffix("+compile"), option.endswith("+compile")
            run = SimpleNamespace(**{**vars(ns), "compile": compiled}, length_dist=str(args.length_dist), trainer=True,
                                  num_workers=args.trainer_workers, unpad=mode)
            if smoke:  # in this process, as the other smoke rows: the last rows of the run, so the state accelerate
                # leaves behind reaches nothing after them (the subprocess's command line: tests/experiments/bench/test_objective_runs_trainer_row.py)
                r = in_process(bench_objectives.trainer_worker, name, run)
            else:
                r = bench_objectives.run_one(name, run)  # a process of its own: accelerate's state stays out of this one
            r.setdefault("objective", name)
            r["path"] = (f"Trainer, {args.trainer_workers} loader workers" + ("" if mode == "auto" else f", --unpad {mode}")
                         + (", --compile" if compiled else ""))
            if "error" not in r:
                add_real_work_rates(r, peaks)
                for path, seconds in (r.get("unpad_probe_s_per_step") or {}).items():  # the probe's times, flat
                    r[f"probe_{path}_ms"] = 1000 * seconds
                ran = ("unpadded" if r.get("unpad") == "on" else "padded") + ("_compiled" if compiled else "")  # (resolved)
                loop = next((u for u in unpad_rows if u.get("objective") == name and u.get("path") == ran
                             and "error" not in u), None)
                if loop is not None:  # per real token: the two runs' batches hold other texts of the same lengths
                    r["vs_loop"] = r["real_tokens_per_s"] / loop["real_tokens_per_s"]
                    r["vs_loop_row"] = ran
            rows.append(r)
            print(f"pretrain {name} {r['path']}: " + (r["error"] if "error" in r else
                  f"{r['sequences_per_s']:.2f} seq/s, {r['real_tokens_per_s']:.0f} real tokens/s, MFU (real tokens) "
                  f"{r['mfu_real_vs_measured_bf16']:.1%}, --unpad {r.get('unpad')}"
                  + (f", {r['compiled_graphs']} graphs compiled" if r.get("compiled_graphs") is not None else "")
                  + (f", {r['vs_loop']:.2f}x the bare loop" if "vs_loop" in r else "")), flush=True)
    return rows


def add_real_work_rates(r: Dict[str, object], peaks: Dict[str, float]) -> None:
    """A pre-training row's rates from its step time and the work it counted: sequences/s, real tokens/s, the padding
    share and MFU counting the real work only (``6 x real_macs_per_step``) on the measured and the datasheet peak."""
    r["sequences_per_s"] = r["sequences"] / r["step_s"]
    r["real_tokens_per_s"] = r["real_tokens_per_step"] / r["step_s"]
    r["padding_share"] = 1 - r["real_tokens_per_step"] / r["padded_tokens_per_step"]
    for label, peak in (("measured_bf16", peaks["bf16_flops"]), ("datasheet", peaks.get("datasheet_bf16_flops"))):
        if peak:
            r[f"mfu_real_vs_{label}"] = 6 * r["real_macs_per_step"] / r["step_s"] / peak


def bench_unpad(args, ns, peaks, smoke: bool) -> List[Dict[str, object]]:
    """The padded and the unpadded path (``--unpad off`` / ``on``) of ``--unpad-objectives`` on texts whose lengths
    follow Wikipedia's block lengths (``--length-dist``, recorded by ``experiments/bench/bench_padding.py``), in the
    same run. MFU counts the work the objective needs only: each sequence at its real length, the MLM head at the
    masked share of its tokens (``real_macs_per_step``); the padded row also gives its MFU counting the padded
    work it does (``mfu_padded_work_vs_measured_bf16``)."""
    from experiments.bench import objective_runs as bench_objectives

    rows: List[Dict[str, object]] = []
    compiled = set(filter(None, (args.compile_objectives or "").split(",")))
    for name in args.unpad_objectives.split(","):
        for mode in ("off", "on") + (("compile",) if name in compiled else ()):
            label = {"on": "unpadded", "off": "padded", "compile": "padded_compiled"}[mode]
            run = SimpleNamespace(**vars(ns), unpad="off" if mode == "compile" else mode,
                                  length_dist=str(args.length_dist), compile=mode == "compile",
                                  profile_out=str(args.out / f"profile_{name}_{label}.txt"),
                                  profile_steps=1 if smoke else 2)  # (a profiled step's table: ~0.4 CPU-s here)
            if smoke:
                r = in_process(bench_objectives.worker, name, run)
            else:
                r = bench_objectives.run_one(name, run)
            r["path"] = label
            if "error" not in r:
                add_real_work_rates(r, peaks)
                if mode != "on":
                    r["mfu_padded_work_vs_measured_bf16"] = 6 * r["padded_macs_per_step"] / r["step_s"] / peaks["bf16_flops"]
            rows.append(r)
            print(f"pretrain {name} {r['path']}: " + (r["error"] if "error" in r else
                  f"{r['sequences_per_s']:.2f} seq/s, {r['real_tokens_per_s']:.0f} real tokens/s, "
                  f"MFU (real tokens) {r['mfu_real_vs_measured_bf16']:.1%}"), flush=True)
        mine = [r for r in rows if r.get("objective") == name and "error" not in r]
        padded = next((r for r in mine if r["path"] == "padded"), None)
        for r in mine:
            if padded is not None and r is not padded:
                r["speedup_vs_padded"] = padded["step_s"] / r["step_s"]
    return rows


def write_markdown(path: Path, record: Dict[str, object]) -> None:
    lines = [f"# GPU benchmarks ({record['info'].get('gpu')})", "", f"Command: `{record['command']}`",
             f"Machine: {json.dumps(record['info'])}",
             f"Measured peaks: " + ", ".join(f"{k} {v:.3g}" for k, v in record["peaks"].items()), ""]
    for part in ("encode", "search", "pretrain", "unpad_rows", "trainer_rows"):
        res = record.get(part) if part not in ("unpad_rows", "trainer_rows") else {
            "rows": (record.get("pretrain") or {}).get(part)}
        if not res or not res["rows"]:
            continue
        rows = res["rows"]
        keys = sorted({k for r in rows for k in r if not isinstance(r[k], (list, dict))}, key=lambda k: (k != "shape", k != "tokens", k))
        title = {"unpad_rows": "pretrain: padded vs unpadded (real length distribution)",
                 "trainer_rows": "pretrain through the Trainer (python -m pretrain's loop) vs the bare loop"}.get(part, part)
        lines += [f"## {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in rows:
            lines.append("| " + " | ".join(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                                          for k in keys) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for bench_*.json and bench_gpu.md")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes and a tiny model on the CPU")
    ap.add_argument("--device", default=None, help="torch device (default: cuda, or cpu with --cpu-smoke)")
    ap.add_argument("--only", default="encode,search,pretrain", help="comma-separated parts to run")
    ap.add_argument("--encode-shapes", help="comma-separated model shapes to encode with: " + ", ".join(SHAPES))
    ap.add_argument("--lengths", type=int, nargs="+")
    ap.add_argument("--docs", type=int, help="documents encoded per length")
    ap.add_argument("--stream-docs", type=int, help="records streamed through doc_encoder().transform_iter on "
                    "MS MARCO-like lengths, beside sentence-transformers (0: not timed)")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--size", type=int, help="documents in the synthetic search index")
    ap.add_argument("--dim", type=int)
    ap.add_argument("--queries", type=int)
    ap.add_argument("--k", type=int)
    ap.add_argument("--search-sweep", action="store_true", help="time the resident fp16 search at 2 and 8 GiB of "
                    "scores per chunk x blocks of 16/32/64 columns")
    ap.add_argument("--chunk-size", type=int, help="rows per streamed chunk (default: torch_search's)")
    ap.add_argument("--seq-length", type=int, help="pre-training sequence length")
    ap.add_argument("--sequences", type=int, help="encoder sequences per pre-training step")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--objectives")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--unpad-objectives", help="objectives timed padded vs unpadded on real text lengths "
                    "(default mlm,cpdae; '' skips)")
    ap.add_argument("--compile-objectives", help="of --unpad-objectives, those also timed padded with --compile "
                    "(torch.compile of every encoder layer; the warm-up steps compile; default mlm on a GPU, '' skips)")
    ap.add_argument("--trainer-objectives", help="objectives also run through pretrain.training.trainer.Trainer on the padded "
                    "rows' text lengths, beside the bare loop (default mlm; '' skips)")
    ap.add_argument("--trainer-workers", type=int, default=None, help="the Trainer rows' DataLoader workers "
                    "(--num-workers; default 0, the option's default)")
    ap.add_argument("--trainer-unpad", help="the Trainer rows' --unpad modes, one row each; MODE+compile adds the "
                    "Trainer's --compile (default auto,on,off+compile on a GPU: the probe's choice, packed rows and "
                    "padded compiled rows, the last beside the bare loop's compiled row; auto with --cpu-smoke)")
    ap.add_argument("--length-dist", type=Path, default=REPO / "experiments" / "results" / "padding_share.json",
                    help="block-length histograms (experiments/bench/bench_padding.py) the unpadded comparison "
                    "draws its text lengths from")
    args = ap.parse_args(argv)
    for key, value in (SMOKE if args.cpu_smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    import torch

    dev = torch.device(args.device or ("cpu" if args.cpu_smoke else "cuda"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu-smoke (tiny sizes on the CPU) or on a GPU machine")
    args.out.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.cpu_smoke else BERT_BASE
    record: Dict[str, object] = {"command": " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
                                 "info": device_info(dev), "peaks": measure_peaks(dev, args.cpu_smoke)}
    print(json.dumps(record["info"]), json.dumps(record["peaks"]), flush=True)
    parts = set(args.only.split(","))
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_bert_dir(Path(tmp) / "bert", **shape)
        def encode_all() -> Dict[str, object]:
            out: Dict[str, object] = {"models": {}, "rows": []}
            for name in args.encode_shapes.split(","):
                if name not in SHAPES:
                    raise ValueError(f"--encode-shapes: unknown shape {name!r}; choose from {', '.join(SHAPES)}")
                mdir = model_dir if SHAPES[name] is shape else make_bert_dir(Path(tmp) / name, **SHAPES[name])
                res = bench_encode(args, dev, record["peaks"], mdir, SHAPES[name], name)
                out["models"][name] = res["model"]
                out["rows"] += res["rows"]
            return out
        def save(part: str, res: Dict[str, object]) -> None:
            """bench_<part>.json and bench_gpu.md as they stand (also mid-part: a run stopped at the suite's
            deadline keeps the rows it finished)."""
            record[part] = res
            (args.out / f"bench_{part}.json").write_text(json.dumps(
                {"command": record["command"], "info": record["info"], "peaks": record["peaks"], **res},
                indent=1) + "\n")
            write_markdown(args.out / "bench_gpu.md", record)

        for part, fn in (("encode", encode_all),
                         ("search", lambda: bench_search(args, dev, record["peaks"])),
                         ("pretrain", lambda: bench_pretrain(args, dev, record["peaks"], model_dir, args.cpu_smoke,
                                                             partial=lambda res: save("pretrain", res)))):
            if part not in parts:
                continue
            t0 = time.perf_counter()
            try:
                record[part] = fn()
                errors = [r["error"] for key in ("rows", "unpad_rows", "trainer_rows")
                          for r in record[part].get(key) or [] if "error" in r]
                if errors:
                    failed.append(part)
                    print(f"{part}: {len(errors)} failed: {errors}", file=sys.stderr)
            except Exception as e:  # record the failure, go on with the other parts
                import traceback

                traceback.print_exc()
                record[part] = {"error": f"{type(e).__name__}: {e}", "rows": []}
                failed.append(part)
            record[part]["seconds"] = time.perf_counter() - t0
            save(part, record[part])
    if failed:
        print(f"failed parts: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
