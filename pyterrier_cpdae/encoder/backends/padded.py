"""The PyTorch backend in padded batches: each batch padded to its longest text, run eagerly, then pooled (the
model may be a view whose last layer computes ``[CLS]`` only, :mod:`~pyterrier_cpdae.encoder.first_token`)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..batching import pad
from ..policy import ASYNC_DEVICES
from ..pooling import pool
from .base import Backend

__all__ = ["PaddedTorch"]


class PaddedTorch(Backend):
    """Padded batches through a PyTorch model (``"torch"``)."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_id: int, pooling: str, normalize: bool):
        self.model, self.device, self.pad_id, self.pooling, self.normalize = model, device, pad_id, pooling, normalize

    def forward(self, seqs: Sequence[Sequence[int]], lengths: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
        """One padded batch through the model: its token outputs and ``(B, longest)`` mask, for
        :func:`~pyterrier_cpdae.encoder.pooling.pool`.

        On :data:`~pyterrier_cpdae.encoder.policy.ASYNC_DEVICES`, with SDPA attention, the attention mask is decided
        on the host: none when no row is padded (as transformers decides), else a ``(B, 1, 1, longest)`` boolean
        mask, which transformers passes on as it is. Given the 2D mask, transformers would test ``mask.all()`` on the
        device, and the host would wait there for the previous batch at every batch."""
        input_ids, mask = pad(seqs, lengths, self.pad_id)
        full = int(np.min(lengths)) == mask.shape[1]
        input_ids = torch.from_numpy(input_ids).to(self.device, non_blocking=True)
        mask = torch.from_numpy(mask).to(self.device, non_blocking=True)
        attention: Optional[torch.Tensor] = mask
        if self.device.type in ASYNC_DEVICES and getattr(self.model.config, "_attn_implementation", None) == "sdpa":
            attention = None if full else mask[:, None, None, :].bool()
        return self.model(input_ids=input_ids, attention_mask=attention)[0], mask

    def run(self, ids: List[List[int]], lengths: np.ndarray, batches: List[np.ndarray], out: np.ndarray,
            bar: Optional[Any] = None) -> None:
        pooled = []
        for rows in batches:
            hidden, mask = self.forward([ids[i] for i in rows], lengths[rows])
            pooled.append(pool(hidden, mask, self.pooling, self.normalize))
            if bar is not None:
                bar.update(len(rows))
        # one copy back per window: on an asynchronous device no batch waits for the one before
        out[np.concatenate(batches)] = torch.cat(pooled).cpu().numpy()
