"""What the experiments reuse is keyed by the data it came from: content digests of model directories and
collections, and the record beside each index of the collection that built it.

* :func:`file_digests`: the SHA-256 of each file, kept in a cache file under the file's (size, mtime_ns, inode,
  ctime_ns), so that an unchanged file is never read again (a run that reuses an index costs one ``stat`` per file)
  and a file rewritten in place -- even with its size and modification time restored (``cp -p``, ``touch -r``) --
  gets a new ``ctime`` and is hashed again.
* :func:`model_identity`: a digest of every file of a model directory (``experiments/main.py`` names its dense
  indexes, saved runs and pre-training output by it).
* :func:`corpus_fingerprint`: a digest of the files a ``load_dataset`` spec reads its documents from (the built-in
  sample's and BEIR's ``corpus.jsonl``, every file of a TREC folder but ``qrels*``, the document file of a SMART
  collection, the document file(s) ir_datasets names for ``irds:`` ids), with :func:`corpus_changes` naming what
  differs between two.
* :func:`stale_reason` / :func:`record_built_from`: the fingerprint recorded beside an index
  (``<index>.built_from.json``) when it is built, with the encoder settings of a dense index
  (:func:`encoder_key`), and the reason to rebuild it when either no longer matches.
* :func:`topics_digest`: the queries a saved run answered (ids and texts).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional

#: parts of a model directory that never change what the encoder computes (a run's optimizer state and logs)
NOT_MODEL = ("checkpoints", "logs")
#: files of a model directory that describe it and are never read by a loader: its model card (``README.md``,
#: ``MODEL_CARD.md`` beside a card of another origin) and the card's state, where evaluations are added after the
#: model was exported (``pretrain.export.card.add_evaluation``)
NOT_MODEL_FILES = ("README.md", "MODEL_CARD.md", "model_card.json")
#: the record of what built an index, beside it: ``<index path>`` + this suffix
BUILT_FROM = ".built_from.json"


def _read_cache(cache_file: str) -> dict[str, Any]:
    try:
        with open(cache_file, encoding="utf8") as f:
            cache = json.load(f)
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def file_digests(paths: Iterable[os.PathLike | str], cache_file: os.PathLike | str) -> dict[str, str]:
    """``{path: sha256}`` of each file, the digests kept in ``cache_file`` under the file's real path and its (size,
    mtime_ns, inode, ctime_ns): a file whose four values are unchanged is not read again."""
    import hashlib

    def file_digest(path: str, chunk: int = 1 << 22) -> str:  # sha256 of a file (hex)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(chunk), b""):
                h.update(block)
        return h.hexdigest()

    from pyterrier_cpdae._files import write_json_atomic

    cache_file = str(cache_file)
    cache, changed, out = _read_cache(cache_file), False, {}
    for path in paths:
        path = str(path)
        st = os.stat(path)
        key, stamp = os.path.realpath(path), [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]
        entry = cache.get(key)
        if not (isinstance(entry, list) and len(entry) == 5 and entry[:4] == stamp):
            entry = cache[key] = stamp + [file_digest(path)]
            changed = True
        out[path] = entry[4]
    if changed:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(cache_file)), exist_ok=True)
            write_json_atomic(cache_file, cache)
        except OSError:  # the digests are still right; only the next run reads the files again
            pass
    return out


def folder_digest(folder: os.PathLike | str, cache_file: os.PathLike | str) -> str:
    """SHA-256 over the names (relative to ``folder``) and contents of every regular file under ``folder`` (hidden
    ones aside), the contents through :func:`file_digests`' cache: a folder copied elsewhere keeps its digest, a
    file added, removed or edited in place gives another."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    digests = file_digests(files, cache_file)
    h = hashlib.sha256(b"folder\n")
    for f in files:
        h.update(f"{f.relative_to(folder).as_posix()}\0{digests[str(f)]}\n".encode())
    return h.hexdigest()


def model_identity(model: str, cache_file: os.PathLike | str) -> str:
    """A digest of everything in the model directory ``model`` (weights, config, tokenizer, pooling files, run
    records) but its ``checkpoints/``, ``logs/`` and model card (:data:`NOT_MODEL_FILES`, rewritten when an
    evaluation is added).

    It changes whenever the weights do, e.g. when the directory is re-trained in place, so that indexes and saved
    runs computed with other weights are never reused. A model that is not a directory (a hub id) is identified by
    its name.
    """
    if not os.path.isdir(model):
        return hashlib.sha256(f"name:{model}".encode()).hexdigest()
    root = os.path.realpath(model)
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (folder == root and d in NOT_MODEL))
        files += [os.path.join(folder, n) for n in sorted(names)
                  if not n.startswith(".") and not (folder == root and n in NOT_MODEL_FILES)]
    digests = file_digests(files, cache_file)
    total = hashlib.sha256()
    for path in files:
        total.update(f"{os.path.relpath(path, root)}\0{digests[path]}\n".encode())
    return total.hexdigest()


