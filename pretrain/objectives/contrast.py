"""In-batch contrastive parts shared by objectives: paired InfoNCE and the span-contrast add-on.

* :func:`paired_info_nce`: anchor ``i`` against the candidates of the whole (data-parallel)
  batch, its own candidate ``i`` the positive (SimCSE's Eq. 1, ICT's in-batch softmax).
* **Span contrast** (the second stage of the RetroMAE extension, Xiao et al. 2022, "SentMAE
  co"; coCondenser, Gao & Callan 2022): an add-on term for *any* objective,
  ``L = L_objective + w·L_span`` with ``w = --span-contrast-weight`` (0: off, the default).
  Every text of the batch gives two spans; their vectors ``h`` (``--representation``: the
  last layer's [CLS] vector, or its mean over the span's real tokens, [CLS] and [SEP]
  included, as the objective's other parts read them; [CLS] for objectives without the option) enter one of two losses,
  ``--span-contrast-form``:

  ``eq8`` (default): the RetroMAE extension's Eq. 8, literally. Text ``i``'s spans are the
  anchor ``h_i`` and its positive ``h_i⁺``; the negatives are the *other texts' positives*::

      L_span = -(1/m) Σ_i log exp(h_i·h_i⁺/τ) / Σ_j exp(h_i·h_j⁺/τ)

  (``j`` over the ``m`` positives of the global batch: the positive and ``m - 1`` negatives;
  one-sided: the positives are never anchors, the anchors never negatives; computed by
  :func:`paired_info_nce` with the dot product). Which of a text's two spans is the anchor is
  a fair coin per text, so that anchors are not always the beginnings of texts.

  ``cocondenser``: coCondenser's symmetric NT-Xent over the ``2m`` spans of the global batch::

      L_span = -(1/2m) Σ_k log exp(h_k·h_k'/τ) / Σ_{l≠k} exp(h_k·h_l/τ)

  (every span ``k`` is an anchor, its twin ``k'`` the positive, the other ``2m - 2`` spans,
  anchors and positives alike, the negatives; computed by
  :func:`pretrain.objectives.cpdae.twin_contrastive_loss`).

  Both: dot product, ``τ = --span-contrast-temperature`` (default 1: none, as in both papers),
  mean over anchors (DDP: the global-batch mean).

  **The spans.** The paper's positives are two spans (sentences) of one article, coCondenser's
  two of a document's pre-cut chunks. Here the two spans of a text are the parts before and
  after a cut point drawn uniformly from ``[⌈n/4⌉, n - ⌈n/4⌉]`` of the training text (disjoint,
  each at least a quarter of the text; a one-token text gives the token twice). A training text
  is a block of the token cache, and a block never mixes documents (:mod:`pretrain.data.corpus`), so
  the two spans always come from one article/document: for a document that fits in one block
  (SciFact abstracts, MS MARCO passages, short articles) any two parts of it; for a longer one
  (a Wikipedia article of several blocks) two neighbouring parts of one block. Spans from two
  different blocks of one article would need a block-to-document map in the token cache (its
  format and cache key) and a sampler drawing pairs of blocks, which the cache does not have.
  The spans are encoded *unmasked* in an extra encoder pass (coCondenser contrasts the masked
  spans it also feeds to MLM; the add-on must not depend on the objective's views).

  :func:`attach_span_contrast` (called by :class:`~pretrain.objectives.base.Objective`) binds
  the collate and losses wrappers on the instance when the weight is positive, so that the
  term applies to every registered objective without per-objective code; the objective's
  own numbers are untouched when it is 0 (no random numbers are drawn either).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..model.distributed import gather_sizes, gather_with_grad, is_distributed, rank, world_size
from ..model.losses import info_nce
from ..data.masking import pad_and_add_special

__all__ = ["twin_contrastive_loss", "paired_info_nce", "cosine", "dot", "split_spans", "span_contrast", "span_contrast_loss",
           "span_contrast_form",
           "attach_span_contrast", "SPAN_CONTRAST_FORMS"]

#: ``--span-contrast-form`` choices: the RetroMAE extension's Eq. 8 (default) and coCondenser's NT-Xent.
SPAN_CONTRAST_FORMS = ("eq8", "cocondenser")


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
    (:func:`pretrain.model.distributed.gather_with_grad`), so ``j`` runs over the global batch; each
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


def span_contrast(h: torch.Tensor, form: str, temperature: float) -> torch.Tensor:
    """``L_span`` of this process's ``(2m, H)`` span vectors, view-major: rows ``0..m-1`` the anchors
    ``h_i``, rows ``m..2m-1`` their positives ``h_i⁺`` (``form``: ``eq8`` or ``cocondenser``, see above)."""
    _check_form(form)
    if h.dim() != 2 or h.shape[0] % 2:
        raise ValueError(f"span vectors must be (2m, H), got {tuple(h.shape)}")
    m = h.shape[0] // 2
    if form == "eq8":
        return paired_info_nce(h[:m], h[m:], temperature, similarity=dot)
    return twin_contrastive_loss(h, lambda a, b: dot(a, a if b is None else b), temperature=temperature)


def span_contrast_loss(objective: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``L_span`` (``--span-contrast-form``) of a batch holding ``span_input_ids``/``span_attention_mask``
    ``(m, 2, L)`` (span 0 of text ``i``: the anchor ``h_i``; span 1: its positive ``h_i⁺``), the spans
    encoded by the objective's encoder and pooled by its :meth:`~pretrain.objectives.base.Objective.text_vectors`
    (``--representation``)."""
    length = batch["span_input_ids"].shape[-1]
    ids = batch["span_input_ids"].transpose(0, 1).reshape(-1, length)  # view-major: the m anchors, then the m positives
    am = batch["span_attention_mask"].transpose(0, 1).reshape(-1, length)
    h = objective.text_vectors(objective.encode(ids, am, packed=objective.packed_inputs(batch, "spans")), am)
    return span_contrast(h, span_contrast_form(objective.config), float(objective.config.span_contrast_temperature))


