"""The paper pipeline's dense indexes (``experiments/paper/retrievers.py::build_retrievers``) are keyed on everything
that changes their vectors: the model's whole content (weights in any number of shards included) and the autocast
dtype, besides the pooling, lengths, normalisation and collection that were keyed already.

It used to stamp eight named files (so a sharded model's weights were not in the key, nor tokenizer side files)
with a content hash that samples files above 1 MiB, and no dtype (an index built in float32 was searched from a
bfloat16 run). Reference: a fresh index built with the second setting in an empty folder.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from tests.helpers.tiny_sets import photon_beir


def _build(capsys, model: Path, spec: str, root: Path) -> str:
    from experiments.paper.retrievers import build_retrievers

    capsys.readouterr()
    build_retrievers({"m": (str(model), "cls")}, spec, index_root=root, normalize=False, doc_max_length=32)
    return capsys.readouterr().out


def _vectors(root: Path) -> np.ndarray:
    from pyterrier_cpdae.dense import DenseIndex

    return np.array(DenseIndex(root / "m").store.vectors(), dtype=np.float32)


def test_a_shard_of_the_weights_rewritten_in_place_rebuilds_the_index(tmp_path, capsys, tiny_bert_dir):
    from transformers import BertForMaskedLM

    model = tmp_path / "sharded"
    BertForMaskedLM.from_pretrained(tiny_bert_dir).save_pretrained(model, max_shard_size="300KB")
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(tiny_bert_dir) / name).is_file():
            shutil.copy(Path(tiny_bert_dir) / name, model / name)
    shards = sorted(model.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (model / "model.safetensors.index.json").is_file()
    spec = f"beir:{photon_beir(tmp_path / 'b')}:train"
    assert "indexed 3 docs" in _build(capsys, model, spec, tmp_path / "i")
    assert "reusing the index" in _build(capsys, model, spec, tmp_path / "i")

    from safetensors.torch import load_file, save_file

    target = next(s for s in shards if any("word_embeddings" in k for k in load_file(s)))
    tensors = load_file(target)
    key = next(k for k in tensors if "word_embeddings" in k)
    tensors[key] = tensors[key].flip(0).contiguous()  # other weights, the same size
    st = target.stat()
    save_file(tensors, target, metadata={"format": "pt"})
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = _build(capsys, model, spec, tmp_path / "i")
    assert "rebuilding the index" in out and "model's content changed" in out
    _build(capsys, model, spec, tmp_path / "fresh")
    np.testing.assert_array_equal(_vectors(tmp_path / "i"), _vectors(tmp_path / "fresh"))


def test_another_autocast_dtype_rebuilds_the_index(tmp_path, capsys, tiny_bert_dir, monkeypatch):
    spec = f"beir:{photon_beir(tmp_path / 'b')}:train"
    model = tmp_path / "m"
    shutil.copytree(tiny_bert_dir, model)
    monkeypatch.setenv("PYTERRIER_CPDAE_DTYPE", "float32")
    assert "indexed 3 docs" in _build(capsys, model, spec, tmp_path / "i")
    float32 = _vectors(tmp_path / "i")
    monkeypatch.setenv("PYTERRIER_CPDAE_DTYPE", "bfloat16")
    out = _build(capsys, model, spec, tmp_path / "i")
    assert "rebuilding the index" in out and "dtype changed" in out
    _build(capsys, model, spec, tmp_path / "fresh")
    np.testing.assert_array_equal(_vectors(tmp_path / "i"), _vectors(tmp_path / "fresh"))
    assert not np.array_equal(_vectors(tmp_path / "i"), float32)  # bfloat16 vectors differ from float32's


def test_a_card_rewritten_after_an_evaluation_keeps_the_index(tmp_path, capsys, tiny_bert_dir):
    """The model card and its state (``README.md``, ``model_card.json``) are rewritten when an evaluation is added
    (``pretrain.export.card.add_evaluation``) and never read by a loader: not part of the model's content."""
    spec = f"beir:{photon_beir(tmp_path / 'b')}:train"
    model = tmp_path / "m"
    shutil.copytree(tiny_bert_dir, model)
    (model / "README.md").write_text("# a card\n")
    assert "indexed 3 docs" in _build(capsys, model, spec, tmp_path / "i")
    (model / "README.md").write_text("# a card\n\n| nDCG@10 | 0.5 |\n")
    (model / "model_card.json").write_text("{}")
    assert "reusing the index" in _build(capsys, model, spec, tmp_path / "i")
    tokenizer = model / "tokenizer.json"
    assert '"photon":' in tokenizer.read_text()
    tokenizer.write_text(tokenizer.read_text().replace('"photon":', '"photom":'))  # "photon" now in word pieces
    assert "model's content changed" in _build(capsys, model, spec, tmp_path / "i")  # a tokenizer file is content
