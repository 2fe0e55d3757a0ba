"""Variable-length attention, for encoding and for pre-training: the one attention function registered with
transformers (:data:`ATTENTION`, :func:`varlen_attention`) and the choice of its kernel.

A packed call runs a batch's texts laid end to end in one row of real tokens, with the cumulative text lengths
(``cu_seq_lens_q``) among the forward call's keyword arguments, which Hugging Face's BERT (transformers 5) hands to
the attention function; attention stays inside each text, so no layer computes on padding.  Every other call (no
``cu_seq_lens_q``) goes to transformers' SDPA, unchanged, so a padded call through the same model is the padded
path.  The kernels take ``(T, heads, head_dim)`` tensors and the text bounds:

* ``flash_attn``: ``flash_attn.flash_attn_varlen_func`` (FlashAttention-2's varlen kernel, attention dropout
  included), on CUDA in bf16/fp16, when the ``flash-attn`` package is installed;
* ``varlen_attn``: torch's ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention varlen, torch >= 2.9), on CUDA
  in bf16/fp16 only, no dropout; :func:`varlen_kernel` probes it once per device and dtype against the reference;
* ``njt``: ``scaled_dot_product_attention`` on nested (jagged) tensors, torch's own varlen dispatch to its fused
  kernels (CUDA; it runs on the CPU too, which the tests use to check its plumbing);
* ``loop``: one ``scaled_dot_product_attention`` per text (:func:`reference_kernel`; any device and dtype; the
  CPU's kernel and the reference of the tests).

Who chooses: the encoder (:mod:`pyterrier_cpdae.encoder.cpdae`, through :mod:`~pyterrier_cpdae.encoder.backends.unpadded`)
asks :func:`varlen_kernel` once per device and dtype and passes the kernel with the call (:data:`KERNEL_KWARG`);
it keeps padded batches where there is none (the CPU, float32, older torch).  Pre-training
(:mod:`pretrain.model.unpadded`) passes no kernel: each call takes :func:`kernel_for_call`'s (``flash_attn`` on
CUDA in half precision when installed, ``njt`` on CUDA otherwise, ``loop`` on the CPU; :data:`FORCE_KERNEL` wins),
with attention dropout while the model trains.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ["ATTENTION", "KERNEL_KWARG", "VARLEN_KERNELS", "FORCE_KERNEL", "register", "varlen_attention",
           "reference_kernel", "varlen_kernel", "first_token_kernel_ok", "kernel_for_call"]

ATTENTION = "cpdae_varlen"
"""The name of the attention function registered in transformers' ``AttentionInterface``."""
_KERNEL_KWARG = "cpdae_varlen_kernel"
KERNEL_KWARG = _KERNEL_KWARG
"""The forward keyword that carries the kernel to the attention (and to a last layer trimmed to [CLS])."""
#: Kernels of a call that carries none (:func:`kernel_for_call`).
VARLEN_KERNELS = ("flash_attn", "njt", "loop")
#: Force one kernel on calls that carry none (tests: ``"njt"`` on the CPU); ``None``: :func:`kernel_for_call` chooses.
FORCE_KERNEL: Optional[str] = None

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


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query/key/value`` ``(B, heads, S, d)``; returns
    ``((B, S, heads, d), None)``.  With ``cu_seq_lens_q`` (a packed row ``B = 1`` of texts ``[cu[i], cu[i+1])``):
    attention inside each text only, by the call's kernel (:data:`KERNEL_KWARG`) or else :func:`kernel_for_call`'s;
    without: transformers' SDPA (the padded path, unchanged)."""
    kernel = kwargs.pop(_KERNEL_KWARG, None)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:  # a padded call
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"unpadded attention expects one packed row, got a batch of {query.shape[0]}")
    # transformers' layout (1, heads, T, head_dim) -> the kernel's (T, heads, head_dim); back as (1, T, heads, dim)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    width = int(kwargs["max_length_q"])
    if kernel is not None:  # the encoder's kernel, chosen once per device and dtype
        out = kernel(q, k, v, cu, cu, width, width, scale=scaling)
    else:
        out = _named_kernel(q, k, v, cu, width, dropout if module.training else 0.0, scaling)
    return out.unsqueeze(0), None


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Registers :func:`varlen_attention` as :data:`ATTENTION` with transformers' ``AttentionInterface`` (and
    transformers' SDPA masks for it, for the padded calls of a model switched to it), once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, varlen_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


# ----------------------------------------------------------------------------- the encoder's kernel
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


# ----------------------------------------------------------------------------- pre-training's kernel, per call
def kernel_for_call(query: torch.Tensor, dropout: float) -> str:
    """The kernel of one call that carries none (module docstring): ``flash_attn`` on CUDA in half precision when
    installed, ``njt`` on CUDA otherwise, ``loop`` on the CPU; :data:`FORCE_KERNEL` wins."""
    if FORCE_KERNEL is not None:
        return FORCE_KERNEL
    if query.device.type != "cuda":
        return "loop"
    if query.dtype in (torch.float16, torch.bfloat16) and _flash_attn() is not None:
        return "flash_attn"
    return "njt"


_FLASH: list = []


def _flash_attn() -> Any:
    if not _FLASH:
        try:
            from flash_attn import flash_attn_varlen_func
        except Exception:  # not installed, or built for another torch / CUDA
            flash_attn_varlen_func = None
        _FLASH.append(flash_attn_varlen_func)
    return _FLASH[0]


def _named_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens_q: torch.Tensor,
                  max_length_q: int, p: float, scaling: Optional[float]) -> torch.Tensor:
    """Attention inside each text of ``(T, heads, d)`` tensors by :func:`kernel_for_call`'s kernel, with attention
    dropout ``p``."""
    kernel = kernel_for_call(q, p)
    if kernel == "flash_attn":
        cu = cu_seq_lens_q.to(torch.int32)
        out = _flash_attn()(q, k, v, cu, cu, int(max_length_q), int(max_length_q), dropout_p=p, softmax_scale=scaling)
    elif kernel == "njt":
        offsets = cu_seq_lens_q.to(torch.int64)
        # the bounds are given, so that torch never reads them back from the device (3 reads per layer otherwise):
        # every text holds at least one token (the packed layouts' and unpadded_last_hidden's rows are never empty,
        # and the fused kernels refuse an empty one) and at most max_length_q
        bounds = {"min_seqlen": 1, "max_seqlen": int(max_length_q)}

        def nested(t: torch.Tensor) -> torch.Tensor:
            return torch.nested.nested_tensor_from_jagged(t, offsets=offsets, **bounds).transpose(1, 2)  # (N, h, j, d)
        with warnings.catch_warnings():  # torch's "prototype" notices of nested tensors
            warnings.simplefilter("ignore", UserWarning)
            out = F.scaled_dot_product_attention(nested(q), nested(k), nested(v), dropout_p=p, scale=scaling)
            out = out.transpose(1, 2).values()
    elif kernel == "loop":
        bounds = cu_seq_lens_q.tolist()
        out = torch.cat([F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                        v[s:e].transpose(0, 1), dropout_p=p, scale=scaling
                                                        ).transpose(0, 1)
                         for s, e in zip(bounds[:-1], bounds[1:])])
    else:
        raise ValueError(f"unknown varlen attention kernel {kernel!r} (known: {', '.join(VARLEN_KERNELS)})")
    return out
