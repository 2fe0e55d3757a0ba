"""Fixtures of the pre-training tests: a four-line corpus and the tiny BERT's tokenizer (a test file's own `corpus` wins)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.cli import DOCS


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(DOCS) + "\n")
    return path


@pytest.fixture
def tok(tiny_bert_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_bert_dir)