def span_contrast_form(config: Any) -> str:
    """``config.span_contrast_form`` checked (``eq8`` for a config without the option)."""
    return _check_form(getattr(config, "span_contrast_form", "eq8"))


def _check_form(form: str) -> str:
    if form not in SPAN_CONTRAST_FORMS:
        raise ValueError(f"--span-contrast-form must be one of {', '.join(SPAN_CONTRAST_FORMS)}, got {form!r}")
    return form


class _WithSpans:
    """The objective's ``collate`` / ``losses`` with the span-contrast add-on (a picklable callable: the collator goes
    to spawned ``DataLoader`` workers with the objective)."""

    def __init__(self, objective: Any, method: str):
        self.objective, self.method = objective, method

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        return getattr(self, "_" + self.method)(self.objective, *args, **kwargs)

    @staticmethod
    def _collate(self: Any, examples: list[list[int]],
                 generators: Optional[list[torch.Generator]] = None) -> dict[str, torch.Tensor]:
        batch = type(self).collate(self, examples, generators)
        if generators is not None:  # text i's cut and coin from generators[i], after what the objective drew from it
            pairs = [split_spans(e, g) for e, g in zip(examples, generators)]
            flip = [bool(torch.rand(1, generator=g)[0] < 0.5) for g in generators]
        else:
            gen = getattr(self, "mask_generator", None)
            pairs = [split_spans(e, gen) for e in examples]
            flip = (torch.rand(len(pairs), generator=gen) < 0.5).tolist()
        if span_contrast_form(self.config) == "eq8":  # Eq. 8 is one-sided: a coin per text picks its anchor span
            pairs = [(b, a) if f else (a, b) for (a, b), f in zip(pairs, flip)]
        ids, am, _ = pad_and_add_special([p[0] for p in pairs] + [p[1] for p in pairs], self.tokenizer)
        m = len(examples)
        batch["span_input_ids"] = torch.stack([ids[:m], ids[m:]], 1)
        batch["span_attention_mask"] = torch.stack([am[:m], am[m:]], 1)
        if self.packs():  # the spans' encoder pass (view-major: the anchors, then the positives), laid out here
            batch.update(self.pack("spans", ids, am))
        return batch

    @staticmethod
    def _losses(self: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = type(self).losses(self, batch)
        l_span = span_contrast_loss(self, batch)
        out["loss"] = out["loss"] + float(self.config.span_contrast_weight) * l_span
        out["span"] = l_span.detach()
        return out


def attach_span_contrast(objective: Any) -> None:
    """Add ``w·L_span`` to ``objective`` when ``config.span_contrast_weight > 0`` (no-op otherwise).

    Binds ``collate`` (adds the two spans of every text, drawn from the text's own generator after the objective's
    draws) and ``losses`` (adds the term and a ``"span"`` loss term) on the instance.

    Raises:
        ValueError: for a negative weight, ``τ <= 0``, an unknown ``--span-contrast-form`` or fewer
            than 2 texts per forward pass.
    """
    config = objective.config
    w = float(getattr(config, "span_contrast_weight", 0.0))
    if w < 0:
        raise ValueError(f"--span-contrast-weight must be >= 0, got {w}")
    if w == 0:
        return
    if not float(config.span_contrast_temperature) > 0:
        raise ValueError(f"--span-contrast-temperature must be > 0, got {config.span_contrast_temperature!r}")
    span_contrast_form(config)
    micro = config.batch_size / max(1, getattr(config, "grad_accum", 1))
    if micro < 2 and world_size() == 1:
        raise ValueError(f"--span-contrast-weight > 0 contrasts the texts of a batch and needs at least 2 texts per "
                         f"forward pass (batch_size {config.batch_size}, grad_accum {getattr(config, 'grad_accum', 1)})")
    objective.collate = _WithSpans(objective, "collate")
    objective.losses = _WithSpans(objective, "losses")
    objective.loss_names = tuple(objective.loss_names) + ("span",)
