"""Bag-of-Words prediction ("Drop your Decoder").

Ma et al., "Drop your Decoder: Pre-training with Bag-of-Word Prediction for Dense Passage
Retrieval" (SIGIR 2024). No decoder: the encoder's [CLS] vector of the masked view is
projected to the vocabulary through the checkpoint's own (tied) MLM head, ``z = head(h_cls)``,
and trained to put its probability mass on the tokens of the input,

    L_BoW = -(1/|S|) * sum_{t in S} log softmax(z)_t,

i.e. cross-entropy against the uniform distribution over the set ``S`` of token ids of the
(unmasked) input, special tokens excluded. The total loss is
``L = L_MLM + w * L_BoW`` with ``w = config.bow_weight``, optionally decayed linearly to 0
over the optimizer steps (``config.bow_weight_schedule = "linear_decay"``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
import torch.nn.functional as F

from ..masking import bag_of_words, continuation_table, mask_tokens, pad_and_add_special, wordpiece_word_ids
from ..losses import mlm_loss
from .base import Objective

BOW_SCHEDULES = ("constant", "linear_decay")


def mlm_head_of(mlm_model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The full masked-LM head (transform + vocabulary projection) of a Hugging Face MLM model.

    ``BertForMaskedLM.cls``, ``RobertaForMaskedLM.lm_head``, ...; falls back to the output
    embeddings (the bare vocabulary projection) for other architectures.
    """
    for attr in ("cls", "lm_head", "head"):
        head = getattr(mlm_model, attr, None)
        if isinstance(head, nn.Module):
            return head
    out = mlm_model.get_output_embeddings()
    if out is None:
        raise ValueError(f"{type(mlm_model).__name__} has no masked-LM head")
    return out


def masked_view_batch(examples: list[list[int]], tokenizer: Any, vocab_size: int, mlm_probability: float,
                      whole_word_mask: bool = False) -> dict[str, torch.Tensor]:
    """The batch shared by the SEED, RetroMAE and BoW objectives.

    ``input_ids`` ([CLS] ids [SEP], padded), ``attention_mask``, ``special_tokens_mask``
    (True at special tokens and padding), and the encoder's BERT-masked view
    ``masked_input_ids`` with ``mlm_labels`` (-100 where not masked).
    """
    input_ids, attention_mask, special = pad_and_add_special(examples, tokenizer)
    word_ids = None
    if whole_word_mask:
        word_ids = wordpiece_word_ids(input_ids, special, continuation_table(tokenizer, vocab_size))
    masked, labels = mask_tokens(input_ids, special, mask_token_id=tokenizer.mask_token_id, vocab_size=vocab_size,
                                 mlm_probability=mlm_probability, word_ids=word_ids)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "special_tokens_mask": special,
            "masked_input_ids": masked, "mlm_labels": labels}


def bow_loss(logits: torch.Tensor, bow: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` against the uniform distribution over each row's bag of words.

    Args:
        logits: ``(B, |V|)`` vocabulary logits.
        bow: ``(B, |V|)`` multi-hot (or non-negative weights) of each text's token set.

    Returns:
        Scalar: mean over texts of ``-(1/|S|) * sum_{t in S} log softmax(z)_t`` (texts with an
        empty bag are skipped; 0 if all are empty).
    """
    logp = F.log_softmax(logits.float(), dim=-1)
    bow = bow.to(logp.dtype)
    size = bow.sum(-1)
    keep = size > 0
    if not bool(keep.any()):
        return logits.sum() * 0.0
    per_text = -(bow[keep] * logp[keep]).sum(-1) / size[keep]
    return per_text.mean()


class BoWObjective(Objective):
    """MLM + ``bow_weight`` x bag-of-words prediction from the [CLS] vector through the MLM head."""

    name = "bow"
    loss_names = ("mlm", "bow")
    needs_mask_token = True

    def __init__(self, mlm_model: Any, tokenizer: Any, config: Any, **extra: Any):
        if config.bow_weight_schedule not in BOW_SCHEDULES:
            raise ValueError(f"unknown bow_weight_schedule {config.bow_weight_schedule!r}; choose one of {BOW_SCHEDULES}")
        if config.bow_weight < 0:
            raise ValueError(f"bow_weight must be >= 0, got {config.bow_weight}")
        super().__init__(mlm_model, tokenizer, config)
        self.bow_weight = float(config.bow_weight)

    def on_step(self, step: int, total_steps: int) -> None:
        """Update the BoW weight after optimizer step ``step`` (of ``total_steps``)."""
        if self.config.bow_weight_schedule == "linear_decay" and total_steps > 0:
            self.bow_weight = float(self.config.bow_weight) * max(0.0, 1.0 - step / total_steps)
        else:
            self.bow_weight = float(self.config.bow_weight)

    def collate(self, examples: list[list[int]]) -> dict[str, torch.Tensor]:
        """Add [CLS]/[SEP], pad, mask at ``mlm_probability``; the bag of words is built in forward."""
        return masked_view_batch(examples, self.tokenizer, self.mlm_model.config.vocab_size,
                                 self.config.mlm_probability, self.config.whole_word_mask)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        head = mlm_head_of(self.mlm_model)
        hidden = self.encoder(input_ids=batch["masked_input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        l_mlm = mlm_loss(hidden, batch["mlm_labels"], head)
        special = batch["special_tokens_mask"].bool() | ~batch["attention_mask"].bool()
        bow = bag_of_words(batch["input_ids"], special, self.mlm_model.config.vocab_size)
        l_bow = bow_loss(head(hidden[:, 0]), bow)
        return {"loss": l_mlm + self.bow_weight * l_bow, "mlm": l_mlm.detach(), "bow": l_bow.detach()}
