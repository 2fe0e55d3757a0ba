"""Exported encoders describe themselves: sentence-transformers, pyterrier-dr and ``CPDAE.from_pretrained`` read a
``python -m pretrain`` / ``finetune`` output identically; training and inference share one pooling function."""
from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

from pyterrier_cpdae import CPDAE
from pyterrier_cpdae.encoder.pooling import pool

TEXTS = ["dense retrieval with a pre-trained encoder", "a", "the decoder reconstructs the masked passage text",
         "bag of words", "query", "an autoencoder for dense passage retrieval pre-training on a corpus"]
WORDS = "retrieval dense encoder corpus query document ranking vector token decoder masked passage".split()


def _corpus(path) -> str:
    import random
    rng = random.Random(0)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(20)) + "." for _ in range(40)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory, tiny_bert_dir) -> str:
    """A [CLS] encoder exported by a 2-step ``python -m pretrain`` CPDAE run (max length 32)."""
    from pretrain import cli

    tmp = tmp_path_factory.mktemp("st-pretrain")
    out = tmp / "out"
    cli.main(["--objective", "cpdae", "--model", tiny_bert_dir, "--corpus", _corpus(tmp / "docs.txt"),
              "--output_dir", str(out), "--cache-dir", str(tmp / "cache"), "--global_batch_size", "4", "--max-length", "32",
              "--max-steps", "2", "--save-steps", "1000", "--learning-rate", "1e-3"])
    return str(out)


@pytest.fixture(scope="module")
def finetuned_dir(tmp_path_factory, tiny_bert_dir) -> str:
    """A mean-pooled encoder exported by a 2-step ``python -m pretrain finetune`` run."""
    from pretrain.finetune import negatives as neg
    from pretrain.finetune.train import main

    tmp = tmp_path_factory.mktemp("st-finetune")
    groups = [neg.Group(f"q{i}", f"{WORDS[i]} {WORDS[i + 1]}", [f"d{i}"], [f"d{i + 1}", f"d{i + 2}"])
              for i in range(8)]
    texts = {f"d{i}": " ".join(WORDS[i % len(WORDS):] + WORDS[:i % len(WORDS)]) for i in range(10)}
    with open(tmp / "groups.jsonl", "w") as f:
        for g in groups:
            f.write(json.dumps({"qid": g.qid, "query": g.query,
                                "pos": [{"docno": d, "text": texts[d]} for d in g.pos],
                                "negs": [{"docno": d, "text": texts[d]} for d in g.negs]}) + "\n")
    out = tmp / "ft"
    main(["--model", tiny_bert_dir, "--train", f"groups:{tmp / 'groups.jsonl'}", "--output_dir", str(out),
          "--per_device_train_batch_size", "4", "--max_steps", "2", "--num_negatives", "2", "--max_seq_length", "24",
          "--learning_rate", "1e-3", "--pooling", "mean"])
    return str(out)


@pytest.fixture(scope="module")
def normalized_dir(tmp_path_factory, tiny_bert_dir) -> str:
    """A mean-pooled, L2-normalised encoder: the tiny BERT with the sentence-transformers files an export writes."""
    from pyterrier_cpdae.encoder.st_export import write_st_config

    out = str(tmp_path_factory.mktemp("st-normalized") / "model")
    shutil.copytree(tiny_bert_dir, out)
    write_st_config(out, pooling="mean", normalize=True, max_seq_length=48, hidden_size=32)
    return out


def _st_encode(path: str) -> np.ndarray:
    import sentence_transformers as st  # the test extra installs it
    return st.SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_numpy=True, batch_size=4)


def _naive(path: str, pooling: str, normalize: bool, max_length: int) -> np.ndarray:
    """The vectors by hand: one text at a time through AutoModel, pooled as the paper/definition says."""
    from transformers import AutoModel, AutoTokenizer
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    rows = []
    with torch.no_grad():
        for t in TEXTS:
            enc = tok(t, truncation=True, max_length=max_length, return_tensors="pt")
            h = model(**enc).last_hidden_state[0]
            v = h[0] if pooling == "cls" else h.mean(0)
            rows.append((v / v.norm() if normalize else v).numpy())
    return np.stack(rows)


