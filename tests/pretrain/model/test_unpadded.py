"""The unpadded encoder path (``--unpad``, :mod:`pretrain.model.unpadded`) against the padded one, on the CPU.

Reference tests: for every objective, a batch of texts of very different lengths (an empty text, one token, a few,
the model's whole 128 positions) gives the same loss terms and the same gradient of every parameter on the
unpadded path (the real tokens packed into one row, attention inside each text) as on the padded path, in float32
(dropout off: both paths draw their dropout masks over tensors of other shapes). The batch is collated by the
unpadded objective, so it carries the packed rows laid out on the host (:mod:`pretrain.data.packing`), which the
padded objective ignores; one case runs a batch without them (unpadded on the device). Both varlen kernels that run on
the CPU are checked: ``loop`` (the CPU's) and ``njt`` (torch's nested-tensor SDPA, the CUDA path's plumbing).
Independently of the padded path, the unpadded hidden states of a batch equal those of each text encoded alone.
Batches of one text, the packer against a naive layout and ``--unpad auto``'s probe: ``tests/pretrain/data/test_packing.py``.
"""
from __future__ import annotations

import copy

import pytest
import torch

from pretrain.model import unpadded
from pyterrier_cpdae.encoder import attention
from pretrain.objectives import objective_config
from pretrain.model.modeling import load_mlm_model
from pretrain.objectives import build_objective

from tests.helpers.objectives import sharpen
from tests.helpers.unpadded import LENGTHS, build, collate, extras, loss_and_grads  # noqa: F401


#: objective -> its options (the add-on span contrast runs on mlm; mean pooling on cpdae and bow)
CASES = {
    "mlm": ("mlm", {}),
    "cpdae": ("cpdae", {"temperature": 0.5}),
    "cpdae_mean": ("cpdae", {"representation": "mean"}),
    "cpdae_r": ("cpdae_r", {"temperature": 2.0}),
    "cpdae_nocl": ("cpdae_nocl", {}),
    "cpdae_idfrec": ("cpdae_idfrec", {}),
    "bow": ("bow", {"representation": "mean"}),
    "seed": ("seed", {}),
    "retromae": ("retromae", {}),
    "simcse": ("simcse", {}),
    "ict": ("ict", {}),
    "prop": ("prop", {}),
    "mlm_span": ("mlm", {"span_contrast_weight": 1.0}),
}


#: the cases also run with the ``njt`` kernel (the CUDA path's plumbing; the others share its code)
NJT_CASES = ("mlm", "cpdae", "ict", "prop")


@pytest.fixture(scope="module")
def sharp_model(tiny_bert_dir):
    """The tiny test BERT with weights that make the losses react to every input (loaded once per module)."""
    model = load_mlm_model(tiny_bert_dir)
    sharpen(model)
    return model



def texts(tok) -> list[list[int]]:
    """Random word pieces of the given lengths, a full stop every 7th token (ICT cuts sentences there)."""
    g = torch.Generator().manual_seed(11)
    stop = tok.convert_tokens_to_ids(".")
    out = []
    for n in LENGTHS:
        ids = torch.randint(2000, 29000, (n,), generator=g).tolist()
        out.append([stop if (j + 1) % 7 == 0 else t for j, t in enumerate(ids)])
    return out


def encoder_calls(obj) -> list[tuple[tuple[int, ...], int]]:
    """``(input_ids shape, real tokens)`` of each call of the encoder in the next forward passes."""
    calls: list = []

    def hook(module, args, kwargs):
        am = kwargs.get("attention_mask")
        calls.append((tuple(kwargs["input_ids"].shape), int(am.sum()) if am is not None else kwargs["input_ids"].numel()))
    obj.encoder.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


@pytest.mark.parametrize("case,kernel,layout", [(c, "loop", "host") for c in sorted(CASES)]
                         + [(c, "njt", "host") for c in NJT_CASES] + [("mlm", "loop", "device")])
