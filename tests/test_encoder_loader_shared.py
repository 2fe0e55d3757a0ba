"""One encoder loader and one autocast choice for training and inference: fine-tuning's
``BiEncoder`` loads with ``CPDAE``'s loader (:mod:`pyterrier_cpdae.encoder.loading`), and the vectors the fine-tuning loss
sees equal the vectors ``CPDAE`` indexes, in float32 and under bf16 autocast, for [CLS] and mean pooling.

(``tests/test_st_export.py::test_training_vectors_equal_inference_vectors`` checks ``BiEncoder.encode`` under a bare
``torch.autocast``; here the vectors are taken inside the forward of the module as ``accelerate`` prepares it for the
fine-tuning Trainer, with the mixed precision the Trainer resolves.)"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pyterrier_cpdae import CPDAE

QUERIES = ["dense retrieval", "a query about the masked passage text and its decoder reconstruction objective"]
PASSAGES = ["dense retrieval with a pre-trained encoder", "a", "the decoder reconstructs the masked passage text",
            "bag of words", "query", "an autoencoder for dense passage retrieval pre-training on a corpus"]
#: Tolerance under bf16 autocast. Both sides run the same bf16 kernels on the same padded batch (CPDAE's batch of
#: 64 holds every text, padded to the longest, as BiEncoder.collate pads), so they agree to float32 rounding: measured
#: bit-identical on the tiny model, whose bf16 vectors differ from its float32 ones by ~2e-4 (max abs, |v| <= 2.9).
#: A bf16-rounding-sized bound (2^-7) would not notice one side running in float32.
BF16_ATOL = 1e-5


@pytest.fixture(scope="module")
def pooler_dir(tmp_path_factory, tiny_bert_dir) -> str:
    """A plain ``BertModel`` checkpoint *with* trained pooler weights (as bert-base-uncased has)."""
    from transformers import AutoTokenizer, BertModel

    torch.manual_seed(0)
    out = str(tmp_path_factory.mktemp("with-pooler") / "m")
    model = BertModel.from_pretrained(tiny_bert_dir, add_pooling_layer=True)
    with torch.no_grad():
        model.pooler.dense.weight.normal_()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize("cuda, bf16", [(False, False), (True, True), (True, False)])
def test_trainer_and_encoder_choose_the_same_autocast(monkeypatch, cuda, bf16):
    from pretrain.training.optim import resolve_mixed_precision
    from pyterrier_cpdae.encoder import DTYPE_ENV, default_dtype

    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    expected = {(False, False): ("no", torch.float32), (True, True): ("bf16", torch.bfloat16),
                (True, False): ("fp16", torch.float16)}[(cuda, bf16)]
    assert (resolve_mixed_precision("auto"), default_dtype("cuda" if cuda else "cpu")) == expected
    assert resolve_mixed_precision("auto", cpu=True) == "no"
