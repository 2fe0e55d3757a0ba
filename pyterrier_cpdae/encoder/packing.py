"""Unpadded (packed) encoding: a batch's texts laid end to end in one row of real tokens, attention kept inside
each text by a variable-length attention kernel, so that no layer computes on padding.

Hugging Face's BERT (transformers 5) sends its attention through ``ALL_ATTENTION_FUNCTIONS`` with the keyword
arguments of the forward call, and its embeddings take ``position_ids``; so a packed batch is one row of token
ids with positions restarting at 0 for every text, plus the cumulative text lengths (``cu_seq_lens_q``), run with
the attention function of :mod:`pyterrier_cpdae.encoder.attention` (its :data:`~pyterrier_cpdae.encoder.attention.ATTENTION`):
it hands packed calls to the kernel the call carries and every other call to transformers' SDPA.  The kernel is
torch's ``varlen_attn`` (:func:`~pyterrier_cpdae.encoder.attention.varlen_kernel`, CUDA in bf16/fp16 only); the
encoder keeps padded batches wherever it is missing (the CPU, float32, older torch, other model types).
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, Sequence, Tuple

import numpy as np
import torch

from .attention import _KERNEL_KWARG, ATTENTION, Kernel, register

__all__ = ["PACKED_MODEL_TYPES", "supports_packing", "packed_forward"]

PACKED_MODEL_TYPES = ("bert",)
"""Model types whose forward pass runs packed: BERT's embeddings take ``position_ids`` (token types are 0) and its
attention goes through transformers' attention interface with the call's keyword arguments."""


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward pass can run packed (its type is in :data:`PACKED_MODEL_TYPES` and it uses
    transformers' attention interface)."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in PACKED_MODEL_TYPES
            and bool(getattr(model, "_supports_attention_backend", False)) and not getattr(config, "is_decoder", False))


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module) -> Iterator[None]:
    """Runs ``model`` with :data:`ATTENTION` (padded calls inside still use SDPA), restored afterwards."""
    register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = before


def packed_forward(model: torch.nn.Module, seqs: Sequence[Sequence[int]], lengths: np.ndarray,
                   device: torch.device, kernel: Kernel,
                   first_token: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Runs the texts ``seqs`` as one packed row and returns their token outputs re-laid as a padded
    ``(B, longest, H)`` batch with its ``(B, longest)`` attention mask, as a padded forward pass would return them
    (the padding rows are zeros), for :func:`~pyterrier_cpdae.encoder.pooling.pool`.  With ``first_token`` the
    model is a view whose last layer runs at each text's first token only
    (:mod:`~pyterrier_cpdae.encoder.first_token`): its ``(B, 1, H)`` output comes back as it is, with a mask of ones."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total, rows, width = int(lengths.sum()), len(lengths), int(lengths.max())
    starts = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    positions = np.arange(total, dtype=np.int64) - np.repeat(starts[:-1], lengths)
    # one host-to-device copy for the ids, positions, text bounds and (unless first_token) each token's place in the
    # padded (rows, width) layout; no step here waits for the device (no boolean-mask indexing, no .item()), so the
    # host prepares the next batch while the device runs this one
    parts = [np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total), positions, starts]
    if not first_token:
        parts.append(positions + np.repeat(np.arange(rows, dtype=np.int64) * width, lengths))
    host = torch.from_numpy(np.concatenate(parts))
    dev = host.to(device, non_blocking=True)
    ids, pos, cu = dev[:total], dev[total:2 * total], dev[2 * total:2 * total + rows + 1].to(torch.int32)
    with _attention_implementation(model):
        hidden = model(input_ids=ids[None], position_ids=pos[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=width, max_length_k=width, **{_KERNEL_KWARG: kernel})[0]
    if first_token:
        return hidden, torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    place = dev[2 * total + rows + 1:]
    padded = hidden.new_zeros((rows * width, hidden.shape[-1])).index_copy_(0, place, hidden[0])
    mask = torch.zeros(rows * width, dtype=torch.long, device=hidden.device).index_fill_(0, place, 1)
    return padded.view(rows, width, -1), mask.view(rows, width)
