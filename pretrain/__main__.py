"""``python -m pretrain``: see :mod:`pretrain.cli` (``python -m pretrain --help``)."""
from __future__ import annotations

import os
import sys

from pyterrier_cpdae._locking import ConcurrentBuildError

from .cli import main


def error_line(e: BaseException) -> str:
    """The one line ``python -m pretrain`` prints for a failure it reports without a traceback."""
    if isinstance(e, MemoryError):
        return f"error: MemoryError: {str(e) or 'out of memory'}"
    return f"error: {type(e).__name__}: {' '.join(str(e).split())}"


def _run() -> int:
    """Bad input, a bad path or file, a full disk, too little memory, an output another process writes (exit 2) or a
    diverged run (NonFiniteError, exit 1): one line instead of a traceback (``PRETRAIN_DEBUG=1`` shows it)."""
    try:
        main()
    except (FloatingPointError, ValueError, OSError, MemoryError, ConcurrentBuildError) as e:
        if os.environ.get("PRETRAIN_DEBUG"):
            raise
        print(error_line(e), file=sys.stderr)
        return 1 if isinstance(e, FloatingPointError) else 2
    return 0


if __name__ == "__main__":
    sys.exit(_run())
