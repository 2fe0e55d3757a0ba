"""The unpadded (packed) backend: a batch's texts laid end to end in one row of real tokens, attention kept inside
each text by a variable-length attention kernel, so that no layer computes on padding (``"torch-unpadded"``).

The whole unpadded path of the encoder is here: whether a model and a device can run it (:func:`supports_packing`,
:func:`packing_kernel`, which also says why not when ``unpad=True`` asks for it), the packed forward pass
(:func:`packed_forward`) and the backend object (:class:`UnpaddedTorch`); the attention function itself and its
kernels are :mod:`pyterrier_cpdae.encoder.attention`, which ``pretrain``'s ``--unpad`` shares.

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
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..attention import _KERNEL_KWARG, ATTENTION, Kernel, register, varlen_kernel
from ..policy import _DTYPE_NAMES
from ..pooling import pool
from .base import Backend

__all__ = ["PACKED_MODEL_TYPES", "supports_packing", "packing_kernel", "packed_forward", "UnpaddedTorch"]

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


def packing_kernel(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                   unpad: Optional[bool]) -> Optional[Kernel]:
    """The variable-length attention kernel when ``model``'s batches run packed on ``device`` in ``dtype``, as the
    encoder option ``unpad`` asks (``None``: where the kernel runs; ``False``: never), else ``None``.

    Raises:
        ValueError: ``unpad=True`` where packed batches cannot run (naming the model type, device and dtype)."""
    if unpad is False:
        return None
    kernel = varlen_kernel(device, dtype) if supports_packing(model) else None
    if kernel is None and unpad:
        raise ValueError(f"unpad=True: packed batches need a BERT model (this one: "
                         f"{getattr(model.config, 'model_type', type(model).__name__)}) and torch's varlen_attn "
                         f"kernel, which runs on CUDA in bf16/fp16 (here: {device}, {_DTYPE_NAMES.get(dtype, dtype)}); "
                         "pass unpad=None (automatic) or False for padded batches")
    return kernel


class UnpaddedTorch(Backend):
    """Packed batches through a PyTorch model and ``kernel`` (``"torch-unpadded"``); with ``first_token`` the model
    is a view whose last layer computes each text's first token only."""

    name = "torch-unpadded"
    packed = True

    def __init__(self, model: torch.nn.Module, device: torch.device, kernel: Kernel, pooling: str, normalize: bool,
                 first_token: bool = False):
        self.model, self.device, self.kernel = model, device, kernel
        self.pooling, self.normalize, self.first_token = pooling, normalize, first_token

    def run(self, ids: List[List[int]], lengths: np.ndarray, batches: List[np.ndarray], out: np.ndarray,
            bar: Optional[Any] = None) -> None:
        pooled = []
        for rows in batches:
            hidden, mask = packed_forward(self.model, [ids[i] for i in rows], lengths[rows], self.device, self.kernel,
                                          first_token=self.first_token)
            pooled.append(pool(hidden, mask, self.pooling, self.normalize))
            if bar is not None:
                bar.update(len(rows))
        out[np.concatenate(batches)] = torch.cat(pooled).cpu().numpy()
