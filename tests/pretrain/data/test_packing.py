"""Packed rows from the data pipeline (``--unpad on``) and ``--unpad auto``'s path probe, on the CPU.

* The packer (:func:`pretrain.data.packing.pack_rows`) against a naive layout written token by token, on random
  batches of odd lengths (2-token rows, full-width rows, one row); its capacities on Wikipedia's block lengths are a
  handful, and ``torch.compile`` compiles once per capacity (counted with dynamo's counting backend).
* The packed forward (:func:`pretrain.model.unpadded.packed_last_hidden`) against each text encoded alone.
* Batches of one text (1 token, the maximum length) give every non-contrastive objective the padded path's losses
  and gradients (the batches of several texts, every objective: ``tests/pretrain/model/test_unpadded.py``).
* A packed training step reads nothing back from the device: no ``nonzero``, no boolean indexing, no scalar read
  (recorded below the autograd layer); the padded step does read (the check can fail).
* The probe: rounds timed in turn with an injected clock, the fastest kept; a run whose probe chose a path is, loss by
  loss and weight by weight, the run of that path without a probe, and records the choice in ``run_config.json``.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.data import packing
from pretrain.data.packing import bucket_size, capacity, filler_sequences, pack_rows
from pretrain.model import unpadded
from pretrain.model.modeling import load_mlm_model

from tests.helpers.objectives import sharpen
from tests.helpers.unpadded import build, collate, extras, loss_and_grads

ROOT = Path(__file__).resolve().parents[3]


def naive_layout(ids, am, types, labels, start):
    """The packed stream written token by token: each row's real tokens, its position from ``start``, its grid index."""
    out = {"input_ids": [], "position_ids": [], "token_type_ids": [], "grid_index": [], "cu": [0], "masked": [],
           "targets": []}
    rows, width = ids.shape
    for i in range(rows):
        for j in range(width):
            if am[i, j]:
                if labels[i, j] != -100:
                    out["masked"].append(len(out["input_ids"]))
                    out["targets"].append(int(labels[i, j]))
                out["input_ids"].append(int(ids[i, j]))
                out["position_ids"].append(start + j)
                out["token_type_ids"].append(int(types[i, j]))
                out["grid_index"].append(i * width + j)
        out["cu"].append(len(out["input_ids"]))
    return out


def random_rows(g, rows, width, low=1):
    lengths = torch.randint(low, width + 1, (rows,), generator=g)
    lengths[0] = width  # a full-width row
    if rows > 2:
        lengths[1] = min(2, width)  # [CLS] [SEP]
    am = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(5, 30000, (rows, width), generator=g) * am
    types = torch.randint(0, 2, (rows, width), generator=g) * am
    labels = torch.where((torch.rand(rows, width, generator=g) < 0.3) & am.bool(), ids, torch.full_like(ids, -100))
    return ids, am, types, labels


