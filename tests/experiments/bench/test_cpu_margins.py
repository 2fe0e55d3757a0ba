"""experiments/bench/cpu_margins.py (the CPU targets in one run) at a tiny size: the three benchmarks
run, their verdicts follow from their own measured seconds (recomputed here from bench_encode.py's and
bench_search_bound.py's JSON), the busy run's load processes are gone afterwards, and --strict fails a missed target
after writing the summary."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "experiments" / "bench" / "cpu_margins.py"
sys.path.insert(0, str(ROOT))

from experiments.bench import cpu_margins  # noqa: E402


def _load_processes() -> list:
    """PIDs of live processes of this test running the busy machine's load loop (below this process: not another
    run's on a shared machine)."""
    found = []
    for pid in sorted(_descendants(os.getpid())):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "torch.mm(a, a, out=b)" in cmdline:
            found.append(pid)
    return found


def _descendants(root: int) -> set:
    """PIDs of every live process below ``root`` (children, grandchildren, ...)."""
    parent = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        kids = [c for c, p in parent.items() if p == pid]
        found.update(kids)
        todo += kids
    return found


def test_encode_margin_by_hand():
    record = {"default": "CPDAE default", "ranking": {"CPDAE default": {"passes": True}},
              "systems": {"CPDAE default": {"cpu_s": [2.0, 4.0, 3.0], "wall_s": [1.0, 2.0, 1.5]},
                          "sentence-transformers encode": {"cpu_s": [3.0, 5.0, 6.0], "wall_s": [2.0, 2.0, 2.0]}}}
    m = cpu_margins.encode_margin(record)
    # medians: peer 5.0 / ours 3.0; per repeat 1.5, 1.25, 2.0
    assert m["cpu_s"] == {"ratio": pytest.approx(5 / 3), "min": 1.25, "max": 2.0}
    # wall: 2.0 / 1.5; per repeat 2.0, 1.0, 1.333
    assert m["wall_s"] == {"ratio": pytest.approx(4 / 3), "min": 1.0, "max": 2.0}
    assert m["ranking"] == {"passes": True}
    assert cpu_margins.verdict(1.5, 1.5) == "met" and cpu_margins.verdict(1.49, 1.5) == "missed"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the load processes")
def test_cpu_margins_smoke(tiny_bert_dir, tmp_path, capfd, monkeypatch, warm_children):
    """The driver runs in this process; the benchmarks and the load loops it starts (``sys.executable``) start warm
    (tests/helpers/warm_python.py), so that the run costs their work, not their imports."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"_id": "d{i}", "title": "t{i}", "text": "{" ".join(["word"] * (5 + 3 * i))}"}}\n'
                              for i in range(12)))
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(f'{{"_id": "q{i}", "text": "word {i}"}}\n' for i in range(5)))
    keep, summary = tmp_path / "keep", tmp_path / "summary.json"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = _descendants(os.getpid())  # (the warm server, started by warm_children, is one of them)
    with cpu_margins.Load([(1, 8, 0)]):  # the check below sees a running load loop (and none once it is stopped)
        assert len(_load_processes()) == 1
    assert not _load_processes()
    with pytest.raises(SystemExit) as exit_:
        cpu_margins.main(
            ["--model", tiny_bert_dir, "--corpus", str(corpus), "--queries", str(queries), "--encode-docs", "12",
             "--repeats", "2", "--max-length", "32", "--poolings", "mean", "--busy", "--busy-sizes", "128", "64",
             "--vectors", str(tmp_path / "v.npy"), "--docs", "5000", "--dim", "16", "--ks", "10",
             "--search-repeats", "1", "--bound-seconds", "0.05", "--bound-n", "64", "--json", str(summary), "--keep",
             str(keep), "--strict"])
    out = capfd.readouterr()
    # a tiny random model is no faster than sentence-transformers: a target is missed, so --strict exits 1, after
    # the summary is printed and written
    assert exit_.value.code == 1, out.out[-3000:] + out.err[-3000:]
    assert "## Summary" in out.out
    assert "compute bound: float32 64 x 64 matmul" in out.out  # --bound-n reached bench_encode.py
    rows = json.loads(summary.read_text())["rows"]
    assert [r["target"].split(" ")[0] for r in rows] == ["encoding", "encoding", "exact"]
    assert rows[2]["target"].startswith("exact search 5,000 x 16, 1000 queries, k=10")
    assert "quiet machine" in rows[0]["target"] and "busy machine" in rows[1]["target"]
    for row, name, need in ((rows[0], "encode_mean_quiet.json", 1.5), (rows[1], "encode_mean_busy.json", 1.2)):
        record = json.loads((keep / name).read_text())["lengths"][0]
        ours = record["systems"][record["default"]]["cpu_s"]
        peer = record["systems"]["sentence-transformers encode"]["cpu_s"]
        assert len(ours) == len(peer) == 2
        ratio = statistics.median(peer) / statistics.median(ours)
        assert row["value"] == pytest.approx(ratio) and row["needed"] == need
        assert row["verdict"] == ("met" if ratio >= need else "missed")
        assert record["ranking"][record["default"]]["passes"] in (True, False)
    search = json.loads((keep / "search.json").read_text())
    assert search["docs"] == 5000 and [r["k"] for r in search["rows"]] == [10]
    assert rows[2]["value"] == pytest.approx(search["rows"][0]["share"])
    assert rows[2]["verdict"] == ("met" if search["rows"][0]["share"] >= 0.8 else "missed")
    assert not _load_processes(), "the busy run's load processes outlived it"
    # nor any other process it started (a warm program is a fork of the warm server, ended when its launcher is)
    deadline = time.monotonic() + 10
    while (left := _descendants(os.getpid()) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes started by the run outlived it: {sorted(left)}"
