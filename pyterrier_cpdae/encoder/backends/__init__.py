"""The encoder's backends, one module each, and the one function that chooses among them (:func:`choose_backend`).

* :mod:`~pyterrier_cpdae.encoder.backends.padded`: ``"torch"``, PyTorch on padded batches;
* :mod:`~pyterrier_cpdae.encoder.backends.unpadded`: ``"torch-unpadded"``, PyTorch on packed batches through a
  variable-length attention kernel (CUDA in bf16/fp16, a BERT model);
* :mod:`~pyterrier_cpdae.encoder.backends.openvino`: ``"openvino"``, an OpenVINO graph compiled from the model (the
  CPU).

:class:`~pyterrier_cpdae.CPDAE` asks :func:`choose_backend` once, at its first encoding, and logs the answer at INFO
with its reason (``encoder backend: openvino (reason: ...)``, logger ``pyterrier_cpdae.encoder.cpdae``); it asks again
only when what the choice was made from changes: an option set on the encoder, ``$PYTERRIER_CPDAE_BACKEND``, a
compilation that failed, or, for the automatic choice that waits for :data:`~.policy.OPENVINO_MIN_TOKENS` tokens
before it compiles OpenVINO, the encoding that reaches them (the choice says so: :attr:`BackendChoice.switch_at`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..attention import first_token_kernel_ok
from ..policy import _DTYPE_NAMES
from .base import Backend
from .openvino import OpenVINOBackend
from .padded import PaddedTorch
from .unpadded import UnpaddedTorch

__all__ = ["Backend", "BackendChoice", "choose_backend", "build_backend", "PaddedTorch", "UnpaddedTorch",
           "OpenVINOBackend", "BACKEND_NAMES"]

#: the backends :func:`choose_backend` chooses among (the option ``backend=`` names ``"torch"`` or ``"openvino"``;
#: ``"torch"`` runs packed batches, ``"torch-unpadded"``, where ``unpad`` and the kernel allow)
BACKEND_NAMES = (PaddedTorch.name, UnpaddedTorch.name, OpenVINOBackend.name)


@dataclass(frozen=True)
class BackendChoice:
    """What :func:`choose_backend` chose and why.

    Attributes:
        name: one of :data:`BACKEND_NAMES`.
        reason: why, in words (logged).
        switch_at: for the automatic choice that compiles OpenVINO only once the encoder has encoded this many
            tokens (over all its calls), that count; the choice is made again when it is reached. ``None``: final.
    """
    name: str
    reason: str
    switch_at: Optional[int] = None

    def __str__(self) -> str:
        return f"encoder backend: {self.name} (reason: {self.reason})"


def choose_backend(*, requested: Optional[str], origin: str, device: torch.device, dtype: torch.dtype,
                   packed: bool, loaded: bool, tokens: int, min_tokens: int, openvino_failed: bool = False,
                   openvino_installed: Callable[[], bool]) -> BackendChoice:
    """The backend of an encoder's next encoding, and the reason.

    Args:
        requested: ``"torch"``, ``"openvino"`` or ``None`` (automatic): the option ``backend``, else
            ``$PYTERRIER_CPDAE_BACKEND``.
        origin: where ``requested`` comes from, for the reason and errors (``"backend='openvino'"``).
        device / dtype: where and in which autocast dtype the encoder runs.
        packed: whether PyTorch would run packed batches (the ``unpad`` option and a kernel for this model, device
            and dtype: :func:`~.unpadded.packing_kernel`).
        loaded: whether the model is loaded by the encoder from a folder or the Hub (``from_pretrained``), rather
            than handed over in memory (it may be training: its weights must be read live, not copied into a graph).
        tokens: tokens the encoder has encoded so far, this window included.
        min_tokens: the automatic choice compiles OpenVINO once ``tokens`` reaches it (:data:`~.policy.OPENVINO_MIN_TOKENS`).
        openvino_failed: OpenVINO failed to compile this model before (the automatic choice then stays on PyTorch).
        openvino_installed: says whether the ``openvino`` package imports (asked only when it matters).

    Raises:
        ValueError: ``openvino`` requested off the CPU or in float16.
        ImportError: ``openvino`` requested and not installed.
    """
    torch_name = UnpaddedTorch.name if packed else PaddedTorch.name
    how = "packed batches" if packed else "padded batches"
    if requested == "torch":
        return BackendChoice(torch_name, f"{origin}, {how}")
    if requested == "openvino":
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"backend='openvino' runs on the CPU in float32 or bf16, not on {device} "
                             f"in {_DTYPE_NAMES.get(dtype, dtype)}")
        if not openvino_installed():
            raise ImportError("backend='openvino' needs the openvino package: pip install 'pyterrier-cpdae[openvino]'")
        return BackendChoice(OpenVINOBackend.name, origin)
    why_not = None
    if device.type != "cpu":
        why_not = f"OpenVINO runs on the CPU, this encoder on {device}"
    elif dtype != torch.float32:
        why_not = f"OpenVINO is chosen automatically in float32 only, this encoder runs in {_DTYPE_NAMES.get(dtype)}"
    elif not loaded:
        why_not = "an in-memory model (it may be training: its weights are read live)"
    elif openvino_failed:
        why_not = "OpenVINO could not compile this model"
    elif not openvino_installed():
        why_not = "the openvino package is not installed (pip install 'pyterrier-cpdae[openvino]')"
    if why_not is not None:
        return BackendChoice(torch_name, f"automatic, {how}: {why_not}")
    if tokens < min_tokens:
        return BackendChoice(torch_name, f"automatic: {tokens:,} tokens encoded so far; OpenVINO is compiled once "
                                         f"this encoder has encoded {min_tokens:,} (OPENVINO_MIN_TOKENS), where its "
                                         "faster encoding repays the compilation", switch_at=min_tokens)
    return BackendChoice(OpenVINOBackend.name, f"automatic: a model loaded on the CPU in float32 that has encoded "
                                                f"{tokens:,} tokens, at least OPENVINO_MIN_TOKENS={min_tokens:,}")


def build_backend(name: str, *, model: torch.nn.Module, trimmed: Optional[torch.nn.Module], kernel: Optional[Any],
                  compiled: Optional[Any], device: torch.device, dtype: torch.dtype, pad_id: int, pooling: str,
                  normalize: bool) -> Backend:
    """The backend object ``name`` (:attr:`BackendChoice.name`) for one encoding call of ``model``.

    ``trimmed`` is the model with its last layer at ``[CLS]`` only, where the encoder uses it (``None``: the full
    model); ``kernel`` the variable-length attention kernel of packed batches; ``compiled`` the OpenVINO graph
    (``"openvino"``). Packed batches use ``trimmed`` only where the kernel takes one query row per text."""
    if name == OpenVINOBackend.name:
        return OpenVINOBackend(compiled, pad_id)
    if name == UnpaddedTorch.name:
        first = trimmed is not None and first_token_kernel_ok(kernel, str(device), dtype)
        return UnpaddedTorch(trimmed if first else model, device, kernel, pooling, normalize, first_token=first)
    return PaddedTorch(trimmed if trimmed is not None else model, device, pad_id, pooling, normalize)
