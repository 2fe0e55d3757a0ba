"""The token cache of a test corpus, built the way the pre-training data tests build it."""
from __future__ import annotations

from pathlib import Path

from pretrain.data.corpus import TokenCache


def build_cache(corpus: Path, tok, cache_dir: Path) -> TokenCache:
    """:class:`TokenCache` of ``corpus`` (32-token texts) under ``cache_dir``: built, or loaded when it is there."""
    return TokenCache.build_or_load(str(corpus), tok, 32, cache_dir, progress=False, num_threads=1)