# ----------------------------------------------------------------------------- collections
def _irds_path(handler: Any, method: str) -> Optional[Path]:
    """The file or folder ``handler.<method>()`` names (``docs_path``, ``queries_path``, ``qrels_path``), or None."""
    path = None
    for kwargs in ({"force": False}, {}):  # force=False: the path without downloading; else build it (once)
        try:
            path = getattr(handler, method)(**kwargs)
        except Exception:  # noqa: BLE001 - no such method, or the file cannot be had offline
            path = None
        if path is not None and Path(path).exists():
            return Path(path)
    return None


def _irds_files(irds_id: str, everything: bool = False) -> list[Path]:
    """The file(s) ir_datasets reads ``irds_id``'s documents (and with ``everything`` its queries and qrels) from;
    ``[]`` when its document handler names none."""
    import ir_datasets

    try:
        ds = ir_datasets.load(irds_id)
        parts = [(ds.docs_handler(), "docs_path")]
        if everything:
            parts += [(ds.queries_handler(), "queries_path"), (ds.qrels_handler(), "qrels_path")]
    except Exception:  # noqa: BLE001 - an unknown id or one without documents: load_dataset says which
        return []
    paths = [_irds_path(h, m) for h, m in parts]
    if paths[0] is None:
        return []
    return [f for p in paths if p is not None for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]


def corpus_files(spec: str, everything: bool = False) -> tuple[str, list[Path], Optional[Path]]:
    """``(kind, files, folder)``: the files ``load_dataset(spec)`` reads the documents of ``spec`` from (with
    ``everything``: its topics and qrels too), and the folder their recorded names are relative to (``None``: names
    are the files' own names)."""
    from pyterrier_cpdae.datasets import SMART_LAYOUTS

    def under(folder: Path) -> list[Path]:  # the files the loaders look at (hidden ones aside)
        return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))

    if spec == "sample":
        import importlib.resources

        folder = Path(str(importlib.resources.files("pyterrier_cpdae") / "data" / "sample"))
        return "sample", [folder / n for n in (("corpus.jsonl", "queries.jsonl", "qrels.tsv") if everything
                                               else ("corpus.jsonl",))], folder
    kind, _, rest = spec.partition(":")
    if kind == "irds":
        import ir_datasets

        files, home = _irds_files(rest, everything), Path(ir_datasets.util.home_path())
        return kind, files, (home if all(f.is_relative_to(home) for f in files) else None)
    folder = Path(rest).expanduser()
    if kind == "beir" and not folder.is_dir() and ":" in rest:
        folder = Path(rest.rsplit(":", 1)[0]).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"dataset folder {folder} (from spec {spec!r}) does not exist or is not a folder")
    if everything:
        return kind, under(folder), folder
    if kind == "beir":
        return kind, [folder / "corpus.jsonl"], folder
    if kind == "trec":  # the loader tells documents from topics by their content: every file but the qrels
        return kind, [p for p in under(folder) if not p.name.lower().startswith("qrels")], folder
    if kind == "tsv":
        from pyterrier_cpdae.datasets.tsv import corpus_path

        return kind, [corpus_path(folder, spec)], folder
    if kind in SMART_LAYOUTS:
        docs = SMART_LAYOUTS[kind].docs.lower()
        return kind, sorted(p for p in folder.iterdir()
                            if p.is_file() and p.name.lower() in (docs, docs + ".txt")), folder
    raise ValueError(f"unknown dataset kind {kind!r} in {spec!r}")


def corpus_fingerprint(spec: str, cache_file: os.PathLike | str, everything: bool = False) -> dict[str, Any]:
    """``{"spec", "kind", "files": {name: sha256}, "digest"}`` of the documents of ``load_dataset(spec)`` (with
    ``everything``: of its topics and qrels too, e.g. for a subset written from them).

    ``digest`` hashes the kind and each file's name (relative to the collection's folder) and content, not the
    folder's path: a collection moved or copied elsewhere keeps its digest, one edited in place gets another. An
    ``irds:`` id whose handler names no document file is identified by its id alone (ir_datasets verifies its
    own downloads); ``"files"`` is then empty.
    """
    kind, files, folder = corpus_files(spec, everything)
    digests = file_digests(files, cache_file)
    named = {(str(f.relative_to(folder)) if folder is not None else str(f)): digests[str(f)] for f in files}
    h = hashlib.sha256(f"{kind}\n".encode())
    if not named:
        h.update(f"spec:{spec}\n".encode())
    for name in sorted(named):
        h.update(f"{name}\0{named[name]}\n".encode())
    return {"spec": spec, "kind": kind, "files": named, "digest": h.hexdigest()}


