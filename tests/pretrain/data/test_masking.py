"""Tests of pretrain.data.masking: special tokens, BERT 80/10/10 masking, whole-word masking, bag-of-words targets."""
from __future__ import annotations

import pytest
import torch

from pretrain.data.masking import bag_of_words, continuation_table, mask_tokens, pad_and_add_special, wordpiece_word_ids


@pytest.fixture
def tokenizer(tok):
    return tok


def test_pad_and_add_special(tokenizer):
    ex = [[1000, 1001, 1002], [2000], []]
    ids, am, special = pad_and_add_special(ex, tokenizer)
    c, s, p = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
    assert ids.tolist() == [[c, 1000, 1001, 1002, s], [c, 2000, s, p, p], [c, s, p, p, p]]
    assert am.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert special.tolist() == [[True, False, False, False, True], [True, False, True, True, True],
                                [True, True, True, True, True]]
    assert special.dtype == torch.bool and ids.dtype == torch.long
    with pytest.raises(ValueError, match="empty"):
        pad_and_add_special([], tokenizer)


def test_special_ids_inside_the_text_are_special(tokenizer):
    # raw text can hold [UNK] (unknown characters) or a literal "[MASK]"/"[SEP]" that the tokenizer maps to the
    # special id; like HF's get_special_tokens_mask, those positions are never masked nor predicted
    ex = [tokenizer("a [MASK] b \u2603 c [SEP] d", add_special_tokens=False)["input_ids"],
          tokenizer("plain words only", add_special_tokens=False)["input_ids"]]
    assert tokenizer.unk_token_id in ex[0] and tokenizer.mask_token_id in ex[0] and tokenizer.sep_token_id in ex[0]
    ids, am, special = pad_and_add_special(ex, tokenizer)
    for i, e in enumerate(ex):
        full = [tokenizer.cls_token_id] + e + [tokenizer.sep_token_id]
        ref = tokenizer.get_special_tokens_mask(full, already_has_special_tokens=True)
        n = len(full)
        assert special[i, :n].tolist() == [bool(x) for x in ref]
        assert bool(special[i, n:].all())
    masked, labels = mask_tokens(ids.repeat(200, 1), special.repeat(200, 1), mask_token_id=tokenizer.mask_token_id,
                                 vocab_size=30522, mlm_probability=0.5, generator=torch.Generator().manual_seed(0))
    assert not bool((labels != -100)[special.repeat(200, 1)].any())
    bow = bag_of_words(ids, special, 30522)
    assert set(torch.nonzero(bow[0]).flatten().tolist()) == set(ex[0]) - set(tokenizer.all_special_ids)


def _random_batch(b=300, length=200, vocab=30522, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length - 1, (b,), generator=g)
    ex = [torch.randint(1000, vocab, (int(n),), generator=g).tolist() for n in lengths]
    return ex


def test_mask_tokens_statistics(tokenizer):
    ex = _random_batch()
    ids, am, special = pad_and_add_special(ex, tokenizer)
    g = torch.Generator().manual_seed(1)
    masked, labels = mask_tokens(ids, special, mask_token_id=tokenizer.mask_token_id, vocab_size=30522,
                                 mlm_probability=0.15, generator=g)
    selected = labels != -100
    n_real = int((~special).sum())
    rate = selected.sum().item() / n_real
    assert abs(rate - 0.15) < 0.005, rate
    # specials and padding are never selected nor changed
    assert not bool(selected[special].any())
    assert torch.equal(masked[special], ids[special])
    # labels hold the original ids
    assert torch.equal(labels[selected], ids[selected])
    # unselected positions are unchanged
    assert torch.equal(masked[~selected], ids[~selected])
    n = selected.sum().item()
    to_mask = (masked[selected] == tokenizer.mask_token_id).sum().item() / n
    unchanged = (masked[selected] == ids[selected]).sum().item() / n
    random = 1 - to_mask - unchanged
    assert abs(to_mask - 0.8) < 0.015, to_mask
    assert abs(random - 0.1) < 0.01, random
    assert abs(unchanged - 0.1) < 0.01, unchanged


def test_mask_tokens_reproducible_and_independent(tokenizer):
    ids, am, special = pad_and_add_special(_random_batch(8, 50), tokenizer)
    kw = dict(mask_token_id=tokenizer.mask_token_id, vocab_size=30522)
    a = mask_tokens(ids, special, generator=torch.Generator().manual_seed(3), **kw)
    b = mask_tokens(ids, special, generator=torch.Generator().manual_seed(3), **kw)
    g = torch.Generator().manual_seed(3)
    c1 = mask_tokens(ids, special, generator=g, **kw)
    c2 = mask_tokens(ids, special, generator=g, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(c1[1], c2[1])  # two views are masked independently


def test_mask_tokens_errors(tokenizer):
    ids = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="same shape"):
        mask_tokens(ids, torch.zeros(2, 4, dtype=torch.bool), mask_token_id=103, vocab_size=10)
    with pytest.raises(ValueError, match="mlm_probability"):
        mask_tokens(ids, torch.zeros(2, 5, dtype=torch.bool), mask_token_id=103, vocab_size=10, mlm_probability=1.5)


def test_whole_word_masking(tokenizer):
    texts = ["unbelievably tokenization of hyperparameters is astonishingly straightforward",
             "electroencephalography reconstructs neurophysiological oscillations"] * 40
    ex = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    ids, am, special = pad_and_add_special(ex, tokenizer)
    table = continuation_table(tokenizer, 30522)
    word_ids = wordpiece_word_ids(ids, special, table)
    # naive reference: word boundaries from the token strings
    for row in range(2):
        toks = tokenizer.convert_ids_to_tokens(ids[row].tolist())
        expected, w = [], -1
        for tok, sp in zip(toks, special[row].tolist()):
            if sp:
                expected.append(-1)
                continue
            if not tok.startswith("##"):
                w += 1
            expected.append(w)
        assert word_ids[row].tolist() == expected
        assert w + 1 == len(texts[row].split())
    masked, labels = mask_tokens(ids, special, mask_token_id=tokenizer.mask_token_id, vocab_size=30522,
                                 mlm_probability=0.3, generator=torch.Generator().manual_seed(0), word_ids=word_ids)
    selected = labels != -100
    assert not bool(selected[special].any())
    n_words = n_sel_words = 0
    for row in range(ids.shape[0]):
        for w in range(int(word_ids[row].max()) + 1):
            sel = selected[row][word_ids[row] == w]
            assert bool(sel.all()) or not bool(sel.any()), "a word was partially masked"
            n_words += 1
            n_sel_words += int(sel.all())
    assert 0.2 < n_sel_words / n_words < 0.4


def test_bag_of_words_matches_python_sets(tokenizer):
    ex = _random_batch(6, 40, vocab=1200)
    ids, am, special = pad_and_add_special(ex, tokenizer)
    bow = bag_of_words(ids, special, 30522)
    assert bow.shape == (6, 30522) and bow.dtype == torch.float32
    for i, e in enumerate(ex):
        assert set(torch.nonzero(bow[i]).flatten().tolist()) == set(e)
    with pytest.raises(ValueError, match="same shape"):
        bag_of_words(ids, special[:, :-1], 30522)
