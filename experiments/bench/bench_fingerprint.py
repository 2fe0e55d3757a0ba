"""Benchmark: the cost of the token cache's corpus fingerprint, which reads every byte of every corpus file.

``pretrain.data.inputs.file_fingerprint`` hashes the whole file (SHA-256 of the size and every byte); it used to
hash 16 chunks of 64 KiB above 1 MiB, which missed edits between the chunks. This script times both on the real
Wikipedia sample (``../shared/data/enwiki-sample``: 200 bz2 files, as ``wiki:`` corpora are read) and on its
decompressed text (one plain-text file of about 200 MB, as a ``.txt`` corpus would be), each in a fresh process
(the fingerprint is kept per process), the files read from the page cache (warmed once before timing: a first
read from disk adds the disk's read time, which the tokenizer pays too). For scale it prints the share of the
token-cache build the fingerprint adds, using the recorded build rate of ``experiments/results/bench_tokenise.md``.

Usage (the recorded run; under a minute)::

    python experiments/bench/bench_fingerprint.py --repeats 5 --out experiments/results/bench_fingerprint.md
"""
from __future__ import annotations

import argparse
import bz2
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WIKI = REPO.parent / "shared" / "data" / "enwiki-sample"

CHILD = r"""
import hashlib, os, sys, time
from pretrain.data.inputs import corpus_fingerprints
spec, mode = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if mode == "full":
    fps = corpus_fingerprints(spec)
    n = sum(fp["size"] for fp in fps.values())
else:  # the former sampled fingerprint: the whole file up to 1 MiB, else 16 chunks of 64 KiB and the size
    from pretrain.data.readers import corpus_files
    n = 0
    for path in corpus_files(spec):
        size = os.path.getsize(path)
        h = hashlib.sha256(str(size).encode())
        with open(path, "rb") as f:
            if size <= 1 << 20:
                h.update(f.read())
            else:
                step = (size - (64 << 10)) / 15
                for i in range(16):
                    f.seek(int(i * step))
                    h.update(f.read(64 << 10))
        n += size
print(time.perf_counter() - t0, n)
"""


def timed(spec: str, mode: str) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", CHILD, spec, mode], capture_output=True, text=True, check=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds, size = out.stdout.split()
    return float(seconds), int(size)


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the Markdown record here")
    args = ap.parse_args(argv)
    if not WIKI.is_dir():
        raise SystemExit(f"error: {WIKI} not found (the shared data folder beside the repository)")
    files = sorted(WIKI.rglob("wiki_*.bz2"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "enwiki.txt"
        with open(text, "wb") as out:
            for p in files:
                out.write(bz2.decompress(p.read_bytes()))
        load0 = os.getloadavg()[0]
        for label, spec, paths in (("wiki: 200 bz2 files", f"wiki:{WIKI}", files),
                                   ("one plain-text file (the sample decompressed)", str(text), [text])):
            warm(paths)
            for mode in ("full", "sampled"):
                times, size = [], 0
                for _ in range(args.repeats):
                    s, size = timed(spec, mode)
                    times.append(s)
                rows.append((label, mode, size, statistics.median(times), min(times), max(times)))
        load1 = os.getloadavg()[0]
    lines = [
        "# Corpus fingerprint: every byte read",
        "",
        "The token cache's key and `--resume`'s input check fingerprint each corpus file by a SHA-256 of its size and",
        "every byte (`pretrain.data.inputs.file_fingerprint`). Timed in a fresh process per measurement, files in the",
        "page cache; the former fingerprint (16 chunks of 64 KiB above 1 MiB, which missed edits between them) beside it.",
        "",
        f"Command: `python experiments/bench/bench_fingerprint.py --repeats {args.repeats}"
        f"{' --out ' + args.out if args.out else ''}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}; shared with other "
        f"jobs (load average {load0:.1f} at the start, {load1:.1f} at the end)",
        "",
        "| corpus | fingerprint | corpus size | median s | range s | MB/s hashed (median) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, mode, size, med, lo, hi in rows:
        what = "every byte" if mode == "full" else "16 x 64 KiB per file"
        rate = f"{size / 1e6 / med:.0f}" if mode == "full" else "-"
        lines.append(f"| {label} | {what} | {size / 1e6:.1f} MB | {med:.3f} | {lo:.3f}-{hi:.3f} | {rate} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
