"""In-batch contrastive parts shared by objectives: paired InfoNCE and the span-contrast add-on.

* :func:`paired_info_nce`: anchor ``i`` against the candidates of the whole (data-parallel)
  batch, its own candidate ``i`` the positive (SimCSE's Eq. 1, ICT's in-batch softmax).
* **Span contrast** (coCondenser, Gao & Callan 2022; the second stage of the RetroMAE
  extension, Xiao et al. 2022, "SentMAE co"): an add-on term for *any* objective,
  ``L = L_objective + w·L_span`` with ``w = --span-contrast-weight`` (0: off, the default).
  Every text of the batch is cut into two spans; the ``2m`` span [CLS] vectors of the
  global batch enter coCondenser's InfoNCE::

      L_span = -(1/2m) Σ_i log exp(h_i·h_i⁺/τ) / Σ_{k≠i} exp(h_i·h_k/τ)

  (dot product as in coCondenser, ``τ = --span-contrast-temperature``, default 1: none;
  every span is an anchor, its twin span the positive, the other ``2m - 2`` spans the
  negatives; computed by :func:`twin_contrastive_loss`).

  Reading taken: coCondenser samples two of a document's pre-cut chunks; here the document
  is the training text (a block of the token cache, never mixing documents) and its two spans
  are the parts before and after a cut point drawn uniformly from ``[⌈n/4⌉, n - ⌈n/4⌉]``
  (disjoint, each at least a quarter of the text; a one-token text gives the token twice).
  The spans are encoded *unmasked* in an extra encoder pass (coCondenser contrasts the
  masked spans it also feeds to MLM; the add-on must not depend on the objective's views).

  :func:`attach_span_contrast` (called by :class:`~pretrain.objectives.base.Objective`) binds
  the collate and forward wrappers on the instance when the weight is positive, so that the
  term applies to every registered objective without per-objective code; the objective's
  own numbers are untouched when it is 0 (no random numbers are drawn either).
"""
from __future__ import annotations

import math
from types import MethodType
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..distributed import gather_sizes, gather_with_grad, is_distributed, rank, world_size
from ..losses import info_nce
from ..masking import pad_and_add_special

__all__ = ["twin_contrastive_loss", "paired_info_nce", "cosine", "dot", "split_spans", "span_contrast_loss", "attach_span_contrast"]


def twin_contrastive_loss(x: torch.Tensor, similarity: Any, temperature: float = 1.0,
                          reduction: str = "mean") -> torch.Tensor:
    """InfoNCE over the views of a data-parallel batch.

    ``x`` holds this process's ``2m`` views, view-major (row ``i`` and ``i+m`` are twins).
    The views of all processes are gathered (with gradients), the similarity of local views
    against every global view is computed with ``similarity(local, global) -> (rows, N)``
    (``global`` is ``None`` in a single process, meaning "local").

    ``reduction="mean"``: every view is an anchor; the loss is the mean over the local rows
    (with DDP's gradient averaging, the global-batch mean). ``"sum"``: CPDAE's Eq. 5 read
    literally, a sum over the ``m`` anchors, the first view of each text (its positive is the
    twin, all other ``2m - 2`` views of the global batch are negatives); each process returns
    ``world_size`` times its local sum, so that DDP's averaging gives the global sum.
    """
    n = x.shape[0]
    if n % 2:
        raise ValueError(f"expected an even number of views (2 per text), got {n}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cl_reduction must be 'mean' or 'sum', got {reduction!r}")
    m = n // 2
    local = torch.arange(n, device=x.device)
    pos = (local + m) % n
    offset, scale, columns = 0, 1, None
    if is_distributed():
        sizes = gather_sizes(n, device=x.device)
        offset = sum(sizes[:rank()])
        if sum(sizes) < 4:
            raise ValueError("contrastive objectives need at least 2 texts per (global) batch")
        columns, scale = gather_with_grad(x), world_size()
    elif m < 2:
        raise ValueError("contrastive objectives need at least 2 texts per batch (got 1): "
                         "the other texts' views are the negatives")
    if reduction == "mean":
        sim = similarity(x, columns)
        return info_nce(sim, pos + offset, self_index=local + offset if columns is not None else None,
                        temperature=temperature)
    anchors = local[:m]
    sim = similarity(x[:m], x if columns is None else columns)
    return scale * info_nce(sim, pos[:m] + offset, self_index=anchors + offset, temperature=temperature,
                            reduction="sum")


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(N, M)`` cosine similarities of the rows of ``a`` and ``b`` (float32, outside autocast)."""
    with torch.autocast(device_type=a.device.type, enabled=False):
        return F.normalize(a.float(), dim=-1) @ F.normalize(b.float(), dim=-1).T


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(N, M)`` inner products of the rows of ``a`` and ``b`` (float32, outside autocast)."""
    with torch.autocast(device_type=a.device.type, enabled=False):
        return a.float() @ b.float().T


