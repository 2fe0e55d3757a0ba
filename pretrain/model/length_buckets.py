"""The encoder's forward pass in length-sorted chunks: a padded batch of texts of unequal lengths computed without
most of its padding, for fine-tuning on the CPU.

A training batch of fine-tuning holds its texts in their data order: the passages of a step (each query's positive and
negatives) are padded together to the longest of them. On the MS MARCO sample at 128 tokens that grid is about 40%
padding, and every layer computes it. :func:`length_bucketed` wraps a Hugging Face encoder's ``forward`` so that a
batch of more than ``rows`` right-padded texts is encoded in chunks of ``rows`` texts sorted by length (longest
first, ties in batch order), each chunk cut to its own longest text, and put back together: the last hidden state
keeps the batch's order and its ``(N, L, H)`` shape, with zeros beyond each chunk's longest text (padding, which
the pooling never reads). The batch itself, its loss and the pooling are unchanged; each text's vectors are the ones the padded pass
gives (a text's real positions never attend to padding), up to float32 summation order. In training, dropout draws
its masks per chunk: other draws of the same distribution.

The chunks are used only where they save at least ``min_saving`` of the batch's positions; left-padded rows, inputs
other than ``input_ids``, ``attention_mask``, ``token_type_ids`` and ``position_ids``, or a request for the hidden
states of every layer or the attentions go to the wrapped ``forward`` unchanged. ``full=False`` is for a forward
whose last hidden state is ``(N, 1, H)`` (:func:`pyterrier_cpdae.encoder.first_token.first_token_model`): its chunks
are not padded back.

:func:`training_forward` sets the forward a fine-tuning trains through: under ``[CLS]`` pooling the last layer at the
first token only (where :func:`~pyterrier_cpdae.encoder.first_token.check_first_token` allows it), and on the CPU the
chunks. It is an attribute of the model object: the weights and what ``save_pretrained`` writes are untouched.

Measured with ``experiments/bench/bench_finetune_speed.py`` (``experiments/results/bench_finetune_speed.md``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from pyterrier_cpdae.encoder.batching import length_sorted_batches
from pyterrier_cpdae.encoder.first_token import check_first_token, first_token_model
from transformers.modeling_outputs import BaseModelOutput

__all__ = ["ROWS", "MIN_SAVING", "chunk_plan", "saving_plan", "length_bucketed", "training_forward"]

#: texts per chunk
ROWS = 16
#: the share of the batch's positions the chunks must save to be used
MIN_SAVING = 0.1
_SLICED = ("token_type_ids", "position_ids")


def chunk_plan(attention_mask: torch.Tensor, rows: int = ROWS) -> list[tuple[torch.Tensor, int]]:
    """``[(row indices, length), ...]``: the rows sorted by length (longest first, ties in order), cut into chunks of
    ``rows`` (the encoder's :func:`~pyterrier_cpdae.encoder.batching.length_sorted_batches`), each with the length of
    its longest row."""
    lengths = attention_mask.sum(1)
    return [(chunk, int(lengths[chunk[0]])) for chunk in
            map(torch.from_numpy, length_sorted_batches(lengths.cpu().numpy(), rows))]


def saving_plan(attention_mask: torch.Tensor, rows: int = ROWS,
                min_saving: float = MIN_SAVING) -> list[tuple[torch.Tensor, int]] | None:
    """The :func:`chunk_plan` of a right-padded batch of more than ``rows`` texts when its chunks take at most
    ``1 - min_saving`` of the padded positions; None when the batch is to go through in one padded pass."""
    n, length = attention_mask.shape
    if n <= rows:
        return None
    plan = chunk_plan(attention_mask, rows)
    if sum(len(c) * l for c, l in plan) > (1 - min_saving) * n * length or not _right_padded(attention_mask):
        return None
    return plan


def _right_padded(attention_mask: torch.Tensor) -> bool:
    lengths = attention_mask.sum(1, keepdim=True)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return bool(torch.equal(attention_mask.bool(), positions[None, :] < lengths))


def length_bucketed(forward: Callable[..., Any], rows: int = ROWS, full: bool = True,
                    min_saving: float = MIN_SAVING) -> Callable[..., Any]:
    """``forward`` (a Hugging Face encoder's) computing a large padded batch in length-sorted chunks (module
    docstring); returns a :class:`~transformers.modeling_outputs.BaseModelOutput` with the last hidden state only
    where it chunks."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")

    def bucketed(input_ids: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
        plain = (input_ids is None or attention_mask is None or input_ids.dim() != 2
                 or kwargs.get("output_hidden_states") or kwargs.get("output_attentions")
                 or any(v is not None for k, v in kwargs.items() if k not in _SLICED and k != "return_dict"))
        plan = None if plain else saving_plan(attention_mask, rows, min_saving)
        if plan is None:
            return forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        n, length = input_ids.shape
        parts, order = [], torch.cat([c for c, _ in plan])
        for chunk, l in plan:
            sliced = {k: (v[chunk, :l] if v.shape[0] == n else v[:, :l]) for k, v in kwargs.items()
                      if k in _SLICED and v is not None}
            out = forward(input_ids=input_ids[chunk, :l], attention_mask=attention_mask[chunk, :l],
                          **{**kwargs, **sliced, "return_dict": True}).last_hidden_state
            parts.append(F.pad(out, (0, 0, 0, length - l)) if full else out)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(n, device=order.device)
        return BaseModelOutput(last_hidden_state=torch.cat(parts).index_select(0, inverse))

    bucketed.__wrapped__ = forward
    return bucketed


def training_forward(model: torch.nn.Module, pooling: str, chunked: bool) -> None:
    """Sets ``model.forward`` to the pass fine-tuning trains through (module docstring): the last layer at [CLS]
    only under ``pooling == "cls"`` where it may be trimmed, in length-sorted chunks when ``chunked``."""
    trim = pooling == "cls" and check_first_token(model) is None
    if trim or chunked:
        forward = (first_token_model(model) if trim else model).forward
        model.forward = length_bucketed(forward, full=not trim) if chunked else forward
