"""The encoder's options grouped in ``EncoderOptions``, its backend chosen once by ``choose_backend`` and logged at INFO
with the reason, its one identity digest, and the old spellings that still work (with a ``DeprecationWarning`` where a
name moved).

References: vectors are checked against each text encoded alone by the PyTorch model (no padding, no batching), and
the flat keyword API against the values it was given."""
from __future__ import annotations

import logging
import pickle
import warnings

import numpy as np
import pytest
import torch

from pyterrier_cpdae import CPDAE
from pyterrier_cpdae.encoder import cpdae as enc_mod
from pyterrier_cpdae.encoder.backends import BackendChoice, choose_backend
from pyterrier_cpdae.encoder.identity import encoder_digest, weights_sha256
from pyterrier_cpdae.encoder.options import (VECTOR_OPTIONS, BatchingOptions, ComputeOptions, EncoderOptions,
                                             ModelOptions, RepresentationOptions)

TEXTS = ["the quick brown fox jumps over the lazy dog", "dense retrieval", "x",
         "a longer text about autoencoders that pre-train the encoder's [CLS] vector for retrieval"]

#: every keyword of CPDAE(...) but the model, tokenizer and config, with a value other than its default
ALL_KWARGS = dict(pooling="mean", normalize=True, query_max_length=16, doc_max_length=64, batch_size=3,
                  device="cpu", dtype="float32", verbose=False, sort_window=5, name_or_path=None, backend="torch",
                  batch_tokens=128, unpad=False, cls_last_layer=False)
LOGGER = "pyterrier_cpdae.encoder.cpdae"


pytestmark = pytest.mark.usefixtures("no_env")  # the encoder's own choices (conftest.py)


@pytest.fixture(scope="module")
def tiny(tiny_bert_dir):
    from pyterrier_cpdae.encoder.loading import load_encoder, load_tokenizer
    return load_encoder(tiny_bert_dir).eval(), load_tokenizer(tiny_bert_dir)


def one_by_one(model, tokenizer, texts, pooling, normalize, max_length=256):
    """Each text alone through the PyTorch model, float32: the reference every backend and batching must match."""
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tokenizer(t, truncation=True, max_length=max_length, return_tensors="pt")["input_ids"]
            h = model(input_ids=ids)[0][0]
            v = h[0] if pooling == "cls" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return torch.stack(out).numpy()


# -- the options dataclass -------------------------------------------------------------------------------------------
def test_options_group_every_keyword_and_round_trip():
    opts = EncoderOptions.from_kwargs(**ALL_KWARGS)
    assert opts.to_kwargs() == ALL_KWARGS  # every flat keyword, in one of the four groups, given back unchanged
    assert set(EncoderOptions.fields().values()) == {"model", "representation", "batching", "compute"}
    assert opts.representation == RepresentationOptions(pooling="mean", normalize=True)
    assert opts.batching == BatchingOptions(query_max_length=16, doc_max_length=64, batch_size=3, sort_window=5,
                                            batch_tokens=128, verbose=False)
    assert opts.compute == ComputeOptions(backend="torch", dtype="float32", unpad=False, cls_last_layer=False)
    assert opts.model == ModelOptions(device="cpu")
    assert opts.pooling == "mean" and opts.batch_tokens == 128  # flat names read through the groups
    assert EncoderOptions.from_kwargs(**opts.to_kwargs()) == opts
    assert opts.replace(pooling="cls") == EncoderOptions.from_kwargs(**{**ALL_KWARGS, "pooling": "cls"})
    assert pickle.loads(pickle.dumps(opts)) == opts
    assert opts.vector_options() == {k: ALL_KWARGS[k] for k in VECTOR_OPTIONS}
    # the defaults are CPDAE's
    assert EncoderOptions().to_kwargs() == dict(name_or_path=None, device=None, pooling="cls", normalize=False,
                                                query_max_length=32, doc_max_length=256, batch_size=32,
                                                sort_window=64, batch_tokens=None, verbose=None, backend=None,
                                                dtype=None, unpad=None, cls_last_layer=None)


@pytest.mark.parametrize("spelling, canonical", [
    (dict(dtype=torch.float16), dict(dtype="float16")), (dict(dtype="HALF"), dict(dtype="float16")),
    (dict(dtype="fp16"), dict(dtype="float16")), (dict(dtype="torch.bfloat16"), dict(dtype="bfloat16")),
    (dict(device=torch.device("cpu")), dict(device="cpu")), (dict(backend="OpenVINO"), dict(backend="openvino")),
    (dict(batch_size=np.int64(4), normalize=np.bool_(True)), dict(batch_size=4, normalize=True)),
    (dict(unpad=np.bool_(False)), dict(unpad=False))])
