"""Full precision on the CPU whatever the checkpoint's dtype.

The reference everywhere is the same weights in float32: a bf16 checkpoint and its exact float32 upcast must
encode identically, and pre-training builds float32 weights from a bf16 checkpoint or config (the Trainer's
``--bf16``/``--fp16`` then decide the training's precision).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

TEXTS = ["dense retrieval with a tiny encoder", "bag of words decoder", "an unrelated passage about rivers"]


def dtypes(path: Path) -> set[str]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return {f.get_slice(k).get_dtype() for k in f.keys()}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


@pytest.fixture(scope="module")
def bf16_and_fp32(tmp_path_factory, tiny_bert_dir) -> tuple[str, str]:
    """The tiny BERT saved in bf16, and the same (rounded) weights saved in float32."""
    from transformers import AutoTokenizer, BertForMaskedLM

    root = tmp_path_factory.mktemp("precision")
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    model = BertForMaskedLM.from_pretrained(tiny_bert_dir).to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    tok.save_pretrained(root / "bf16")
    assert json.loads((root / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model.float().save_pretrained(root / "fp32")
    tok.save_pretrained(root / "fp32")
    assert dtypes(root / "bf16" / "model.safetensors") == {"BF16"}
    assert dtypes(root / "fp32" / "model.safetensors") == {"F32"}
    return str(root / "bf16"), str(root / "fp32")


def test_a_bf16_checkpoint_encodes_in_float32_on_the_cpu(bf16_and_fp32):
    from pyterrier_cpdae import CPDAE

    bf16, fp32 = bf16_and_fp32
    ref = CPDAE.from_pretrained(fp32, device="cpu", dtype="float32", backend="torch").encode_docs(TEXTS)
    for dtype in ("float32", None):  # forced, and the automatic choice on the CPU
        enc = CPDAE.from_pretrained(bf16, device="cpu", dtype=dtype, backend="torch")
        assert {p.dtype for p in enc.model.parameters()} == {torch.float32}
        np.testing.assert_allclose(enc.encode_docs(TEXTS), ref, rtol=0, atol=1e-6)
    # what bf16 compute gives instead is measurably different: the comparison above can fail
    bf16_vecs = CPDAE(CPDAE.from_pretrained(bf16, device="cpu").model.to(torch.bfloat16),
                      CPDAE.from_pretrained(bf16).tokenizer, device="cpu").encode_docs(TEXTS)
    assert np.abs(bf16_vecs - ref).max() > 1e-3


def test_an_in_memory_bf16_model_is_used_as_given_with_a_warning(bf16_and_fp32, caplog):
    from pyterrier_cpdae import CPDAE

    enc = CPDAE.from_pretrained(bf16_and_fp32[0], device="cpu")
    with caplog.at_level(logging.WARNING, logger="pyterrier_cpdae.encoder"):
        CPDAE(enc.model.to(torch.bfloat16), enc.tokenizer, device="cpu").encode_docs(TEXTS[:1])
    assert "weights are bfloat16: its vectors are computed in bfloat16, not in float32" in caplog.text


def test_pre_training_from_a_bf16_config_builds_float32_weights(bf16_and_fp32):
    from pretrain.model.modeling import load_mlm_model

    model = load_mlm_model(bf16_and_fp32[0], from_config=bf16_and_fp32[0])
    assert {p.dtype for p in model.parameters()} == {torch.float32}

