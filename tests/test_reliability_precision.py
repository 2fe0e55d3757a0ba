"""Full precision on the CPU whatever the checkpoint's dtype.

The reference everywhere is the same weights in float32: a bf16 checkpoint and its exact float32 upcast must
encode, fine-tune and pre-train identically, because every loader builds float32 weights (training keeps float32
master weights; encoding computes in the documented autocast dtype). The export's dtype is ``--save-dtype``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from pretrain.logging_utils import read_metrics

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


def _pretrain(model: str, out: Path, cache: Path, corpus: Path, **kw):
    from pretrain.cli import pretrain
    from pretrain.arguments import objective_config

    return pretrain(objective_config(objective="cpdae", model=model, corpus=str(corpus), output=str(out),
                                   cache_dir=str(cache), batch_size=4, max_length=32, max_steps=3, save_steps=3,
                                   logging_steps=1, learning_rate=1e-3, report_to="csv", **kw))


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(f"{' '.join(TEXTS)} number {i} of many similar lines." for i in range(24)) + "\n")
    return path


def test_pre_training_from_a_bf16_checkpoint_trains_in_float32(tmp_path, bf16_and_fp32, corpus):
    bf16, fp32 = bf16_and_fp32
    for name, start in (("bf16", bf16), ("fp32", fp32)):
        _pretrain(start, tmp_path / name, tmp_path / "cache", corpus)
    rows = {n: read_metrics(str(tmp_path / n / "logs" / "metrics.csv")) for n in ("bf16", "fp32")}
    assert [(r["step"], r["loss"], r["mlm"], r["rec"]) for r in rows["bf16"]] == \
        [(r["step"], r["loss"], r["mlm"], r["rec"]) for r in rows["fp32"]]
    ckpt = tmp_path / "bf16" / "checkpoints" / "checkpoint-3" / "model.safetensors"
    assert dtypes(ckpt) == {"F32"}
    assert dtypes(tmp_path / "bf16" / "model.safetensors") == {"F32"}
    a, b = tensors(tmp_path / "bf16" / "model.safetensors"), tensors(tmp_path / "fp32" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pre_training_from_a_bf16_config_builds_float32_weights(bf16_and_fp32):
    from pretrain.model.modeling import load_mlm_model

    model = load_mlm_model(bf16_and_fp32[0], from_config=bf16_and_fp32[0])
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_the_trainer_keeps_float32_master_weights(tmp_path, caplog):
    from _train_worker import RegressionData, TinyRegressor, collate
    from pretrain.arguments import TrainConfig
    from pretrain.training.trainer import Trainer

    module = TinyRegressor().to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="pretrain.training.trainer"):
        Trainer(module, RegressionData(16), collate, TrainConfig(output=str(tmp_path / "r"), batch_size=8, max_steps=1,
                                                                    warmup_ratio=0))
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert "holds bfloat16 parameters: training keeps float32 master weights" in caplog.text
    with pytest.raises(ValueError, match="--save-dtype must be one of float32, bfloat16, float16, got 'fp8'"):
        Trainer(TinyRegressor(), RegressionData(16), collate,
                TrainConfig(output=str(tmp_path / "s"), batch_size=8, max_steps=1, save_dtype="fp8"))


def test_the_export_dtype_is_chosen_and_recorded(tmp_path, tiny_bert_dir, corpus):
    from pyterrier_cpdae import CPDAE
    from pretrain.model.modeling import CPDAEDecoder

    out = tmp_path / "run"
    _pretrain(tiny_bert_dir, out, tmp_path / "cache", corpus, save_dtype="bfloat16")
    assert dtypes(out / "model.safetensors") == {"BF16"} and dtypes(out / "decoder" / "model.safetensors") == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    run = json.loads((out / "run_config.json").read_text())
    assert run["config"]["save_dtype"] == "bfloat16" and run["trainer"]["save_dtype"] == "bfloat16"
    # the checkpoint keeps the float32 master weights; the export is their rounding
    master = tensors(out / "checkpoints" / "checkpoint-3" / "model.safetensors")
    assert {t.dtype for t in master.values()} == {torch.float32}
    exported = tensors(out / "model.safetensors")
    for k, t in exported.items():
        if k.startswith("bert.pooler."):  # carried from the base into the export, not trained (test_export_weights.py)
            continue
        assert torch.equal(t, master["mlm_model." + k].to(torch.bfloat16)), k
    # loaded back for encoding or as a decoder: float32 weights
    assert {p.dtype for p in CPDAE.from_pretrained(str(out), device="cpu").model.parameters()} == {torch.float32}
    assert {p.dtype for p in CPDAEDecoder.from_pretrained(str(out)).parameters()} == {torch.float32}
