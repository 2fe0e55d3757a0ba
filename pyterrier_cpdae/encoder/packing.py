"""Unpadded (packed) encoding: a batch's texts laid end to end in one row of real tokens, attention kept inside
each text by a variable-length attention kernel, so that no layer computes on padding.

Hugging Face's BERT (transformers 5) sends its attention through ``ALL_ATTENTION_FUNCTIONS`` with the keyword
arguments of the forward call, and its embeddings take ``position_ids``; so a packed batch is one row of token
ids with positions restarting at 0 for every text, plus the cumulative text lengths (``cu_seq_lens_q``), run with
the attention function registered here (:data:`ATTENTION`): it hands packed calls to the variable-length kernel
and every other call to transformers' SDPA.  The kernel is torch's ``torch.nn.attention.varlen.varlen_attn``
(FlashAttention varlen), which runs on CUDA in bf16/fp16 only; :func:`varlen_kernel` probes it once per device and
dtype, and the encoder keeps padded batches wherever it is missing (the CPU, float32, older torch, other model
types).  :func:`reference_kernel` computes the same attention text by text with SDPA (the CPU reference of the
tests).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Callable, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["ATTENTION", "PACKED_MODEL_TYPES", "supports_packing", "varlen_kernel", "reference_kernel", "packed_forward",
           "KERNEL_KWARG", "first_token_kernel_ok"]

ATTENTION = "cpdae_varlen"
"""The name of the attention function registered in transformers' ``AttentionInterface``."""
PACKED_MODEL_TYPES = ("bert",)
"""Model types whose forward pass runs packed: BERT's embeddings take ``position_ids`` (token types are 0) and its
attention goes through transformers' attention interface with the call's keyword arguments."""
_KERNEL_KWARG = "cpdae_varlen_kernel"
KERNEL_KWARG = _KERNEL_KWARG
"""The forward keyword that carries the kernel to the attention (and to a last layer trimmed to [CLS])."""

Kernel = Callable[..., torch.Tensor]


def reference_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: Optional[float] = None) -> torch.Tensor:
    """Variable-length attention of ``(T, heads, head_dim)`` tensors computed text by text with SDPA (any device
    and dtype; slow): what ``varlen_attn`` computes, for the CPU tests.  Text ``i``'s queries are rows
    ``cu_q[i]:cu_q[i+1]`` of ``q`` and its keys and values rows ``cu_k[i]:cu_k[i+1]`` of ``k`` and ``v``."""
    out = torch.empty_like(q)
    bounds = zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist())
    for a, b, c, d in bounds:
        seg = [q[a:b].transpose(0, 1), k[c:d].transpose(0, 1), v[c:d].transpose(0, 1)]
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(*seg, scale=scale).transpose(0, 1)
    return out


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
               **kwargs: Any) -> Tuple[torch.Tensor, None]:
    kernel = kwargs.pop(_KERNEL_KWARG, None)
    cu = kwargs.get("cu_seq_lens_q")
    if kernel is None or cu is None:  # a padded call
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    # transformers' layout (1, heads, T, head_dim) -> the kernel's (T, heads, head_dim); back as (1, T, heads, dim)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    width = int(kwargs["max_length_q"])
    out = kernel(q, k, v, cu, cu, width, width, scale=scaling)
    return out.unsqueeze(0), None


@functools.lru_cache(maxsize=None)
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward pass can run packed (its type is in :data:`PACKED_MODEL_TYPES` and it uses
    transformers' attention interface)."""
    config = getattr(model, "config", None)
    return (getattr(config, "model_type", None) in PACKED_MODEL_TYPES
            and bool(getattr(model, "_supports_attention_backend", False)) and not getattr(config, "is_decoder", False))


@functools.lru_cache(maxsize=None)
def _probe(device: str, dtype: torch.dtype) -> Optional[Kernel]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    try:
        q = torch.randn(6, 2, 32, device=device, dtype=dtype)
        cu = torch.tensor([0, 2, 6], device=device, dtype=torch.int32)
        out = varlen_attn(q, q, q, cu, cu, 4, 4)
        ref = reference_kernel(q.float(), q.float(), q.float(), cu, cu, 4, 4)
        if not torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2):
            return None
    except Exception:  # no FlashAttention build for this card/dtype
        return None
    return varlen_attn


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> Optional[Kernel]:
    """torch's ``varlen_attn`` when it runs (and agrees with :func:`reference_kernel`) on ``device`` in ``dtype``,
    else ``None``; probed once per device and dtype.  Only CUDA in bf16/fp16 qualifies."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    return _probe(str(device), dtype)


@functools.lru_cache(maxsize=None)
def first_token_kernel_ok(kernel: Kernel, device: str, dtype: torch.dtype) -> bool:
    """Whether ``kernel`` computes one query row per text against all of that text's keys (query segments of
    length 1, key segments of the texts' lengths), as a last layer trimmed to ``[CLS]`` calls it: checked once per
    kernel, device and dtype against :func:`reference_kernel`."""
    try:
        q = torch.randn(2, 2, 32, device=device, dtype=dtype)
        kv = torch.randn(6, 2, 32, device=device, dtype=dtype)
        cu_q = torch.tensor([0, 1, 2], device=device, dtype=torch.int32)
        cu_k = torch.tensor([0, 2, 6], device=device, dtype=torch.int32)
        out = kernel(q, kv, kv, cu_q, cu_k, 1, 4)
        ref = reference_kernel(q.float(), kv.float(), kv.float(), cu_q, cu_k, 1, 4)
        return bool(torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2))
    except Exception:  # a kernel without separate query and key lengths
        return False


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module) -> Iterator[None]:
    """Runs ``model`` with :data:`ATTENTION` (padded calls inside still use SDPA), restored afterwards."""
    _register()
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
