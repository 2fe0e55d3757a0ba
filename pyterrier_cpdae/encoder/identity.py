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

import numpy as np
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


#: dtypes whose CPU tensors are summed by numpy (float64 accumulation, 5x faster than torch's float64 sum on the CPU)
_NUMPY_SUM = (torch.float16, torch.float32, torch.float64)


def weights_key(model: torch.nn.Module) -> Tuple:
    """The cheap identity of ``model``'s weights (module docstring): equal keys, the same weights.

    Read before every window an OpenVINO graph encodes and by every :meth:`~.cpdae.CPDAE.producer` call: the sums of
    a CPU tensor are numpy's (float64 accumulation; MiniLM's 22M weights in ~25 ms instead of ~120 ms), those of
    other tensors torch's, all of them fetched with one device-to-host copy (one synchronisation on a GPU, not one
    per tensor)."""
    with torch.no_grad():
        named = list(_tensors(model))
        values: list = [None] * len(named)
        on_device = []
        for i, (_, t) in enumerate(named):
            t = t.detach()
            if t.device.type == "cpu" and t.dtype in _NUMPY_SUM:
                values[i] = float(np.add.reduce(t.reshape(-1).numpy(), dtype=np.float64))
            else:
                on_device.append((i, torch.sum(t, dtype=torch.float64)))
        if on_device:
            sums = [s for _, s in on_device]
            got = torch.stack(sums).tolist() if len({s.device for s in sums}) == 1 else [float(s) for s in sums]
            for (i, _), v in zip(on_device, got):
                values[i] = v
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
