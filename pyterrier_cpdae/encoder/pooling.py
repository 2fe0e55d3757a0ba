"""Text vectors from token outputs: the one pooling function of training (``pretrain``) and inference (``CPDAE``)."""
from __future__ import annotations

import torch

__all__ = ["POOLINGS", "pool"]

#: Supported poolings: ``"cls"`` (the last layer's first token, as in CPDAE) and ``"mean"`` (masked mean).
POOLINGS = ("cls", "mean")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: str = "cls",
         normalize: bool = False) -> torch.Tensor:
    """Turns token outputs ``(B, L, H)`` into text vectors ``(B, H)``, float32 (float64 for float64 input).

    The pooling is computed in float32 whatever the dtype of ``hidden`` (under bf16/fp16 autocast a
    low-precision masked mean would lose digits), so that training and inference give the same vectors.

    Args:
        hidden: last hidden states.
        attention_mask: ``(B, L)``, 1 for real tokens and 0 for padding.
        pooling: ``"cls"`` (first token) or ``"mean"`` (mean over real tokens; 0 for a text without any).
        normalize: L2-normalise the vectors.

    Raises:
        ValueError: for an unknown pooling.
    """
    if hidden.dtype not in (torch.float32, torch.float64):  # half precision is widened; float64 stays float64
        hidden = hidden.float()
    if pooling == "cls":
        vecs = hidden[:, 0]
    elif pooling == "mean":
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        vecs = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    else:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {POOLINGS}")
    if normalize:
        vecs = torch.nn.functional.normalize(vecs, p=2, dim=-1)
    return vecs
