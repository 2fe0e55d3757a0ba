"""``python -m pretrain``: see :mod:`pretrain.cli` (``python -m pretrain --help``)."""
from __future__ import annotations

import os
import sys

from pyterrier_cpdae._locking import ConcurrentBuildError

from .cli import main


def _run() -> int:
    """Bad input, a bad path or file, a full disk, too little memory, an output another process writes (exit 2) or a
    diverged run (NonFiniteError, exit 1): one line instead of a traceback (``PRETRAIN_DEBUG=1`` shows it)."""
    try:
        main()
    except (FloatingPointError, ValueError, OSError, MemoryError, ConcurrentBuildError) as e:
        if os.environ.get("PRETRAIN_DEBUG"):
            raise
        text = " ".join(str(e).split()) or ("out of memory" if isinstance(e, MemoryError) else "")
        print(f"error: {type(e).__name__}: {text}", file=sys.stderr)
        return 1 if isinstance(e, FloatingPointError) else 2
    return 0


if __name__ == "__main__":
    sys.exit(_run())
