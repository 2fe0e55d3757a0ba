"""experiments/bench/cpu_margins.py (the CPU targets in one run) at a tiny size: the three benchmarks
run, their verdicts follow from their own measured seconds (recomputed here from bench_encode.py's and
bench_search_bound.py's JSON), the busy run's load processes are gone afterwards, and --strict fails a missed target
after writing the summary."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "bench" / "cpu_margins.py"
sys.path.insert(0, str(ROOT))

from experiments.bench import cpu_margins  # noqa: E402


def _load_processes() -> list:
    """PIDs of live processes running the busy machine's load loop."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "torch.mm(a, a, out=b)" in cmdline:
            found.append(int(pid))
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
def test_cpu_margins_smoke(tiny_bert_dir, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"_id": "d{i}", "title": "t{i}", "text": "{" ".join(["word"] * (5 + 3 * i))}"}}\n'
                              for i in range(12)))
    queries = tmp_path / "queries.jsonl"
    queries.write_text("".join(f'{{"_id": "q{i}", "text": "word {i}"}}\n' for i in range(5)))
    keep, summary = tmp_path / "keep", tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", tiny_bert_dir, "--corpus", str(corpus), "--queries", str(queries),
         "--encode-docs", "12", "--repeats", "2", "--max-length", "32", "--poolings", "mean", "--busy",
         "--busy-sizes", "128", "64", "--vectors", str(tmp_path / "v.npy"), "--docs", "5000", "--dim", "16",
         "--ks", "10", "--search-repeats", "1", "--bound-seconds", "0.05", "--json", str(summary), "--keep",
         str(keep), "--strict"], env=env, capture_output=True, text=True, timeout=600)
    # a tiny random model is no faster than sentence-transformers: a target is missed, so --strict exits 1, after
    # the summary is printed and written
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "## Summary" in res.stdout
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