def corpus_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What differs between two :func:`corpus_fingerprint` records, in words."""
    if old.get("kind") != new.get("kind") or not old.get("files") or not new.get("files"):
        return f"built from {old.get('spec')!r}, this run reads {new.get('spec')!r}"
    a, b = old["files"], new["files"]
    parts = [f"{n} changed" for n in sorted(set(a) & set(b)) if a[n] != b[n]]
    parts += [f"{n} is new" for n in sorted(set(b) - set(a))] + [f"{n} is gone" for n in sorted(set(a) - set(b))]
    where = f" ({old.get('spec')} -> {new.get('spec')})" if old.get("spec") != new.get("spec") else ""
    return "its documents differ: " + ", ".join(parts[:5]) + (" ..." if len(parts) > 5 else "") + where


def built_from_file(index_path: os.PathLike | str) -> Path:
    """``<index path>.built_from.json``: the corpus fingerprint the index beside it was built from."""
    return Path(str(index_path).rstrip("/\\") + BUILT_FROM)


def encoder_key(enc: Any, model_id: str) -> dict[str, Any]:
    """Everything that changes the document vectors of the encoder ``enc`` (a ``CPDAE``) made from the model whose
    :func:`model_identity` is ``model_id``: the model's content, the pooling, the normalisation, the document length
    (as the encoder uses it) and the autocast dtype (``$PYTERRIER_CPDAE_DTYPE`` and the device included).

    What it leaves out does not change a vector beyond float32 summation order: the batch size, the token budget,
    the sort window, the backend (OpenVINO within ~3e-6 of PyTorch) and unpadded batches."""
    from pyterrier_cpdae.encoder import default_dtype

    dtype = enc.dtype if enc.dtype is not None else str(default_dtype(enc.device)).replace("torch.", "")
    return {"model": model_id, "pooling": enc.pooling, "normalize": bool(enc.normalize),
            "doc_max_length": int(enc.doc_max_length), "dtype": dtype}


def key_digest(key: dict[str, Any]) -> str:
    """A SHA-256 (hex) of a JSON-able key such as :func:`encoder_key`'s (names an artifact built with it)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def stale_reason(index_path: os.PathLike | str, built: bool, fingerprint: dict[str, Any],
                 encoder: Optional[dict[str, Any]] = None) -> Optional[str]:
    """``None`` when the index at ``index_path`` is built and was built from ``fingerprint``'s documents (and, for a
    dense index, with the encoder settings ``encoder``, :func:`encoder_key`); else why it must be (re)built, in
    words."""
    if not built:
        return "not built yet"
    try:
        have = json.loads(built_from_file(index_path).read_text())
    except (OSError, ValueError):
        have = None
    if not isinstance(have, dict) or "digest" not in have:
        return f"it records no fingerprint of the collection it was built from ({built_from_file(index_path).name})"
    if have["digest"] != fingerprint["digest"]:
        return "it was built from another collection: " + corpus_changes(have, fingerprint)
    if encoder is not None and have.get("encoder") != encoder:
        old = have.get("encoder")
        if not isinstance(old, dict):
            return "it records no encoder settings"
        diff = [f"{k} {old.get(k)!r} -> {encoder.get(k)!r}" if k != "model" else "the model's content"
                for k in sorted(set(old) | set(encoder)) if old.get(k) != encoder.get(k)]
        return "it was built with other encoder settings: " + ", ".join(diff)
    return None


def forget_built_from(index_path: os.PathLike | str) -> None:
    """Drop the record before the index is rebuilt (a build cut short leaves no record, so it is rebuilt again)."""
    built_from_file(index_path).unlink(missing_ok=True)


def record_built_from(index_path: os.PathLike | str, fingerprint: dict[str, Any],
                      encoder: Optional[dict[str, Any]] = None) -> None:
    """Record, once the index is built, the fingerprint of the collection it was built from (and, for a dense index,
    the encoder settings it was built with, :func:`encoder_key`)."""
    from pyterrier_cpdae._files import write_json_atomic

    write_json_atomic(built_from_file(index_path), fingerprint if encoder is None else {**fingerprint,
                                                                                       "encoder": encoder})


def topics_digest(topics: Any) -> str:
    """A digest of the queries of a topics frame (``qid``, ``query``), in order."""
    lines = "".join(f"{q}\t{t}\n" for q, t in zip(topics["qid"].astype(str), topics["query"].astype(str)))
    return hashlib.sha256(lines.encode()).hexdigest()
