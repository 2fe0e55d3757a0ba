"""A randomly initialised BERT checkpoint with a synthetic WordPiece vocabulary, made offline.

The GPU machine has no Hub access and the real MiniLM package is too large to carry, so the GPU suite builds
its models here: ``BertForMaskedLM`` with random weights (seeded) and a ``BertTokenizerFast`` whose vocabulary
is the five special tokens followed by the words ``w0 w1 ...``.  Every ``w<i>`` is one token, so
:func:`synthetic_texts` makes texts of an exact token count.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Union

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

#: BERT-base's shape (the papers' encoder)
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                 vocab_size=30522, max_position_embeddings=512)
#: all-MiniLM-L6-v2's shape (the cpu and gpu scales' encoder)
MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
              vocab_size=30522, max_position_embeddings=512)
#: a tiny shape for CPU smoke runs and tests (bench_objectives draws token ids from 1000 up)
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=1100,
            max_position_embeddings=512)


def make_bert_dir(out: Union[str, Path], *, seed: int = 0, **shape) -> str:
    """Writes a random ``BertForMaskedLM`` (``shape``: :class:`transformers.BertConfig` fields) and its tokenizer."""
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = shape.get("vocab_size", BERT_BASE["vocab_size"])
    if vocab_size <= len(SPECIALS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIALS)} special tokens, got {vocab_size}")
    (out / "vocab.txt").write_text("\n".join(SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))]) + "\n")
    tok = BertTokenizerFast(vocab_file=str(out / "vocab.txt"), do_lower_case=True,
                            model_max_length=shape.get("max_position_embeddings", 512))
    config = BertConfig(**{**BERT_BASE, **shape}, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    BertForMaskedLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def synthetic_texts(n: int, tokens: int, vocab_size: int, seed: int = 0) -> List[str]:
    """``n`` texts of exactly ``tokens`` word pieces each (``tokens + 2`` with [CLS]/[SEP])."""
    import numpy as np

    words = np.random.default_rng(seed).integers(0, vocab_size - len(SPECIALS), size=(n, tokens))
    return [" ".join(f"w{i}" for i in row) for row in words]
