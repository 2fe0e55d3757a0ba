"""Batch construction shared by the pre-training objectives: special tokens and padding,
BERT-style masking (80/10/10, optional whole-word masking) and bag-of-words targets.

All functions work on CPU tensors inside ``Objective.collate`` and are deterministic given
a ``torch.Generator``; :func:`mask_rows` draws every row from its own generator over the row's own tokens, so that a
text's masks do not depend on the batch it is in (its length, its neighbours, their order).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers import PreTrainedTokenizerBase

__all__ = ["pad_and_add_special", "mask_tokens", "mask_rows", "bag_of_words", "continuation_table", "wordpiece_word_ids"]


def pad_and_add_special(examples: Sequence[Sequence[int]], tokenizer: PreTrainedTokenizerBase
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Wrap every token-id list as ``[CLS] ids [SEP]`` and right-pad to the longest one.

    Args:
        examples: Token-id lists without added special tokens.
        tokenizer: The model's tokenizer (provides the CLS, SEP and PAD ids and ``all_special_ids``).

    Returns:
        ``(input_ids, attention_mask, special_tokens_mask)``, each ``(B, L)``; ``input_ids``
        and ``attention_mask`` are ``long``, ``special_tokens_mask`` is ``bool`` and is True at
        ``[CLS]``, ``[SEP]`` *and* padding positions, and at content positions holding a special
        token id (``[UNK]``, or a literal ``[SEP]``/``[MASK]`` the tokenizer found in the raw text),
        as in ``tokenizer.get_special_tokens_mask``: everything that must never be masked or predicted.

    Raises:
        ValueError: for an empty batch or a tokenizer without CLS/SEP/PAD tokens.
    """
    if len(examples) == 0:
        raise ValueError("cannot build a batch from an empty list of examples")
    cls_id, sep_id, pad_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
    if cls_id is None or sep_id is None or pad_id is None:
        raise ValueError(f"tokenizer {type(tokenizer).__name__} needs CLS, SEP and PAD tokens "
                         f"(got cls={cls_id}, sep={sep_id}, pad={pad_id})")
    length = max(len(e) for e in examples) + 2
    b = len(examples)
    special_ids = torch.as_tensor(sorted({i for i in tokenizer.all_special_ids if i is not None}), dtype=torch.long)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    special = torch.ones((b, length), dtype=torch.bool)
    for i, ids in enumerate(examples):
        n = len(ids)
        input_ids[i, 0] = cls_id
        if n:
            content = torch.as_tensor(list(ids), dtype=torch.long)
            input_ids[i, 1:n + 1] = content
            special[i, 1:n + 1] = torch.isin(content, special_ids)
        input_ids[i, n + 1] = sep_id
        attention_mask[i, :n + 2] = 1
    return input_ids, attention_mask, special


def continuation_table(tokenizer: PreTrainedTokenizerBase, vocab_size: Optional[int] = None,
                       prefix: str = "##") -> torch.Tensor:
    """``(|V|,)`` bool table: True for WordPiece continuation tokens (``##xyz``)."""
    vocab = tokenizer.get_vocab()
    size = max(vocab_size or 0, max(vocab.values()) + 1)
    table = torch.zeros(size, dtype=torch.bool)
    ids = [i for t, i in vocab.items() if t.startswith(prefix)]
    if ids:
        table[torch.as_tensor(ids)] = True
    return table


def wordpiece_word_ids(input_ids: torch.Tensor, special_tokens_mask: torch.Tensor,
                       continuation: torch.Tensor) -> torch.Tensor:
    """Word index of every token for whole-word masking.

    A word starts at each non-special token that is not a WordPiece continuation
    (``continuation[token]`` False); continuation tokens join the preceding word.

    Args:
        input_ids: ``(B, L)`` token ids.
        special_tokens_mask: ``(B, L)`` True at special/padding positions.
        continuation: table from :func:`continuation_table`.

    Returns:
        ``(B, L)`` long tensor: per-row word indices ``0..W-1``, ``-1`` at special positions.
    """
    special = special_tokens_mask.bool()
    cont = continuation.to(input_ids.device)[input_ids]
    start = ~cont & ~special
    # a continuation token directly after a special token starts a word of its own
    prev_special = torch.ones_like(special)
    prev_special[:, 1:] = special[:, :-1]
    start |= cont & prev_special & ~special
    word = torch.cumsum(start.long(), dim=1) - 1
    return word.masked_fill(special, -1)


