"""``python -m pretrain``: see :mod:`pretrain.cli` (``python -m pretrain --help``)."""
from __future__ import annotations

import sys

from pyterrier_cpdae._locking import ConcurrentBuildError

from .cli import main


def error_line(e: BaseException) -> str:
    """The one line ``python -m pretrain`` prints for a failure it reports without a traceback."""
    if isinstance(e, MemoryError):
        return f"error: MemoryError: {str(e) or 'out of memory'}"
    return f"error: {type(e).__name__}: {' '.join(str(e).split())}"


def _run() -> int:
    try:
        main()
    except FloatingPointError as e:
        # pretrain.training.finite.NonFiniteError, a diverged run: exit 1 with the step, the loss term and what is left
        # on disk, no traceback
        import os
        if os.environ.get("PRETRAIN_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except (ValueError, OSError, MemoryError, ConcurrentBuildError) as e:
        # bad input, a bad path or file, a full disk, too little memory, an output another process is writing:
        # a one-line message instead of a traceback (set PRETRAIN_DEBUG=1 for the traceback)
        import os
        if os.environ.get("PRETRAIN_DEBUG"):
            raise
        print(error_line(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_run())
