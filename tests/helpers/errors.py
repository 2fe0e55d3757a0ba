"""What the tests of one-line errors share: the ``file:line:`` prefix of an error that names a line."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Union


def at(path: Union[str, Path], line: int) -> str:
    """The ``<path>:<line>:`` prefix of an error naming line ``line`` of ``path``, as a regex."""
    return re.escape(f"{path}:{line}:")
