"""Finite training: :class:`NonFiniteError` stops a run that met a non-finite loss or weight (raised by
:class:`pretrain.training.trainer.PretrainCallback` and before a checkpoint or the export is written)."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["NonFiniteError", "nonfinite_tensors"]


class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss or weight and stopped; nothing was saved from such weights."""


def nonfinite_tensors(module: nn.Module) -> list[str]:
    """Names of the floating-point parameters and buffers of ``module`` holding a NaN or an infinity (one device
    synchronisation)."""
    named = [(n, t) for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_floating_point()]
    bad = (~torch.stack([torch.isfinite(t.detach()).all() for _, t in named])).tolist() if named else []
    return [n for (n, _), b in zip(named, bad) if b]
