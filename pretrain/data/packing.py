"""Packed rows: an encoder pass's inputs laid out on the host without padding (``--unpad on``).

An objective's ``collate`` (which runs in the DataLoader's workers) builds its padded batch as always and, when the
run is unpadded, also the *packed* layout of each encoder pass it will run (:func:`pack_rows`): the real tokens of
all rows concatenated into one 1-D stream, every row a sequence of its own (its own [CLS], its own positions
``start .. start + n - 1``; each masked view of a text is a row, so CPDAE's two views stay two sequences), with

* ``input_ids``, ``position_ids``, ``token_type_ids`` ``(C,)``: the stream, filled up to the capacity ``C``;
* ``cu_seqlens`` ``(R + P + 1,)`` int32: the sequence bounds, the ``R`` rows first, then ``P`` filler sequences;
* ``grid_index`` ``(T,)``: where each of the ``T`` real tokens sits in the padded ``(R, L)`` grid (row-major);
* ``first_index`` ``(R,)``: the stream position of each row's first token ([CLS]);
* ``masked_index``, ``masked_labels`` ``(M,)`` (with ``labels``): the stream positions of the masked tokens, in the
  padded grid's row-major order, and their targets, so that the MLM head runs at those positions only.

The device then needs no ``nonzero``, ``cumsum`` or boolean indexing per step (nothing that waits for it): the
tensors travel with the batch, pinned by the DataLoader and copied without blocking.

**Capacity.** ``C`` is a multiple of a bucket ``B`` fixed by the pass's row count and the longest sequence allowed
(:func:`bucket_size`: ``max(bound, ⌈R·bound / CAPACITY_STEPS⌉)`` rounded up to a multiple of 8), the smallest that
holds the real tokens and at least ``P`` filler tokens, so ``torch.compile`` sees few shapes: at most
``CAPACITY_STEPS + 1`` capacities for a given row count, a handful on real length distributions. The ``C - T``
filler tokens (the padding id, position ``start``, segment 0) form ``P`` non-empty sequences of at most ``bound``
tokens each (:func:`filler_sequences`), whose outputs are never read: attention stays inside each sequence, so they
change nothing else, their attention costs at most ``P`` sequences of ``bound`` tokens, and no sequence is empty
(the fused varlen kernels refuse empty ones). ``P`` and so ``cu_seqlens``' length are fixed for a given row count,
and every sequence is at most ``bound`` long, so the kernel's maximum length is a constant too.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional

import numpy as np
import torch

__all__ = ["CAPACITY_STEPS", "PACKED_FIELDS", "sequence_bound", "bucket_size", "filler_sequences", "capacity",
           "pack_rows", "packed_keys", "packed_from_batch"]

#: The capacities of a pass of ``R`` rows are multiples of ``⌈R·bound / CAPACITY_STEPS⌉`` (see the module docstring).
CAPACITY_STEPS = 32

#: The tensors of a packed layout (``masked_*`` only when built with labels).
PACKED_FIELDS = ("input_ids", "position_ids", "token_type_ids", "cu_seqlens", "grid_index", "first_index",
                 "masked_index", "masked_labels")


def sequence_bound(max_length: int, width: int) -> int:
    """The longest sequence of a pass: the run's ``max_length`` (constant, so the kernel's maximum length is), or the
    padded width ``width`` of a batch that exceeds it."""
    return max(int(max_length), int(width))


def bucket_size(rows: int, bound: int, steps: int = CAPACITY_STEPS) -> int:
    """The capacity step of a pass of ``rows`` rows whose sequences are at most ``bound`` tokens long."""
    b = max(int(bound), math.ceil(int(rows) * int(bound) / int(steps)))
    return -(-b // 8) * 8


def filler_sequences(bucket: int, bound: int) -> int:
    """``P``, the number of filler sequences: enough that ``bucket + P - 1`` filler tokens (the most a capacity
    leaves) fit in ``P`` sequences of at most ``bound`` tokens, and at least 1."""
    if bound < 2:
        raise ValueError(f"packed rows need sequences of up to at least 2 tokens ([CLS] and [SEP]), got {bound}")
    return max(1, math.ceil((bucket - 1) / (bound - 1)))


def capacity(real: int, bucket: int, pieces: int) -> int:
    """The smallest multiple of ``bucket`` that holds ``real`` tokens and ``pieces`` filler tokens."""
    return -(-(int(real) + int(pieces)) // bucket) * bucket


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_length: int, position_start: int = 0,
              pad_id: int = 0, token_type_ids: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
              steps: int = CAPACITY_STEPS) -> dict[str, torch.Tensor]:
    """The packed layout (module docstring) of the right-padded rows ``input_ids`` ``(R, L)`` with
    ``attention_mask`` (1 at real tokens), on the host.

    Args:
        max_length: The run's longest sequence (``--max-length``): with the rows' width, the bound of
            :func:`sequence_bound`.
        position_start: Position id of a sequence's first token (0 for BERT; RoBERTa's start after its padding index).
        pad_id: Token id of the filler tokens.
        token_type_ids: ``(R, L)`` segment ids (zeros when ``None``).
        labels: ``(R, L)`` MLM targets, ``-100`` where there is none: adds ``masked_index`` and ``masked_labels``.
        steps: :data:`CAPACITY_STEPS`.

    Raises:
        ValueError: for shapes that disagree, a row without a real token or one whose real tokens are not a prefix
            (not right-padded).
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"packed rows need (rows, length) input_ids and attention_mask of one shape, got "
                         f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}")
    for name, t in (("token_type_ids", token_type_ids), ("labels", labels)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"packed rows: {name} {tuple(t.shape)} does not match input_ids {tuple(input_ids.shape)}")
    rows, width = input_ids.shape
    # numpy on the host: single-threaded (no intra-op thread pool to wake for a few thousand tokens, which costs more
    # than the work when the training process's own threads are busy)
    mask = attention_mask.detach().cpu().numpy().astype(bool, copy=False)
    lengths = mask.sum(1)
    if rows == 0 or int(lengths.min()) < 1 or bool((mask != (np.arange(width)[None, :] < lengths[:, None])).any()):
        raise ValueError("packed rows need right-padded rows of at least one real token each (a row's real tokens "
                         "first, then its padding); use --unpad off")
    bound = sequence_bound(max_length, width)
    bucket = bucket_size(rows, bound, steps)
    pieces = filler_sequences(bucket, bound)
    real = int(lengths.sum())
    cap = capacity(real, bucket, pieces)
    fill = cap - real
    grid_index = np.flatnonzero(mask)  # row-major: row by row, each row's tokens in order
    ids = np.empty(cap, dtype=np.int64)
    ids[:real] = input_ids.detach().cpu().numpy().reshape(-1)[grid_index]
    ids[real:] = int(pad_id)
    positions = np.full(cap, int(position_start), dtype=np.int64)
    positions[:real] += grid_index % width
    types = np.zeros(cap, dtype=np.int64)
    if token_type_ids is not None:
        types[:real] = token_type_ids.detach().cpu().numpy().reshape(-1)[grid_index]
    # the filler: `pieces` sequences of sizes differing by at most one (each >= 1 and <= bound, see filler_sequences)
    sizes = np.full(pieces, fill // pieces, dtype=np.int64)
    sizes[:fill % pieces] += 1
    bounds = np.concatenate([[0], np.cumsum(lengths), real + np.cumsum(sizes)]).astype(np.int64)
    layout = {"input_ids": torch.from_numpy(ids), "position_ids": torch.from_numpy(positions),
              "token_type_ids": torch.from_numpy(types), "cu_seqlens": torch.from_numpy(bounds.astype(np.int32)),
              "grid_index": torch.from_numpy(grid_index.astype(np.int64)),
              "first_index": torch.from_numpy(bounds[:rows].copy())}
    if labels is not None:
        targets = labels.detach().cpu().numpy().reshape(-1)[grid_index]
        selected = np.flatnonzero(targets != -100)
        layout["masked_index"] = torch.from_numpy(selected.astype(np.int64))
        layout["masked_labels"] = torch.from_numpy(targets[selected].astype(np.int64))
    return layout


def packed_keys(name: str, layout: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``layout`` under the batch keys of pass ``name`` (``packed_<name>_<field>``)."""
    return {f"packed_{name}_{field}": t for field, t in layout.items()}


def packed_from_batch(batch: Mapping[str, torch.Tensor], name: str) -> Optional[dict[str, torch.Tensor]]:
    """The packed layout of pass ``name`` that ``batch`` carries (:func:`packed_keys`), or ``None``."""
    prefix = f"packed_{name}_"
    layout = {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}
    return layout or None
