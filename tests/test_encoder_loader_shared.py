"""One encoder loader and one autocast choice for training and inference: fine-tuning's
``BiEncoder`` loads with ``CPDAE``'s loader (:mod:`pyterrier_cpdae.encoder.loading`), and the vectors the fine-tuning loss
sees equal the vectors ``CPDAE`` indexes, in float32 and under bf16 autocast, for [CLS] and mean pooling.

(``tests/test_st_export.py::test_training_vectors_equal_inference_vectors`` checks ``BiEncoder.encode`` under a bare
``torch.autocast``; here the vectors are taken inside the forward of the module as ``accelerate`` prepares it for the
fine-tuning Trainer, with the mixed precision the Trainer resolves.)"""
from __future__ import annotations


import pytest
import torch

from pyterrier_cpdae import CPDAE

#: Tolerance under bf16 autocast. Both sides run the same bf16 kernels on the same padded batch (CPDAE's batch of
#: 64 holds every text, padded to the longest, as BiEncoder.collate pads), so they agree to float32 rounding: measured
#: bit-identical on the tiny model, whose bf16 vectors differ from its float32 ones by ~2e-4 (max abs, |v| <= 2.9).
#: A bf16-rounding-sized bound (2^-7) would not notice one side running in float32.
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
