"""Finite training: :class:`FiniteGuard` decides once per optimizer step whether an update may be applied, and
:class:`NonFiniteError` stops a run that met a non-finite loss, gradient norm or weight."""
from __future__ import annotations

import logging
import math
from typing import Optional

import torch
from torch import nn

__all__ = ["MAX_SKIPPED_STEPS", "NonFiniteError", "nonfinite_flags", "nonfinite_tensors", "FiniteGuard"]

logger = logging.getLogger(__name__)

#: Consecutive optimizer steps whose gradients fp16 loss scaling may skip as non-finite (the scaler lowers its scale
#: after each) before the run stops: from the default scale 2**16, 20 halvings reach 2**-4.
MAX_SKIPPED_STEPS = 20


# ----------------------------------------------------------------------------- finite training
class NonFiniteError(FloatingPointError):
    """Training met a non-finite loss, gradient norm or weight and stopped; nothing was saved from such weights."""


def nonfinite_flags(module: nn.Module) -> tuple[list[str], Optional[torch.Tensor]]:
    """The names of the floating-point parameters and buffers of ``module`` and, on their device, a float tensor
    holding 1 for each that holds a NaN or an infinity, else 0 (None when there is none). Queued, not waited for:
    no device synchronisation."""
    named = [(n, t) for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_floating_point()]
    if not named:
        return [], None
    return [n for n, _ in named], (~torch.stack([torch.isfinite(t.detach()).all() for _, t in named])).float()


def nonfinite_tensors(module: nn.Module) -> list[str]:
    """Names of the floating-point parameters and buffers of ``module`` holding a NaN or an infinity (one
    device synchronisation; empty when all are finite)."""
    names, bad = nonfinite_flags(module)
    if bad is None:
        return []
    return [n for n, b in zip(names, bad.tolist()) if b]


def _fmt(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in values.items())


class FiniteGuard:
    """Decides, once per optimizer step, whether an update may be applied.

    A non-finite loss (or loss term) stops the run at once: loss scaling cannot repair a forward pass. A
    non-finite gradient norm stops it at once too, except under fp16 loss scaling (``loss_scaling``), where
    the scaler skips that update and lowers its scale: then only more than ``max_skipped`` consecutive skipped
    steps stop the run.

    Args:
        loss_scaling: Whether an fp16 gradient scaler is in use.
        max_skipped: Consecutive skipped steps allowed under loss scaling.
    """

    def __init__(self, loss_scaling: bool = False, max_skipped: int = MAX_SKIPPED_STEPS):
        self.loss_scaling = loss_scaling
        self.max_skipped = max_skipped
        self.skipped = 0

    def check(self, step: int, losses: dict[str, float], grad_norm: float) -> None:
        """Check the losses (``{"loss": ..., <term>: ...}``) and gradient norm of optimizer step ``step``
        (1-based, the step of the log row it would write).

        Raises:
            NonFiniteError: naming the step, the non-finite loss terms or the gradient norm.
        """
        bad = [k for k, v in losses.items() if not math.isfinite(v)]
        if bad:
            terms = [k for k in bad if k != "loss"]
            what = (f"loss terms {', '.join(terms)} are" if len(terms) > 1 else f"loss term {terms[0]} is" if terms
                    else "total loss is (its terms are finite)")
            raise NonFiniteError(f"step {step}: the {what} not finite ({_fmt(losses)})")
        if math.isfinite(grad_norm):
            self.skipped = 0
            return
        if self.loss_scaling and self.skipped < self.max_skipped:
            self.skipped += 1
            logger.warning("step %d: gradient norm %s under fp16 loss scaling: the scaler skips this update "
                           "(%d consecutive, at most %d)", step, grad_norm, self.skipped, self.max_skipped)
            return
        after = (f" after {self.skipped} consecutive updates skipped by fp16 loss scaling" if self.loss_scaling
                 else "")
        raise NonFiniteError(f"step {step}: the gradient norm is {grad_norm}{after} (losses finite: "
                             f"{_fmt(losses)})")
