"""End-to-end ``python -m pretrain finetune`` runs on a tiny synthetic BEIR collection."""
from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import pytest

from pretrain import negatives as neg
from pretrain.config import FinetuneConfig, parse_config
from pretrain.finetune import load_training_data, main

WORDS = ("apple river mountain engine planet violin castle garden doctor ocean pencil rocket winter "
         "forest bridge camera silver dragon island market").split()


def _write_beir(root, n_docs=40, n_queries=16, extra_qrels=()):
    rng = random.Random(0)
    os.makedirs(root / "qrels", exist_ok=True)
    docs = []
    with open(root / "corpus.jsonl", "w") as f:
        for i in range(n_docs):
            words = rng.sample(WORDS, 6)
            docs.append(words)
            f.write(json.dumps({"_id": f"d{i}", "title": words[0], "text": " ".join(words)}) + "\n")
    with open(root / "queries.jsonl", "w") as f:
        for i in range(n_queries):
            f.write(json.dumps({"_id": f"q{i}", "text": " ".join(docs[i][:3])}) + "\n")
    with open(root / "qrels" / "train.tsv", "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for i in range(n_queries):
            f.write(f"q{i}\td{i}\t1\n")
        for q, d, s in extra_qrels:
            f.write(f"{q}\t{d}\t{s}\n")
    return f"beir:{root}:train"


def _args(model, train, out, *extra):
    return ["--model", model, "--train", train, "--output", str(out), "--batch-size", "4", "--max-steps", "2",
            "--num-negatives", "2", "--negatives-depth", "10", "--query-max-length", "16", "--doc-max-length", "24",
            "--learning-rate", "1e-3", "--logging-steps", "1", "--cpu", *extra]


def _weights(path):
    from safetensors.numpy import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def test_max_train_queries_sampling_is_reproducible(tmp_path):
    pytest.importorskip("pyterrier_cpdae.datasets")
    spec = _write_beir(tmp_path / "beir", extra_qrels=[("q3", "d9", 0)])
    a = load_training_data(spec, max_train_queries=5, seed=1)
    b = load_training_data(spec, max_train_queries=5, seed=1)
    c = load_training_data(spec, max_train_queries=5, seed=2)
    assert a.topics["qid"].tolist() == b.topics["qid"].tolist()
    assert len(a.topics) == 5 and a.topics["qid"].tolist() != c.topics["qid"].tolist()
    all_q = load_training_data(spec).topics["qid"].tolist()
    assert sorted(all_q) == sorted(f"q{i}" for i in range(16))
    assert a.topics["qid"].tolist() == neg.sample_queries(all_q, 5, 1)
    assert a.positives == {q: [f"d{q[1:]}"] for q in a.topics["qid"]}   # label-0 qrel of q3 is not a positive


def test_finetune_bm25_end_to_end_loads_with_cpdae(tmp_path, tiny_bert_dir, caplog):
    pytest.importorskip("pyterrier_cpdae.bm25")
    encoder_mod = pytest.importorskip("pyterrier_cpdae.encoder")
    spec = _write_beir(tmp_path / "beir")
    out = tmp_path / "ft"
    with caplog.at_level(logging.INFO, logger="pretrain"):
        summary = main(_args(tiny_bert_dir, spec, out, "--negatives", "bm25"))
    assert summary["num_queries"] == 16 and summary["rounds"][0]["num_examples"] == 16
    groups, _ = neg.read_groups(str(out / "groups" / "round-0.jsonl"))
    assert [g.qid for g in groups] == sorted(f"q{i}" for i in range(16))
    corpus_ids = {f"d{i}" for i in range(40)}
    for g in groups:
        assert g.pos == [f"d{g.qid[1:]}"] and g.pos[0] not in g.negs and set(g.negs) <= corpus_ids
        assert 0 < len(g.negs) <= 10
    args = json.loads((out / "training_args.json").read_text())
    assert args["finished"] and args["config"]["pooling"] == "cls" and args["config"]["negatives"] == "bm25"
    # the encoder was trained: its weights moved away from the starting checkpoint
    before, after = _weights(tiny_bert_dir), _weights(str(out))
    key = next(k for k in after if k.endswith("encoder.layer.0.attention.self.query.weight"))
    assert not np.allclose(after[key], before["bert." + key if "bert." + key in before else key])
    model = encoder_mod.CPDAE.from_pretrained(str(out), pooling="cls")
    vecs = model.encode_queries(["apple river", "ocean planet"])
    assert vecs.shape == (2, 32) and np.isfinite(vecs).all()
    assert (out / "rounds" / "round-0" / "logs" / "metrics.csv").exists()
    # the same command again is refused; with --resume it reuses everything
    with pytest.raises(ValueError, match="--resume"):
        main(_args(tiny_bert_dir, spec, out, "--negatives", "bm25"))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pretrain"):
        main(_args(tiny_bert_dir, spec, out, "--negatives", "bm25", "--resume"))
    assert "reusing the saved groups" in caplog.text and "already trained" in caplog.text
    with pytest.raises(ValueError, match="different fine-tuning run"):
        main(_args(tiny_bert_dir, spec, out, "--negatives", "bm25", "--num-negatives", "3", "--resume"))


def test_finetune_file_negatives_and_a_dense_mining_round(tmp_path, tiny_bert_dir):
    pytest.importorskip("pyterrier_cpdae.dense_index")
    pytest.importorskip("pyterrier_cpdae.encoder")
    spec = _write_beir(tmp_path / "beir")
    groups_file = tmp_path / "negs.jsonl"
    neg.write_groups(str(groups_file), [neg.Group(f"q{i}", "ignored", [f"d{i}"], [f"d{(i + 1) % 40}", f"d{i + 20}"])
                                        for i in range(16)])
    out = tmp_path / "ft"
    summary = main(_args(tiny_bert_dir, spec, out, "--negatives", f"file:{groups_file}", "--mining-rounds", "1",
                         "--pooling", "mean", "--loss", "pairwise"))
    assert [r["round"] for r in summary["rounds"]] == [0, 1]
    r0, _ = neg.read_groups(str(out / "groups" / "round-0.jsonl"))
    assert r0[0].negs == ["d1", "d20"] and r0[0].query != "ignored"   # query text comes from the topics
    r1, _ = neg.read_groups(str(out / "groups" / "round-1.jsonl"))
    assert len(r1) == 16
    for g in r1:                        # dense top-10 minus the positive
        assert g.pos[0] not in g.negs and len(g.negs) in (9, 10) and len(set(g.negs)) == len(g.negs)
    assert (out / "rounds" / "round-1" / "config.json").exists() and (out / "config.json").exists()
    assert not (out / "dense_index").exists()


def test_groups_spec_with_inline_texts_needs_no_corpus(tmp_path, tiny_bert_dir):
    pytest.importorskip("pyterrier_cpdae.encoder")
    path = tmp_path / "groups.jsonl"
    with open(path, "w") as f:
        for i in range(8):
            f.write(json.dumps({"qid": f"q{i}", "query": f"{WORDS[i]} question",
                                "pos": [{"text": f"{WORDS[i]} answer"}],
                                "negs": [{"text": f"{w} other"} for w in WORDS[10:14]]}) + "\n")
    out = tmp_path / "ft"
    summary = main(_args(tiny_bert_dir, f"groups:{path}", out, "--max-train-queries", "4"))
    assert summary["num_queries"] == 4 and summary["rounds"][0]["num_examples"] == 4
    with pytest.raises(ValueError, match="needs a corpus"):
        main(_args(tiny_bert_dir, f"groups:{path}", tmp_path / "ft2", "--mining-rounds", "1"))


def test_bad_training_data_errors(tmp_path, tiny_bert_dir):
    pytest.importorskip("pyterrier_cpdae.datasets")
    groups_file = tmp_path / "negs.jsonl"
    neg.write_groups(str(groups_file), [neg.Group(f"q{i}", "x", [], ["d30", "d31"]) for i in range(16)])
    # qrels naming documents that are not in the corpus
    spec = _write_beir(tmp_path / "beir", extra_qrels=[("q1", "ghost-7", 1)])
    with pytest.raises(ValueError, match="not in the corpus: ghost-7"):
        main(_args(tiny_bert_dir, spec, tmp_path / "a", "--negatives", f"file:{groups_file}"))
    # no judged positive at all
    empty = tmp_path / "empty"
    _write_beir(empty)
    qrels = empty / "qrels" / "train.tsv"
    qrels.write_text(qrels.read_text().replace("\t1\n", "\t0\n"))
    with pytest.raises(ValueError, match="no training query has a judged positive"):
        main(_args(tiny_bert_dir, f"beir:{empty}:train", tmp_path / "b", "--negatives", f"file:{groups_file}"))
    # every query dropped for too few negatives
    spec = _write_beir(tmp_path / "beir2")
    with pytest.raises(ValueError, match="no training example left"):
        main(_args(tiny_bert_dir, spec, tmp_path / "c", "--negatives", f"file:{groups_file}",
                   "--num-negatives", "3", "--few-negatives", "drop"))
    with pytest.raises(ValueError, match="unknown --negatives"):
        main(_args(tiny_bert_dir, spec, tmp_path / "d", "--negatives", "colbert"))


def test_config_parses_finetune_flags():
    cfg = parse_config(FinetuneConfig, ["--train", "x", "--negatives", "model:/m", "--mining-rounds", "2",
                                        "--no-in-batch-negatives", "--max-train-queries", "100"])
    assert cfg.negatives == "model:/m" and cfg.mining_rounds == 2 and not cfg.in_batch_negatives
    assert cfg.max_train_queries == 100 and cfg.learning_rate == 5e-6 and cfg.num_negatives == 7
