"""Block packing of the token cache: documents split into sentences (:func:`split_sentences`), whose token ids are
packed greedily, in order, into blocks of at most ``max_length - 2`` ids, never merging two documents (see
:mod:`pretrain.data.corpus`); :func:`encode_batch` turns a batch of documents into what the cache stores, on
threads (``_encode_batches``)."""
from __future__ import annotations

import collections
import functools
import itertools
import re
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

__all__ = ["split_sentences", "block_lengths", "pack_sentences", "fast_backend", "pack_texts", "token_dtype",
           "encode_batch"]

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


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id of a ``vocab_size`` vocabulary fits (``vocab_size <= 65536``), else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)


Encoded = tuple[int, Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]]


def encode_batch(texts: Sequence[str], tokenizer: Any, max_length: int, *, backend: Any = None) -> Encoded:
    """Tokenize and pack a batch of documents into what the cache stores.

    Args:
        texts: The documents.
        tokenizer: A Hugging Face tokenizer.
        max_length: Block length including the two special tokens.
        backend: :func:`fast_backend` of ``tokenizer`` (None: call ``tokenizer`` itself). The output is the same.

    Returns:
        ``(documents with at least one block, None)`` when the batch yields no block, else
        ``(documents, (tokens, lengths, ids, counts))``: the flat token ids in the cache's dtype,
        the block lengths (``int64``), and the token ids occurring in the blocks with the number
        of blocks each occurs in (the batch's document-frequency contribution).

    Raises:
        ValueError: if the tokenizer produces an id outside its vocabulary.
    """
    vocab_size = len(tokenizer)
    counts, ids = _sentence_ids(texts, tokenizer, backend)
    # blocks are cut from the concatenated sentences of each document, so the flat token array of the
    # batch is all sentences back to back and packing only decides the block lengths
    sent_lens = [len(x) for x in ids]
    lengths: list[int] = []
    docs = i = 0
    for n in counts:
        doc = block_lengths(sent_lens[i:i + n], max_length - 2)
        docs += bool(doc)
        lengths += doc
        i += n
    if not lengths:
        return docs, None
    total = sum(lengths)
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=total)
    if flat.min() < 0 or flat.max() >= vocab_size:
        raise ValueError(f"tokenizer produced id {int(flat.max())} outside its vocabulary of {vocab_size}")
    lens = np.asarray(lengths, dtype=np.int64)
    # document frequency: count each id once per block (a sort of (block, id) keys, then their distinct ids;
    # a plain sort is several times faster than np.unique's hashing and runs without the GIL)
    keys = np.repeat(np.arange(len(lens), dtype=np.int64), lens) * vocab_size + flat
    keys.sort()
    first = np.empty(len(keys), dtype=bool)
    first[0] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    df = np.bincount(keys[first] % vocab_size, minlength=vocab_size)
    uids = np.flatnonzero(df)
    return docs, (flat.astype(token_dtype(vocab_size)), lens, uids, df[uids])


def _encode_batches(batches: Iterator[list[str]], tokenizer: Any, max_length: int,
                    num_threads: int) -> Iterator[tuple[int, Encoded]]:
    """``(len(texts), encode_batch(texts))`` for each batch, in order, on ``num_threads`` threads.

    The calling thread reads the corpus (bz2 decompression runs without the GIL) while the threads
    tokenize: the Rust tokenizer releases the GIL, so the threads tokenize in parallel and only the
    Python parts (parsing, sentence splitting, packing) take turns. At most ``2 * num_threads``
    batches are in flight, so memory stays bounded by the batch size. No process is started (no
    start-up cost, nothing to pickle, safe in a process that holds a JVM). Tokenizers without a Rust
    backend (:func:`fast_backend` is None) run on the calling thread: they hold the GIL throughout.
    """
    backend = fast_backend(tokenizer)
    encode = functools.partial(encode_batch, tokenizer=tokenizer, max_length=max_length, backend=backend)
    if num_threads <= 1 or backend is None:
        for texts in batches:
            yield len(texts), encode(texts)
        return
    from concurrent.futures import ThreadPoolExecutor

    pending: collections.deque = collections.deque()
    with ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize") as pool:
        try:
            for texts in batches:
                pending.append((len(texts), pool.submit(encode, texts)))
                if len(pending) >= 2 * num_threads:
                    n, result = pending.popleft()
                    yield n, result.result()
            while pending:
                n, result = pending.popleft()
                yield n, result.result()
        finally:  # an error (or the consumer stopping) drops the queued batches
            for _, result in pending:
                result.cancel()


def _batched(it: Iterable[str], n: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
