"""The objectives' data collators (pretrain.data.collators): every example's masks and views come from
(seed, epoch, example index) alone, whatever batch, order or history it is collated in."""
from __future__ import annotations

import types

import pytest
import torch

from pretrain.objectives import objective_config
from pretrain.data.collators import CollatorEpochCallback, PretrainingCollator, example_generator
from pretrain.data.masking import mask_rows, mask_tokens, pad_and_add_special
from pretrain.model.modeling import load_mlm_model
from pretrain.objectives import build_objective

#: objective -> options; every objective that draws something at random in its collator
CASES = {
    "mlm": ("mlm", {}),
    "cpdae_wwm": ("cpdae", {"whole_word_mask": True}),
    "retromae": ("retromae", {}),
    "ict": ("ict", {}),
    "prop": ("prop", {}),
    "mlm_span": ("mlm", {"span_contrast_weight": 1.0}),
}



@pytest.fixture(scope="module")
def model(tiny_bert_dir):
    return load_mlm_model(tiny_bert_dir)


def texts(tok, n: int = 8) -> list[list[int]]:
    """``n`` texts of varied lengths (6..48 word pieces), a full stop every 7th token (ICT's sentences)."""
    g = torch.Generator().manual_seed(11)
    stop = tok.convert_tokens_to_ids(".")
    out = []
    for i in range(n):
        ids = torch.randint(2000, 29000, (6 + (i * 13) % 43,), generator=g).tolist()
        out.append([stop if (j + 1) % 7 == 0 else t for j, t in enumerate(ids)])
    return out


def build(name: str, opts: dict, model, tok):
    config = objective_config(name, model=model.name_or_path, batch_size=4, max_length=64, **opts)
    extra = {}
    if name == "prop":
        p = torch.rand(model.config.vocab_size, generator=torch.Generator().manual_seed(3)) + 0.01
        extra = {"collection_prob": p / p.sum(), "mu": 30.0, "token_frequency": p / p.sum()}
    return build_objective(name, model, tok, config, **extra)


def rows(batch: dict, m: int) -> list[dict]:
    """Per example: every per-text tensor of the batch (texts on dim 0), plus the batch's padded length per key."""
    return [{k: v[i] for k, v in batch.items() if torch.is_tensor(v) and v.dim() and v.shape[0] == m}
            for i in range(m)]


