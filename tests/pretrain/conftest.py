"""Fixtures of the pre-training tests: a four-line corpus and the tiny BERT's tokenizer, one per test module
(a test file's own `corpus` wins)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import DOCS


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(DOCS) + "\n")
    return path


@pytest.fixture(scope="module")
def tok(tiny_bert_dir):
    """The tiny BERT's tokenizer (all-MiniLM-L6-v2's, saved beside it): one per test module."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_bert_dir)