def test_pretrain_export_is_a_cls_model_for_every_loader(pretrained_dir):
    modules = json.load(open(os.path.join(pretrained_dir, "modules.json")))
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling"]
    pooling = json.load(open(os.path.join(pretrained_dir, "1_Pooling", "config.json")))
    assert pooling["pooling_mode_cls_token"] and not pooling["pooling_mode_mean_tokens"]
    assert json.load(open(os.path.join(pretrained_dir, "sentence_bert_config.json")))["max_seq_length"] == 32
    enc = CPDAE.from_pretrained(pretrained_dir, dtype="float32")
    assert (enc.pooling, enc.normalize, enc.doc_max_length, enc.query_max_length) == ("cls", False, 32, 32)
    ours = enc.encode_docs(TEXTS)
    np.testing.assert_allclose(ours, _naive(pretrained_dir, "cls", False, 32), atol=1e-5)
    np.testing.assert_allclose(_st_encode(pretrained_dir), ours, atol=1e-5)


def test_pyterrier_dr_agrees_on_the_cls_model(pretrained_dir):
    import pyterrier_dr  # the test extra installs it
    hgf = pyterrier_dr.HgfBiEncoder.from_pretrained(pretrained_dir, device="cpu")
    ours = CPDAE.from_pretrained(pretrained_dir, dtype="float32").encode_docs(TEXTS)
    np.testing.assert_allclose(hgf.encode_docs(TEXTS), ours, atol=1e-5)


def test_finetuned_mean_model_loads_unchanged_in_sentence_transformers(finetuned_dir):
    enc = CPDAE.from_pretrained(finetuned_dir, dtype="float32")
    assert (enc.pooling, enc.normalize, enc.doc_max_length) == ("mean", False, 24)
    ours = enc.encode_docs(TEXTS)
    np.testing.assert_allclose(ours, _naive(finetuned_dir, "mean", False, 24), atol=1e-5)
    np.testing.assert_allclose(_st_encode(finetuned_dir), ours, atol=1e-5)


def test_mean_normalised_export_agrees_with_sentence_transformers(normalized_dir):
    modules = json.load(open(os.path.join(normalized_dir, "modules.json")))
    assert modules[-1]["type"] == "sentence_transformers.models.Normalize"
    enc = CPDAE.from_pretrained(normalized_dir, dtype="float32")
    assert (enc.pooling, enc.normalize, enc.doc_max_length) == ("mean", True, 48)
    ours = enc.encode_docs(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, _naive(normalized_dir, "mean", True, 48), atol=1e-5)
    np.testing.assert_allclose(_st_encode(normalized_dir), ours, atol=1e-5)


def test_explicit_arguments_win_with_a_warning(normalized_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="pyterrier_cpdae.encoder"):
        enc = CPDAE.from_pretrained(normalized_dir, pooling="cls", normalize=True, doc_max_length=16)
    assert (enc.pooling, enc.normalize, enc.doc_max_length) == ("cls", True, 16)
    text = caplog.text
    assert "pooling='cls' overrides 'mean'" in text and "doc_max_length=16 overrides 48" in text
    assert "normalize=" not in text  # agrees with the stored value: no warning


def test_plain_dirs_keep_defaults(tiny_bert_dir):
    plain = CPDAE.from_pretrained(tiny_bert_dir)
    assert (plain.pooling, plain.normalize, plain.query_max_length, plain.doc_max_length) == ("cls", False, 32, 128)


