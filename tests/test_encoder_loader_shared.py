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
def finetuned_dir(tmp_path_factory, tiny_bert_dir) -> str:
    """A model exported by a 2-step ``python -m pretrain finetune`` run (mean pooling, query/doc lengths 16/24)."""
    from pretrain.finetune.train import main

    tmp = tmp_path_factory.mktemp("loader-finetune")
    words = "retrieval dense encoder corpus query document ranking vector token decoder masked passage".split()
    texts = {f"d{i}": " ".join(words[i:] + words[:i]) for i in range(10)}
    with open(tmp / "groups.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"qid": f"q{i}", "query": f"{words[i]} {words[i + 1]}",
                                "pos": [{"docno": f"d{i}", "text": texts[f"d{i}"]}],
                                "negs": [{"docno": f"d{j}", "text": texts[f"d{j}"]} for j in (i + 1, i + 2)]}) + "\n")
    out = tmp / "ft"
    main(["--model", tiny_bert_dir, "--train", f"groups:{tmp / 'groups.jsonl'}", "--output", str(out),
          "--batch-size", "4", "--max-steps", "2", "--num-negatives", "2", "--query-max-length", "16",
          "--doc-max-length", "24", "--learning-rate", "1e-3", "--pooling", "mean", "--cpu"])
    return str(out)


def _training_vectors(model_dir: str, pooling: str, mixed_precision: str):
    """The query and passage vectors inside ``BiEncoder.forward`` as the fine-tuning Trainer runs it: the module
    prepared by ``accelerate`` with the Trainer's resolved mixed precision (dropout off, so that they are defined)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from pretrain.finetune.biencoder import BiEncoder
    from pretrain.training.optim import resolve_mixed_precision

    bi = BiEncoder.from_pretrained(model_dir, pooling=pooling, query_max_length=16, doc_max_length=24)
    seen = []
    encode = bi.encode

    def spy(input_ids, attention_mask):
        seen.append(encode(input_ids, attention_mask))
        return seen[-1]
    bi.encode = spy
    AcceleratorState._reset_state(True)
    try:
        acc = Accelerator(mixed_precision=resolve_mixed_precision(mixed_precision, cpu=True), cpu=True)
        model = acc.prepare(bi)
        model.eval()
        batch = bi.collate([(QUERIES[0], PASSAGES[:3]), (QUERIES[1], PASSAGES[3:])])
        with torch.no_grad():
            model(batch)
    finally:
        AcceleratorState._reset_state(True)
    q, p = seen
    assert q.dtype == p.dtype == torch.float32
    return q.numpy(), p.numpy()


@pytest.mark.parametrize("mixed_precision", ["auto", "bf16"])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_finetune_forward_vectors_equal_cpdae_vectors(finetuned_dir, pooling, mixed_precision):
    q_train, p_train = _training_vectors(finetuned_dir, pooling, mixed_precision)
    # inference: the directory's stored lengths; the automatic dtype (float32 on the CPU, as "auto" training) or bf16
    enc = CPDAE.from_pretrained(finetuned_dir, pooling=pooling, batch_size=64,
                                dtype=None if mixed_precision == "auto" else "bf16")
    assert (enc.query_max_length, enc.doc_max_length) == (16, 24)
    q, p = enc.encode_queries(QUERIES), enc.encode_docs(PASSAGES)
    atol = 1e-5 if mixed_precision == "auto" else BF16_ATOL
    np.testing.assert_allclose(q, q_train, rtol=0, atol=atol)
    np.testing.assert_allclose(p, p_train, rtol=0, atol=atol)
    if mixed_precision == "bf16":  # autocast really ran on both sides: their float32 vectors are farther than atol
        p32 = CPDAE.from_pretrained(finetuned_dir, pooling=pooling, batch_size=64, dtype="float32").encode_docs(PASSAGES)
        assert np.abs(p32 - p).max() > 10 * atol and np.abs(p32 - p_train).max() > 10 * atol


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


def test_training_and_inference_load_the_same_encoder(pooler_dir, tiny_bert_dir):
    """Regression: BiEncoder always dropped the pooler while CPDAE kept it when the checkpoint had one."""
    from safetensors import safe_open

    from pretrain.finetune.biencoder import BiEncoder

    with safe_open(f"{pooler_dir}/model.safetensors", framework="pt") as f:
        assert any(k.startswith("pooler.") for k in f.keys())
    for path in (pooler_dir, tiny_bert_dir):  # with pooler weights; an MLM checkpoint without
        train = BiEncoder.from_pretrained(path).encoder
        infer = CPDAE.from_pretrained(path).model
        assert type(train) is type(infer) and type(train).__name__ == "BertModel"
        assert train.pooler is None and infer.pooler is None
        a, b = train.state_dict(), infer.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_training_loader_refuses_what_inference_refuses(tiny_bert_dir, tmp_path):
    """BiEncoder.from_pretrained names a missing config.json and missing tokenizer files, as CPDAE does."""
    import shutil

    from pretrain.finetune.biencoder import BiEncoder

    with pytest.raises(OSError, match=r"config\.json does not exist"):
        BiEncoder.from_pretrained(str(tmp_path))
    no_tok = tmp_path / "no-tok"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{tiny_bert_dir}/{name}", no_tok / name)
    with pytest.raises(OSError, match="holds no tokenizer files"):
        BiEncoder.from_pretrained(str(no_tok))


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
