"""What identifies an encoder: one digest, :func:`encoder_digest`, over the digest of the weights it computes its
vectors with (:func:`weights_sha256`) and the options that change its vectors. Every stored identity is read from
these two parts.

:func:`encoder_digest` is the encoder's identity (:meth:`~.cpdae.CPDAE.identity`): what it keys its caches by (its
:meth:`~.cpdae.CPDAE.producer` record, and with it the stamp its rows carry; its compiled OpenVINO graph).

:func:`producer_record` spells the same two parts out as the fields a dense index stores and compares (their format
is the index's): the options by name, and the weights' digest cut to :data:`RECORD_DIGEST_CHARS` hex characters as
``weights_content``. ``weights_sha256`` holds the same value, except while the weights are those of a local folder's
files, unedited since they were loaded: then it is the digest of those files (:func:`files_sha256`), which indexes
recorded before ``weights_content`` existed compare (``_producers.py``), and which a model card records in full.

:func:`weights_sha256` hashes the encoder's own tensors (names relative to the base model, float32 values), so the
same weights give the same digest whether they were loaded from a folder (:func:`~.loading.load_encoder`) or handed
over in memory (``CPDAE(model, tokenizer)``, with or without a pooler, in any dtype); tensors that never take part in
an encoding are left out (the pooler: texts are pooled from the hidden states; integer buffers such as
``position_ids``). The digest is kept per module and computed again only when :func:`weights_key` changes.

:func:`weights_key` is no identity, only what tells that a module's weights changed: a digest of the contents of its
encoding tensors (xxHash's 128-bit XXH3 over their names, dtypes, shapes and bytes), read before every use of
something built from them (a compiled OpenVINO graph, a weights digest, every :meth:`~.cpdae.CPDAE.producer` call):
any edit of any value changes it, in place or not, seen by torch's version counter or not (an edit through
``.data``, two rows of the embedding matrix swapped). XXH3 reads memory at several GB/s, so taking it at every use
costs a few tens of milliseconds for a BERT-base encoder (``experiments/results/weights_key_timing.md``).
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import xxhash

__all__ = ["encoder_digest", "weights_sha256", "files_sha256", "producer_record", "identity_of", "producer_of",
           "weights_key", "content_digest",
           "legacy_digest", "state_dict_sha256", "RECORD_DIGEST_CHARS", "SAFETENSORS_WEIGHTS"]

#: the hex characters of a digest that a producer record keeps (``weights_content``, ``weights_sha256``)
RECORD_DIGEST_CHARS = 16

#: a model folder's safetensors weights: one file, or an index naming its shards
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")

_DIGESTS: "weakref.WeakKeyDictionary[Any, Tuple[str, str]]" = weakref.WeakKeyDictionary()
_LEGACY: "weakref.WeakKeyDictionary[Any, Tuple[str, Optional[str]]]" = weakref.WeakKeyDictionary()
_FILES: Dict[tuple, str] = {}  # (files' real paths, devices, inodes, sizes, mtimes, ctimes) -> SHA-256


def _tensors(model: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the floating tensors that compute an encoding, named relative to the base model."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    for name, t in model.state_dict(keep_vars=True).items():
        if not t.is_floating_point():
            continue
        if prefix and name.startswith(prefix + "."):
            name = name[len(prefix) + 1:]
        if name.split(".")[0] == "pooler":
            continue
        yield name, t


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` as stored (a contiguous host copy only for a tensor that is not one already); a bfloat16
    tensor is read as int16, which numpy can hold."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.reshape(-1).numpy()).cast("B")


def weights_key(model: torch.nn.Module) -> str:
    """A digest of the contents of ``model``'s encoding tensors (module docstring): equal keys, the same names,
    dtypes, shapes and bytes; any edit of a value, by any means, changes it.

    XXH3-128 (``xxhash``) over each tensor's name, dtype, shape and stored bytes, read in place on the CPU (a tensor
    on another device is copied to the host first). Not a cryptographic digest: it tells weights apart, it does not
    withstand someone crafting a collision on purpose (:func:`weights_sha256`, SHA-256, is what an index records)."""
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, t in _tensors(model):
            h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
            h.update(_tensor_bytes(t))
    return h.hexdigest()


def weights_sha256(model: torch.nn.Module, key: Optional[str] = None) -> str:
    """The digest of an encoder's weights: SHA-256 (hex) over ``model``'s encoding tensors, in the order of their
    names (relative to the base model), each as ``"<name> <shape>\\n"`` followed by its float32 values' bytes.
    Computed again only when :func:`weights_key` (``key``, when the caller has just taken it) changes."""
    key = weights_key(model) if key is None else key
    have = _DIGESTS.get(model)
    if have is not None and have[0] == key:
        return have[1]
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in sorted(_tensors(model), key=lambda nt: nt[0]):
            h.update(f"{name} {tuple(t.shape)}\n".encode())
            h.update(memoryview(t.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy()).cast("B"))
    digest = h.hexdigest()
    _DIGESTS[model] = (key, digest)
    return digest


def _weight_files(path: str) -> List[str]:
    """The safetensors files of the model folder ``path``: ``model.safetensors``, or the shard index followed by
    the shards it names (sorted); none for a folder without them."""
    single, index = (os.path.join(path, n) for n in SAFETENSORS_WEIGHTS)
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index, encoding="utf8") as f:
            return [index] + [os.path.join(path, os.path.basename(n))
                              for n in sorted(set(json.load(f).get("weight_map", {}).values()))]
    return []


def files_sha256(path: Optional[str]) -> Optional[str]:
    """The digest of a model folder's weights files: SHA-256 (hex) of ``model.safetensors`` (what ``sha256sum
    model.safetensors`` prints), or of a sharded model's index file followed by its shards; ``None`` for a Hub name
    or a folder without safetensors weights. Hashed once per process and file version: a file replaced in place
    (``cp -p``, ``touch -r``) keeps its size and mtime, never its ctime (which no user call can set back)."""
    if not path or not os.path.isdir(path):
        return None
    files = _weight_files(path)
    if not files:
        return None
    key = tuple((os.path.realpath(f), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                for f, st in ((f, os.stat(f)) for f in files))
    if key not in _FILES:
        h = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fin:
                for block in iter(lambda: fin.read(8 << 20), b""):
                    h.update(block)
        _FILES[key] = h.hexdigest()
    return _FILES[key]


def encoder_digest(weights: str, options: Mapping[str, Any]) -> str:
    """The identity of an encoder: XXH3-128 (hex) over ``weights`` (its :func:`weights_sha256`; ``"name:<model>"``
    while the weights of a Hub model are not loaded) and the canonical JSON of ``options``, the options that change
    its vectors (:meth:`~.cpdae.CPDAE.vector_options`: pooling, normalisation, both maximum lengths, the autocast
    dtype, in their canonical spellings). Equal digests, the same vectors for every text; options that do not change
    the vectors (batching, backend, device, progress bar) are not part of it."""
    if not isinstance(weights, str) or not weights:
        raise ValueError(f"weights must be a weights digest or a model name, got {weights!r}")
    h = xxhash.xxh3_128()
    h.update(weights.encode() + b"\n")
    h.update(json.dumps(dict(options), sort_keys=True, separators=(",", ":"), default=str).encode())
    return h.hexdigest()


def producer_record(weights: Optional[str], options: Mapping[str, Any], *, model: str, dim: int,
                    files: Optional[str] = None) -> Dict[str, Any]:
    """The producer record of the encoder whose identity is :func:`encoder_digest` ``(weights, options)``: the
    same parts as fields (:meth:`~.cpdae.CPDAE.producer` says what each means).

    ``weights`` is the :func:`weights_sha256` of the loaded tensors (``None`` while a Hub model is not loaded: the
    record then names only the ``model``); ``files`` the :func:`files_sha256` of the folder they were loaded from,
    given only while they are unedited since. Digests are cut to :data:`RECORD_DIGEST_CHARS` hex characters."""
    cut = RECORD_DIGEST_CHARS
    stamp = files if files is not None else weights
    out: Dict[str, Any] = {"encoder": "CPDAE", "model": str(model), "weights_sha256": stamp[:cut] if stamp else None,
                           "pooling": options["pooling"], "normalize": options["normalize"],
                           "max_length": int(options["doc_max_length"]), "dtype": options["dtype"], "dim": int(dim)}
    if weights is not None:
        out["weights_content"] = weights[:cut]
    return out


def _weights_of(encoder: Any, key: Optional[str] = None) -> Tuple[Optional[torch.nn.Module], Optional[str]]:
    """The module whose weights identify ``encoder`` (a :class:`~pyterrier_cpdae.CPDAE`) and its
    :func:`weights_key` (``key`` when the caller has just taken it); ``(None, None)`` for a Hub model not loaded yet
    (not fetched for an identity). A model in a local folder is loaded."""
    local = encoder.name_or_path is not None and os.path.isdir(encoder.name_or_path)
    module = encoder.model if encoder._model is not None or local else None
    if module is None:
        return None, None
    return module, (weights_key(module) if key is None else key)


def identity_of(encoder: Any, key: Optional[str] = None) -> str:
    """:meth:`CPDAE.identity <pyterrier_cpdae.CPDAE.identity>`: :func:`encoder_digest` of ``encoder``'s
    :func:`weights_sha256` (the model's name while a Hub model is not loaded) and its ``vector_options()``."""
    module, key = _weights_of(encoder, key)
    weights = weights_sha256(module, key) if module is not None else f"name:{encoder.name_or_path}"
    return encoder_digest(weights, encoder.vector_options())


def producer_of(encoder: Any) -> Dict[str, Any]:
    """:meth:`CPDAE.producer <pyterrier_cpdae.CPDAE.producer>`: :func:`producer_record` of the parts of
    ``encoder``'s identity, with the files' digest while its weights are those it loaded from a local folder,
    unedited since; kept on the encoder while its identity holds."""
    module, key = _weights_of(encoder)
    weights = weights_sha256(module, key) if module is not None else None
    options = encoder.vector_options()
    identity = (encoder_digest(weights or f"name:{encoder.name_or_path}", options), encoder.name_or_path)
    cached = encoder.__dict__.get("_producer")
    if cached is not None and cached[0] == identity:  # the record is a function of the identity
        return dict(cached[1])
    # an in-place edit of the loaded module makes them other weights: then the record names only their digest
    edited = getattr(encoder, "_loaded_key", None) not in (None, key)
    files = files_sha256(encoder.name_or_path) if module is not None and not edited else None
    name = encoder.name_or_path if encoder.name_or_path is not None else \
        f"<in-memory {type(encoder._model).__name__}>"
    out = producer_record(weights, options, model=name, dim=encoder.dim, files=files)
    encoder._producer = (identity, out)
    return dict(out)


def content_digest(model: torch.nn.Module, key: Optional[str] = None) -> str:
    """:func:`weights_sha256` cut to :data:`RECORD_DIGEST_CHARS` hex characters: what a producer record holds as
    ``weights_content``."""
    return weights_sha256(model, key)[:RECORD_DIGEST_CHARS]


def legacy_digest(model: torch.nn.Module, key: Optional[str] = None) -> Optional[str]:
    """Deprecated: the SHA-256 of an in-memory model's whole state dict (names, dtypes, shapes, bytes), which
    producer records held as ``weights_sha256`` before it was derived from :func:`weights_sha256`. Kept per module
    while :func:`weights_key` is unchanged."""
    warnings.warn("pyterrier_cpdae.encoder.identity.legacy_digest is deprecated: an encoder's weights have one "
                  "digest, weights_sha256(model)", DeprecationWarning, stacklevel=2)
    key = weights_key(model) if key is None else key
    have = _LEGACY.get(model)
    if have is None or have[0] != key:
        have = _LEGACY[model] = (key, state_dict_sha256(model))
    return have[1]


def state_dict_sha256(model: torch.nn.Module) -> str:
    """SHA-256 (hex, :data:`RECORD_DIGEST_CHARS` characters) of ``model``'s whole state dict: its names, dtypes,
    shapes and bytes (what older producer records hold as ``weights_sha256`` for an in-memory model)."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:RECORD_DIGEST_CHARS]
