"""How an exported encoder describes itself: sentence-transformers' module files, written and read in one place.

An encoder directory written by ``python -m pretrain`` or ``python -m pretrain finetune`` holds, next to the
Hugging Face ``config.json`` / weights / tokenizer, the files with which sentence-transformers (and so any tool
that reads them) rebuilds the same text encoder::

    modules.json                        # Transformer -> Pooling [-> Normalize]
    sentence_bert_config.json           # {"max_seq_length": ..., "do_lower_case": false}
    1_Pooling/config.json               # "pooling_mode": "cls" (sentence-transformers 6) or pooling_mode_cls_token
    config_sentence_transformers.json   # similarity function (dot, or cosine when normalised)

:func:`write_st_config` writes them; :func:`read_encoder_settings` reads them back (or, for directories exported
before these files existed, the ``training_args.json`` of a fine-tuning run) for :meth:`CPDAE.from_pretrained`.
:func:`export_pipeline` says which of them a run continued from a base model keeps: the base's own pipeline
(``Normalize`` included) unless the run's pooling option replaces it.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from .._files import read_config_file, short_repr, write_json_atomic
from .pooling import POOLINGS

__all__ = ["write_st_config", "read_encoder_settings", "folder_settings", "exported_model_files",
           "remove_exported_model", "base_pipeline", "export_pipeline"]

MODULES = "modules.json"
SBERT_CONFIG = "sentence_bert_config.json"
POOLING_DIR = "1_Pooling"
NORMALIZE_DIR = "2_Normalize"
ST_CONFIG = "config_sentence_transformers.json"
TRAINING_ARGS = "training_args.json"
#: the model card of a toolkit export (``pretrain.export.card``) and its stored record
CARD = "README.md"
CARD_STATE = "model_card.json"
#: the words that identify a card the toolkit wrote (a README.md without them is a user's and is never removed)
TOOLKIT_CARD_MARK = "model card written by pyterrier-cpdae"

#: what a saved model directory can hold besides its training records: the weights, the transformers and tokenizer
#: files, and the sentence-transformers files (modules.json names any other module folders)
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
               "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "vocab.txt", "added_tokens.json", MODULES, SBERT_CONFIG, ST_CONFIG, POOLING_DIR, NORMALIZE_DIR,
               CARD_STATE)


def _is_toolkit_card(path: str) -> bool:
    try:
        with open(path, encoding="utf8", errors="replace") as f:
            return TOOLKIT_CARD_MARK in f.read(8192)
    except OSError:
        return False


def exported_model_files(path: Union[str, os.PathLike]) -> list:
    """The paths under ``path`` that a saved model wrote (``MODEL_FILES``, weight shards, and every module folder
    its ``modules.json`` names, the model card when the toolkit wrote it) and that exist: what ``--overwrite``
    removes so that a run cut short leaves no earlier model behind that still loads. Anything else in the directory
    (a user's own files, a README.md the toolkit did not write) is not listed."""
    path = os.fspath(path)
    names = set(MODEL_FILES)
    try:
        names |= {n for n in os.listdir(path) if n.startswith("model-") and n.endswith(".safetensors")}
        modules_path = os.path.join(path, MODULES)
        modules = _read_json(modules_path, top=list) if os.path.isfile(modules_path) else []
        names |= {m["path"] for m in modules if isinstance(m, dict) and isinstance(m.get("path"), str)
                  and m["path"] not in (".", "..") and os.path.basename(os.path.normpath(m["path"])) == m["path"]}
        # (a module folder is one name inside the model directory: "..", "." or a path would delete elsewhere)
        if _is_toolkit_card(os.path.join(path, CARD)):
            names.add(CARD)
    except (OSError, ValueError):
        pass
    return sorted(os.path.join(path, n) for n in names if os.path.lexists(os.path.join(path, n)))


def remove_exported_model(path: Union[str, os.PathLike]) -> list:
    """Delete ``exported_model_files(path)`` (a folder with its contents, a link itself, not its target); returns
    what was removed."""
    removed = exported_model_files(path)
    for p in removed:
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)
    return removed


_ST_POOLING_KEYS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens"}
_OTHER_POOLING_KEYS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


