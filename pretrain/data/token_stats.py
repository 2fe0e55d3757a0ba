"""Per-token statistics of a tokenized corpus (a :class:`~pretrain.data.corpus.TokenCache`'s document frequencies):
the IDF weights of ``cpdae_idfrec`` and the log-odds prior of a bag-of-words decoder's bias."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

__all__ = ["idf_weights", "token_prior_logits"]


def idf_weights(cache_or_df: Any, num_texts: Optional[int] = None, *,
                smoothing: float = 1.0) -> torch.Tensor:
    """Per-token IDF weights for the IDF-weighted reconstruction loss (``cpdae_idfrec``).

    The smoothed IDF of scikit-learn's ``TfidfVectorizer(smooth_idf=True)``::

        idf(t) = ln((N + s) / (df(t) + s)) + 1

    with ``N`` the number of texts (blocks), ``df(t)`` the number of blocks containing
    token ``t`` and ``s`` the smoothing (1 by default). Weights are >= 1; a token in every
    block gets 1, a token never seen gets ``ln(N + s) - ln(s) + 1`` (the maximum).

    Args:
        cache_or_df: A :class:`TokenCache`, or a document-frequency array (then give ``num_texts``).
        num_texts: ``N`` when ``cache_or_df`` is an array.
        smoothing: ``s`` > 0.

    Returns:
        A float32 tensor of shape (|V|,).
    """
    if hasattr(cache_or_df, "document_frequency"):
        df = cache_or_df.document_frequency()
        n = cache_or_df.num_texts if num_texts is None else num_texts
    else:
        df = np.asarray(cache_or_df)
        if num_texts is None:
            raise ValueError("num_texts is required when passing a document-frequency array")
        n = num_texts
    if smoothing <= 0:
        raise ValueError(f"smoothing must be > 0, got {smoothing}")
    if df.ndim != 1 or (df < 0).any() or (df > n).any():
        raise ValueError(f"document frequencies must be a 1-d array within [0, {n}]")
    idf = np.log((n + smoothing) / (df.astype(np.float64) + smoothing)) + 1.0
    return torch.from_numpy(idf.astype(np.float32))


def token_prior_logits(cache_or_df: Any, num_texts: Optional[int] = None) -> torch.Tensor:
    """Log-odds of each token occurring in a text (block): ``log(p / (1 - p))``, ``p = (df + ½) / (N + 1)``.

    The bias at which a sigmoid decoder of "which tokens occur in this text" outputs the corpus
    prior (``--decoder-bias-init prior``); the add-½ smoothing keeps it finite for tokens that
    occur in no block or in every block.

    Args:
        cache_or_df: A :class:`TokenCache`, or a document-frequency array (then give ``num_texts``).
        num_texts: ``N`` when ``cache_or_df`` is an array.

    Returns:
        A float32 tensor of shape (|V|,).
    """
    if hasattr(cache_or_df, "document_frequency"):
        df, n = cache_or_df.document_frequency(), cache_or_df.num_texts
    else:
        if num_texts is None:
            raise ValueError("num_texts is required when passing a document-frequency array")
        df, n = np.asarray(cache_or_df), num_texts
    if df.ndim != 1 or (df < 0).any() or (df > n).any():
        raise ValueError(f"document frequencies must be a 1-d array within [0, {n}]")
    p = (df.astype(np.float64) + 0.5) / (n + 1.0)
    return torch.from_numpy(np.log(p / (1.0 - p)).astype(np.float32))