def mask_tokens(input_ids: torch.Tensor, special_tokens_mask: torch.Tensor, *, mask_token_id: int,
                vocab_size: int, mlm_probability: float = 0.15, generator: Optional[torch.Generator] = None,
                word_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: select ``mlm_probability`` of the non-special tokens; of those, 80% become
    ``[MASK]``, 10% a uniformly random token and 10% stay unchanged.

    Args:
        input_ids: ``(B, L)`` token ids (not modified).
        special_tokens_mask: ``(B, L)`` True where tokens must never be selected (special
            tokens and padding).
        mask_token_id: Id of the mask token.
        vocab_size: Random replacements are drawn from ``[0, vocab_size)``.
        mlm_probability: Selection probability per token (per word with ``word_ids``).
        generator: Optional random generator (reproducible masking).
        word_ids: Optional ``(B, L)`` word indices (``-1`` at special positions, see
            :func:`wordpiece_word_ids`): whole words are selected together.

    Returns:
        ``(masked_input_ids, labels)``: ``labels`` holds the original id at selected positions
        and ``-100`` elsewhere.

    Raises:
        ValueError: for shape mismatches or a probability outside ``[0, 1]``.
    """
    if input_ids.shape != special_tokens_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and special_tokens_mask "
                         f"{tuple(special_tokens_mask.shape)} must have the same shape")
    if not 0.0 <= mlm_probability <= 1.0:
        raise ValueError(f"mlm_probability must be in [0, 1], got {mlm_probability}")
    special = special_tokens_mask.bool()
    dev = input_ids.device
    if word_ids is None:
        prob = torch.full(input_ids.shape, float(mlm_probability), device=dev).masked_fill(special, 0.0)
        selected = torch.bernoulli(prob, generator=generator).bool()
    else:
        if word_ids.shape != input_ids.shape:
            raise ValueError(f"word_ids {tuple(word_ids.shape)} must have the shape of input_ids {tuple(input_ids.shape)}")
        # one uniform draw per (row, word); a row has at most L words
        u = torch.rand(input_ids.shape, generator=generator, device=dev)
        selected = (u.gather(1, word_ids.clamp(min=0)) < mlm_probability) & (word_ids >= 0) & ~special
    labels = input_ids.masked_fill(~selected, -100)
    replace = torch.bernoulli(torch.full(input_ids.shape, 0.8, device=dev), generator=generator).bool() & selected
    randomise = (torch.bernoulli(torch.full(input_ids.shape, 0.5, device=dev), generator=generator).bool()
                 & selected & ~replace)
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, device=dev, dtype=input_ids.dtype)
    masked = input_ids.masked_fill(replace, mask_token_id)
    masked = torch.where(randomise, random_ids, masked)
    return masked, labels


def mask_rows(input_ids: torch.Tensor, special_tokens_mask: torch.Tensor, attention_mask: torch.Tensor,
              generators: Sequence[torch.Generator], *, num_views: int = 1, mask_token_id: int, vocab_size: int,
              mlm_probability: float = 0.15, word_ids: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mask_tokens` row by row, ``num_views`` times: views ``0..num_views-1`` of row ``i`` are drawn in turn
    from ``generators[i]`` over the row's real tokens only (``attention_mask``), so a row's masks depend on its tokens
    and its generator alone, never on the batch's padded length or on the other rows.

    Returns:
        ``(masked_input_ids, labels)``, each ``(B, num_views, L)`` (padding unchanged, labels ``-100`` there).

    Raises:
        ValueError: when there is not one generator per row.
    """
    b = input_ids.shape[0]
    if len(generators) != b:
        raise ValueError(f"mask_rows needs one generator per row: {len(generators)} for {b} rows")
    masked = input_ids.unsqueeze(1).repeat(1, num_views, 1)
    labels = torch.full_like(masked, -100)
    lengths = attention_mask.sum(1).tolist()
    for i, (g, n) in enumerate(zip(generators, lengths)):
        n = int(n)
        row, spec = input_ids[i:i + 1, :n], special_tokens_mask[i:i + 1, :n]
        words = None if word_ids is None else word_ids[i:i + 1, :n]
        for v in range(num_views):
            x, y = mask_tokens(row, spec, mask_token_id=mask_token_id, vocab_size=vocab_size,
                               mlm_probability=mlm_probability, generator=g, word_ids=words)
            masked[i, v, :n] = x[0]
            labels[i, v, :n] = y[0]
    return masked, labels


def bag_of_words(input_ids: torch.Tensor, special_tokens_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Multi-hot ``(B, |V|)`` float32 targets: 1 for every token id occurring in the row,
    ignoring positions where ``special_tokens_mask`` is True (special tokens, padding).

    Pass the *unmasked* ``input_ids`` to get the token set of the original text.
    """
    if input_ids.shape != special_tokens_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and special_tokens_mask "
                         f"{tuple(special_tokens_mask.shape)} must have the same shape")
    ids = input_ids.masked_fill(special_tokens_mask.bool(), vocab_size)  # dump column, dropped below
    out = torch.zeros(input_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=input_ids.device)
    out.scatter_(1, ids, 1.0)
    return out[:, :vocab_size]
