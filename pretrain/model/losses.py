"""Loss functions of the pre-training objectives.

* :func:`mlm_loss`: masked-LM cross-entropy computed on the masked positions only (the
  hidden states are gathered *before* the vocabulary projection, so no ``B×L×|V|`` tensor
  is ever built).
* :func:`rec_loss`: CPDAE's bag-of-words reconstruction loss, sigmoid binary
  cross-entropy over the vocabulary (optionally IDF-weighted).
* :func:`pairwise_js`: all pairwise Jensen–Shannon divergences between word distributions,
  as a memory-efficient autograd function (memory ``O(chunk·N·|V|)`` instead of
  ``O(N²·|V|)``), and :func:`pairwise_js_naive`, its broadcast reference.
* :func:`info_nce`: InfoNCE / NT-Xent over a similarity matrix.

Everything that involves ``log``/``sigmoid`` runs in float32 (float64 inputs stay float64),
also under autocast.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

__all__ = ["mlm_loss", "mlm_loss_selected", "rec_loss", "pairwise_js", "pairwise_js_naive", "info_nce", "word_distribution", "entropy"]


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def mlm_loss(hidden: torch.Tensor, labels: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor],
             num_items: Optional[Union[float, torch.Tensor]] = None) -> torch.Tensor:
    """Masked-LM cross-entropy over the positions where ``labels != -100``.

    Args:
        hidden: ``(B, L, H)`` last hidden states.
        labels: ``(B, L)`` original token ids at masked positions, ``-100`` elsewhere.
        lm_head: Maps ``(n, H)`` hidden states to ``(n, |V|)`` logits (e.g. ``BertOnlyMLMHead``).
        num_items: Divide the summed loss by this instead of the local number of masked
            tokens (used to make the loss exact under data parallelism, see
            :func:`pretrain.model.distributed.global_mean_count`).

    Returns:
        Scalar float32 loss (mean over masked tokens). A batch without any masked token
        gives ``0`` (still connected to the graph).
    """
    if hidden.shape[:2] != labels.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on (B, L)")
    sel = labels != -100
    return mlm_loss_selected(hidden[sel], labels[sel], lm_head, num_items)


def mlm_loss_selected(states: torch.Tensor, targets: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor],
                      num_items: Optional[Union[float, torch.Tensor]] = None) -> torch.Tensor:
    """:func:`mlm_loss` of the states already gathered at the masked positions: ``states`` ``(M, H)``, ``targets``
    ``(M,)`` (the packed path's host-built masked positions: no boolean indexing on the device)."""
    if states.shape[:1] != targets.shape:
        raise ValueError(f"states {tuple(states.shape)} and targets {tuple(targets.shape)} disagree on M")
    logits = lm_head(states).float()
    total = F.cross_entropy(logits, targets, reduction="sum")
    if num_items is None:
        num_items = targets.numel()
    if targets.numel() == 0:
        return logits.sum() * 0.0
    return total / torch.as_tensor(num_items, dtype=total.dtype, device=total.device)


def rec_loss(logits: torch.Tensor, targets: torch.Tensor, weights: Optional[torch.Tensor] = None,
             reduction: str = "sum") -> torch.Tensor:
    """Bag-of-words reconstruction loss: sigmoid BCE of every vocabulary entry.

    ``L_REC = mean_n  R_v [ w_v · BCE(σ(z_nv), y_nv) ]`` where ``R`` is a sum (CPDAE Eq. 4)
    or a mean over the vocabulary.

    Args:
        logits: ``(N, |V|)`` decoder logits (any float dtype; computed in float32).
        targets: ``(N, |V|)`` multi-hot targets (:func:`pretrain.data.masking.bag_of_words`).
        weights: Optional per-token weights, ``(|V|,)`` (e.g. IDF) or ``(N, |V|)``.
        reduction: ``"sum"`` or ``"mean"`` over the vocabulary; always averaged over rows.
    """
    if logits.shape != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must have the same shape")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    dt = _work_dtype(logits)
    per = F.binary_cross_entropy_with_logits(logits.to(dt), targets.to(dt), reduction="none")
    if weights is not None:
        if weights.shape[-1] != logits.shape[-1]:
            raise ValueError(f"weights {tuple(weights.shape)} do not match the vocabulary size {logits.shape[-1]}")
        per = per * weights.to(device=per.device, dtype=dt)
    per_row = per.sum(-1) if reduction == "sum" else per.mean(-1)
    return per_row.mean()


def word_distribution(logits: torch.Tensor, kind: str = "sigmoid") -> torch.Tensor:
    """Turn decoder logits into word distributions ``ž`` (rows sum to 1), in float32.

    ``"sigmoid"`` (CPDAE): ``σ(z) / Σ σ(z)``; ``"softmax"``: ``softmax(z)``.
    """
    z = logits.to(_work_dtype(logits))
    if kind == "sigmoid":
        s = torch.sigmoid(z)
        return s / s.sum(-1, keepdim=True)
    if kind == "softmax":
        return torch.softmax(z, dim=-1)
    raise ValueError(f"unknown word distribution {kind!r}; use 'sigmoid' or 'softmax'")


def _log(x: torch.Tensor) -> torch.Tensor:
    """``log`` with the argument clamped at the smallest normal number (finite at 0)."""
    return x.clamp_min(torch.finfo(x.dtype).tiny).log()


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (natural log) of the rows of ``p``, with ``0·log 0 = 0``."""
    return -(p * _log(p)).sum(-1)


def pairwise_js_naive(p: torch.Tensor, q: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reference ``(N, M)`` Jensen–Shannon divergences by broadcasting (memory ``N·M·|V|``).

    ``JS(p_i, q_j) = H((p_i + q_j)/2) − (H(p_i) + H(q_j))/2``.
    """
    q = p if q is None else q
    m = (p[:, None, :] + q[None, :, :]) * 0.5
    return entropy(m) - 0.5 * (entropy(p)[:, None] + entropy(q)[None, :])


class _PairwiseJS(torch.autograd.Function):
    """Chunked pairwise JS; backward recomputes the mixtures chunk by chunk.

    With ``JS_ij = H(M_ij) − (H(p_i)+H(q_j))/2`` and ``M_ij = (p_i+q_j)/2``:
    ``∂JS_ij/∂p_i = (log p_i − log M_ij)/2`` and ``∂JS_ij/∂q_j = (log q_j − log M_ij)/2``.
    In the symmetric case (``q is p``) the two contributions are merged through
    ``S = G + Gᵀ`` so that one pass over the chunks suffices.
    """

    @staticmethod
    def forward(ctx, p: torch.Tensor, q: Optional[torch.Tensor], chunk_size: int) -> torch.Tensor:  # type: ignore[override]
        sym = q is None
        qq = p if sym else q
        hp, hq = entropy(p), (None if sym else entropy(qq))
        hq = hp if sym else hq
        out = torch.empty(p.shape[0], qq.shape[0], dtype=p.dtype, device=p.device)
        for s in range(0, p.shape[0], chunk_size):
            m = (p[s:s + chunk_size, None, :] + qq[None, :, :]).mul_(0.5)
            hm = -torch.linalg.vecdot(m, _log(m))
            out[s:s + chunk_size] = hm
            del m
        out -= 0.5 * (hp[:, None] + hq[None, :])
        ctx.sym, ctx.chunk_size = sym, chunk_size
        if sym:
            ctx.save_for_backward(p)
        else:
            ctx.save_for_backward(p, q)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        with torch.autocast(device_type=grad.device.type, enabled=False):
            return _PairwiseJS._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad: torch.Tensor):
        if ctx.sym:
            (p,) = ctx.saved_tensors
            qq = p
            g = grad + grad.T  # S = G + Gᵀ: row i collects both of its roles
        else:
            p, qq = ctx.saved_tensors
            g = grad
        g = g.to(p.dtype)
        need_p = ctx.needs_input_grad[0]
        need_q = (not ctx.sym) and ctx.needs_input_grad[1]
        grad_p = torch.empty_like(p) if need_p else None
        acc_q = torch.zeros_like(qq) if need_q else None
        for s in range(0, p.shape[0], ctx.chunk_size):
            gs = g[s:s + ctx.chunk_size]  # (c, M)
            logm = (p[s:s + ctx.chunk_size, None, :] + qq[None, :, :]).mul_(0.5)
            logm = logm.clamp_min_(torch.finfo(logm.dtype).tiny).log_()  # (c, M, V), in place
            if need_p:
                # Σ_j g_ij log M_ij  -> (c, V)
                grad_p[s:s + ctx.chunk_size] = torch.bmm(gs[:, None, :], logm).squeeze(1)
            if need_q:
                # Σ_i g_ij log M_ij  -> (M, V)
                acc_q += torch.einsum("cm,cmv->mv", gs, logm)
            del logm
        if need_p:
            grad_p = 0.5 * (_log(p) * g.sum(1, keepdim=True) - grad_p)
        grad_q = None
        if need_q:
            grad_q = 0.5 * (_log(qq) * g.sum(0)[:, None] - acc_q)
        return grad_p, grad_q, None


