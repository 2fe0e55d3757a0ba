"""The CPU margins measured side by side in one run, with a verdict for each target.

Runs, one after the other on this machine, as separate processes (each benchmark is its own script, with its own
peer measured in the same run; this driver only starts them and reads their ``--json`` results):

1. ``bench_encode.py`` at 256 tokens for each pooling of ``--poolings`` (default ``mean``, all-MiniLM-L6-v2's own,
   and ``cls``, CPDAE's): the default CPU encoder against ``sentence-transformers``' ``encode`` at the shared batch
   size, with its ranking check (the ordered top-10 of every SciFact query identical to PyTorch float32's for >= 99%
   of the queries).  Target: >= ``--encode-target`` (1.5x) in process CPU time.
2. With ``--busy``, the same at mean pooling while the machine is busy: beside it run a 2-thread float32
   ``1024 x 1024`` torch matmul loop at nice 19 and a 1-thread ``512 x 512`` loop at normal priority (the load of the
   busy runs recorded in ``experiments/results/bench_encode.md``; ``--busy-sizes`` changes the two sizes), stopped
   when it ends, whatever happens.  Target: >= ``--busy-target`` (1.2x) in process CPU time.
3. ``bench_search_bound.py`` over ``--vectors`` (``--docs`` x ``--dim`` float32, created by it if absent: 13.6 GB
   for the default 8,841,823 x 384): exact search (``numpy_search``'s default path: fused where it pays), 1,000
   queries at each k of ``--ks``, against the 2-core compute bound measured in the same run.  Target: >=
   ``--search-target`` (80%) of the bound.

Each benchmark's own output is printed as it runs (the record keeps it); at the end one table gives every target,
what it needs, what was measured (median and range over the repeats) and whether it is met.  ``--json`` also writes
that table.  A missed target is a measurement, not an error: the exit status is 0 unless a benchmark fails or
``--strict`` is given.  The ranking bar is checked by bench_encode.py, and search rankings are checked against a
float64 brute force by bench_search_bound.py, which stops on any difference beyond float32 rounding.

Usage::

    python experiments/bench/cpu_margins.py --vectors /data/msmarco_like_384.npy [--busy] [--json margins.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "experiments" / "bench"

# the busy machine's load: a torch float32 n x n matmul loop per entry (threads, n, niceness); the process sets its
# own niceness first (no preexec_fn: that is not safe in a process with threads)
LOAD_CODE = ("import os, sys\nos.nice(int(sys.argv[3]))\nimport torch\ntorch.set_num_threads(int(sys.argv[1]))\n"
             "n = int(sys.argv[2])\na = torch.randn(n, n)\nb = torch.empty(n, n)\nwhile True:\n"
             "    torch.mm(a, a, out=b)\n")


def encode_margin(record: Dict[str, Any], peer: str = "sentence-transformers encode") -> Dict[str, Any]:
    """The default CPDAE row's speed-up over ``peer`` in one bench_encode.py length record: the ratio of the
    medians (peer / CPDAE) in CPU and wall time and the range of the per-repeat ratios, with its ranking verdict."""
    ours, theirs = record["systems"][record["default"]], record["systems"][peer]
    out: Dict[str, Any] = {"system": record["default"], "peer": peer}
    for clock in ("cpu_s", "wall_s"):
        per = [p / o for p, o in zip(theirs[clock], ours[clock])]
        out[clock] = {"ratio": statistics.median(theirs[clock]) / statistics.median(ours[clock]),
                      "min": min(per), "max": max(per)}
    out["ranking"] = record["ranking"].get(record["default"])
    return out


def verdict(measured: float, needed: float) -> str:
    return "met" if measured >= needed else "missed"


def run(cmd: List[str], what: str) -> None:
    shown = ["python", os.path.relpath(cmd[1], REPO), *cmd[2:]]
    print(f"\n### {what}\n\n$ {' '.join(shown)}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(cmd, env=env)
    if res.returncode != 0:
        raise SystemExit(f"cpu_margins: {what} failed (exit {res.returncode}): {' '.join(shown)}")


class Load:
    """The busy machine's background load: one process per ``(threads, n, nice)``, stopped on exit."""

    def __init__(self, spec: List[tuple]):
        self.spec, self.procs = spec, []

    def __enter__(self) -> "Load":
        for threads, n, nice in self.spec:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", LOAD_CODE, str(threads), str(n), str(nice)], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # the loops running before the timings start
        for p in self.procs:
            if p.poll() is not None:
                raise SystemExit(f"cpu_margins: the background load process exited with {p.returncode}")
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def main(argv: List[str] | None = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vectors", default=None, help="the search benchmark's .npy of float32 vectors (created if "
                    "absent); without it the search part is skipped")
    ap.add_argument("--docs", type=int, default=8_841_823, help="rows of --vectors (MS MARCO's passage count)")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--ks", type=int, nargs="+", default=[1000, 10])
    ap.add_argument("--search-repeats", type=int, default=2)
    ap.add_argument("--search-target", type=float, default=0.80, help="share of the compute bound (default 0.80)")
    ap.add_argument("--encode-docs", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3, help="encoding repeats")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--poolings", nargs="+", choices=["mean", "cls"], default=["mean", "cls"])
    ap.add_argument("--encode-target", type=float, default=1.5)
    ap.add_argument("--busy", action="store_true", help="also encode (mean pooling) on a busy machine")
    ap.add_argument("--busy-target", type=float, default=1.2)
    ap.add_argument("--busy-sizes", type=int, nargs=2, default=[1024, 512], metavar=("N2", "N1"),
                    help="matmul sizes of the 2-thread (nice 19) and the 1-thread load loops")
    ap.add_argument("--model", default=None, help="encoder dir (bench_encode.py's default: all-MiniLM-L6-v2)")
    ap.add_argument("--corpus", default=None, help="BEIR corpus.jsonl (bench_encode.py's default: SciFact)")
    ap.add_argument("--queries", default=None, help="BEIR queries.jsonl of the ranking check (default SciFact's)")
    ap.add_argument("--bound-seconds", type=float, default=None, help="passed to both benchmarks")
    ap.add_argument("--bound-n", type=int, default=None,
                    help="passed to bench_encode.py: the size of its float32 bound's square matmul (default 2048)")
    ap.add_argument("--json", default=None, help="also write the summary table here")
    ap.add_argument("--keep", default=None, help="keep each benchmark's own --json result in this folder")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)

    common: List[str] = []
    for flag, value in (("--model", args.model), ("--corpus", args.corpus), ("--queries", args.queries),
                        ("--bound-seconds", args.bound_seconds), ("--bound-n", args.bound_n)):
        if value is not None:
            common += [flag, str(value)]
    shown = sys.argv[1:] if argv is None else list(argv)
    print(f"$ python experiments/bench/cpu_margins.py {' '.join(shown)}\n")
    print(f"# The CPU margins in one run\n\nstarted {time.strftime('%Y-%m-%d %H:%M:%S')}; "
          f"{os.cpu_count()} CPUs; load average (1 min) {os.getloadavg()[0]:.1f}", flush=True)
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cpu_margins_") as scratch:
        tmp = args.keep or scratch
        os.makedirs(tmp, exist_ok=True)
        def encode(pooling: str, busy: bool) -> None:
            out = Path(tmp) / f"encode_{pooling}_{'busy' if busy else 'quiet'}.json"
            need = args.busy_target if busy else args.encode_target
            cmd = [sys.executable, str(BENCH / "bench_encode.py"), "--docs", str(args.encode_docs), "--repeats",
                   str(args.repeats), "--skip", "SBertBiEncoder", "--max-lengths", str(args.max_length),
                   "--pooling", pooling, "--target", f"{need:g}", "--json", str(out), *common]
            what = f"encoding at {args.max_length} tokens, {pooling} pooling, {'busy' if busy else 'quiet'} machine"
            if busy:
                n2, n1 = args.busy_sizes
                with Load([(2, n2, 19), (1, n1, 0)]):
                    run(cmd, what + f" (load: 2-thread {n2} x {n2} matmul loop at nice 19, 1-thread {n1} x {n1} "
                                    "at normal priority)")
            else:
                run(cmd, what)
            record = json.loads(out.read_text())["lengths"][0]
            m = encode_margin(record)
            rank = m["ranking"]
            rows.append({"target": what, "needs": f">= {need:g}x sentence-transformers (CPU time)",
                         "measured": f"{m['cpu_s']['ratio']:.2f}x ({m['cpu_s']['min']:.2f}-{m['cpu_s']['max']:.2f}); "
                                     f"wall {m['wall_s']['ratio']:.2f}x"
                                     + (f"; top-{rank['top']} identical {rank['identical_top']:.1%}" if rank else ""),
                         "verdict": verdict(m["cpu_s"]["ratio"], need)
                         if rank is None or rank["passes"] else "missed (ranking bar)",
                         "value": m["cpu_s"]["ratio"], "needed": need, "system": m["system"],
                         "load_average_end": record["load_average_end"]})

        for pooling in args.poolings:
            encode(pooling, busy=False)
        if args.busy:
            encode("mean", busy=True)
        if args.vectors is not None:
            out = Path(tmp) / "search.json"
            cmd = [sys.executable, str(BENCH / "bench_search_bound.py"), "--vectors", args.vectors, "--docs",
                   str(args.docs), "--dim", str(args.dim), "--ks", *map(str, args.ks), "--repeats",
                   str(args.search_repeats), "--paths", "fused", "--json", str(out)]
            if args.bound_seconds is not None:
                cmd += ["--bound-seconds", str(args.bound_seconds)]
            run(cmd, f"exact search over {args.docs:,} x {args.dim} float32")
            result = json.loads(out.read_text())
            for r in result["rows"]:
                rows.append({"target": f"exact search {result['docs']:,} x {result['dim']}, {result['queries']} "
                                       f"queries, k={r['k']} (numpy_search's default path)",
                             "needs": f">= {args.search_target:.0%} of the compute bound",
                             "measured": f"{r['share']:.1%} ({r['share_min']:.1%}-{r['share_max']:.1%}); "
                                         f"{result['queries'] / r['wall_s']:.0f} queries/s",
                             "verdict": verdict(r["share"], args.search_target), "value": r["share"],
                             "needed": args.search_target})

    print(f"\n## Summary (finished {time.strftime('%Y-%m-%d %H:%M:%S')})\n")
    print("| target | needs | measured: median (range over the repeats) | verdict |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['target']} | {r['needs']} | {r['measured']} | **{r['verdict']}** |")
    summary = {"rows": rows, "all_met": all(r["verdict"] == "met" for r in rows)}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.strict and not summary["all_met"]:
        raise SystemExit(1)
    return summary


if __name__ == "__main__":
    main()
