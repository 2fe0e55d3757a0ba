"""Unsupervised SimCSE (Gao, Yao & Chen, EMNLP 2021).

Every text of a batch of ``m`` texts is encoded twice; the only difference between the two
encodings is the encoder's dropout (standard dropout masks drawn independently per row, as
the paper's "pass the same sentence twice" does: the batch holds each text twice). With
``h_i`` and ``h_i⁺`` the [CLS] vectors of the two passes, Eq. 1 of the paper::

    ℓ_i = -log  exp(sim(h_i, h_i⁺)/τ) / Σ_{j=1..N} exp(sim(h_i, h_j⁺)/τ)

with cosine similarity ``sim``, temperature ``τ`` (paper: 0.05, ``--temperature``) and the
second passes ``h_j⁺`` of the *global* batch (gathered across processes) as candidates; the
loss is the mean of ``ℓ_i`` over the batch.

Reading taken: the representation is the last layer's [CLS] vector itself; the paper's
unsupervised model adds an MLP over [CLS] during training only (dropped at test time), which
is not added here, so that the trained representation is the one the encoder is used with.
No MLM term (the paper's MLM auxiliary is an option it reports as hurting STS). The text is
not masked, so no mask token is needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..arguments import RunConfig, POSITIVE, opt
from ..model.distributed import world_size
from ..data.masking import pad_and_add_special
from . import register_objective
from .base import Objective, ObjectiveOptions
from .contrast import cosine, paired_info_nce

__all__ = ["SimCSEObjective", "SimCSEOptions"]


@dataclass
class SimCSEOptions(ObjectiveOptions):
    """Options of unsupervised SimCSE."""

    temperature: float = opt(0.05, "InfoNCE temperature τ over cosine similarities (SimCSE: 0.05).", check=POSITIVE)


@register_objective
class SimCSEObjective(Objective):
    """SimCSE (unsupervised): the same text encoded twice, dropout the only noise; InfoNCE over
    cosine similarities of [CLS] with in-batch negatives."""

    name = "simcse"
    fixed_representation = "cls"  # the [CLS] vector is what the contrast trains (and the export pools)
    sequences_per_text = 2
    Options = SimCSEOptions
    #: Gao et al. (EMNLP 2021), unsupervised SimCSE with BERT-base: 1 epoch over 10^6 English Wikipedia sentences,
    #: batch 64, lr 3e-5, max length 32, τ = 0.05 (Appendix A; the authors' run_unsup_example.sh:
    #: --num_train_epochs 1 --per_device_train_batch_size 64 --learning_rate 3e-5 --max_seq_length 32 --temp 0.05,
    #: one process). That script sets no warm-up and no weight decay: Hugging Face Trainer's defaults, 0 and 0.
    presets = {"paper": {"learning_rate": 3e-5, "global_batch_size": 64, "num_train_epochs": 1.0, "max_length": 32,
                         "temperature": 0.05, "warmup_steps": 0.0, "weight_decay": 0.0}}
    loss_names = ("cl",)
    needs_mask_token = False
    contrastive = True
    uses_mlm_head = False  # no MLM term: see Objective.uses_mlm_head
    ddp_find_unused_parameters = True  # the MLM head is not used

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: RunConfig,
                 **extra: Any):
        super().__init__(mlm_model, tokenizer, config, **extra)
        if not float(config.temperature) > 0:
            raise ValueError(f"--temperature must be > 0, got {config.temperature!r}")
        mc = mlm_model.config
        if not (getattr(mc, "hidden_dropout_prob", 0) or getattr(mc, "attention_probs_dropout_prob", 0)):
            raise ValueError(f"objective 'simcse' uses dropout as its only noise, but the model {config.model!r} has "
                             "hidden_dropout_prob = attention_probs_dropout_prob = 0: both encodings of a text would be "
                             "identical; use a checkpoint with dropout")

    def collate(self, examples: list[list[int]], generators: Optional[list[torch.Generator]] = None
                ) -> dict[str, torch.Tensor]:
        """``[CLS] text [SEP]``, padded: ``input_ids``, ``attention_mask`` ``(m, L)`` (nothing random: ``generators``
        is not read; the noise is the encoder's dropout)."""
        if len(examples) < 2 and world_size() == 1:
            raise ValueError(f"objective 'simcse' is contrastive and needs at least 2 texts per batch, got {len(examples)}")
        input_ids, attention_mask, _ = pad_and_add_special(examples, self.tokenizer)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.packs():  # forward's one encoder pass over both copies, laid out here (in the DataLoader's workers)
            batch.update(self.pack("passes", input_ids.repeat(2, 1), attention_mask.repeat(2, 1)))
        return batch

    def losses(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"loss": L_SimCSE, "cl": ...}``; both passes in one encoder call (rows ``i`` and ``i + m``)."""
        m = batch["input_ids"].shape[0]
        ids = batch["input_ids"].repeat(2, 1)
        am = batch["attention_mask"].repeat(2, 1)
        h = self.cls_vectors(self.encode(ids, am, packed=self.packed_inputs(batch, "passes")))
        loss = paired_info_nce(h[:m], h[m:], float(self.config.temperature), cosine)
        return {"loss": loss, "cl": loss.detach()}
