"""The encoder's automatic dtype, the native-bf16 detection and the ranking-equivalence bar.

The bar for any faster encoding path: vectors at cosine >= 0.9999 to float32 and the exact top-10 identical for
>= 99% of queries on Vaswani and SciFact.  bf16 autocast keeps the cosine (min 0.99996) but reorders the top-10 of
20-25% of queries (experiments/results/encode_equivalence.md), so the automatic dtype on the CPU is float32 even
where bf16 is native; these tests hold the default to the bar on real slices.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from pyterrier_cpdae.encoder import cpdae as enc_mod
from pyterrier_cpdae.encoder import CPDAE, cpu_has_native_bf16, default_dtype

REPO = Path(__file__).resolve().parents[3]


def _equivalence_module():
    spec = importlib.util.spec_from_file_location("encode_equivalence", REPO / "experiments" / "studies" / "encode_equivalence.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fresh_detection(monkeypatch):
    """Clears the cached CPU detection before and after the test (the test patches what it reads)."""
    monkeypatch.delenv(enc_mod.DTYPE_ENV, raising=False)
    cpu_has_native_bf16.cache_clear()
    yield
    cpu_has_native_bf16.cache_clear()


def _caps(**flags):
    base = {"avx512_f": True, "avx512_bf16": False, "amx_bf16": False, "amx_tile": False, "cpu_name": "test"}
    base.update(flags)
    return lambda: base


@pytest.mark.parametrize("flags, expected", [({}, False), ({"avx512_bf16": True}, True), ({"amx_bf16": True}, True),
                                             ({"amx_tile": True}, False)])
def test_native_bf16_detection_reads_cpu_flags(fresh_detection, monkeypatch, flags, expected):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", _caps(**flags), raising=False)
    assert cpu_has_native_bf16() is expected


def test_native_bf16_detection_falls_back_to_proc_cpuinfo(fresh_detection, monkeypatch, tmp_path):
    """Without torch.cpu.get_capabilities the flags line of /proc/cpuinfo decides."""
    import builtins

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    real_open = builtins.open
    for line, expected in (("flags\t\t: fpu avx512f avx512_bf16 avx512_vnni\n", True),
                           ("flags\t\t: fpu avx2 avx512f avx512bw\n", False)):
        fake = tmp_path / "cpuinfo"
        fake.write_text("processor\t: 0\nmodel name\t: test\n" + line)
        monkeypatch.setattr(builtins, "open",
                            lambda f, *a, **k: real_open(fake if f == "/proc/cpuinfo" else f, *a, **k))
        cpu_has_native_bf16.cache_clear()
        assert cpu_has_native_bf16() is expected


def test_native_bf16_detection_needs_onednn_bf16(fresh_detection, monkeypatch):
    """AVX512-BF16 flags do not count when torch's oneDNN backend cannot run bf16."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", _caps(avx512_bf16=True, amx_bf16=True), raising=False)
    assert cpu_has_native_bf16() is False


@pytest.mark.parametrize("native", [True, False])
def test_automatic_dtype_is_float32_on_cpu_with_or_without_native_bf16(fresh_detection, monkeypatch, tiny_bert_dir,
                                                                        native):
    """bf16 misses the ranking bar, so the CPU default is float32 whatever the CPU; CUDA keeps bf16/fp16."""
    monkeypatch.setattr(enc_mod, "cpu_has_native_bf16", lambda: native)
    assert default_dtype("cpu") == torch.float32
    assert CPDAE.from_pretrained(tiny_bert_dir, device="cpu")._autocast_dtype() == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert default_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert default_dtype("cuda") == torch.float16