def test_equivalent_spellings_are_one_option(spelling, canonical):
    a, b = EncoderOptions.from_kwargs(**spelling), EncoderOptions.from_kwargs(**canonical)
    assert a == b and hash(a) == hash(b) and a.to_kwargs() == b.to_kwargs()
    assert type(a.to_kwargs()[next(iter(canonical))]) is type(next(iter(canonical.values())))


@pytest.mark.parametrize("kwargs, message", [
    (dict(pooling="max"), "pooling must be one of"), (dict(batch_size=0), "batch_size must be a positive integer"),
    (dict(sort_window=True), "sort_window must be a positive integer"),
    (dict(batch_tokens=10), "batch_tokens=10 is below the maximum length of 256"),
    (dict(unpad="yes"), "unpad must be True, False or None"), (dict(dtype="int8"), "dtype must be one of"),
    (dict(backend="onnx"), "backend must be one of"),
    (dict(cls_last_layer=True, pooling="mean"), "cls_last_layer=True needs pooling='cls'"),
    (dict(device="gpu7"), "device must be a torch device")])
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EncoderOptions.from_kwargs(**kwargs)


def test_an_unknown_option_is_named():
    with pytest.raises(TypeError, match=r"unknown encoder option\(s\) \['poolling'\]"):
        EncoderOptions.from_kwargs(poolling="cls")


# -- the keyword API stays -------------------------------------------------------------------------------------------
def test_old_keyword_calls_build_the_options_and_encode_as_before(tiny):
    model, tok = tiny
    enc = CPDAE(model, tok, **ALL_KWARGS)
    assert enc.options == EncoderOptions.from_kwargs(**ALL_KWARGS)
    for name, value in ALL_KWARGS.items():  # every keyword is still an attribute, with the value given
        got = getattr(enc, name)
        assert (str(got) if name == "device" else got) == value, name
    assert enc.device == torch.device("cpu")
    ref = one_by_one(model, tok, TEXTS, "mean", True, max_length=64)
    np.testing.assert_allclose(enc.encode_docs(TEXTS), ref, atol=1e-5, rtol=1e-4)
    # an encoder made from its options is equal and encodes the same vectors
    again = CPDAE.from_options(enc.options, model, tok)
    assert again == enc and again.options == enc.options
    np.testing.assert_array_equal(again.encode_docs(TEXTS), enc.encode_docs(TEXTS))


def test_from_pretrained_keeps_its_keywords_and_round_trips(tiny_bert_dir):
    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", pooling="mean", doc_max_length=48, batch_size=2,
                                dtype="fp32", backend="torch")
    assert enc.options.name_or_path == enc.name_or_path and enc.options.dtype == "float32"
    again = CPDAE.from_options(enc.options)  # no model: loaded from options.name_or_path
    assert again == enc and again.options == enc.options and again.producer() == enc.producer()


def test_setting_an_option_checks_it_and_chooses_the_backend_again(tiny, caplog):
    model, tok = tiny
    enc = CPDAE(model, tok, device="cpu", backend="torch")
    with pytest.raises(ValueError, match="pooling must be one of"):
        enc.pooling = "max"
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        enc.batch_size = 0
    assert enc.pooling == "cls" and enc.batch_size == 32  # unchanged by a refused value
    enc.encode_docs(TEXTS)
    enc.pooling = "mean"
    assert enc.options.representation.pooling == "mean"
    np.testing.assert_allclose(enc.encode_docs(TEXTS), one_by_one(model, tok, TEXTS, "mean", False), atol=1e-5,
                               rtol=1e-4)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        enc.backend = None
        enc.encode_docs(TEXTS)
    assert "encoder backend: torch (reason: automatic, padded batches: an in-memory model" in caplog.text


def test_an_encoder_pickled_with_flat_attributes_loads(tiny):
    """An encoder pickled before the options were grouped held them as flat attributes: it still loads."""
    model, tok = tiny
    enc = CPDAE(model, tok, device="cpu", pooling="mean", batch_size=5)
    state = enc.__getstate__()
    flat = dict(state, **{k: v for k, v in enc.options.to_kwargs().items()})
    del flat["_options"]
    flat["device"] = torch.device("cpu")
    old = CPDAE.__new__(CPDAE)
    old.__setstate__(flat)
    assert old.options == enc.options and old == enc
    np.testing.assert_array_equal(old.encode_docs(TEXTS), enc.encode_docs(TEXTS))