def write_st_config(path: Union[str, os.PathLike], *, pooling: str, hidden_size: int, max_seq_length: int,
                    normalize: bool = False, do_lower_case: bool = False) -> None:
    """Writes the sentence-transformers description of the encoder saved at ``path``.

    Args:
        path: the Hugging Face model directory (``config.json`` and weights at its root).
        pooling: ``"cls"`` or ``"mean"``.
        hidden_size: the vector dimension (``1_Pooling``'s ``word_embedding_dimension``).
        max_seq_length: truncation length in tokens, special tokens included.
        normalize: L2-normalise the vectors (adds a ``Normalize`` module; similarity ``cosine``, else ``dot``).
        do_lower_case: lower-case texts before tokenising (leave ``False`` when the tokenizer does it).

    Raises:
        ValueError: for an unknown pooling or a non-positive length.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if int(max_seq_length) < 1:
        raise ValueError(f"max_seq_length must be positive, got {max_seq_length!r}")
    path = os.fspath(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": POOLING_DIR, "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, NORMALIZE_DIR), exist_ok=True)
    os.makedirs(os.path.join(path, POOLING_DIR), exist_ok=True)
    pooling_config: Dict[str, Any] = {"word_embedding_dimension": int(hidden_size)}
    for name, key in _ST_POOLING_KEYS.items():
        pooling_config[key] = name == pooling
    pooling_config.update({k: False for k in _OTHER_POOLING_KEYS})
    pooling_config["include_prompt"] = True
    import torch
    import transformers

    write_json_atomic(Path(path, POOLING_DIR, "config.json"), pooling_config)
    write_json_atomic(Path(path, SBERT_CONFIG), {"max_seq_length": int(max_seq_length),
                                                   "do_lower_case": bool(do_lower_case)})
    write_json_atomic(Path(path, ST_CONFIG), {
        "__version__": {"transformers": transformers.__version__, "pytorch": torch.__version__.split("+")[0]},
        "prompts": {}, "default_prompt_name": None,
        "similarity_fn_name": "cosine" if normalize else "dot"})
    write_json_atomic(Path(path, MODULES), modules)


def _read_json(path: str, top: type = dict) -> Any:
    """A side file of a model directory, read as data by the bounded reader (:func:`read_config_file`): one line
    naming the file when it is not JSON, too large, or does not hold a ``top`` (an object; a list for
    ``modules.json``)."""
    try:
        return read_config_file(path, top=top)
    except ValueError as e:
        raise ValueError(f"{e}; restore the file, or save the model again") from None


def _setting(path: str, key: str, value: Any) -> Any:
    """A stored encoder setting, checked: ``pooling`` one of :data:`POOLINGS`, lengths integers >= 1, flags
    booleans.

    Raises:
        ValueError: naming the file, the key and the value (cut short).
    """
    if key == "pooling":
        ok = value in POOLINGS
        want = f"one of {POOLINGS}"
    elif key in ("normalize", "do_lower_case"):
        ok, want = isinstance(value, bool), "true or false"
    else:  # a length: an integer (256.0 too), not a boolean, not inf or 1e400
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= _MAX_LENGTH
        want = f"an integer in [1, {_MAX_LENGTH}]"
    if not ok:
        raise ValueError(f"{path}: {key} must be {want}, got {short_repr(value)}")
    return value


#: a length in tokens far above any model's positions (positions are clamped to the model's own maximum later)
_MAX_LENGTH = 1 << 24


def _pooling_modes(cfg: Dict[str, Any]) -> tuple:
    """``(CPDAE poolings, other modes)`` a Pooling ``config.json`` enables: sentence-transformers 6 writes
    ``"pooling_mode": "cls"`` (or a list of modes, concatenated), earlier versions one boolean per mode."""
    if "pooling_mode" in cfg:
        mode = cfg["pooling_mode"]
        names = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, (list, tuple)) else [mode]
        return [m for m in names if m in POOLINGS], [short_repr(m) for m in names if m not in POOLINGS]
    return ([name for name, key in _ST_POOLING_KEYS.items() if cfg.get(key)],
            [k for k in _OTHER_POOLING_KEYS if cfg.get(k)])


_TOKENIZER_FILES = ("tokenizer_config.json", "config.json")


def _tokenizer_length(path: str) -> Optional[tuple]:
    """``(length, source file)`` that sentence-transformers 6 cuts texts at in model directory ``path``: the
    tokenizer's ``model_max_length`` (a million or more: unknown) capped at ``max_position_embeddings``; None when
    neither file says."""
    found = []
    for name, key in zip(_TOKENIZER_FILES, ("model_max_length", "max_position_embeddings")):
        file = os.path.join(path, name)
        value = _read_json(file).get(key) if os.path.isfile(file) else None
        if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1_000_000:
            found.append((_setting(file, key, value), file))
    return min(found, default=None)


def read_encoder_settings(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """The pooling, normalisation and maximum lengths a model directory declares (only those it declares).

    sentence-transformers files come first (``pooling``, ``normalize``, ``doc_max_length`` = ``max_seq_length``,
    ``do_lower_case``); a fine-tuning run's ``training_args.json`` fills in what they lack (``pooling``,
    ``query_max_length``, ``doc_max_length``), so that directories exported before the sentence-transformers files
    existed describe themselves too. A query length that no ``training_args.json`` declares is ``max_seq_length``
    too: the folder's own pipeline (``SentenceTransformer.encode``) cuts queries and documents alike. A folder saved by
    sentence-transformers 6 (``"pooling_mode": "cls"``, no ``max_seq_length``) declares its length through its
    tokenizer (``model_max_length``, capped at ``max_position_embeddings``), as sentence-transformers reads it.

    Returns:
        ``{setting: (value, source file)}``; empty for a Hub name or a plain Hugging Face directory.

    Raises:
        ValueError: when a sentence-transformers file is unreadable, or its pooling is one CPDAE does not implement.
    """
    path = os.fspath(path)
    out: Dict[str, Any] = {}
    if not os.path.isdir(path):
        return out
    modules_path = os.path.join(path, MODULES)
    if os.path.isfile(modules_path):
        modules = _read_json(modules_path, top=list)
        for i, m in enumerate(modules):
            if not isinstance(m, dict) or not isinstance(m.get("type", ""), str) \
                    or not isinstance(m.get("path", ""), str):
                raise ValueError(f"{modules_path}: module {i} must be an object with a \"type\" and a \"path\" "
                                 f"string, got {short_repr(m)}")
        types = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
        out["normalize"] = ("Normalize" in types, MODULES)
        for m, kind in zip(modules, types):
            if kind != "Pooling":
                continue
            sub = m.get("path", POOLING_DIR)
            if os.path.isabs(sub) or ".." in sub.replace("\\", "/").split("/"):
                raise ValueError(f"{modules_path}: the Pooling module's path {short_repr(sub)} leaves the model "
                                 "directory; a module is a folder inside it")
            pool_path = os.path.join(path, sub, "config.json")
            if not os.path.isfile(pool_path):
                raise ValueError(f"{modules_path} names a Pooling module in {short_repr(sub)}, but {pool_path} does "
                                 "not exist")
            cfg = _read_json(pool_path)
            modes, others = _pooling_modes(cfg)
            if len(modes) != 1 or others:
                raise ValueError(f"{pool_path}: CPDAE implements exactly one of {POOLINGS} pooling, but this "
                                 f"file enables {modes + others}; pass pooling= "
                                 "explicitly only if you accept different vectors from sentence-transformers")
            out["pooling"] = (modes[0], pool_path)
    sbert_path = os.path.join(path, SBERT_CONFIG)
    if os.path.isfile(sbert_path):
        cfg = _read_json(sbert_path)
        if cfg.get("max_seq_length") is not None:
            out["doc_max_length"] = (_setting(sbert_path, "max_seq_length", cfg["max_seq_length"]), sbert_path)
        if "do_lower_case" in cfg:
            out["do_lower_case"] = (_setting(sbert_path, "do_lower_case", cfg["do_lower_case"]), sbert_path)
    args_path = os.path.join(path, TRAINING_ARGS)
    if os.path.isfile(args_path):
        config = _read_json(args_path).get("config", {})
        if not isinstance(config, dict):
            raise ValueError(f"{args_path}: \"config\" must be an object of the run's options, got "
                             f"{short_repr(config)}")
        for key in ("pooling", "query_max_length", "doc_max_length"):
            if key not in out and config.get(key) is not None:
                out[key] = (_setting(args_path, key, config[key]), args_path)
    if os.path.isfile(modules_path) and "doc_max_length" not in out:
        # sentence-transformers 6 stores no max_seq_length: it cuts at the tokenizer's model_max_length, capped at
        # the config's max_position_embeddings (its Transformer module)
        limit = _tokenizer_length(path)
        if limit is not None:
            out["doc_max_length"] = limit
    if "query_max_length" not in out and out.get("doc_max_length", (None, None))[1] in (
            sbert_path, *(os.path.join(path, n) for n in _TOKENIZER_FILES)):
        # sentence-transformers cuts every text, queries too, at max_seq_length (SentenceTransformer.encode)
        out["query_max_length"] = out["doc_max_length"]
    return out


#: the settings that ``CPDAE.from_pretrained`` takes from a model folder, and their defaults where it declares none
FOLDER_SETTINGS = {"pooling": "cls", "normalize": False, "query_max_length": 32, "doc_max_length": 256}


def folder_settings(path: str, **given: Any) -> Tuple[Dict[str, Any], List[str]]:
    """The :data:`FOLDER_SETTINGS` of an encoder loaded from ``path``, and the warnings they call for.

    A setting ``given`` (not ``None``) wins, with a warning when it contradicts the one the folder declares
    (:func:`read_encoder_settings`); one left ``None`` is the declared one, else its default. A folder that asks for
    lower-cased texts is warned about too: CPDAE does not lower-case them.

    Raises:
        ValueError: as :func:`read_encoder_settings`.
    """
    stored = read_encoder_settings(path)
    notes = []
    if stored.get("do_lower_case", (False,))[0]:
        notes.append(f"{path}: do_lower_case is true in {stored['do_lower_case'][1]}, but CPDAE does not lower-case "
                     "texts; lower-case them before encoding to match sentence-transformers")
    settings = {}
    for key, default in FOLDER_SETTINGS.items():
        value = given.get(key)
        if value is None:
            settings[key] = stored[key][0] if key in stored else default
            continue
        if key in stored and stored[key][0] != value:
            notes.append(f"{key}={value!r} overrides {stored[key][0]!r} stored in {stored[key][1]}")
        settings[key] = value
    return settings, notes


def base_pipeline(base: Union[str, os.PathLike, None]) -> Optional[Dict[str, Any]]:
    """The sentence-transformers pipeline that model directory ``base`` declares, or None when it declares none (a
    Hub name, a plain Hugging Face directory, unreadable files).

    Returns:
        ``{"modules": [module type names, in order], "pooling", "normalize", "max_seq_length", "do_lower_case"}``
        (the last two None where the directory does not say).
    """
    if not base or not os.path.isdir(base) or not os.path.isfile(os.path.join(base, MODULES)):
        return None
    try:
        modules = _read_json(os.path.join(base, MODULES), top=list)
        types = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
        settings = read_encoder_settings(base)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if "pooling" not in settings:
        return None
    return {"modules": types, "pooling": settings["pooling"][0], "normalize": bool(settings["normalize"][0]),
            "max_seq_length": settings.get("doc_max_length", (None,))[0],
            "do_lower_case": settings.get("do_lower_case", (None,))[0]}


_KEPT_TYPES = ("Transformer", "Pooling", "Normalize")


def export_pipeline(base: Union[str, os.PathLike, None], pooling: str, option: str = "pooling") -> Dict[str, Any]:
    """The sentence-transformers pipeline of an export continued from ``base`` with the run's ``pooling``.

    The base's own pipeline is kept, ``Normalize`` included, with its maximum length and lower-casing, when the run
    pools as the base does; a run whose pooling option (``option``) differs replaces the base's Pooling and what
    follows it by its own ``Transformer -> Pooling``. Modules that CPDAE does not implement (e.g. ``Dense``) are never
    exported, and the note says so.

    Returns:
        ``{"normalize": bool, "max_seq_length": int or None, "do_lower_case": bool or None, "kept": bool,
        "modules": [module type names of the export], "note": one sentence for the model card}``.
    """
    pipe = base_pipeline(base)
    own = ["Transformer", "Pooling"]
    if pipe is None:
        return {"normalize": False, "max_seq_length": None, "do_lower_case": None, "kept": False, "modules": own,
                "note": f"Transformer → Pooling ({pooling}): the base declares no sentence-transformers pipeline"}
    if pipe["pooling"] != pooling:
        return {"normalize": False, "max_seq_length": None, "do_lower_case": None, "kept": False, "modules": own,
                "note": f"Transformer → Pooling ({pooling}): the run's {option} ({pooling}) replaces the base's "
                        f"pipeline ({' → '.join(pipe['modules'])}, {pipe['pooling']} pooling)"}
    kept = [t for t in pipe["modules"] if t in _KEPT_TYPES]
    dropped = [t for t in pipe["modules"] if t not in _KEPT_TYPES]
    note = f"{' → '.join(kept)} ({pooling} pooling{', L2-normalised' if pipe['normalize'] else ''}), kept from the base"
    if dropped:
        note += f"; the base's {', '.join(dropped)} module(s) are not exported (CPDAE does not implement them)"
    return {"normalize": pipe["normalize"], "max_seq_length": pipe["max_seq_length"],
            "do_lower_case": pipe["do_lower_case"], "kept": True, "modules": kept, "note": note}
