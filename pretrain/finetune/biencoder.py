"""The trainable bi-encoder used for fine-tuning, and its ranking losses.

One encoder is shared by queries and passages; a text's vector is its [CLS] output (the
paper) or the masked mean of its token outputs, and relevance is the dot product. Two
losses are offered:

* :func:`listwise_loss` -- softmax cross-entropy of each query over its own group
  (1 positive + n negatives) and, with in-batch negatives, over every other query's
  passages as well (the Tevatron / DPR recipe). Under DDP the query and passage vectors
  of all processes are gathered first (:func:`pretrain.training.distributed.gather_with_grad`),
  so the negatives span the global batch.
* :func:`pairwise_loss` -- RankNet over the (positive, negative_j) pairs of each group,
  ``mean_j log(1 + exp(s_neg_j - s_pos))``, which is how the CPDAE paper describes its
  fine-tuning loss.

:class:`BiEncoder` is the ``nn.Module`` handed to :class:`pretrain.training.trainer.Trainer`: its
``forward(batch)`` returns ``{"loss": ...}`` and :meth:`BiEncoder.collate` tokenises a list
of training groups.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pyterrier_cpdae.encoder.pooling import POOLINGS, pool
from pyterrier_cpdae.encoder.st_export import write_st_config

from ..training import distributed

if TYPE_CHECKING:  # transformers is imported lazily (the losses do not need it)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

LOSSES = ("listwise", "pairwise")


def group_scores(q: torch.Tensor, p: torch.Tensor, group_size: int) -> torch.Tensor:
    """Scores of each query against its own group only: ``(B, G)``.

    Args:
        q: Query vectors ``(B, d)``.
        p: Passage vectors ``(B * G, d)``; rows ``i*G .. i*G+G-1`` are query ``i``'s group,
            positive first.
        group_size: ``G`` (1 positive + n negatives).
    """
    if p.shape[0] != q.shape[0] * group_size:
        raise ValueError(f"expected {q.shape[0]} x {group_size} passages, got {p.shape[0]}")
    return torch.einsum("bd,bgd->bg", q, p.view(q.shape[0], group_size, -1))


def listwise_loss(q: torch.Tensor, p: torch.Tensor, group_size: int, in_batch_negatives: bool = True,
                  temperature: float = 1.0) -> torch.Tensor:
    """Softmax cross-entropy of each query's positive against its negatives (mean over queries).

    With ``in_batch_negatives`` the candidates of query ``i`` are *all* ``B * G`` passages of
    the batch (score matrix ``q @ p.T`` of shape ``(B, B*G)``, label ``i * G``); without, only
    its own group (``(B, G)``, label 0).

    Args:
        q: Query vectors ``(B, d)``.
        p: Passage vectors ``(B * G, d)``, grouped per query with the positive first.
        group_size: ``G``.
        in_batch_negatives: Use the other queries' passages as extra negatives.
        temperature: Scores are divided by this before the softmax.
    """
    if in_batch_negatives:
        if p.shape[0] != q.shape[0] * group_size:
            raise ValueError(f"expected {q.shape[0]} x {group_size} passages, got {p.shape[0]}")
        scores = q @ p.T
        labels = torch.arange(q.shape[0], device=q.device) * group_size
    else:
        scores = group_scores(q, p, group_size)
        labels = torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
    return F.cross_entropy(scores.float() / temperature, labels)


def pairwise_loss(q: torch.Tensor, p: torch.Tensor, group_size: int) -> torch.Tensor:
    """RankNet loss ``mean over queries and j of log(1 + exp(s(q, neg_j) - s(q, pos)))``.

    Args:
        q: Query vectors ``(B, d)``.
        p: Passage vectors ``(B * G, d)``, grouped per query with the positive first.
        group_size: ``G`` (must be >= 2).
    """
    if group_size < 2:
        raise ValueError("pairwise loss needs at least one negative per query (group size >= 2)")
    s = group_scores(q, p, group_size).float()
    return F.softplus(s[:, 1:] - s[:, :1]).mean()


def _gather_keep_local(x: torch.Tensor) -> torch.Tensor:
    """All processes' rows of ``x`` (equal sizes), where only this process's rows carry gradient."""
    full = distributed.gather_with_grad(x.contiguous()).detach()
    n, r = x.shape[0], distributed.rank()
    return torch.cat([full[: r * n], x, full[(r + 1) * n:]])


def distributed_listwise_loss(q: torch.Tensor, p: torch.Tensor, group_size: int,
                              temperature: float = 1.0) -> torch.Tensor:
    """:func:`listwise_loss` with in-batch negatives over the *global* batch of all processes.

    Query and passage vectors are gathered with :func:`pretrain.training.distributed.gather_with_grad`;
    each process keeps the gradient of its own rows only (the Tevatron recipe), and the
    gradient is multiplied by the world size so that, after DDP averages the processes'
    gradients, it equals the gradient of the global-batch loss computed in one process. The
    returned value is the global-batch loss itself (identical on every process). Identical to
    :func:`listwise_loss` when not distributed.
    """
    world = distributed.world_size()
    if world == 1:
        return listwise_loss(q, p, group_size, True, temperature)
    # checked before any gradient-carrying collective, so that every process raises at the same point
    sizes = distributed.gather_sizes(q.shape[0], device=q.device)
    if len(set(sizes)) > 1:
        raise ValueError(f"in-batch negatives across processes need the same local batch on every process, "
                         f"got {sizes} queries (world size {world})")
    loss = listwise_loss(_gather_keep_local(q), _gather_keep_local(p), group_size, True, temperature)
    return loss + (world - 1) * (loss - loss.detach())  # value: loss; gradient: world x loss


class BiEncoder(nn.Module):
    """A shared-weight dual encoder trained with :func:`listwise_loss` or :func:`pairwise_loss`.

    Args:
        encoder: A Hugging Face encoder (``AutoModel``; e.g. ``BertModel``).
        tokenizer: Its tokenizer.
        pooling: ``"cls"`` or ``"mean"`` (:func:`pyterrier_cpdae.encoder.pooling.pool`, shared with ``CPDAE``).
        normalize: L2-normalise the vectors (scores are then cosine similarities).
        loss: ``"listwise"`` or ``"pairwise"``.
        in_batch_negatives: Listwise only: add the other queries' passages (of all processes)
            as negatives.
        query_max_length: Query truncation length in tokens (special tokens included).
        doc_max_length: Passage truncation length in tokens.
        cls_last_layer: Under ``"cls"`` pooling, run the encoder's last layer at ``[CLS]`` only (as ``CPDAE`` does:
            :mod:`pyterrier_cpdae.encoder.first_token`): the loss reads no other position of it, so the loss and
            every gradient are the full layer's (to float32 summation order) for less work. ``None`` = where the
            model allows it (checked once against the full layer), ``False`` = the full layer.
    """

    def __init__(self, encoder: "PreTrainedModel", tokenizer: "PreTrainedTokenizerBase", *, pooling: str = "cls",
                 loss: str = "listwise", in_batch_negatives: bool = True, query_max_length: int = 32,
                 doc_max_length: int = 256, normalize: bool = False, cls_last_layer: Optional[bool] = None):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {pooling!r}; expected one of {POOLINGS}")
        if loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; expected one of {LOSSES}")
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.normalize = normalize
        self.loss_name = loss
        self.in_batch_negatives = in_batch_negatives
        self.query_max_length = query_max_length
        self.doc_max_length = doc_max_length
        self.cls_last_layer = cls_last_layer
        self._trimmable: Optional[bool] = None  # checked at the first encode

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs) -> "BiEncoder":
        """Load the encoder (any ``AutoModel`` checkpoint, e.g. a ``python -m pretrain`` output) and tokenizer with
        the loaders of ``CPDAE.from_pretrained`` (:func:`pyterrier_cpdae.encoder.loading.load_encoder`: no pooler, an MLM
        head left out, missing encoder weights refused), so that training and inference see the same encoder."""
        from pyterrier_cpdae.encoder.loading import load_encoder, load_tokenizer

        return cls(load_encoder(name_or_path), load_tokenizer(name_or_path), **kwargs)

    def __repr__(self) -> str:
        return (f"BiEncoder({type(self.encoder).__name__}, pooling={self.pooling!r}, loss={self.loss_name!r}, "
                f"in_batch_negatives={self.in_batch_negatives})")

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        """Enable gradient checkpointing in the encoder."""
        self.encoder.gradient_checkpointing_enable(**kwargs)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Text vectors ``(B, H)`` of a tokenised batch."""
        out = self._forward_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        return pool(out.last_hidden_state, attention_mask, self.pooling, self.normalize)

    def _forward_encoder(self) -> nn.Module:
        """The encoder, or a view of it whose last layer runs at ``[CLS]`` only (see ``cls_last_layer``)."""
        if self.pooling != "cls" or self.cls_last_layer is False:
            return self.encoder
        from pyterrier_cpdae.encoder.first_token import check_first_token, first_token_model

        if self._trimmable is None:
            self._trimmable = check_first_token(self.encoder) is None
        return first_token_model(self.encoder) if self._trimmable else self.encoder

    def collate(self, examples: Sequence[tuple[str, Sequence[str]]]) -> dict[str, torch.Tensor]:
        """Tokenise training examples ``(query, [positive, negative_1, ..., negative_n])``.

        Every example must have the same group size. Returns ``q_input_ids``/``q_attention_mask``
        ``(B, Lq)`` and ``p_input_ids``/``p_attention_mask`` ``(B*G, Lp)``.
        """
        if not examples:
            raise ValueError("cannot collate an empty batch")
        sizes = {len(passages) for _, passages in examples}
        if len(sizes) != 1:
            raise ValueError(f"all groups of a batch must have the same size, got sizes {sorted(sizes)}")
        queries = [q for q, _ in examples]
        passages = [t for _, ps in examples for t in ps]
        q = self.tokenizer(queries, max_length=self.query_max_length, truncation=True, padding=True,
                           return_tensors="pt")
        p = self.tokenizer(passages, max_length=self.doc_max_length, truncation=True, padding=True,
                           return_tensors="pt")
        return {"q_input_ids": q["input_ids"], "q_attention_mask": q["attention_mask"],
                "p_input_ids": p["input_ids"], "p_attention_mask": p["attention_mask"]}

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss of one (local) batch; under DDP the in-batch negatives span all processes."""
        q = self.encode(batch["q_input_ids"], batch["q_attention_mask"])
        p = self.encode(batch["p_input_ids"], batch["p_attention_mask"])
        group_size = p.shape[0] // q.shape[0]
        if self.loss_name == "pairwise":
            loss = pairwise_loss(q, p, group_size)
            return {"loss": loss, "pairwise": loss.detach()}
        if self.in_batch_negatives:
            loss = distributed_listwise_loss(q, p, group_size)
        else:
            loss = listwise_loss(q, p, group_size, self.in_batch_negatives)
        return {"loss": loss, "listwise": loss.detach()}

    def save_pretrained(self, path: str) -> None:
        """Write the encoder and tokenizer as a Hugging Face directory at ``path``, described for
        sentence-transformers and ``CPDAE.from_pretrained`` (pooling, normalisation, ``doc_max_length``)."""
        os.makedirs(path, exist_ok=True)
        self.encoder.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        write_st_config(path, pooling=self.pooling, normalize=self.normalize, max_seq_length=self.doc_max_length,
                        hidden_size=self.encoder.config.hidden_size)

