"""The encoder's forward in length-sorted chunks (:mod:`pretrain.model.length_buckets`) against the plain padded pass.

Reference: the transformers model's own forward on the whole padded batch (float64, dropout off): the chunked pass
gives every text's hidden states at its real positions, zeros beyond its chunk's longest text, the same mean-pooled vectors and
the same gradient of every parameter; the chunk plan against a plan written out by hand; the cases it must leave to
the plain pass (left padding, few rows, little padding to save, other inputs).
"""
from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, BertModel

from pretrain.model.length_buckets import chunk_plan, length_bucketed, training_forward
from pyterrier_cpdae.encoder.first_token import first_token_model

#: right-padded rows of very different lengths (one token up to the whole width)
LENGTHS = [3, 40, 1, 17, 40, 8, 25, 2, 33, 5, 12, 9, 40, 6, 21, 4, 15, 30, 7, 11]


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=64)
    return BertModel(cfg).double().eval()  # no dropout: the chunked and the padded pass see the same network


def batch(lengths=LENGTHS, width=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    types = torch.randint(0, 2, ids.shape, generator=g) * mask
    return ids * mask, mask, types


def mean_pool(hidden, mask):
    m = mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1)


def test_chunk_plan_sorts_longest_first_ties_in_order_and_cuts_each_chunk_to_its_longest():
    mask = (torch.arange(10)[None, :] < torch.tensor([4, 9, 4, 1, 9, 6, 2])[:, None]).long()
    plan = chunk_plan(mask, rows=3)
    assert [(c.tolist(), n) for c, n in plan] == [([1, 4, 5], 9), ([0, 2, 6], 4), ([3], 1)]


def test_chunked_pass_equals_the_padded_pass_at_real_positions(bert):
    ids, mask, types = batch()
    want = bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    calls = []

    def counted(**kw):
        calls.append(tuple(kw["input_ids"].shape))
        return bert.forward(**kw)

    got = length_bucketed(counted, rows=6)(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    assert calls == [(6, 40), (6, 21), (6, 8), (2, 2)]  # 40,40,40,33,30,25 | 21,17,15,12,11,9 | 8,..,3 | 2,1
    assert got.shape == want.shape
    real = mask.bool()
    assert torch.allclose(got[real], want[real], rtol=0, atol=1e-10)
    assert not got[mask.sum(1) <= 2][:, 2:].any()  # the last chunk (lengths 2, 1) computed 2 positions only
    assert torch.allclose(mean_pool(got, mask), mean_pool(want, mask), rtol=0, atol=1e-10)


def test_chunked_pass_gives_the_padded_pass_gradients(bert):
    ids, mask, types = batch(seed=2)
    target = torch.randn(len(LENGTHS), 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def grads(forward):
        bert.zero_grad()
        hidden = forward(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        loss = ((mean_pool(hidden, mask) - target) ** 2).sum()
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in bert.named_parameters() if p.grad is not None}

    plain, chunked = grads(bert.forward), grads(length_bucketed(bert.forward, rows=4))
    assert chunked[0] == pytest.approx(plain[0], rel=1e-12)
    assert chunked[1].keys() == plain[1].keys()
    for name, g in plain[1].items():
        assert torch.allclose(chunked[1][name], g, rtol=1e-9, atol=1e-12), name


def test_first_token_view_in_chunks_gives_each_texts_cls_vector(bert):
    ids, mask, types = batch(seed=4)
    view = first_token_model(bert)
    got = length_bucketed(view.forward, rows=5, full=False)(input_ids=ids, attention_mask=mask,
                                                           token_type_ids=types).last_hidden_state
    want = bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state[:, :1]
    assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", ["left_padded", "few_rows", "little_padding", "other_input", "hidden_states"])
def test_what_the_chunks_leave_to_the_plain_pass(bert, case):
    ids, mask, types = batch()
    kwargs = {"token_type_ids": types}
    if case == "left_padded":
        ids, mask = ids.flip(1), mask.flip(1)
    elif case == "few_rows":
        ids, mask, types = ids[:4], mask[:4], types[:4]
        kwargs = {"token_type_ids": types}
    elif case == "little_padding":
        ids, mask, types = batch([40] * 19 + [30])
        kwargs = {"token_type_ids": types}
    elif case == "other_input":
        kwargs["head_mask"] = torch.ones(2, 2, dtype=torch.float64)
    else:
        kwargs["output_hidden_states"] = True
    calls = []
    forward = length_bucketed(lambda **kw: calls.append(kw["input_ids"].shape) or bert.forward(**kw), rows=4)
    out = forward(input_ids=ids, attention_mask=mask, **kwargs)
    assert calls == [ids.shape]  # one call on the whole batch, its own output returned
    want = bert(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state
    assert torch.equal(out.last_hidden_state, want)


def test_rows_below_one_refused(bert):
    with pytest.raises(ValueError, match="rows must be >= 1"):
        length_bucketed(bert.forward, rows=0)


def test_training_forward_chunks_and_trims_as_asked_leaving_the_weights_alone(bert):
    ids, mask, types = batch(seed=5)
    keys = set(bert.state_dict())
    want = bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
    training_forward(bert, "mean", chunked=False)
    assert "forward" not in vars(bert)  # nothing to change: the model's own forward
    try:
        training_forward(bert, "mean", chunked=True)
        got = bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        assert torch.allclose(got[mask.bool()], want[mask.bool()], rtol=0, atol=1e-10)
        del bert.forward
        training_forward(bert, "cls", chunked=True)
        got = bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        assert got.shape[1] == 1 and torch.allclose(got, want[:, :1], rtol=0, atol=1e-10)
    finally:
        vars(bert).pop("forward", None)
    assert set(bert.state_dict()) == keys
