"""What identifies the weights an encoder computes its vectors with, whatever they were loaded from.

:func:`content_digest` hashes the encoder's own tensors (names relative to the base model, float32 values), so the
same weights give the same digest whether they were loaded from a folder (:func:`~.loading.load_encoder`) or handed
over in memory (``CPDAE(model, tokenizer)``, with or without a pooler, in any dtype); tensors that never take part in
an encoding are left out (the pooler: texts are pooled from the hidden states; integer buffers such as
``position_ids``). The digest is kept per module and computed again only when :func:`weights_key` changes.

:func:`weights_key` is the cheap identity of a module's weights, read before every use of something built from them
(a compiled OpenVINO graph, a digest): each tensor's storage address and torch's version counter (bumped by every
in-place change under ``torch.no_grad()``, ``load_state_dict``, an optimizer step) and its sum in float64 (which also
changes with an edit through ``.data``, which the version counter does not see).
"""
from __future__ import annotations

import hashlib
import weakref
from typing import Any, Iterator, Optional, Tuple

import torch

from .loading import weights_digest

__all__ = ["content_digest", "legacy_digest", "weights_key"]

_DIGESTS: "weakref.WeakKeyDictionary[Any, Tuple[Tuple, str]]" = weakref.WeakKeyDictionary()
_LEGACY: "weakref.WeakKeyDictionary[Any, Tuple[Tuple, Optional[str]]]" = weakref.WeakKeyDictionary()


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


def weights_key(model: torch.nn.Module) -> Tuple:
    """The cheap identity of ``model``'s weights (module docstring): equal keys, the same weights."""
    with torch.no_grad():
        named = list(_tensors(model))
        sums = [torch.sum(t.detach(), dtype=torch.float64) for _, t in named]
        # one device-to-host copy for all the sums (one synchronisation on a GPU, not one per tensor)
        values = torch.stack(sums).tolist() if len({s.device for s in sums}) == 1 else [float(s) for s in sums]
        return tuple((name, t.data_ptr(), t._version, v) for (name, t), v in zip(named, values))


def content_digest(model: torch.nn.Module) -> str:
    """SHA-256 (hex, 16 characters) of ``model``'s encoding tensors: their names (sorted), shapes and float32 values."""
    key = weights_key(model)
    have = _DIGESTS.get(model)
    if have is not None and have[0] == key:
        return have[1]
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in sorted(_tensors(model), key=lambda nt: nt[0]):
            h.update(f"{name} {tuple(t.shape)}\n".encode())
            h.update(t.detach().to("cpu", torch.float32).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    digest = h.hexdigest()[:16]
    _DIGESTS[model] = (key, digest)
    return digest


def legacy_digest(model: torch.nn.Module) -> Optional[str]:
    """:func:`~.loading.weights_digest` of an in-memory model's whole state dict (what an index recorded as
    ``weights_sha256`` before ``weights_content``), kept per module while :func:`weights_key` is unchanged."""
    key = weights_key(model)
    have = _LEGACY.get(model)
    if have is None or have[0] != key:
        have = _LEGACY[model] = (key, weights_digest(model))
    return have[1]