def test_loss_and_gradients_unpadded_equal_padded(case, kernel, layout, sharp_model, tok, monkeypatch):
    from pretrain.data.packing import bucket_size, capacity, filler_sequences

    name, opts = CASES[case]
    monkeypatch.setattr(attention, "FORCE_KERNEL", kernel)
    padded, unpadded_obj = (build(name, opts, mode, sharp_model, tok) for mode in ("off", "on"))
    for (n, a), (_, b) in zip(padded.state_dict().items(), unpadded_obj.state_dict().items()):
        assert torch.equal(a, b), n  # the same weights
    batch = collate(unpadded_obj if layout == "host" else padded, texts(tok))
    assert any(k.startswith("packed_") for k in batch) == (layout == "host")
    ref_calls = encoder_calls(padded)
    ref_losses, ref_grads = loss_and_grads(padded, batch)
    calls = encoder_calls(unpadded_obj)
    losses, grads = loss_and_grads(unpadded_obj, batch)
    # the unpadded path ran: each encoder call saw one packed row, of the real tokens of the padded call and (host
    # layout) the filler sequences up to its capacity, a multiple of the pass's bucket
    if layout == "host":
        def packed_width(shape, real):
            bucket = bucket_size(shape[0], max(128, shape[1]))
            return capacity(real, bucket, filler_sequences(bucket, max(128, shape[1])))
        assert [(1, packed_width(shape, real)) for shape, real in ref_calls] == [shape for shape, _ in calls]
    else:
        assert [(1, real) for _, real in ref_calls] == [shape for shape, _ in calls], (ref_calls, calls)
    assert all(shape[0] > 1 and real < shape[0] * shape[1] for shape, real in ref_calls)  # there was padding
    assert unpadded_obj.mlm_model.config._attn_implementation == unpadded.ATTN_IMPLEMENTATION
    assert padded.mlm_model.config._attn_implementation != unpadded.ATTN_IMPLEMENTATION
    assert losses.keys() == ref_losses.keys() and "loss" in losses
    for k, v in ref_losses.items():
        assert losses[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, losses, ref_losses)
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    for n, g in ref_grads.items():
        scale = max(1.0, float(g.abs().max()))  # the loss terms differ in size by 4 orders (CPDAE's summed L_REC)
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{case}/{n}: {m}")


def test_unpadded_rows_equal_each_text_encoded_alone(sharp_model, tok):
    """An independent reference: attention stays inside each text, positions restart at each [CLS]."""
    from pretrain.data.masking import pad_and_add_special

    model = copy.deepcopy(sharp_model).eval()
    ids, am, _ = pad_and_add_special(texts(tok), tok)
    types = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(2)) * am
    with torch.no_grad():
        alone = [model.base_model(input_ids=ids[i:i + 1, :int(am[i].sum())],
                                  token_type_ids=types[i:i + 1, :int(am[i].sum())]).last_hidden_state[0]
                 for i in range(len(ids))]
        hidden = unpadded.unpadded_last_hidden(model, ids, am, types)
    assert hidden.shape == (*ids.shape, model.config.hidden_size)
    for i, ref in enumerate(alone):
        n = ref.shape[0]
        torch.testing.assert_close(hidden[i, :n], ref, rtol=1e-5, atol=1e-5)
        assert not hidden[i, n:].any()  # zeros at padding
    # a padded call through the switched model is transformers' own SDPA path, unchanged
    with torch.no_grad():
        padded = model.base_model(input_ids=ids, attention_mask=am, token_type_ids=types).last_hidden_state
    for i, ref in enumerate(alone):
        torch.testing.assert_close(padded[i, :ref.shape[0]], ref, rtol=1e-5, atol=1e-5)


def test_unpadded_training_step_draws_dropout_and_is_finite(sharp_model, tok):
    obj = build("cpdae", {}, "on", sharp_model, tok).train()
    batch = collate(obj, texts(tok))
    torch.manual_seed(3)
    a = obj(batch)
    a["loss"].backward()
    b = obj(batch)
    assert torch.isfinite(a["loss"]) and float(a["mlm"]) != float(b["mlm"])  # dropout acts on the packed tokens
    assert all(torch.isfinite(p.grad).all() for p in obj.parameters() if p.grad is not None)


