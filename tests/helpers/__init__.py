"""What the tests share besides fixtures (``tests/conftest.py`` and each folder's ``conftest.py``): helper modules
imported as ``tests.helpers.<module>``, and the checkout's folders."""
from __future__ import annotations

from pathlib import Path

#: the tests folder, and the checkout's root above it
TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
