"""Plain masked-language-model pre-training: the shared baseline of every objective.

Each text is masked once (BERT 15%, 80/10/10; whole words with ``--whole-word-mask``) and
the MLM cross-entropy is computed on the masked positions only. The masked views and the
MLM term are the shared ones of :class:`~pretrain.objectives.base.MaskedViewsMixin`.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..arguments import RunConfig
from . import register_objective
from .base import MaskedViewsMixin, MLMOptions, Objective

__all__ = ["MLMObjective", "MaskedViewsMixin"]  # MaskedViewsMixin: re-exported from .base (its former home)


@register_objective
class MLMObjective(MaskedViewsMixin, Objective):
    """BERT masked-LM pre-training (one masked view per text); losses ``{"loss", "mlm"}``."""

    name = "mlm"
    Options = MLMOptions
    loss_names = ("mlm",)
    num_views = 1
    ddp_find_unused_parameters = False

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig,
                 **extra: Any):
        super().__init__(mlm_model, tokenizer, config, **extra)
        self._mask_setup()

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, labels = self.encode_views(batch)
        loss = self.masked_lm_loss(hidden, labels)
        return {"loss": loss, "mlm": loss.detach()}
