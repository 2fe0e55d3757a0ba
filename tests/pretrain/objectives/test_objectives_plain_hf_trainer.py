"""An objective trains in a plain, unmodified ``transformers.Trainer`` on a ``datasets.Dataset`` of token ids
(the example of docs/pretraining.md, "In your own Trainer"), and what it saves loads."""
from __future__ import annotations

import os

import pytest
import torch

datasets = pytest.importorskip("datasets")


def _train(tiny_bert_dir, tmp_path):
    from transformers import AutoModelForMaskedLM, AutoTokenizer, Trainer, TrainingArguments

    from pretrain.data.collators import CollatorEpochCallback
    from pretrain.objectives import build_objective, objective_config
    from pyterrier_cpdae import load_dataset

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert_dir)
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_pretrained(tiny_bert_dir)
    texts = [doc["text"] for doc in load_dataset("sample").get_corpus_iter()][:24]
    train = datasets.Dataset.from_dict({"text": texts}).map(
        lambda batch, idx: {"input_ids": tokenizer(batch["text"], add_special_tokens=False, truncation=True,
                                                   max_length=62)["input_ids"], "idx": idx},
        batched=True, with_indices=True, remove_columns=["text"])
    config = objective_config("cpdae", max_length=64, batch_size=8, decoder_bias_init="zero")
    objective = build_objective("cpdae", model, tokenizer, config)
    collator = objective.data_collator(seed=0)
    fixed = collator([train[i] for i in range(8)])  # a fixed batch: the terms before and after training
    objective.eval()
    with torch.no_grad():
        before = objective(**fixed).terms
    args = TrainingArguments(str(tmp_path / "run"), per_device_train_batch_size=8, num_train_epochs=3,
                             learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                             disable_tqdm=True)
    trainer = Trainer(model=objective, args=args, train_dataset=train, data_collator=collator,
                      callbacks=[CollatorEpochCallback(collator)])
    trainer.train()
    objective.eval()
    with torch.no_grad():
        after = objective(**fixed).terms
    out = str(tmp_path / "final")
    objective.save_pretrained(out)
    return objective, trainer, collator, before, after, out


def test_cpdae_trains_in_a_plain_hf_trainer_and_its_export_loads(tiny_bert_dir, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from pretrain.model.modeling import CPDAEDecoder

    objective, trainer, collator, before, after, out = _train(tiny_bert_dir, tmp_path)
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 9  # 24 texts / 8 per step * 3 epochs, one line a step
    assert sum(logged[-3:]) < 0.8 * sum(logged[:3])  # L_REC (a sum over the vocabulary) dominates and falls fast
    assert collator.epoch == 2  # the callback moved the collator's masks to each epoch
    assert set(before) == set(after) == {"mlm", "rec", "cl"}
    assert float(after["rec"]) < 0.8 * float(before["rec"])
    assert all(torch.isfinite(v) for v in after.values())
    # the export: the encoder as a Hugging Face model, the decoder under decoder/, a sentence-transformers pipeline
    enc = AutoModel.from_pretrained(out)
    for name, p in objective.mlm_model.base_model.state_dict().items():
        assert torch.equal(enc.state_dict()[name], p), name
    dec = CPDAEDecoder.from_pretrained(os.path.join(out, "decoder"))
    for name, p in objective.decoder.state_dict().items():
        assert torch.equal(dec.state_dict()[name], p), name
    st = SentenceTransformer(out, device="cpu")
    v = st.encode(["a query about retrieval"], convert_to_tensor=True)
    assert v.shape == (1, objective.mlm_model.config.hidden_size) and bool(torch.isfinite(v).all())


def test_objective_config_holds_the_options_and_refuses_what_is_not_one():
    import dataclasses

    from pretrain.objectives import SHARED_SETTINGS, objective_class, objective_config

    cfg = objective_config("cpdae", max_length=128, cl_weight=0.5)
    fields = {f.name: f.default for f in dataclasses.fields(objective_class("cpdae").Options)}
    assert cfg.cl_weight == 0.5 and cfg.max_length == 128 and cfg.objective == "cpdae"
    assert all(getattr(cfg, k) == v for k, v in fields.items() if k != "cl_weight")
    assert all(getattr(cfg, k) == v for k, v in SHARED_SETTINGS.items() if k != "max_length")
    with pytest.raises(ValueError, match="objective 'cpdae' has no option bow_weight"):
        objective_config("cpdae", bow_weight=1.0)
    with pytest.raises(ValueError, match="objective 'cpdae': --cl_weight must be >= 0, got -1"):
        objective_config("cpdae", cl_weight=-1)
    with pytest.raises(ValueError, match="--representation must be one of auto, cls, mean"):
        objective_config("mlm", representation="max")