def test_pack_rows_is_the_naive_layout_plus_filler_sequences():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        rows = [1, 2, 5, 40][trial % 4]
        width = int(torch.randint(2, 70, (1,), generator=g))
        max_length = [width, 64, 2 * width][trial % 3]  # the run's --max-length, or a batch wider than it
        start = [0, 2][trial % 2]  # BERT, RoBERTa
        ids, am, types, labels = random_rows(g, rows, width)
        got = pack_rows(ids, am, max_length=max_length, position_start=start, pad_id=7, token_type_ids=types,
                        labels=labels)
        ref = naive_layout(ids, am, types, labels, start)
        real = len(ref["input_ids"])
        bound = max(max_length, width)
        bucket = bucket_size(rows, bound)
        pieces = filler_sequences(bucket, bound)
        cap = got["input_ids"].shape[0]
        # the capacity: a multiple of the bucket, the least holding the real tokens and one per filler sequence
        assert cap % bucket == 0 and real + pieces <= cap < real + pieces + bucket, (trial, cap, real, bucket)
        assert cap == capacity(real, bucket, pieces)
        for key in ("input_ids", "position_ids", "token_type_ids"):
            assert got[key][:real].tolist() == ref[key], (trial, key)
        assert got["input_ids"][real:].eq(7).all() and got["position_ids"][real:].eq(start).all()
        assert not got["token_type_ids"][real:].any()
        assert got["grid_index"].tolist() == ref["grid_index"]
        cu = got["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu.shape == (rows + pieces + 1,)
        assert cu[:rows + 1].tolist() == ref["cu"] and int(cu[-1]) == cap
        filler = (cu[rows + 1:] - cu[rows:-1]).tolist()  # the filler sequences: none empty, none beyond the bound
        assert len(filler) == pieces and min(filler) >= 1 and max(filler) <= bound and max(filler) - min(filler) <= 1
        assert got["first_index"].tolist() == ref["cu"][:-1]
        assert got["masked_index"].tolist() == ref["masked"] and got["masked_labels"].tolist() == ref["targets"]
        assert all(t.dtype == torch.int64 for k, t in got.items() if k != "cu_seqlens")


def test_pack_rows_refuses_rows_it_cannot_pack():
    ids = torch.tensor([[101, 2000, 102, 0], [0, 101, 2001, 102]])
    with pytest.raises(ValueError, match=r"right-padded rows of at least one real token.*use --unpad off"):
        pack_rows(ids, (ids != 0).long(), max_length=8)  # the second row is left-padded
    with pytest.raises(ValueError, match=r"right-padded rows of at least one real token"):
        pack_rows(ids[:1], torch.zeros_like(ids[:1]), max_length=8)  # an empty row
    with pytest.raises(ValueError, match=r"one shape, got \(2, 4\) and \(2, 3\)"):
        pack_rows(ids, torch.ones(2, 3, dtype=torch.long), max_length=8)
    with pytest.raises(ValueError, match=r"labels \(1, 4\) does not match input_ids \(2, 4\)"):
        pack_rows(ids, torch.ones_like(ids), max_length=8, labels=ids[:1])
    with pytest.raises(ValueError, match=r"sequences of up to at least 2 tokens"):
        filler_sequences(8, 1)


def wikipedia_batches(max_length: int, rows: int, n: int):
    """``n`` batches of ``rows`` texts whose lengths follow the Wikipedia sample's block-length histogram."""
    record = json.loads((ROOT / "experiments" / "results" / "padding_share.json").read_text())
    hist = next(r["length_histogram"] for r in record["lengths"] if r["max_length"] == max_length)
    values = np.array([int(k) for k in hist])
    p = np.array(list(hist.values()), dtype=np.float64)
    rng = np.random.default_rng(0)
    for _ in range(n):
        lengths = torch.as_tensor(rng.choice(values, size=rows, p=p / p.sum()))
        width = int(lengths.max())
        am = (torch.arange(width)[None] < lengths[:, None]).long()
        yield am * 9, am


def test_few_shapes_on_wikipedia_lengths_and_one_compile_per_capacity():
    """On the Wikipedia sample's 512-token blocks, 128 rows per pass (MLM's 128 texts, CPDAE's 64 texts x 2 views),
    40 batches hold 2 to 4 capacities and one ``cu_seqlens`` length; dynamo compiles a function of the packed stream once
    per capacity with static shapes, and at most twice with its default (dynamic after the first change)."""
    import torch._dynamo

    layouts = [pack_rows(ids, am, max_length=512) for ids, am in wikipedia_batches(512, 128, 40)]
    capacities = sorted({lay["input_ids"].shape[0] for lay in layouts})
    assert len({lay["cu_seqlens"].shape[0] for lay in layouts}) == 1
    assert 1 < len(capacities) <= 4 and all(c % bucket_size(128, 512) == 0 for c in capacities), capacities

    def compiles(dynamic):
        frames = []

        def backend(gm, example_inputs):
            frames.append(tuple(t.shape for t in example_inputs if torch.is_tensor(t)))
            return gm.forward

        torch._dynamo.reset()
        fn = torch.compile(lambda ids, pos, cu: (ids * 2 + pos).sum() + cu[-1], backend=backend, dynamic=dynamic)
        for lay in layouts[:8] + layouts:
            fn(lay["input_ids"], lay["position_ids"], lay["cu_seqlens"])
        torch._dynamo.reset()
        return len(frames)

    assert compiles(False) == len(capacities)
    assert compiles(None) <= 2


@pytest.fixture(scope="module")
def sharp_model(tiny_bert_dir):
    model = load_mlm_model(tiny_bert_dir)
    sharpen(model)
    return model.eval()



def test_packed_hidden_states_equal_each_text_encoded_alone(sharp_model):
    """An independent reference: the packed row's states, its rows' [CLS], the grid and the masked positions, against
    each text run alone through the model (no padding, no packing); rows of 2 and of 128 (all) positions."""
    model = copy.deepcopy(sharp_model)
    g = torch.Generator().manual_seed(4)
    ids, am, types, labels = random_rows(g, 5, 128, low=2)
    ids[:, 0] = 101
    layout = pack_rows(ids, am, max_length=128, token_type_ids=types, labels=labels)
    with torch.no_grad():
        hidden = unpadded.packed_last_hidden(model, layout, tuple(ids.shape), 128)
        alone = [model.base_model(input_ids=ids[i:i + 1, :int(am[i].sum())],
                                  token_type_ids=types[i:i + 1, :int(am[i].sum())]).last_hidden_state[0]
                 for i in range(len(ids))]
    grid = hidden.grid()
    assert grid.shape == (5, 128, model.config.hidden_size)
    for i, ref in enumerate(alone):
        torch.testing.assert_close(grid[i, :ref.shape[0]], ref, rtol=1e-5, atol=1e-5)
        assert not grid[i, ref.shape[0]:].any()
    torch.testing.assert_close(hidden.first(), torch.stack([ref[0] for ref in alone]), rtol=1e-5, atol=1e-5)
    states, targets = hidden.masked()
    sel = labels != -100
    torch.testing.assert_close(states, grid[sel], rtol=0, atol=0)  # the grid's row-major order
    assert targets.tolist() == labels[sel].tolist()


#: a batch of one text: 1 token or the maximum length (126 tokens + [CLS]/[SEP] = the model's 128 positions)
ONE_TEXT = {"mlm": 126, "cpdae_nocl": 1, "seed": 1, "retromae": 126, "bow": 126, "prop": 1}


@pytest.mark.parametrize("name", sorted(ONE_TEXT))
def test_a_batch_of_one_text_gives_the_padded_losses_and_gradients(name, sharp_model, tok):
    """One text per batch (the non-contrastive objectives), of 1 token or of the maximum length; float32, losses to
    1e-5 relative, gradients to 1e-4 relative (the tolerances of tests/pretrain/model/test_unpadded.py)."""
    opts = {"representation": "mean"} if name == "bow" else {}
    padded, packed = (build(name, opts, mode, sharp_model, tok) for mode in ("off", "on"))
    text = torch.randint(2000, 29000, (ONE_TEXT[name],), generator=torch.Generator().manual_seed(6)).tolist()
    batch = collate(packed, [text])
    assert any(k.startswith("packed_") for k in batch)
    ref_losses, ref_grads = loss_and_grads(padded, batch)
    losses, grads = loss_and_grads(packed, batch)
    assert losses.keys() == ref_losses.keys()
    for k, v in ref_losses.items():
        assert losses[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, losses, ref_losses)
    assert grads.keys() == ref_grads.keys() and grads
    for key, ref in ref_grads.items():
        scale = max(1.0, float(ref.abs().max()))
        torch.testing.assert_close(grads[key], ref, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{key}: {m}")


# ------------------------------------------------------------------------------------ nothing read back
def _device_only_kernel(q, k, v, cu, max_length_q, p, scaling):
    """Attention inside each sequence computed from ``cu`` on the device alone (a block-diagonal mask from
    ``searchsorted``): the CPU's own kernel reads the bounds back (one SDPA per text), a GPU's does not."""
    segment = torch.searchsorted(cu[1:].to(torch.int64), torch.arange(q.shape[0]), right=True)
    mask = segment[:, None] == segment[None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           attn_mask=mask, scale=scaling)
    return out.transpose(0, 1)


def _reads_back(obj, batch) -> list[str]:
    """The operators of a forward and backward pass whose result the host must wait for (on a GPU: a
    synchronisation): a scalar read, ``nonzero`` (boolean indexing, ``masked_select``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    waits = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
             "aten.nonzero_static.default", "aten.item.default"}
    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in waits:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        obj(batch)["loss"].backward()
    return seen


@pytest.mark.parametrize("name", ["mlm", "cpdae"])
def test_a_packed_step_reads_nothing_back_from_the_device(name, sharp_model, tok, monkeypatch):
    from pyterrier_cpdae.encoder import attention

    monkeypatch.setattr(attention, "_named_kernel", _device_only_kernel)
    padded, packed = (build(name, {}, mode, sharp_model, tok) for mode in ("off", "on"))
    g = torch.Generator().manual_seed(8)
    batch = collate(packed, [torch.randint(2000, 29000, (n,), generator=g).tolist() for n in (3, 30, 11, 1)])
    assert _reads_back(packed, batch) == []
    assert "aten._local_scalar_dense.default" in _reads_back(padded, batch)  # the padded path's count of masks: seen


# ------------------------------------------------------------------------------------ the probe
def test_the_probe_times_paths_in_turn_and_keeps_the_fastest():
    from pretrain.model.path_probe import fastest, time_paths

    now = [0.0]
    cost = {"off": 1.0, "on": 0.5}
    calls: list[str] = []

    def step(path):
        calls.append(path)
        now[0] += cost[path] + (10.0 if calls.count(path) == 1 else 0.0)  # a slow first call (compilation)

    times = time_paths(step, ("off", "on"), rounds=3, clock=lambda: now[0])
    assert calls == ["off", "on"] + ["off", "on"] * 3  # warm-up untimed, then rounds in turn
    assert times == {"off": 1.0, "on": 0.5} and fastest(times) == "on"
    assert fastest({"off": 0.2, "on": 0.2}) == "off" and fastest({"on": 0.2, "off": 0.3}) == "on"
    with pytest.raises(ValueError, match="at least one path and one round"):
        time_paths(step, (), rounds=3)


def test_auto_without_a_probe_is_the_padded_path_on_the_cpu(sharp_model, tok):
    obj = build("mlm", {}, "auto", sharp_model, tok)
    assert unpadded.PROBE_DEVICES == ("cuda",) and obj.probe_paths(torch.device("cpu")) == ()
    assert obj.probe_paths(torch.device("cuda")) == ("off", "on")
    assert obj.path_record() == {"unpad": "auto", "unpad_option": "auto"} and not obj.packs()
    assert packing.packed_from_batch(obj.collate([[2000, 2001]]), "views") is None  # nothing laid out
    with pytest.raises(ValueError, match="unknown encoder path 'fast'"):
        obj.use_path("fast")