# -- the backend: chosen once, with its reason -----------------------------------------------------------------------
def choose(**changes):
    args = dict(requested=None, origin="automatic", device=torch.device("cpu"), dtype=torch.float32, packed=False,
                loaded=True, tokens=10, min_tokens=100, openvino_failed=False, openvino_installed=lambda: True)
    return choose_backend(**{**args, **changes})


def test_choose_backend_rules():
    assert choose(requested="torch", origin="backend='torch'") == BackendChoice("torch", "backend='torch', padded batches")
    assert choose(requested="torch", packed=True).name == "torch-unpadded"
    assert choose(requested="openvino", origin="backend='openvino'") == BackendChoice("openvino", "backend='openvino'")
    pending = choose(tokens=10)
    assert pending.name == "torch" and pending.switch_at == 100 and "10 tokens encoded so far" in pending.reason
    final = choose(tokens=100)
    assert final.name == "openvino" and final.switch_at is None and "100 tokens" in final.reason
    for changes, why in [(dict(device=torch.device("cuda")), "on cuda"), (dict(dtype=torch.bfloat16), "bfloat16"),
                         (dict(loaded=False), "in-memory model"), (dict(openvino_failed=True), "could not compile"),
                         (dict(openvino_installed=lambda: False), "not installed")]:
        got = choose(tokens=10**6, **changes)
        assert got.name == "torch" and got.switch_at is None and why in got.reason, (changes, got)
    assert choose(device=torch.device("cuda"), dtype=torch.bfloat16, packed=True).name == "torch-unpadded"
    with pytest.raises(ValueError, match="runs on the CPU in float32 or bf16, not on cpu in float16"):
        choose(requested="openvino", dtype=torch.float16)
    with pytest.raises(ImportError, match="pip install"):
        choose(requested="openvino", openvino_installed=lambda: False)
    asked = []
    choose(requested="torch", openvino_installed=lambda: asked.append(1) or True)
    assert not asked  # the openvino import is not tried where it does not matter
    assert str(final).startswith("encoder backend: openvino (reason: automatic")


def backend_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("encoder backend:")]


def test_the_backend_is_chosen_once_and_logged_with_its_reason(tiny_bert_dir, caplog):
    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch", batch_size=2)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(3):
            enc.encode_docs(TEXTS)
        enc.encode_queries(TEXTS)
    assert backend_lines(caplog) == ["encoder backend: torch (reason: backend='torch', padded batches)"]
    assert [r.levelno for r in caplog.records if r.getMessage().startswith("encoder backend:")] == [logging.INFO]


def test_the_automatic_switch_to_openvino_is_logged_when_it_happens(tiny_bert_dir, tiny, monkeypatch, caplog):
    pytest.importorskip("openvino")
    tokens = sum(map(len, CPDAE.from_pretrained(tiny_bert_dir).tokenizer(TEXTS)["input_ids"]))
    monkeypatch.setattr(enc_mod, "OPENVINO_MIN_TOKENS", 2 * tokens)
    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        first = enc.encode_docs(TEXTS)
        assert enc._openvino is None
        second = enc.encode_docs(TEXTS)  # reaches OPENVINO_MIN_TOKENS: compiled now
        assert enc._openvino is not None
        enc.encode_docs(TEXTS)
    assert backend_lines(caplog) == [
        f"encoder backend: torch (reason: automatic: {tokens:,} tokens encoded so far; OpenVINO is compiled once this "
        f"encoder has encoded {2 * tokens:,} (OPENVINO_MIN_TOKENS), where its faster encoding repays the compilation)",
        f"encoder backend: openvino (reason: automatic: a model loaded on the CPU in float32 that has encoded "
        f"{2 * tokens:,} tokens, at least OPENVINO_MIN_TOKENS={2 * tokens:,})"]
    model, tok = tiny
    ref = one_by_one(model, tok, TEXTS, "cls", False)
    np.testing.assert_allclose(first, ref, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(second, ref, atol=1e-5, rtol=1e-4)


def test_the_environment_variable_is_the_reason_when_it_chooses(tiny_bert_dir, monkeypatch, caplog):
    monkeypatch.setenv(enc_mod.BACKEND_ENV, "torch")
    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        enc.encode_docs(TEXTS)
    assert backend_lines(caplog) == ["encoder backend: torch (reason: PYTERRIER_CPDAE_BACKEND=torch, padded batches)"]


def test_an_openvino_graph_is_compiled_again_when_an_option_changes_the_vectors(tiny_bert_dir, tiny):
    """The compiled graph holds the pooling and normalisation: it is kept by the encoder's identity, so setting
    ``pooling`` or ``normalize`` compiles it again (a graph of the old options would give the old vectors)."""
    pytest.importorskip("openvino")
    model, tok = tiny
    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="openvino", batch_size=2)
    np.testing.assert_allclose(enc.encode_docs(TEXTS), one_by_one(model, tok, TEXTS, "cls", False), atol=1e-5,
                               rtol=1e-4)
    enc.pooling, enc.normalize = "mean", True
    np.testing.assert_allclose(enc.encode_docs(TEXTS), one_by_one(model, tok, TEXTS, "mean", True), atol=1e-5,
                               rtol=1e-4)


