"""The masked views shared by the masked-LM objectives (:class:`MaskedViewsMixin`): every text masked ``num_views``
times, and the MLM term over them."""
from __future__ import annotations

from typing import Optional

import torch

from ..data.masking import continuation_table, mask_rows, mask_tokens, pad_and_add_special, wordpiece_word_ids
from ..model.distributed import global_mean_count
from ..model.losses import mlm_loss, mlm_loss_selected
from ..model.modeling import mlm_head
from ..model.unpadded import PackedHidden

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

    def collate(self, examples: list[list[int]], generators: Optional[list[torch.Generator]] = None
                ) -> dict[str, torch.Tensor]:
        """Add [CLS]/[SEP], pad and mask every text ``num_views`` times independently (with ``generators``: the
        views of text ``i`` drawn from ``generators[i]`` alone, :func:`~pretrain.data.masking.mask_rows`)."""
        input_ids, attention_mask, special = pad_and_add_special(examples, self.tokenizer)
        word_ids = None
        if self._continuation is not None:
            word_ids = wordpiece_word_ids(input_ids, special, self._continuation)
        kw = dict(mask_token_id=self.tokenizer.mask_token_id, vocab_size=self.mlm_model.config.vocab_size,
                  mlm_probability=self.mask_probability, word_ids=word_ids)
        if generators is not None:
            masked_views, label_views = mask_rows(input_ids, special, attention_mask, generators,
                                                  num_views=self.num_views, **kw)
        else:
            masked, labels = [], []
            for _ in range(self.num_views):
                x, y = mask_tokens(input_ids, special, generator=self.mask_generator, **kw)
                masked.append(x)
                labels.append(y)
            masked_views, label_views = torch.stack(masked, 1), torch.stack(labels, 1)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "special_tokens_mask": special,
                 "masked_input_ids": masked_views, "mlm_labels": label_views}
        if self.packs():  # the encoder pass of encode_views, laid out here (in the DataLoader's workers)
            batch.update(self.pack("views", self.views(masked_views), attention_mask.repeat(self.num_views, 1),
                                   labels=self.views(label_views)))
        return batch

    @staticmethod
    def views(t: torch.Tensor) -> torch.Tensor:
        """``(m, k, L)`` → ``(k·m, L)``, view-major (rows ``i + v·m`` belong to text ``i``)."""
        return t.transpose(0, 1).reshape(-1, t.shape[-1])

    def encode_views(self, batch: dict[str, torch.Tensor]) -> tuple["torch.Tensor | PackedHidden", torch.Tensor]:
        """Run the encoder on all masked views; returns ``(last hidden states of the k·m views (see
        :meth:`Objective.encode`), labels (k·m, L))``."""
        k = batch["masked_input_ids"].shape[1]
        ids = self.views(batch["masked_input_ids"])
        am = batch["attention_mask"].repeat(k, 1)
        hidden = self.encode(ids, am, packed=self.packed_inputs(batch, "views"))
        return hidden, self.views(batch["mlm_labels"])

    def masked_lm_loss(self, hidden: "torch.Tensor | PackedHidden", labels: torch.Tensor) -> torch.Tensor:
        """MLM loss, normalised by the global mean number of masked tokens per process, so that
        DDP's gradient averaging gives exactly the gradient of the global-batch mean. A packed pass reads its
        host-built masked positions and counts them from their shape (no boolean indexing, no wait for the device)."""
        if isinstance(hidden, PackedHidden):
            states, targets = hidden.masked()
            n = global_mean_count(int(targets.shape[0]), device=targets.device)
            return mlm_loss_selected(states, targets, mlm_head(self.mlm_model), num_items=n)
        n = global_mean_count(int((labels != -100).sum()), device=labels.device)
        return mlm_loss(hidden, labels, mlm_head(self.mlm_model), num_items=n)
