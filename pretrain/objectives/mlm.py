"""Plain masked-language-model pre-training: the shared baseline of every objective.

Each text is masked once (BERT 15%, 80/10/10; whole words with ``--whole-word-mask``) and
the MLM cross-entropy is computed on the masked positions only.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..config import PretrainConfig
from ..distributed import global_mean_count
from ..losses import mlm_loss
from ..masking import continuation_table, mask_tokens, pad_and_add_special, wordpiece_word_ids
from ..modeling import mlm_head
from .base import Objective


class MaskedViewsMixin:
    """Builds ``num_views`` independently masked views of every text in ``collate``.

    Batch layout (every tensor has the texts on dim 0, so a batch can be split across
    processes along dim 0): ``input_ids``, ``attention_mask``, ``special_tokens_mask``
    ``(m, L)`` for the unmasked texts (with [CLS]/[SEP], padded; the special-token mask is
    True at padding too) and ``masked_input_ids``, ``mlm_labels`` ``(m, num_views, L)``.
    :meth:`views` flattens the views view-major: rows ``i``, ``i + m``, ``i + 2m``... are
    the views of text ``i``.
    """

    num_views: int = 1
    #: Optional generator used for masking (reproducible batches); default: torch's global RNG.
    mask_generator: Optional[torch.Generator] = None

    @property
    def mask_probability(self) -> float:
        """Share of the text tokens masked in each view (BERT masking: ``config.mlm_probability``)."""
        return self.config.mlm_probability

    def _mask_setup(self) -> None:
        self._continuation = None
        if self.config.whole_word_mask:
            self._continuation = continuation_table(self.tokenizer, self.mlm_model.config.vocab_size)

    def collate(self, examples: list[list[int]]) -> dict[str, torch.Tensor]:
        """Add [CLS]/[SEP], pad and mask every text ``num_views`` times independently."""
        input_ids, attention_mask, special = pad_and_add_special(examples, self.tokenizer)
        word_ids = None
        if self._continuation is not None:
            word_ids = wordpiece_word_ids(input_ids, special, self._continuation)
        masked, labels = [], []
        for _ in range(self.num_views):
            x, y = mask_tokens(input_ids, special, mask_token_id=self.tokenizer.mask_token_id,
                               vocab_size=self.mlm_model.config.vocab_size,
                               mlm_probability=self.mask_probability, generator=self.mask_generator,
                               word_ids=word_ids)
            masked.append(x)
            labels.append(y)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "special_tokens_mask": special,
                "masked_input_ids": torch.stack(masked, 1), "mlm_labels": torch.stack(labels, 1)}

    @staticmethod
    def views(t: torch.Tensor) -> torch.Tensor:
        """``(m, k, L)`` → ``(k·m, L)``, view-major (rows ``i + v·m`` belong to text ``i``)."""
        return t.transpose(0, 1).reshape(-1, t.shape[-1])

    def encode_views(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the encoder on all masked views; returns ``(last_hidden_state (k·m, L, H), labels (k·m, L))``."""
        k = batch["masked_input_ids"].shape[1]
        ids = self.views(batch["masked_input_ids"])
        am = batch["attention_mask"].repeat(k, 1)
        hidden = self.encoder(input_ids=ids, attention_mask=am).last_hidden_state
        return hidden, self.views(batch["mlm_labels"])

    def masked_lm_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """MLM loss, normalised by the global mean number of masked tokens per process, so that
        DDP's gradient averaging gives exactly the gradient of the global-batch mean."""
        n = global_mean_count(int((labels != -100).sum()), device=labels.device)
        return mlm_loss(hidden, labels, mlm_head(self.mlm_model), num_items=n)


class MLMObjective(MaskedViewsMixin, Objective):
    """BERT masked-LM pre-training (one masked view per text); losses ``{"loss", "mlm"}``."""

    name = "mlm"
    loss_names = ("mlm",)
    num_views = 1
    ddp_find_unused_parameters = False

    def __init__(self, mlm_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: PretrainConfig,
                 **extra: Any):
        super().__init__(mlm_model, tokenizer, config, **extra)
        self._mask_setup()

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden, labels = self.encode_views(batch)
        loss = self.masked_lm_loss(hidden, labels)
        return {"loss": loss, "mlm": loss.detach()}