def pairwise_js(p: torch.Tensor, q: Optional[torch.Tensor] = None, chunk_size: int = 8) -> torch.Tensor:
    """All pairwise Jensen–Shannon divergences (natural log) between the rows of ``p`` and ``q``.

    Memory-efficient: the ``(chunk, M, |V|)`` mixtures are built one chunk of rows at a time
    in the forward pass and recomputed in the backward pass, so peak memory is
    ``O(chunk_size · M · |V|)`` instead of ``O(N · M · |V|)`` for :func:`pairwise_js_naive`.

    Args:
        p: ``(N, |V|)`` probability distributions (rows sum to 1, entries ≥ 0).
        q: Optional ``(M, |V|)`` distributions; default ``p`` (the symmetric ``(N, N)`` case).
        chunk_size: Rows of ``p`` processed at once.

    Returns:
        ``(N, M)`` divergences in float32 (float64 for float64 inputs).
    """
    if p.dim() != 2 or (q is not None and (q.dim() != 2 or q.shape[1] != p.shape[1])):
        raise ValueError(f"pairwise_js needs 2-D inputs with the same vocabulary size, got {tuple(p.shape)}"
                         f" and {None if q is None else tuple(q.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dt = _work_dtype(p)
    p = p.to(dt)
    if q is not None:
        q = q.to(dt)
    with torch.autocast(device_type=p.device.type, enabled=False):  # full precision, also under autocast
        return _PairwiseJS.apply(p, q, int(chunk_size))


def info_nce(sim: torch.Tensor, pos_index: torch.Tensor, self_index: Optional[torch.Tensor] = None,
             temperature: float = 1.0, reduction: str = "mean") -> torch.Tensor:
    """InfoNCE: cross-entropy of each row's positive against every other column.

    Row ``i`` scores ``sim[i] / temperature``; its own column (``self_index[i]``) is excluded,
    its positive is column ``pos_index[i]``, every other column is a negative.

    Args:
        sim: ``(N, M)`` similarities (larger = more similar).
        pos_index: ``(N,)`` column of each row's positive.
        self_index: ``(N,)`` column holding the row itself (excluded); default ``arange(N)``
            for a square ``sim``; pass ``-1`` entries to exclude nothing for that row.
        temperature: Divides the similarities.
        reduction: ``"mean"`` or ``"sum"`` over rows, or ``"none"`` (one loss per row).

    Returns:
        The loss of every row reduced over rows (float32).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if sim.dim() != 2 or pos_index.shape != (sim.shape[0],):
        raise ValueError(f"info_nce needs sim (N, M) and pos_index (N,), got {tuple(sim.shape)} and {tuple(pos_index.shape)}")
    n, m = sim.shape
    if m < 2:
        raise ValueError("info_nce needs at least 2 columns (a positive and a negative or itself)")
    if self_index is None:
        if n != m:
            raise ValueError("self_index is required for a non-square similarity matrix")
        self_index = torch.arange(n, device=sim.device)
    # checked where the indices are: at once on the CPU, by the device on a GPU (without waiting for it; a failed
    # check stops the device's queue there)
    try:
        torch._assert_async(~(self_index == pos_index.to(self_index.device)).any(),
                            "a row's positive cannot be the row itself")
    except RuntimeError as e:
        raise ValueError(str(e)) from None
    logits = sim.to(_work_dtype(sim)) / temperature
    # each row's own column (none for -1) to -inf: a mask, not boolean indexing (which waits for the device)
    own = torch.arange(m, device=sim.device).unsqueeze(0) == self_index.to(sim.device).unsqueeze(1)
    logits = logits.masked_fill(own, float("-inf"))
    return F.cross_entropy(logits, pos_index.to(sim.device), reduction=reduction)
