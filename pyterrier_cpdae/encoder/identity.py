"""What identifies an encoder: one digest, :func:`encoder_digest`, over what identifies the weights it computes its
vectors with, whatever they were loaded from (:func:`weights_key`), and the options that change its vectors.

:func:`encoder_digest` is the encoder's identity (:meth:`~.cpdae.CPDAE.identity`): what it keys its caches by (its
:meth:`~.cpdae.CPDAE.producer` record, and with it the stamp its rows carry; its compiled OpenVINO graph). The
producer record's weights fields are what a dense index stores and compares (their format is the index's): they are
computed from the weights only when the identity changes.

:func:`content_digest` hashes the encoder's own tensors (names relative to the base model, float32 values), so the
same weights give the same digest whether they were loaded from a folder (:func:`~.loading.load_encoder`) or handed
over in memory (``CPDAE(model, tokenizer)``, with or without a pooler, in any dtype); tensors that never take part in
an encoding are left out (the pooler: texts are pooled from the hidden states; integer buffers such as
``position_ids``). The digest is kept per module and computed again only when :func:`weights_key` changes.

:func:`weights_key` is a digest of the contents of a module's encoding tensors (xxHash's 128-bit XXH3 over their
names, dtypes, shapes and bytes), read before every use of something built from them (a compiled OpenVINO graph, a
content digest, every :meth:`~.cpdae.CPDAE.producer` call): any edit of any value changes it, in place or not, seen
by torch's version counter or not (an edit through ``.data``, two rows of the embedding matrix swapped). XXH3 reads
memory at several GB/s, so taking it at every load costs a few tens of milliseconds for a BERT-base encoder
(``experiments/results/weights_key_timing.md``), less than the float64 sums the key was built from before.
"""
from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any, Iterator, Mapping, Optional, Tuple

import torch
import xxhash

from .loading import weights_digest

__all__ = ["encoder_digest", "content_digest", "legacy_digest", "weights_key"]

_DIGESTS: "weakref.WeakKeyDictionary[Any, Tuple[str, str]]" = weakref.WeakKeyDictionary()
_LEGACY: "weakref.WeakKeyDictionary[Any, Tuple[str, Optional[str]]]" = weakref.WeakKeyDictionary()


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
    withstand someone crafting a collision on purpose (``content_digest``, SHA-256, is what an index records)."""
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, t in _tensors(model):
            h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
            h.update(_tensor_bytes(t))
    return h.hexdigest()


def content_digest(model: torch.nn.Module, key: Optional[str] = None) -> str:
    """SHA-256 (hex, 16 characters) of ``model``'s encoding tensors: their names (sorted), shapes and float32 values
    (what an index records as ``weights_content``), computed again only when :func:`weights_key` (``key``, when the
    caller has just taken it) changes."""
    key = weights_key(model) if key is None else key
    have = _DIGESTS.get(model)
    if have is not None and have[0] == key:
        return have[1]
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in sorted(_tensors(model), key=lambda nt: nt[0]):
            h.update(f"{name} {tuple(t.shape)}\n".encode())
            h.update(memoryview(t.detach().to("cpu", torch.float32).contiguous().reshape(-1).numpy()).cast("B"))
    digest = h.hexdigest()[:16]
    _DIGESTS[model] = (key, digest)
    return digest


def legacy_digest(model: torch.nn.Module, key: Optional[str] = None) -> Optional[str]:
    """:func:`~.loading.weights_digest` of an in-memory model's whole state dict (what an index recorded as
    ``weights_sha256`` before ``weights_content``), kept per module while :func:`weights_key` is unchanged."""
    key = weights_key(model) if key is None else key
    have = _LEGACY.get(model)
    if have is None or have[0] != key:
        have = _LEGACY[model] = (key, weights_digest(model))
    return have[1]


def encoder_digest(weights: str, options: Mapping[str, Any]) -> str:
    """The identity of an encoder: XXH3-128 (hex) over ``weights`` (its :func:`weights_key`; the model's name while
    its weights are not loaded) and the canonical JSON of ``options``, the options that change its vectors
    (:meth:`~.cpdae.CPDAE.vector_options`: pooling, normalisation, both maximum lengths, the autocast dtype, in their
    canonical spellings). Equal digests, the same vectors for every text; options that do not change the vectors
    (batching, backend, device, progress bar) are not part of it."""
    if not isinstance(weights, str) or not weights:
        raise ValueError(f"weights must be a weights key or a model name, got {weights!r}")
    h = xxhash.xxh3_128()
    h.update(weights.encode() + b"\n")
    h.update(json.dumps(dict(options), sort_keys=True, separators=(",", ":"), default=str).encode())
    return h.hexdigest()