def same_row(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to padding: equal on the shorter last dimension, and the longer one's excess constant."""
    if a.shape[:-1] != b.shape[:-1]:
        return False
    if a.dim() == 0 or a.shape[-1] == b.shape[-1]:
        return torch.equal(a, b)
    short, long_ = (a, b) if a.shape[-1] < b.shape[-1] else (b, a)
    n = short.shape[-1]
    rest = long_[..., n:]
    return torch.equal(short, long_[..., :n]) and bool((rest == rest.reshape(-1)[0]).all())


@pytest.mark.parametrize("case", list(CASES))
def test_an_examples_masks_do_not_depend_on_its_batch_its_order_or_what_came_before(case, model, tok):
    name, opts = CASES[case]
    obj = build(name, opts, model, tok)
    data = texts(tok)
    feats = [{"input_ids": t, "idx": i} for i, t in enumerate(data)]
    collator = obj.data_collator(seed=7)
    first = collator(feats[:4])
    torch.manual_seed(123)  # the global RNG is not read
    other = PretrainingCollator(obj.collate, seed=7)
    other(feats[4:])  # other batches first, in another collator
    other(feats[2:6])
    mixed = other([feats[3], feats[6], feats[0], feats[5], feats[2], feats[1]])  # other neighbours, other order
    assert mixed["idx"].tolist() == [3, 6, 0, 5, 2, 1]
    out = obj(**mixed)  # the collated batch is the objective's keyword input, idx included
    assert set(out.terms) == set(obj.loss_names) and bool(torch.isfinite(out.loss)) and out.loss.requires_grad
    a, b = rows(first, 4), rows(mixed, 6)
    keys = set(a[0])
    assert {"idx", "input_ids"} <= keys and keys == set(b[0])
    for i in range(4):
        j = mixed["idx"].tolist().index(i)
        for k in keys:
            assert same_row(a[i][k], b[j][k]), (case, i, k)
    # the masks are drawn, not fixed: another epoch (or seed) masks the same texts otherwise
    drawn = [k for k in keys if k in ("masked_input_ids", "query_input_ids", "span_input_ids", "decoder_seed")]
    assert drawn, keys
    collator.set_epoch(1)
    later = rows(collator(feats[:4]), 4)
    assert any(not same_row(a[i][k], later[i][k]) for i in range(4) for k in drawn)
    reseeded = rows(obj.data_collator(seed=8)(feats[:4]), 4)
    assert any(not same_row(a[i][k], reseeded[i][k]) for i in range(4) for k in drawn)


def test_retromae_decoder_masks_follow_the_example(model, tok):
    """The decoder's attention masks (drawn in forward from the collated per-text seeds) are the example's too."""
    from pretrain.objectives.retromae import retromae_decoder_mask

    obj = build("retromae", {}, model, tok)
    data = texts(tok)
    collator = obj.data_collator(seed=3)
    b1 = collator([{"input_ids": data[i], "idx": i} for i in (0, 1, 2)])
    b2 = collator([{"input_ids": data[i], "idx": i} for i in (7, 2, 0)])

    def masks(b):
        return retromae_decoder_mask(b["attention_mask"], b["special_tokens_mask"], 0.5, row_seeds=b["decoder_seed"],
                                     size=64)
    m1, m2 = masks(b1), masks(b2)
    for i, j in ((0, 2), (2, 1)):
        n = int(b1["attention_mask"][i].sum())
        assert torch.equal(m1[i, :n, :n], m2[j, :n, :n])
        assert int(b2["attention_mask"][j].sum()) == n
    # the count of hidden content tokens is still RetroMAE's: round(0.5 * (n_b - 1)) per content row
    content = b1["attention_mask"][0].bool() & ~b1["special_tokens_mask"][0]
    n_b = int(content.sum())
    hidden = (~m1[0])[content][:, content].sum(1) - 1  # minus the row's own position
    assert hidden.tolist() == [int((n_b - 1) * 0.5 + 0.5)] * n_b


def test_mask_rows_is_mask_tokens_on_each_row_alone(tok):
    """Reference: mask_tokens on the row without padding, from a generator seeded as the row's."""
    data = texts(tok, 5)
    ids, am, special = pad_and_add_special(data, tok)
    gens = [example_generator(1, 0, i) for i in range(5)]
    masked, labels = mask_rows(ids, special, am, gens, num_views=2, mask_token_id=tok.mask_token_id,
                               vocab_size=tok.vocab_size, mlm_probability=0.3)
    assert masked.shape == labels.shape == (5, 2, ids.shape[1])
    for i, row in enumerate(data):
        n = len(row) + 2
        g = example_generator(1, 0, i)
        for v in range(2):
            x, y = mask_tokens(ids[i:i + 1, :n], special[i:i + 1, :n], mask_token_id=tok.mask_token_id,
                               vocab_size=tok.vocab_size, mlm_probability=0.3, generator=g)
            assert torch.equal(masked[i, v, :n], x[0]) and torch.equal(labels[i, v, :n], y[0])
        assert bool((masked[i, :, n:] == tok.pad_token_id).all()) and bool((labels[i, :, n:] == -100).all())


def test_example_generator_streams_differ_and_repeat():
    def draw(*key):
        return torch.rand(4, generator=example_generator(*key))
    assert torch.equal(draw(0, 0, 5), draw(0, 0, 5))
    keys = [(0, 0, 5), (0, 0, 6), (0, 1, 5), (1, 0, 5), (0, 5, 0), (5, 0, 0)]
    draws = [tuple(draw(*k).tolist()) for k in keys]
    assert len(set(draws)) == len(keys)
    with pytest.raises(ValueError, match="idx must be >= 0"):
        example_generator(0, 0, -1)


def test_collator_refuses_features_it_cannot_place(model, tok):
    obj = build("mlm", {}, model, tok)
    collator = obj.data_collator()
    with pytest.raises(ValueError, match=r"feature 1 of the batch needs 'input_ids' .* and 'idx'"):
        collator([{"input_ids": [2000], "idx": 0}, {"input_ids": [2001]}])
    with pytest.raises(ValueError, match=r"feature 0 \(idx 4\) has 70 tokens; at most max_length - 2 = 62"):
        collator([{"input_ids": [2000] * 70, "idx": 4}])
    with pytest.raises(ValueError, match="empty"):
        collator([])


def test_epoch_callback_sets_the_epoch_at_each_epoch_and_on_a_resume():
    seen = []
    collator = PretrainingCollator(lambda ids, generators: seen.append(generators) or {}, seed=0)
    cb = CollatorEpochCallback(collator)
    args = types.SimpleNamespace(dataloader_persistent_workers=False, dataloader_num_workers=0)
    cb.on_train_begin(args, types.SimpleNamespace(epoch=2.5), None)  # resumed in the middle of epoch 2
    assert collator.epoch == 2
    for e in (0.0, 1.0, 3.0):
        cb.on_epoch_begin(args, types.SimpleNamespace(epoch=e), None)
        assert collator.epoch == int(e)
    with pytest.raises(ValueError, match="dataloader_persistent_workers"):
        cb.on_train_begin(types.SimpleNamespace(dataloader_persistent_workers=True, dataloader_num_workers=2),
                          types.SimpleNamespace(epoch=0.0), None)


@pytest.mark.parametrize("case", ["mlm", "mlm_span"])
def test_the_collator_pickles_for_spawned_dataloader_workers(case, model, tok):
    """A spawned DataLoader worker gets the collator pickled: the span-contrast add-on (RetroMAE's second stage) was
    bound with types.MethodType and could not be unpickled. The copy gives the very batch of the original."""
    import pickle

    name, opts = CASES[case]
    collator = build(name, opts, model, tok).data_collator(seed=5)
    feats = [{"input_ids": t, "idx": i} for i, t in enumerate(texts(tok, 4))]
    copy = pickle.loads(pickle.dumps(collator))
    want, got = collator(feats), copy(feats)
    assert set(got) == set(want) and ("span_input_ids" in got) == (case == "mlm_span")
    assert all(torch.equal(got[k], want[k]) for k in want)
