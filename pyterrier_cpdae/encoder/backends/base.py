"""What every encoder backend is: an object that runs a sorting window's batches through the model and writes their
pooled vectors (:class:`Backend`); :func:`~pyterrier_cpdae.encoder.backends.choose_backend` picks one."""
from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

__all__ = ["Backend"]


class Backend:
    """Runs the batches of a tokenized window and writes their float32 vectors.

    Attributes:
        name: the backend's name in logs and in :func:`~pyterrier_cpdae.encoder.backends.choose_backend`'s choice.
        packed: whether its batches hold real tokens only (a token budget then counts the texts' lengths, not rows
            x the longest text).
    """

    name = ""
    packed = False

    def run(self, ids: List[List[int]], lengths: np.ndarray, batches: List[np.ndarray], out: np.ndarray,
            bar: Optional[Any] = None) -> None:
        """Encodes the window's texts ``ids`` (token ids, ``lengths`` of them) in ``batches`` (arrays of row numbers
        that cover the window) and writes row ``i``'s vector to ``out[i]``; advances the progress ``bar`` by the
        texts encoded."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<encoder backend {self.name}>"
