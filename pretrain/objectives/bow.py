"""Bag-of-Words prediction ("Drop your Decoder").

Ma et al., "Drop your Decoder: Pre-training with Bag-of-Word Prediction for Dense Passage
Retrieval" (SIGIR 2024). No decoder: the encoder's [CLS] vector of the masked view is
projected to the vocabulary through the checkpoint's own (tied) MLM head, ``z = head(h_cls)``
(default), or, with ``--bow-projection embeddings``, through the word-embedding matrix alone,
``z = E h_cls`` (Eq. 11's literal "LM head, i.e. its embedding matrix"), and trained
to put its probability mass on the tokens of the input,

    L_BoW = -(1/|S|) * sum_{t in S} log softmax(z)_t,

i.e. cross-entropy against the uniform distribution over the set ``S`` of token ids of the
(unmasked) input, special tokens excluded. The total loss is
``L = L_MLM + w * L_BoW`` with ``w = config.bow_weight``, optionally decayed linearly to 0
over the optimizer steps (``config.bow_weight_schedule = "linear_decay"``).

The batch and the MLM term are the shared ones of :class:`~pretrain.objectives.mlm.MaskedViewsMixin`
(one masked view per text); the BoW term costs one vocabulary projection per *text*.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..arguments import RunConfig, NON_NEGATIVE, opt
from ..data.masking import bag_of_words
from ..model.modeling import mlm_head
from . import register_objective
from .base import MaskedViewsMixin, MLMOptions, Objective, RepresentationOptions

__all__ = ["BOW_SCHEDULES", "BoWObjective", "BoWOptions", "bow_loss", "bow_weight_at"]

BOW_SCHEDULES = ("constant", "linear_decay")


@dataclass
class BoWOptions(RepresentationOptions, MLMOptions):
    """Options of the bag-of-words prediction objective."""

    bow_weight: float = opt(1.0, "BoW: weight of the bag-of-words loss.", check=NON_NEGATIVE)
    bow_weight_schedule: str = opt("constant", "BoW: schedule of the BoW weight over optimizer steps.",
                                   choices=list(BOW_SCHEDULES))
    bow_projection: str = opt("mlm_head", "BoW: how [CLS] becomes vocabulary logits: mlm_head (the checkpoint's full "
                              "MLM head: transform, tied embeddings, bias) or embeddings (Eq. 11 literally, the "
                              "embedding matrix alone: z = E h).", choices=["mlm_head", "embeddings"])


def bow_weight_at(weight: float, schedule: str, step: int, total_steps: int) -> float:
    """The BoW coefficient after ``step`` of ``total_steps`` optimizer steps.

    ``"constant"``: ``weight``; ``"linear_decay"``: ``weight * max(0, 1 - step / total_steps)``.

    Raises:
        ValueError: for an unknown schedule.
    """
    if schedule not in BOW_SCHEDULES:
        raise ValueError(f"unknown bow_weight_schedule {schedule!r}; choose one of {BOW_SCHEDULES}")
    if schedule == "linear_decay" and total_steps > 0:
        return float(weight) * max(0.0, 1.0 - step / total_steps)
    return float(weight)


def bow_loss(logits: torch.Tensor, bow: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` against the uniform distribution over each row's bag of words.

    Args:
        logits: ``(B, |V|)`` vocabulary logits.
        bow: ``(B, |V|)`` multi-hot (or non-negative weights) of each text's token set.

    Returns:
        Scalar: mean over texts of ``-(1/|S|) * sum_{t in S} log softmax(z)_t`` (texts with an
        empty bag are skipped; 0 if all are empty).

    Raises:
        ValueError: if the shapes differ.
    """
    if logits.shape != bow.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and bow {tuple(bow.shape)} must have the same shape")
    logp = F.log_softmax(logits.float(), dim=-1)
    bow = bow.to(logp.dtype)
    size = bow.sum(-1)
    keep = size > 0
    if not bool(keep.any()):
        return logits.sum() * 0.0
    per_text = -(bow[keep] * logp[keep]).sum(-1) / size[keep]
    return per_text.mean()


@register_objective
class BoWObjective(MaskedViewsMixin, Objective):
    """MLM + ``w`` x bag-of-words prediction from the [CLS] vector through the MLM head.

    Losses ``{"loss", "mlm", "bow"}``; ``loss = mlm + w * bow`` where ``w`` is
    :attr:`bow_weight` (updated by :meth:`on_step`).

    Raises:
        ValueError: for an unknown ``bow_weight_schedule`` or a negative ``bow_weight``.
    """

    name = "bow"
    Options = BoWOptions
    #: Ma et al. (SIGIR 2024) on Wikipedia + BookCorpus; the authors' README (github.com/ma787639046/bowdpr,
    #: "Pre-training with Bag-of-Word Prediction"): bert-base-uncased, --max_seq_length 512 --mlm_probability 0.30
    #: --max_steps 140000 --warmup_steps 4000 --learning_rate 3e-4 --weight_decay 0.01
    #: --per_device_train_batch_size 64 --gradient_accumulation_steps 4 under a plain `torchrun` (one process):
    #: 256 texts per step, its cosine LR schedule with a floor of 0.1 of the peak (cosine_with_min_lr). Not
    #: expressible here (a documented departure): the BoW weight's cosine decay to 0.1 (--bow_weight_schedule:
    #: constant or linear to 0).
    presets = {"paper": {"learning_rate": 3e-4, "global_batch_size": 256, "max_steps": 140000,
                         "warmup_steps": 4000, "weight_decay": 0.01, "max_length": 512,
                         "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
                         "mlm_probability": 0.3}}
    loss_names = ("mlm", "bow")
    num_views = 1
    ddp_find_unused_parameters = False

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig,
                 **extra: Any):
        if config.bow_weight_schedule not in BOW_SCHEDULES:
            raise ValueError(f"unknown bow_weight_schedule {config.bow_weight_schedule!r}; choose one of {BOW_SCHEDULES}")
        if config.bow_weight < 0:
            raise ValueError(f"bow_weight must be >= 0, got {config.bow_weight}")
        if config.bow_projection not in ("mlm_head", "embeddings"):
            raise ValueError(f"bow_projection must be 'mlm_head' or 'embeddings', got {config.bow_projection!r}")
        super().__init__(mlm_model, tokenizer, config, **extra)
        self._mask_setup()
        self.bow_weight = float(config.bow_weight)

    def vocabulary_logits(self, cls: torch.Tensor) -> torch.Tensor:
        """``(B, H)`` [CLS] vectors → ``(B, |V|)`` logits (``--bow-projection``)."""
        if self.config.bow_projection == "embeddings":
            return cls @ self.mlm_model.get_input_embeddings().weight.T
        return mlm_head(self.mlm_model)(cls)

    def on_step(self, step: int, total_steps: int) -> None:
        """Set the BoW weight for the next update; the trainer calls this after every optimizer step."""
        self.bow_weight = bow_weight_at(self.config.bow_weight, self.config.bow_weight_schedule, step, total_steps)

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, labels = self.encode_views(batch)
        l_mlm = self.masked_lm_loss(hidden, labels)
        special = batch["special_tokens_mask"].bool() | ~batch["attention_mask"].bool()
        bow = bag_of_words(batch["input_ids"], special, self.mlm_model.config.vocab_size)
        l_bow = bow_loss(self.vocabulary_logits(self.text_vectors(hidden, batch["attention_mask"])), bow)
        return {"loss": l_mlm + self.bow_weight * l_bow, "mlm": l_mlm.detach(), "bow": l_bow.detach()}