def test_auto_is_padded_until_a_probe_resolves_it(sharp_model, tok):
    obj = build("mlm", {}, "auto", sharp_model, tok)
    assert obj.unpad == "auto"
    assert not unpadded.use_unpadded("auto", torch.device("cpu"))
    # on CUDA too, until the trainer's probe turns it into on or off (tests/pretrain/data/test_packing.py)
    assert not unpadded.use_unpadded("auto", torch.device("cuda"))
    assert unpadded.use_unpadded("on", torch.device("cpu")) and not unpadded.use_unpadded("off", torch.device("cuda"))
    calls = encoder_calls(obj)
    batch = collate(obj, texts(tok))
    obj(batch)
    assert [shape for shape, _ in calls] == [tuple(batch["input_ids"].shape)]  # the padded grid: the CPU's numbers stay the padded path's
    assert obj.mlm_model.config._attn_implementation != unpadded.ATTN_IMPLEMENTATION


def test_unsupported_model_auto_falls_back_and_on_is_refused():
    from transformers import DistilBertConfig, DistilBertForMaskedLM

    model = DistilBertForMaskedLM(DistilBertConfig(vocab_size=100, dim=16, n_layers=1, n_heads=2, hidden_dim=32))
    assert unpadded.resolve_unpad("auto", model) == "off"
    with pytest.raises(ValueError, match=r"--unpad on: model type 'distilbert' is not one the unpadded path supports"):
        unpadded.resolve_unpad("on", model)
    with pytest.raises(ValueError, match=r"--unpad must be one of auto, on, off, got 'yes'"):
        unpadded.resolve_unpad("yes", model)


def test_unpad_option_is_checked_and_may_change_on_resume(tiny_bert_dir):
    from pretrain.arguments import ModelArguments, check_options
    from pretrain.training.run_dir import RESUMABLE

    with pytest.raises(ValueError, match=r"--unpad must be one of auto, on, off, got 'sometimes'"):
        check_options(ModelArguments(unpad="sometimes"))
    assert ModelArguments().unpad == "auto"
    assert {"unpad", "torch_compile"} <= RESUMABLE


def test_a_batch_that_is_not_right_padded_is_refused(tiny_bert_dir):
    model = load_mlm_model(tiny_bert_dir)
    ids = torch.tensor([[101, 2000, 102, 0], [0, 101, 2001, 102]])
    am = (ids != 0).long()
    with pytest.raises(ValueError, match=r"right-padded rows.*use --unpad off"):
        unpadded.unpadded_last_hidden(model, ids, am)


def test_switched_model_saves_no_attention_implementation(sharp_model, tok, tmp_path):
    import json

    obj = build("mlm", {}, "on", sharp_model, tok)
    obj(collate(obj, texts(tok)))
    obj.save_pretrained(str(tmp_path / "out"))
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not any("attn" in k for k in saved), saved  # the export loads anywhere, with any attention


def test_roberta_positions_start_after_the_padding_index():
    from transformers import RobertaConfig, RobertaForMaskedLM

    torch.manual_seed(0)
    model = RobertaForMaskedLM(RobertaConfig(vocab_size=200, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, max_position_embeddings=40, pad_token_id=1)).eval()
    ids = torch.tensor([[0, 50, 60, 70, 2], [0, 80, 2, 1, 1]])
    am = (ids != 1).long()
    with torch.no_grad():
        padded = model.base_model(input_ids=ids, attention_mask=am).last_hidden_state
        hidden = unpadded.unpadded_last_hidden(model, ids, am)
    torch.testing.assert_close(hidden[am.bool()], padded[am.bool()], rtol=1e-5, atol=1e-5)


def test_compile_compiles_every_encoder_layer_in_place(sharp_model, tok):
    """``--torch_compile`` (the trainer calls the objective's ``compile_encoder``): each encoder layer compiled in place,
    the parameter names (and so checkpoints and the export) unchanged. Compilation itself runs at the first step (not
    here: minutes on a CPU)."""
    obj = build("mlm", {}, "on", sharp_model, tok)
    names = [n for n, _ in obj.named_parameters()]
    obj.compile_encoder()
    layers = obj.encoder.encoder.layer
    assert len(layers) == 2 and all(layer._compiled_call_impl is not None for layer in layers)
    assert [n for n, _ in obj.named_parameters()] == names