# -- one digest ------------------------------------------------------------------------------------------------------
def test_the_identity_is_one_digest_of_the_weights_and_the_vector_options(tiny):
    model, tok = tiny
    base = CPDAE(model, tok, device="cpu", dtype="float32")
    assert base.identity() == encoder_digest(weights_sha256(model), base.vector_options())
    assert base.vector_options() == dict(pooling="cls", normalize=False, query_max_length=32, doc_max_length=128,
                                         dtype="float32")  # 256 cut to the model's 128 positions
    # equivalent spellings, and options that do not change the vectors: one identity, one producer, equal encoders
    same = [CPDAE(model, tok, device=torch.device("cpu"), dtype=torch.float32),
            CPDAE(model, tok, device="cpu", dtype="fp32", query_max_length=np.int64(32), normalize=np.bool_(False)),
            CPDAE(model, tok, device="cpu", dtype="float", batch_size=3, sort_window=2, batch_tokens=0, verbose=True,
                  backend="torch", unpad=False, cls_last_layer=False)]
    for enc in same:
        assert enc.identity() == base.identity() and enc.producer() == base.producer()
        assert enc == base and hash(enc) == hash(base)
    # each option that changes the vectors changes the identity
    for change in [dict(pooling="mean"), dict(normalize=True), dict(query_max_length=16), dict(doc_max_length=64),
                   dict(dtype="bf16")]:
        other = CPDAE(model, tok, device="cpu", **{"dtype": "float32", **change})
        assert other.identity() != base.identity(), change
    # the automatic dtype is named in the identity: float32 on the CPU, the same identity as dtype="float32"
    assert CPDAE(model, tok, device="cpu").identity() == base.identity()


def test_the_identity_follows_an_edit_of_the_weights(tiny_bert_dir):
    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu")
    before, producer = enc.identity(), enc.producer()
    emb = enc.model.embeddings.word_embeddings.weight
    with torch.no_grad():
        emb.data[[5, 6]] = emb.data[[6, 5]].clone()
    assert enc.identity() != before and enc.producer() != producer
    with torch.no_grad():
        emb.data[[5, 6]] = emb.data[[6, 5]].clone()
    assert enc.identity() == before and enc.producer() == producer


def test_encoder_digest_is_stable_and_checks_its_input():
    a = encoder_digest("k", {"pooling": "cls", "dtype": "float32"})
    assert a == encoder_digest("k", {"dtype": "float32", "pooling": "cls"})  # key order does not matter
    assert len(a) == 32 and a != encoder_digest("k2", {"pooling": "cls", "dtype": "float32"})
    with pytest.raises(ValueError, match="weights digest or a model name"):
        encoder_digest("", {})


# -- moved names warn ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("old, new, names", [
    ("pyterrier_cpdae.encoder.packing", "pyterrier_cpdae.encoder.backends.unpadded",
     ["packed_forward", "supports_packing", "PACKED_MODEL_TYPES"]),
    ("pyterrier_cpdae.encoder.openvino_backend", "pyterrier_cpdae.encoder.backends.openvino",
     ["compile_encoder", "openvino_available", "CompiledEncoder"])])
def test_moved_modules_warn_and_give_the_same_objects(old, new, names):
    import importlib
    old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        with pytest.warns(DeprecationWarning, match=f"{old}.{name} moved to {new}.{name}"):
            got = getattr(old_mod, name)
        assert got is getattr(new_mod, name)
    with pytest.raises(AttributeError), warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(old_mod, "no_such_name")
