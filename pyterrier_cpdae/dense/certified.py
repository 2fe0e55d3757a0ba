"""Exact top-k in half precision: candidates scored from float16, rescored in float32, the cut proved (torch).

The float32 kernel (:func:`.kernels.torch_search` with ``precision="fp32"``) is bound by the card's float32 peak.  Here each chunk is scored from float16 queries and
vectors on tensor cores, with float32 accumulation and a float32 result (:func:`half_scores`), the best
``width >= k`` entries of each query are taken from those approximate scores, and only they are scored again from
the stored values in float32.  The result is the float32 kernel's whenever a per-query check holds, and the check is
a proof, not a heuristic:

* each query is scaled by a power of two (exact) and rounded to float16; the rounding errors of the query and of the
  vectors are known exactly (their norms are measured), and the float32 accumulation of ``dim`` products is bounded
  (:func:`lower_bound`);
* a document left out has a half-precision score ``<=`` the ``width``-th candidate's, ``s_w``;
* a document whose float32 (reference) score reaches the ``k``-th best float32 score among the candidates, ``e_k``,
  gets a half-precision score of at least ``L = lower_bound(e_k)``;
* so if ``L > s_w``, no document left out can enter the top ``k`` (nor tie with its last entry), and the top ``k``
  of the candidates by (float32 score, ascending id) is the exact result.

A query that fails the check (a dense band of near-equal scores at the cut, many duplicate documents) is searched
again with four times the candidates, and if it fails again, by the float32 kernel: never a wrong result, only a
slower one.  Each chunk's candidates are found without sorting its whole score matrix: the maximum of every block
of ``BLOCK`` consecutive documents is taken, the ``width`` blocks with the largest maxima are the only ones that can
hold a top-``width`` entry (at least ``width`` entries reach the ``width``-th largest block maximum), and the
top-``width`` is taken over those blocks' documents alone.  The scores are document-major (``(n, q)``) so that the
block maxima are a coalesced reduction over rows (a reduction along each query's row measured at a tenth of the
memory bandwidth on a GPU).
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

#: columns per block of the candidate pre-selection (see the module docstring)
BLOCK = 32

#: the largest document norm the proof is applied to (longer vectors: the float32 kernel decides)
MAX_FP16_NORM = 2.0 ** 14

#: unit roundoff of float32
U32 = 2.0 ** -24

#: extra candidates per query beyond ``k``: ``max(MIN_EXTRA, k // 4)``
MIN_EXTRA = 64


def candidates_for(k: int) -> int:
    """How many candidates a query keeps for a top-``k`` (the first try)."""
    return k + max(MIN_EXTRA, k // 4)


def query_scale(q):
    """Per-query powers of two that bring each query's norm into (0.5, 1] (1 for a zero query): scaling by them
    is exact, and keeps the float16 query away from overflow and (mostly) from subnormals."""
    import torch

    norms = torch.linalg.vector_norm(q.float(), dim=1)
    exps = torch.where(norms > 0, torch.ceil(torch.log2(norms.clamp_min(1e-30))), torch.zeros_like(norms))
    return torch.exp2(-exps)


def lower_bound(exact_scaled, q16_norm, q_err, max_doc_norm: float, max_doc_err: float, dim: int):
    """The half-precision score (:func:`half_scores`) that any document whose float32 reference score reaches
    ``exact_scaled`` must at least get (scaled units, per query).

    For such a document ``x`` (norm ``<= max_doc_norm``): its true inner product is ``>= exact_scaled - g`` with
    ``g = 2 dim u32 |q| M`` (the reference's float32 accumulation); the half-precision score sums the exact products
    of the *rounded* query and vector, whose true sum is ``>= true - |e_q| M - |q16| |e_d|`` (``e_q``, ``e_d``: the
    exact rounding errors of query and vector, by Cauchy-Schwarz), up to its own float32 accumulation,
    ``2 dim u32 |q16| (M + |e_d|)``.  All margins are inflated by 1% and the bound is lowered by ``2**-20`` of its
    magnitude before it is rounded to float32, for the float32/float64 evaluation of the norms and of the bound.
    """
    acc = 2 * dim * U32
    margin = (acc * q16_norm.double() * max_doc_norm  # reference accumulation (|q| ~ |q16|, within 2**-11)
              + q_err.double() * max_doc_norm + q16_norm.double() * max_doc_err  # query and vector rounding
              + acc * q16_norm.double() * (max_doc_norm + max_doc_err)) * 1.01  # the half path's accumulation
    low = exact_scaled.double() - margin
    low = low - low.abs() * 2.0 ** -20
    return low.float()


@contextlib.contextmanager
def full_precision():
    """float32 matmuls in IEEE float32 (no TF32) for the duration, whatever the caller set globally: the rescoring
    and the float32 kernel then compute what :func:`lower_bound` assumes."""
    import torch

    prec = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        yield
    finally:
        torch.set_float32_matmul_precision(prec)


def half_scores(c16, q16):
    """``(n, q)`` float32 scores of float16 vectors ``c16`` by float16 queries ``q16``: every product exact, summed in
    float32, the result not rounded further (document-major, for :func:`block_topk`).

    CUDA: ``torch.mm(..., out_dtype=torch.float32)`` (tensor cores, float32 accumulation and output; no
    reduced-precision reduction applies to a float32 output). Elsewhere, or a torch without it: the float16 values
    widened to float32 (exactly) and multiplied in IEEE float32 (:func:`full_precision`).
    """
    import torch

    if c16.device.type == "cuda":
        try:
            return torch.mm(c16, q16.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # pragma: no cover (a torch without mm's out_dtype)
            pass
    return c16.float() @ q16.float().T


def block_topk(scores, width: int, block: Optional[int] = None):
    """``(values, rows)``, each ``(q, width)``: for each column (query) of the document-major ``scores`` ``(n, q)``,
    its ``width`` largest entries (``width <= n``; in no particular order among equal values), found through the
    maxima of blocks of ``block`` consecutive rows (module docstring): a reduction over rows, coalesced."""
    import torch

    block = BLOCK if block is None else block
    n, q = scores.shape
    nb = -(-n // block)
    if nb <= 2 * width:  # the pre-selection would not shrink the problem
        return scores.T.topk(width, dim=1)
    full = n // block
    maxima = scores[:full * block].view(full, block, q).amax(dim=1)  # (full, q)
    if full < nb:
        maxima = torch.cat([maxima, scores[full * block:].amax(dim=0, keepdim=True)], dim=0)
    chosen = maxima.T.topk(width, dim=1).indices  # (q, width): the blocks that can hold a top-width entry
    rows = (chosen.unsqueeze(2) * block + torch.arange(block, device=scores.device)).reshape(q, width * block)
    outside = rows >= n  # the last block's rows beyond the matrix (only when n is not a multiple of block)
    cols = torch.arange(q, device=scores.device).unsqueeze(1)
    values = scores[rows.clamp_max(n - 1), cols]  # (q, width * block)
    values.masked_fill_(outside, float("-inf"))
    top, pos = values.topk(width, dim=1)
    return top, rows.gather(1, pos)


class CertifiedTopK:
    """Running candidates of a query batch over the chunks of an index (see the module docstring).

    ``add(chunk, offset, stride, start)`` for each chunk ``(n, dim)`` on the device (rows ``start...`` of a part
    whose row ``r`` has the id ``r * stride + offset``); ``result(k)`` gives ``(scores, ids, certified)``: the top-``k`` float32 scores and ids of each query,
    exact where ``certified``.
    """

    def __init__(self, q, width: int, rescore_bytes: int = 256 << 20, deferred: bool = False):
        import torch

        self.q32 = q.float()
        self.scale = query_scale(self.q32)
        scaled = self.q32 * self.scale[:, None]
        self.q16 = scaled.half()
        self.q_err = torch.linalg.vector_norm(scaled - self.q16.float(), dim=1)  # the query's exact rounding error
        self.q16_norm = torch.linalg.vector_norm(self.q16.float(), dim=1)
        self.width = width
        self.rescore_bytes = rescore_bytes
        self.approx = self.exact = self.ids = None
        self.max_norm = torch.zeros((), device=q.device)
        self.max_err = torch.zeros((), device=q.device)  # largest rounding error of a vector to float16 (norm)
        self.total = 0
        self.provable = True  # False once result() saw vectors too long for float16 scores (or not finite)
        self.deferred = deferred  # candidates rescored once, by rescore_parts(), not chunk by chunk

    def add(self, chunk, offset: int, stride: int, start: int) -> None:
        """Scores ``chunk`` (rows ``start...`` of a part with ids ``row * stride + offset``)."""
        import torch

        n = len(chunk)
        if n == 0:
            return
        self.total += n
        self.max_norm = torch.maximum(self.max_norm, torch.linalg.vector_norm(chunk, dim=1, dtype=torch.float32).max())
        c16 = chunk if chunk.dtype == torch.float16 else chunk.to(torch.float16)
        if c16 is not chunk:
            err = torch.linalg.vector_norm(chunk.float() - c16.float(), dim=1).max()
            self.max_err = torch.maximum(self.max_err, err)
        scores = half_scores(c16, self.q16)  # (n, q) float32
        width = min(self.width, n)
        top, cols = block_topk(scores, width)
        del scores
        approx = top / self.scale[:, None]
        exact = approx if self.deferred else self._rescore(chunk, cols)
        ids = (cols + start) * stride + offset
        if self.approx is not None:
            approx = torch.cat([self.approx, approx], dim=1)
            exact = torch.cat([self.exact, exact], dim=1)
            ids = torch.cat([self.ids, ids], dim=1)
            if approx.shape[1] > self.width:
                approx, sel = approx.topk(self.width, dim=1)
                exact, ids = exact.gather(1, sel), ids.gather(1, sel)
        self.approx, self.exact, self.ids = approx, exact, ids

    def rescore_parts(self, parts) -> None:
        """With ``deferred``: the final candidates' float32 scores, from the parts ``(vectors, offset, stride)``
        held on the device (one gather for all candidates instead of one per chunk)."""
        import torch

        if len(parts) == 1:
            vectors, offset, stride = parts[0]
            self.exact = self._rescore(vectors, (self.ids - offset) // stride)
            return
        for vectors, offset, stride in parts:
            rel = self.ids - offset
            rows = torch.div(rel, stride, rounding_mode="floor")
            mine = (rel % stride == 0) & (rows >= 0) & (rows < len(vectors))
            self.exact = torch.where(mine, self._rescore(vectors, rows.clamp(0, len(vectors) - 1)), self.exact)

    def _rescore(self, chunk, cols):
        """float32 scores of the rows ``cols`` ``(q, w)`` of ``chunk``: the reference's arithmetic (float32
        products summed in float32), in query slices of about ``rescore_bytes``."""
        import torch

        q, w = cols.shape
        dim = chunk.shape[1]
        step = max(1, self.rescore_bytes // max(1, w * dim * 4))
        out = torch.empty((q, w), dtype=torch.float32, device=chunk.device)
        for a in range(0, q, step):
            rows = chunk.index_select(0, cols[a:a + step].reshape(-1)).view(-1, w, dim).float()
            out[a:a + step] = torch.bmm(rows, self.q32[a:a + step, :, None]).squeeze(2)
        return out

    def result(self, k: int):
        """``(scores, ids, certified)``: each query's top ``k`` by (float32 score, ascending id) among its
        candidates, and whether that is provably the exact top ``k`` (module docstring)."""
        import torch

        by_id = self.ids.argsort(dim=1)
        exact, ids = self.exact.gather(1, by_id), self.ids.gather(1, by_id)
        order = torch.sort(exact, dim=1, descending=True, stable=True).indices[:, :k]
        scores, top_ids = exact.gather(1, order), ids.gather(1, order)
        if self.total <= self.width:  # every document is a candidate
            return scores, top_ids, torch.ones(len(scores), dtype=torch.bool, device=scores.device)
        max_norm, max_err = float(self.max_norm), float(self.max_err)
        self.provable = math.isfinite(max_norm) and math.isfinite(max_err) and max_norm <= MAX_FP16_NORM
        if not self.provable:
            return scores, top_ids, torch.zeros(len(scores), dtype=torch.bool, device=scores.device)
        cut = self.approx.min(dim=1).values * self.scale  # the width-th half-precision score, scaled back (exact)
        low = lower_bound(scores[:, k - 1] * self.scale, self.q16_norm, self.q_err, max_norm, max_err,
                            self.q32.shape[1])
        return scores, top_ids, low > cut
