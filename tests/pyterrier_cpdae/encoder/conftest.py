"""Fixtures of the encoder's tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def no_env(monkeypatch):
    """Neither ``$PYTERRIER_CPDAE_BACKEND`` nor ``$PYTERRIER_CPDAE_DTYPE`` set: the encoder's own choices."""
    from pyterrier_cpdae.encoder.policy import BACKEND_ENV, DTYPE_ENV

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv(DTYPE_ENV, raising=False)