def paired_info_nce(anchors: torch.Tensor, candidates: torch.Tensor, temperature: float,
                    similarity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cosine) -> torch.Tensor:
    """``mean_i -log exp(s(a_i, c_i)/τ) / Σ_j exp(s(a_i, c_j)/τ)`` with in-batch negatives.

    ``anchors`` and ``candidates`` are this process's ``(m, H)`` rows (row ``i`` of each is a
    positive pair). The candidates of all processes are gathered with gradients
    (:func:`pretrain.distributed.gather_with_grad`), so ``j`` runs over the global batch; each
    process returns the mean over its local anchors, which DDP's gradient averaging turns into
    the gradient of the global-batch mean.

    Raises:
        ValueError: for mismatched shapes, ``τ <= 0`` or a global batch of fewer than 2 pairs.
    """
    if anchors.dim() != 2 or anchors.shape != candidates.shape:
        raise ValueError(f"anchors and candidates must be (m, H) of the same shape, got {tuple(anchors.shape)} "
                         f"and {tuple(candidates.shape)}")
    if not float(temperature) > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    m = anchors.shape[0]
    offset, columns = 0, candidates
    if is_distributed():
        sizes = gather_sizes(m, device=anchors.device)
        offset = sum(sizes[:rank()])
        if sum(sizes) < 2:
            raise ValueError("in-batch contrastive objectives need at least 2 texts per (global) batch")
        columns = gather_with_grad(candidates)
    elif m < 2:
        raise ValueError("in-batch contrastive objectives need at least 2 texts per batch (got 1): "
                         "the other texts are the negatives")
    sim = similarity(anchors, columns)
    labels = torch.arange(m, device=anchors.device) + offset
    return info_nce(sim, labels, self_index=torch.full_like(labels, -1), temperature=float(temperature))


# ------------------------------------------------------------------------- span contrast
def split_spans(ids: list[int], generator: Optional[torch.Generator] = None) -> tuple[list[int], list[int]]:
    """Cut a text into two disjoint spans at a point drawn uniformly from ``[⌈n/4⌉, n - ⌈n/4⌉]``.

    A text of one token gives that token twice; an empty text gives two empty spans.
    """
    n = len(ids)
    if n < 2:
        return list(ids), list(ids)
    lo = max(1, math.ceil(n / 4))
    hi = max(lo, n - lo)
    cut = lo + int(torch.randint(hi - lo + 1, (1,), generator=generator))
    return list(ids[:cut]), list(ids[cut:])


def span_contrast_loss(objective: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``L_span`` of a batch holding ``span_input_ids``/``span_attention_mask`` ``(m, 2, L)``."""
    ids = batch["span_input_ids"].transpose(0, 1).reshape(-1, batch["span_input_ids"].shape[-1])
    am = batch["span_attention_mask"].transpose(0, 1).reshape(-1, ids.shape[-1])
    h = objective.encoder(input_ids=ids, attention_mask=am).last_hidden_state[:, 0].float()
    return twin_contrastive_loss(h, lambda a, b: dot(a, a if b is None else b),
                                 temperature=float(objective.config.span_contrast_temperature))


def _collate_with_spans(self: Any, examples: list[list[int]]) -> dict[str, torch.Tensor]:
    batch = type(self).collate(self, examples)
    gen = getattr(self, "mask_generator", None)
    pairs = [split_spans(e, gen) for e in examples]
    ids, am, _ = pad_and_add_special([p[0] for p in pairs] + [p[1] for p in pairs], self.tokenizer)
    m = len(examples)
    batch["span_input_ids"] = torch.stack([ids[:m], ids[m:]], 1)
    batch["span_attention_mask"] = torch.stack([am[:m], am[m:]], 1)
    return batch


def _forward_with_span_contrast(self: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = type(self).forward(self, batch)
    l_span = span_contrast_loss(self, batch)
    out["loss"] = out["loss"] + float(self.config.span_contrast_weight) * l_span
    out["span"] = l_span.detach()
    return out


def attach_span_contrast(objective: Any) -> None:
    """Add ``w·L_span`` to ``objective`` when ``config.span_contrast_weight > 0`` (no-op otherwise).

    Binds ``collate`` (adds the two spans of every text) and ``forward`` (adds the term and a
    ``"span"`` loss component) on the instance; accelerate's autocast wraps the bound forward
    like any other.

    Raises:
        ValueError: for a negative weight, ``τ <= 0`` or fewer than 2 texts per forward pass.
    """
    config = objective.config
    w = float(getattr(config, "span_contrast_weight", 0.0))
    if w < 0:
        raise ValueError(f"--span-contrast-weight must be >= 0, got {w}")
    if w == 0:
        return
    if not float(config.span_contrast_temperature) > 0:
        raise ValueError(f"--span-contrast-temperature must be > 0, got {config.span_contrast_temperature!r}")
    micro = config.batch_size / max(1, getattr(config, "grad_accum", 1))
    if micro < 2 and world_size() == 1:
        raise ValueError(f"--span-contrast-weight > 0 contrasts the texts of a batch and needs at least 2 texts per "
                         f"forward pass (batch_size {config.batch_size}, grad_accum {getattr(config, 'grad_accum', 1)})")
    objective.collate = MethodType(_collate_with_spans, objective)
    objective.forward = MethodType(_forward_with_span_contrast, objective)
    objective.loss_names = tuple(objective.loss_names) + ("span",)
