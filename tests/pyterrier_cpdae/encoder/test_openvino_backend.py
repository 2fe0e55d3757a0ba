"""The OpenVINO backend of CPDAE: same vectors as PyTorch, chosen automatically only where it
is safe and pays off, forced either way by ``backend=`` or ``$PYTERRIER_CPDAE_BACKEND``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pyterrier_cpdae.encoder.backends import openvino as _openvino
from pyterrier_cpdae.encoder import cpdae as enc_mod
from pyterrier_cpdae.encoder import CPDAE

if not _openvino.openvino_available():  # the test extra installs it: a missing backend fails, it does not skip
    raise ImportError('openvino is not installed: pip install -e ".[test]"')

TEXTS = ["the quick brown fox jumps over the lazy dog", "dense retrieval", "a third text, longer than the others: "
         "autoencoders pre-train the encoder's [CLS] vector for retrieval", "x"]


pytestmark = pytest.mark.usefixtures("no_env")  # the encoder's own choices (conftest.py)


def naive_vectors(model, tokenizer, texts, pooling, normalize):
    """One text at a time, no padding, PyTorch float32: the reference the batched backends must match."""
    out = []
    with torch.no_grad():
        for t in texts:
            ids = tokenizer(t, truncation=True, max_length=256, return_tensors="pt")["input_ids"]
            h = model(input_ids=ids)[0][0]
            v = h[0] if pooling == "cls" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return torch.stack(out).numpy()


@pytest.mark.parametrize("pooling, normalize", [("cls", False), ("mean", True)])
def test_openvino_vectors_match_pytorch(tiny_bert_dir, pooling, normalize):
    """Padded batches of unequal lengths through the compiled graph give the unpadded one-by-one PyTorch vectors."""
    ov = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="openvino", pooling=pooling, normalize=normalize,
                               batch_size=3)
    pt_ = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch", pooling=pooling, normalize=normalize,
                                batch_size=3)
    got = ov.encode_docs(TEXTS)
    assert ov._openvino is not None and pt_._openvino is None
    ref = naive_vectors(pt_.model, pt_.tokenizer, TEXTS, pooling, normalize)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(got, pt_.encode_docs(TEXTS), atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(ov.encode_queries("dense retrieval"), ref[1], atol=1e-5, rtol=1e-4)


def test_automatic_backend_rules(tiny_bert_dir, monkeypatch):
    """Auto: OpenVINO for a loaded model on the CPU in float32 once it has encoded OPENVINO_MIN_TOKENS tokens over
    all calls (so small chunks, as an indexing pipeline hands over, switch too), PyTorch before that, for an
    in-memory model, bf16, or when the environment variable says torch."""
    tokens = sum(len(t) for t in CPDAE.from_pretrained(tiny_bert_dir).tokenizer(TEXTS)["input_ids"])
    monkeypatch.setattr(enc_mod, "OPENVINO_MIN_TOKENS", 3 * tokens)
    auto = CPDAE.from_pretrained(tiny_bert_dir, device="cpu")
    auto.encode_docs(TEXTS)
    auto.encode_docs(TEXTS)
    assert auto._openvino is None  # 2 small calls: compiling would not pay off yet
    auto.encode_docs(TEXTS)
    assert auto._openvino is not None  # the third crosses the total
    assert auto.encode_docs(["x"]).shape == (1, auto.dim)  # compiled once, then used for every window
    monkeypatch.setattr(enc_mod, "OPENVINO_MIN_TOKENS", 1)  # from here on, any job is large enough
    in_memory = CPDAE(auto.model, auto.tokenizer, device="cpu")
    in_memory.encode_docs(TEXTS)
    assert in_memory._openvino is None  # the model may be training: its weights must be read live
    bf16 = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", dtype="bf16")
    bf16.encode_docs(TEXTS)
    assert bf16._openvino is None
    monkeypatch.setenv(enc_mod.BACKEND_ENV, "torch")
    env = CPDAE.from_pretrained(tiny_bert_dir, device="cpu")
    env.encode_docs(TEXTS)
    assert env._openvino is None
    monkeypatch.setenv(enc_mod.BACKEND_ENV, "onnx")
    with pytest.raises(ValueError, match="PYTERRIER_CPDAE_BACKEND.*'onnx'"):
        env.encode_docs(TEXTS)


def test_backend_errors_and_fallback(tiny_bert_dir, monkeypatch, caplog):
    with pytest.raises(ValueError, match="backend must be one of"):
        CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="onnx")
    with pytest.raises(ValueError, match="backend='openvino' runs on the CPU in float32 or bf16"):
        CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="openvino", dtype="fp16").encode_docs(TEXTS)
    # a graph that cannot be compiled: the automatic choice warns and stays on PyTorch, an explicit one raises
    def broken(*a, **k):
        raise RuntimeError("unsupported operation")
    monkeypatch.setattr(enc_mod, "compile_encoder", broken)
    monkeypatch.setattr(enc_mod, "OPENVINO_MIN_TOKENS", 1)
    auto = CPDAE.from_pretrained(tiny_bert_dir, device="cpu")
    ref = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch").encode_docs(TEXTS)
    np.testing.assert_array_equal(auto.encode_docs(TEXTS), ref)
    assert "OpenVINO could not compile" in caplog.text and auto._openvino_failed
    with pytest.raises(RuntimeError, match="unsupported operation"):
        CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="openvino").encode_docs(TEXTS)
    monkeypatch.setattr(enc_mod, "openvino_available", lambda: False)
    with pytest.raises(ImportError, match=r"pyterrier-cpdae\[openvino\]"):
        CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="openvino").encode_docs(TEXTS)
    assert "backend='openvino'" in repr(CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="openvino"))


def test_compiled_encoder_pickles_and_is_shared_by_threads(tiny_bert_dir):
    """The compiled graph is left out of a pickle (rebuilt on first use) and serves concurrent threads."""
    import pickle
    from concurrent.futures import ThreadPoolExecutor

    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="openvino", batch_size=2)
    ref = enc.encode_docs(TEXTS)
    copy = pickle.loads(pickle.dumps(enc))
    assert copy._openvino is None and copy == enc
    np.testing.assert_allclose(copy.encode_docs(TEXTS), ref, atol=1e-6)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: enc.encode_docs(TEXTS * 3), range(8)))
    for r in results:
        np.testing.assert_allclose(r, np.concatenate([ref] * 3), atol=1e-6)


@pytest.mark.parametrize("streams", [1, 2, 3])
def test_streams_give_each_batch_its_one_by_one_vectors(tiny_bert_dir, streams):
    """:class:`CompiledEncoder`: several padded batches run through the parallel streams at once, and a lone batch
    cut into one piece per stream, each give the unpadded one-by-one PyTorch vectors of its rows, in order."""
    from pyterrier_cpdae.encoder.batching import pad
    from pyterrier_cpdae.encoder.loading import load_encoder, load_tokenizer

    model, tok = load_encoder(tiny_bert_dir).eval(), load_tokenizer(tiny_bert_dir)
    texts = TEXTS * 2 + ["one more", "and the last text of all"]
    ids = tok(texts, add_special_tokens=True)["input_ids"]
    groups = [[0, 1, 2], [3], [4, 5, 6, 7, 8, 9]]
    batches = [pad([ids[i] for i in g], np.array([len(ids[i]) for i in g]), tok.pad_token_id) for g in groups]
    compiled = _openvino.compile_encoder(model, "mean", True, threads=2, streams=streams)
    assert compiled.streams == streams
    ref = naive_vectors(model, tok, texts, "mean", True)
    got = compiled.map(batches)
    assert [len(v) for v in got] == [len(g) for g in groups]
    for g, v in zip(groups, got):
        np.testing.assert_allclose(v, ref[g], atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(compiled(*batches[2]), ref[groups[2]], atol=1e-5, rtol=1e-4)  # cut in pieces
    np.testing.assert_allclose(compiled(*batches[1]), ref[groups[1]], atol=1e-5, rtol=1e-4)  # one row: one piece


def test_compiling_prints_no_transformers_warning(tiny_bert_dir):
    """The converter's trace check reads every module attribute, and a transformers model's ``loss_function``
    property warns ``loss_type=None ... unrecognized`` when read: compiling shows no such line (the once-per-process
    cache is cleared first, so that the warning could appear here)."""
    import logging

    import transformers.utils.logging as tlog

    from pyterrier_cpdae.encoder.backends.openvino import compile_encoder

    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("transformers.modeling_utils")
    log.addHandler(handler)
    level = log.level
    try:
        tlog.warning_once.cache_clear()
        enc.model.loss_function  # noqa: B018 (the property itself still warns, once: the check is not vacuous)
        assert any("loss_type" in m for m in seen)
        seen.clear()
        tlog.warning_once.cache_clear()
        compile_encoder(enc.model, "mean", True)
        assert seen == []
        assert log.level == level  # restored
    finally:
        log.removeHandler(handler)


def test_compiling_sends_no_usage_report(tiny_bert_dir, monkeypatch):
    """OpenVINO's converter reports each conversion to Google Analytics (from processes forked off the caller) unless
    the user opted out; with nobody having opted out (no consent file), the converter called directly reports, and
    compile_encoder sends nothing; the telemetry's sender is the user's again afterwards."""
    import openvino as ov
    from openvino.tools.ovc.telemetry_utils import init_ovc_telemetry
    from openvino_telemetry.utils.opt_in_checker import ConsentCheckResult, OptInChecker
    from openvino_telemetry.utils.sender import TelemetrySender

    from pyterrier_cpdae.encoder.loading import load_encoder

    sent = []
    recorder = lambda self, backend, message: sent.append(message)  # noqa: E731
    monkeypatch.setattr(TelemetrySender, "send", recorder)
    # OpenVINO's default (opt-out), whatever this machine's setting; the telemetry decides its consent when it is
    # initialised for another application than the last one (the converter's is "OVC")
    monkeypatch.setattr(OptInChecker, "check", lambda self, *args, **kwargs: ConsentCheckResult.NO_FILE)
    model = load_encoder(tiny_bert_dir).eval()
    example = {"input_ids": torch.tensor([[101, 2000, 102]]), "attention_mask": torch.tensor([[1, 1, 1]])}
    init_ovc_telemetry("pyterrier-cpdae test")
    ov.convert_model(_openvino._Pooled(model, "mean", True), example_input=example)
    assert sent  # the converter alone reports (the check below is not vacuous)
    init_ovc_telemetry("pyterrier-cpdae test")
    sent.clear()
    compiled = _openvino.compile_encoder(model, "mean", True)
    assert compiled(example["input_ids"].numpy(), example["attention_mask"].numpy()).shape == (1, 32)
    assert sent == []
    assert TelemetrySender.__dict__["send"] is recorder  # restored


def test_a_compiled_encoder_is_freed_when_dropped(tiny_bert_dir):
    """The inference queue (a native object) holds its callback strongly and the collector cannot see through it,
    so a callback bound to the encoder made a cycle that was never freed (each MiniLM encoder leaked ~400 MB: the
    cpu-scale evaluation of 57 models ran out of 24 GB). Dropped, a compiled encoder is now freed, and an encoder
    with its compiled graph too, after encoding."""
    import gc
    import weakref

    from pyterrier_cpdae.encoder.backends.openvino import compile_encoder

    enc = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="openvino")
    enc.encode_docs(TEXTS)
    graph = weakref.ref(enc._openvino)
    encoder = weakref.ref(enc)
    del enc
    gc.collect()
    assert encoder() is None and graph() is None
    model = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", backend="torch").model
    compiled = compile_encoder(model, "mean", False)
    ids = np.array([[101, 2000, 102]])
    assert compiled(ids, np.ones_like(ids)).shape == (1, model.config.hidden_size)
    ref = weakref.ref(compiled)
    del compiled
    gc.collect()
    assert ref() is None