def test_dtype_env_var_replaces_the_automatic_dtype_only(fresh_detection, monkeypatch, tiny_bert_dir):
    """PYTERRIER_CPDAE_DTYPE sets the dtype of dtype=None encoders (and is applied: the vectors change); an
    explicit dtype wins; a bad value is named with the variable."""
    texts = ["the quick brown fox jumps over the lazy dog", "a second, longer text about dense retrieval models"]
    fp32 = CPDAE.from_pretrained(tiny_bert_dir, device="cpu", dtype="float32")
    ref = fp32.encode_docs(texts)
    auto = CPDAE.from_pretrained(tiny_bert_dir, device="cpu")
    np.testing.assert_array_equal(auto.encode_docs(texts), ref)  # default on the CPU: float32, bit for bit
    monkeypatch.setenv(enc_mod.DTYPE_ENV, "bf16")
    assert auto._autocast_dtype() == torch.bfloat16
    vecs = auto.encode_docs(texts)
    assert vecs.dtype == np.float32 and not np.array_equal(vecs, ref)  # bf16 was really used
    cos = np.sum(vecs * ref, 1) / (np.linalg.norm(vecs, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() > 0.99
    assert fp32._autocast_dtype() == torch.float32
    np.testing.assert_array_equal(fp32.encode_docs(texts), ref)
    monkeypatch.setenv(enc_mod.DTYPE_ENV, "int8")
    with pytest.raises(ValueError, match="PYTERRIER_CPDAE_DTYPE='int8'"):
        auto.encode_docs(texts)


#: documents per slice (the first N of the collection), with all 93 Vaswani queries / the 16 SciFact train queries
#: with a relevant document among its 100. Small, and still telling the dtypes apart: on these slices bf16 autocast
#: reorders the top-10 of 20 of the 93 Vaswani queries and 4 of the 16 SciFact ones, OpenVINO's float32 graph none
#: (python experiments/studies/encode_equivalence.py --docs 200 --collections vaswani --dtype bf16 --backend torch;
#: --docs 100 --collections scifact). 500 and 300 documents took about a minute of the suite's time.
SLICES = {"vaswani": 200, "scifact": 100}


@pytest.mark.slow
@pytest.mark.parametrize("collection", sorted(SLICES))
def test_automatic_dtype_keeps_rankings_on_real_slices(collection, shared_data, minilm_path, monkeypatch):
    """The automatic dtype meets the bar on the first 200 docs of Vaswani (all 93 queries) / 100 of SciFact (its 16
    train queries with a relevant doc in the slice): min cosine >= 0.9999 and identical ordered top-10 for >= 99% of
    queries, as does OpenVINO's graph (on these slices the automatic backend stays on PyTorch, so it is checked
    explicitly). With native bf16 the bf16 opt-in is checked for the cosine (its top-10 order is not held to the bar).
    All settings are compared with one PyTorch float32 encoding of the slice."""
    monkeypatch.delenv(enc_mod.DTYPE_ENV, raising=False)
    eq = _equivalence_module()
    docs, topics, qrels = eq.load_collection(collection, str(shared_data), SLICES[collection])
    assert len(docs) == SLICES[collection] and len(topics) == (93 if collection == "vaswani" else 16)
    monkeypatch.delenv(enc_mod.BACKEND_ENV, raising=False)
    openvino = enc_mod.openvino_available()
    reference = eq.encode_reference(minilm_path, docs, topics)
    results = eq.compare_dtypes(minilm_path, docs, topics, [None] + (["bf16"] if cpu_has_native_bf16() else []),
                                qrels=qrels, reference=reference)
    defaults = results[:1]
    # OpenVINO too where auto keeps this job on torch (where the default is OpenVINO, that run is the same encoder)
    if openvino and defaults[0]["backend"] != "openvino":
        defaults += eq.compare_dtypes(minilm_path, docs, topics, [{"backend": "openvino"}], qrels=qrels,
                                      reference=reference)
    for r in defaults:
        assert r["dtype"] == "float32", r
        assert min(r["min_cos_docs"], r["min_cos_queries"]) >= 0.9999, r
        assert r["identical_topk"] >= 0.99, r
    if openvino:
        assert "openvino" in [r["backend"] for r in defaults]
    if cpu_has_native_bf16():
        bf16 = results[-1]
        assert bf16["dtype"] == "bfloat16"
        assert min(bf16["min_cos_docs"], bf16["min_cos_queries"]) >= 0.9999, bf16
