"""The encoder's one digest (``encoder/identity.py``): the weights' digest recomputed independently with hashlib over
the tensors of the weights file and over the file's bytes; the producer record's fields derived from it; the
producer check refusing another encoder and accepting the same one, also against records written before the fields
came from the one digest."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import warnings

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from pyterrier_cpdae import CPDAE
from pyterrier_cpdae._producers import check_query_producer, same_document_producer
from pyterrier_cpdae.encoder import identity
from pyterrier_cpdae.encoder.loading import load_encoder, load_tokenizer
from tests.helpers.producers import enc as _enc


def reference_weights_sha256(folder: str) -> str:
    """SHA-256 over the tensors of a BertModel's weights file, read with safetensors (not through torch.nn): the
    floating tensors but the pooler's, by name, each ``"<name> <shape>\\n"`` and its float32 bytes."""
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        if name.startswith("pooler.") or not np.issubdtype(t.dtype, np.floating):
            continue
        h.update(f"{name} {tuple(t.shape)}\n".encode())
        h.update(np.ascontiguousarray(t, dtype="<f4").tobytes())
    return h.hexdigest()


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_the_weights_digest_is_sha256_over_the_tensors(two_encoders):
    a, b = two_encoders
    model = load_encoder(a)
    ref = reference_weights_sha256(a)
    assert identity.weights_sha256(model) == ref
    assert identity.content_digest(model) == ref[:16]
    # a copy of the module holds the same tensors: the same digest
    assert identity.weights_sha256(copy.deepcopy(model)) == ref
    assert identity.weights_sha256(load_encoder(b)) == reference_weights_sha256(b) != ref


def test_the_files_digest_is_sha256_of_the_files(two_encoders, tmp_path):
    a = two_encoders[0]
    assert identity.files_sha256(a) == file_sha256(os.path.join(a, "model.safetensors"))
    assert identity.files_sha256(str(tmp_path)) is None and identity.files_sha256("org/hub-name") is None
    # a sharded folder: its index file, then its shards in name order
    model = load_encoder(a)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    index = sharded / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) > 1
    h = hashlib.sha256(index.read_bytes())
    for s in shards:
        h.update((sharded / s).read_bytes())
    assert identity.files_sha256(str(sharded)) == h.hexdigest()
    # the model card's digest is the same function
    from pretrain.export.record import weights_sha256
    assert weights_sha256(a) == identity.files_sha256(a) and weights_sha256(str(sharded)) == h.hexdigest()


def test_the_record_and_the_identity_come_from_the_one_digest(two_encoders):
    a = two_encoders[0]
    ref, files = reference_weights_sha256(a), file_sha256(os.path.join(a, "model.safetensors"))
    enc = _enc(a)
    assert enc.identity() == identity.encoder_digest(ref, enc.vector_options())
    rec = enc.producer()
    assert rec == {"encoder": "CPDAE", "model": a, "weights_sha256": files[:16], "pooling": "cls",
                   "normalize": False, "max_length": 32, "dtype": "float32", "dim": 16, "weights_content": ref[:16]}
    # in memory: no files, so both fields are the weights' digest
    memory = CPDAE(load_encoder(a), load_tokenizer(a), device="cpu", dtype="float32", doc_max_length=32)
    assert memory.identity() == enc.identity()
    assert memory.producer()["weights_sha256"] == memory.producer()["weights_content"] == ref[:16]
    # an edit in memory: the weights are no longer the files', the record names the new weights' digest
    with torch.no_grad():
        enc.model.embeddings.word_embeddings.weight[3] += 1
    edited = enc.producer()
    new = identity.weights_sha256(copy.deepcopy(enc.model))
    assert new != ref and edited["weights_sha256"] == edited["weights_content"] == new[:16]
    assert enc.identity() == identity.encoder_digest(new, enc.vector_options())


def test_the_producer_check_refuses_another_encoder_and_accepts_the_same(two_encoders, tmp_path):
    a, b = two_encoders
    rec_a, rec_b = _enc(a).producer(), _enc(b).producer()
    with pytest.raises(ValueError, match="weights_content"):
        check_query_producer(tmp_path, rec_a, rec_b)
    assert not same_document_producer(rec_a, rec_b)
    # the same weights from another folder, and in memory: one producer
    copy_dir = tmp_path / "copy"
    shutil.copytree(a, copy_dir)
    memory = CPDAE(load_encoder(a), load_tokenizer(a), device="cpu", dtype="float32", doc_max_length=32).producer()
    for same in (_enc(str(copy_dir)).producer(), memory):
        check_query_producer(tmp_path, rec_a, same)
        assert same_document_producer(rec_a, same)


def test_records_written_before_the_one_digest_are_still_compared(two_encoders, tmp_path):
    """An index recorded the files' digest as ``weights_sha256`` (an in-memory model's: its state dict's) beside
    ``weights_content``, or, older, ``weights_sha256`` alone: the same encoder is accepted, another refused."""
    a, b = two_encoders
    enc_a, enc_b = _enc(a), _enc(b)
    files_a = file_sha256(os.path.join(a, "model.safetensors"))[:16]
    both = dict(enc_a.producer(), weights_sha256=files_a)
    memory_era = dict(enc_a.producer(), weights_sha256="0123456789abcdef")  # a state dict's digest
    files_only = {k: v for k, v in both.items() if k != "weights_content"}
    for old in (both, memory_era, files_only):
        check_query_producer(tmp_path, old, enc_a.producer())
        assert same_document_producer(old, enc_a.producer())
        with pytest.raises(ValueError, match="cannot search"):
            check_query_producer(tmp_path, old, enc_b.producer())
        assert not same_document_producer(old, enc_b.producer())


def test_the_older_digest_functions_warn_and_keep_their_values(two_encoders):
    from pyterrier_cpdae.encoder.loading import weights_digest

    a = two_encoders[0]
    model = load_encoder(a)
    ref = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        ref.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        ref.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    with pytest.warns(DeprecationWarning, match="weights_sha256"):
        assert identity.legacy_digest(model) == ref.hexdigest()[:16]
    with pytest.warns(DeprecationWarning, match="weights_digest is deprecated"):
        assert weights_digest(path=a) == file_sha256(os.path.join(a, "model.safetensors"))[:16]
    with pytest.warns(DeprecationWarning):
        assert weights_digest(model) == ref.hexdigest()[:16]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        identity.weights_sha256(model), identity.files_sha256(a)  # the one digest does not warn