def test_unsupported_sentence_transformers_pooling_is_refused(normalized_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(normalized_dir, bad)
    cfg_path = bad / "1_Pooling" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        CPDAE.from_pretrained(bad)


# ----------------------------------------------------------------------------- folders saved by sentence-transformers 6
def _st6_folder(root, tiny_bert_dir: str, pooling, normalize: bool) -> str:
    """A ``SentenceTransformer`` built from the tiny BERT (texts cut at 12 tokens) and saved by its own
    ``save_pretrained``: sentence-transformers 6's format (``"pooling_mode"``, the length in the tokenizer)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    enc = Transformer(tiny_bert_dir, max_seq_length=12)
    modules = [enc, Pooling(enc.get_embedding_dimension(), pooling_mode=pooling), *[Normalize()][:normalize]]
    out = str(root / f"st6-{pooling}-{normalize}")
    SentenceTransformer(modules=modules, device="cpu").save_pretrained(out)
    return out


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("normalize", [False, True])
def test_a_sentence_transformers_6_folder_loads_with_its_own_vectors(tiny_bert_dir, tmp_path, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    path = _st6_folder(tmp_path, tiny_bert_dir, pooling, normalize)
    assert json.load(open(os.path.join(path, "1_Pooling", "config.json")))["pooling_mode"] == pooling  # the new format
    assert "max_seq_length" not in json.load(open(os.path.join(path, "sentence_bert_config.json")))
    enc = CPDAE.from_pretrained(path, dtype="float32", batch_size=len(TEXTS))
    assert (enc.pooling, enc.normalize, enc.query_max_length, enc.doc_max_length) == (pooling, normalize, 12, 12)
    st = SentenceTransformer(path, device="cpu")
    want = st.encode(TEXTS, convert_to_numpy=True, batch_size=4)
    np.testing.assert_allclose(enc.encode_docs(TEXTS), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(enc.encode_queries(TEXTS), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(want, _naive(path, pooling, normalize, 12), atol=1e-5)  # and both cut at 12 tokens
    from pretrain.export.record import encoder_settings  # what a record states of such a folder

    got = encoder_settings(path)
    assert (got["pooling"], got["normalize"], got["max_seq_length"], got["dimension"]) == (pooling, normalize, 12, 32)
    assert got["similarity"] == ("cosine" if normalize else st.similarity_fn_name)


@pytest.mark.parametrize("mode", ["max", ["cls", "mean"]])
def test_a_sentence_transformers_6_pooling_cpdae_lacks_is_refused(tiny_bert_dir, tmp_path, mode):
    path = _st6_folder(tmp_path, tiny_bert_dir, mode, False)
    with pytest.raises(ValueError, match="1_Pooling.config.json: CPDAE implements exactly one of"):
        CPDAE.from_pretrained(path)


# ----------------------------------------------------------------------------- one pooling function
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_training_vectors_equal_inference_vectors(finetuned_dir, pooling, tmp_path):
    """The SentenceTransformer fine-tuning builds (what the loss sees) and CPDAE.encode_docs give the same vectors."""
    from pretrain.finetune.arguments import parse_args
    from pretrain.finetune.train import build_model

    fa, _ = parse_args(["--output_dir", str(tmp_path), "--pooling", pooling, "--max_seq_length", "24"])
    model, normalize = build_model(finetuned_dir, fa)
    model.eval()
    with torch.no_grad():
        train_vecs = model.encode(TEXTS, convert_to_tensor=True)
    assert train_vecs.dtype == torch.float32 and normalize is False
    enc = CPDAE.from_pretrained(finetuned_dir, pooling=pooling, doc_max_length=24, batch_size=len(TEXTS),
                                dtype="float32")
    np.testing.assert_allclose(enc.encode_docs(TEXTS), train_vecs.numpy(), rtol=0, atol=1e-6)


def test_pool_matches_the_definition():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]], dtype=torch.bfloat16)
    mask = torch.tensor([[1, 1, 0]])
    assert pool(hidden, mask, "cls").tolist() == [[1.0, 2.0]]
    assert pool(hidden, mask, "mean").tolist() == [[2.0, 3.0]]
    assert pool(hidden, mask, "mean").dtype == torch.float32
    np.testing.assert_allclose(pool(hidden, mask, "mean", normalize=True).numpy(), [[2 / 13 ** .5, 3 / 13 ** .5]])
    with pytest.raises(ValueError, match="unknown pooling"):
        pool(hidden, mask, "max")
