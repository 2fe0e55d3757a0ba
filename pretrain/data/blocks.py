"""Block packing of the token cache: documents split into sentences (:func:`split_sentences`), whose token ids are
packed greedily, in order, into blocks of at most ``max_length - 2`` ids, never merging two documents (see
:mod:`pretrain.data.corpus`)."""
from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

__all__ = ["split_sentences", "block_lengths", "pack_sentences", "fast_backend", "pack_texts"]

# A sentence ends at . ! ? (optionally followed by closing quotes/brackets) followed by
# whitespace and a character that is not a lower-case ASCII letter (so "e.g. this" stays
# one sentence); line breaks always end a sentence.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'\u201d\u2019)\]]*\s+(?=[^\sa-z])")


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences with a small rule-based splitter (no models, no nltk).

    Boundaries are line breaks and ``. ! ?`` (plus closing quotes/brackets) followed by
    whitespace and a character that is not a lower-case ASCII letter. Every character of
    ``text`` except the whitespace at boundaries is kept, so tokenizing the sentences one
    by one gives the same WordPiece ids as tokenizing ``text`` (whitespace separates words).

    Example:
        >>> split_sentences("Hello world. It is e.g. fine!\\nNew line")
        ['Hello world.', 'It is e.g. fine!', 'New line']
    """
    out: list[str] = []
    for line in text.splitlines():
        start = 0
        for m in _SENTENCE_END.finditer(line):
            # keep closing quotes/brackets with the sentence they close
            end = m.start() + len(m.group(0).rstrip())
            piece = line[start:end].strip()
            if piece:
                out.append(piece)
            start = m.end()
        piece = line[start:].strip()
        if piece:
            out.append(piece)
    return out


def block_lengths(lengths: Iterable[int], max_content: int) -> list[int]:
    """The packing rule on sentence lengths: the lengths of the blocks :func:`pack_sentences` makes.

    Sentences (given by their token counts) are kept whole and in order; one that does not fit in
    the current block starts the next block; one longer than ``max_content`` is cut into pieces of
    ``max_content`` ids (the last piece may be followed by further sentences); empty ones are skipped.

    Example:
        >>> block_lengths([3, 4, 0, 9, 1], max_content=5)
        [3, 4, 5, 4, 1]
    """
    if max_content < 1:
        raise ValueError(f"block capacity must be >= 1 token, got {max_content}")
    out: list[int] = []
    cur = 0
    for n in lengths:
        if n <= 0:
            continue
        if cur + n <= max_content:
            cur += n
            continue
        if cur:
            out.append(cur)
        while n > max_content:
            out.append(max_content)
            n -= max_content
        cur = n
    if cur:
        out.append(cur)
    return out


def pack_sentences(sentences: Sequence[Sequence[int]], max_content: int) -> list[list[int]]:
    """Greedily pack tokenized sentences of one document into blocks of ``<= max_content`` ids.

    Sentences are kept whole and in order; one that does not fit in the current block
    starts the next block; one longer than ``max_content`` is cut into pieces of
    ``max_content`` ids (the last piece may be followed by further sentences); see :func:`block_lengths`.

    Args:
        sentences: Token ids of each sentence (no special tokens).
        max_content: Block capacity (``max_length - 2``).

    Returns:
        The blocks; their concatenation equals the concatenation of ``sentences``.
    """
    flat = [t for s in sentences for t in s]
    blocks, i = [], 0
    for n in block_lengths(map(len, sentences), max_content):
        blocks.append(flat[i:i + n])
        i += n
    return blocks


def fast_backend(tokenizer: Any) -> Any:
    """A private copy of a Hugging Face fast tokenizer's Rust backend (``tokenizers.Tokenizer``) with
    truncation and padding off, or None for any other tokenizer.

    The copy gives the ids ``tokenizer(texts, add_special_tokens=False, truncation=False)`` gives, is not
    affected by the truncation/padding state the wrapper leaves behind after other calls, and may be
    called from several threads at once (each call releases the GIL while Rust tokenizes).
    """
    from transformers import PreTrainedTokenizerFast
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    from tokenizers import Tokenizer
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    return backend


def _sentence_ids(texts: Sequence[str], tokenizer: Any, backend: Any = None) -> tuple[list[int], list[list[int]]]:
    """Split each text into sentences and tokenize all of them in one call (no special tokens).

    Returns:
        The number of sentences of each text and the token ids of every sentence, in order.
    """
    sents = [split_sentences(t) for t in texts]
    flat = [s for ss in sents for s in ss]
    counts = [len(ss) for ss in sents]
    if not flat:
        return counts, []
    if backend is not None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: no character offsets
        return counts, [e.ids for e in encode(flat, add_special_tokens=False)]
    ids = tokenizer(flat, add_special_tokens=False, truncation=False, return_attention_mask=False,
                    return_token_type_ids=False, verbose=False)["input_ids"]
    return counts, ids


def pack_texts(texts: Sequence[str], tokenizer: Any, max_length: int) -> list[list[list[int]]]:
    """Tokenize and pack a batch of documents; one list of blocks per document.

    All sentences of the batch are tokenized in a single (fast) tokenizer call without
    special tokens.
    """
    counts, ids = _sentence_ids(texts, tokenizer, fast_backend(tokenizer))
    out, i = [], 0
    for n in counts:
        out.append(pack_sentences(ids[i:i + n], max_length - 2))
        i += n
    return out
