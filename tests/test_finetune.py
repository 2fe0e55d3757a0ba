"""End-to-end ``python -m pretrain finetune`` runs on a tiny synthetic BEIR collection."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from _warm_python import torchrun, warm_python

from pretrain.finetune import negatives as neg
from pretrain.config import FinetuneConfig, parse_config
from pretrain.finetune.train import load_training_data, main

REPO = Path(__file__).resolve().parents[1]
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


def _write_groups(path, negatives) -> str:
    """A groups file for q0..q15 (positive ``d<i>``, negatives ``negatives(i)``); returns its path."""
    neg.write_groups(str(path), [neg.Group(f"q{i}", "ignored", [f"d{i}"], negatives(i)) for i in range(16)])
    return str(path)


def _args(model, train, out, *extra):
    return ["--model", model, "--train", train, "--output", str(out), "--batch-size", "4", "--max-steps", "2",
            "--num-negatives", "2", "--negatives-depth", "10", "--query-max-length", "16", "--doc-max-length", "24",
            "--learning-rate", "1e-3", "--logging-steps", "1", "--cpu", *extra]


def _weights(path):
    from safetensors.numpy import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def test_max_train_queries_sampling_is_reproducible(tmp_path):
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
    import pyterrier_cpdae.encoder.cpdae as encoder_mod
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
    spec = _write_beir(tmp_path / "beir")
    groups_file = _write_groups(tmp_path / "negs.jsonl", lambda i: [f"d{(i + 1) % 40}", f"d{i + 20}"])
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
    # the defaults share the paper's numbers (lr 5e-6, 64 queries per batch, 1 positive + 7 negatives, [CLS])
    # but not its loss or schedule (listwise, rounds restart from --model); --preset paper is the paper's recipe
    cfg = parse_config(FinetuneConfig, [])
    assert (cfg.learning_rate, cfg.batch_size, cfg.num_negatives, cfg.pooling, cfg.loss, cfg.round_init) == \
        (5e-6, 64, 7, "cls", "listwise", "base")


@pytest.mark.multiproc
def test_irds_triples_small_docpairs_are_read_from_a_fixture_cache(tmp_path, tiny_bert_dir):
    """``--negatives file:irds:msmarco-passage/train/triples-small`` offline, from a temp IR_DATASETS_HOME."""
    base = tmp_path / "irds" / "msmarco-passage"
    (base / "train").mkdir(parents=True)
    (base / "irds_version.txt").write_text("v2")  # exactly, or the migrator deletes collection.tsv
    (base / "collection.tsv").write_text("".join(f"{i}\t{' '.join(random.Random(i).sample(WORDS, 5))}\n"
                                                 for i in range(30)))
    (base / "train" / "queries.tsv").write_text("".join(f"{100 + i}\t{WORDS[i]} {WORDS[i + 1]}\n" for i in range(9)))
    # qid 108 has no judged positive: it is skipped, and so are its docpairs
    (base / "train" / "qrels").write_text("".join(f"{100 + i} 0 {i} 1\n" for i in range(8)))
    triples = [(100 + i, i, (i + k) % 30) for k in (10, 11, 12, 13) for i in range(9)]
    triples += [(100, 0, 10), (101, 1, 1), (102, 2, 0)]   # a repeated pair, a negative that is the positive
    (base / "train" / "small.triples.qidpid.tsv").write_text("".join(f"{q}\t{a}\t{b}\n" for q, a, b in triples))
    out = tmp_path / "ft"
    args = _args(tiny_bert_dir, "irds:msmarco-passage/train", out, "--negatives",
                 "file:irds:msmarco-passage/train/triples-small", "--negatives-depth", "3")
    code = f"""
        import socket
        def no_network(*args, **kwargs):
            raise RuntimeError("network access attempted")
        socket.socket.connect = no_network
        from pretrain.finetune.train import main
        main({args!r})
    """
    run = subprocess.run([warm_python(), "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "IR_DATASETS_HOME": str(tmp_path / "irds")}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    groups, _ = neg.read_groups(str(out / "groups" / "round-0.jsonl"))
    # by hand: the first 3 distinct negatives of each query's docpairs (in file order), minus its positive
    expected = {str(100 + i): [str((i + k) % 30) for k in (10, 11, 12)] for i in range(8)}
    assert {g.qid: g.negs for g in groups} == expected
    assert all(g.pos == [str(int(g.qid) - 100)] for g in groups)
    assert "skipped 1 of 9 training queries without a judged positive" in (out / "finetune.log").read_text()
    assert (base / "collection.tsv").exists() and (out / "config.json").exists()


def test_model_negatives_equal_a_naive_dense_ranking(tmp_path, tiny_bert_dir):
    """``--negatives model:<dir>``: the pools are the checkpoint's exact dense top-k minus the positive."""
    import pyterrier_cpdae.encoder.cpdae as encoder_mod
    spec = _write_beir(tmp_path / "beir")
    groups_file = _write_groups(tmp_path / "negs.jsonl", lambda i: [f"d{i + 20}"])
    first = tmp_path / "first"
    main(_args(tiny_bert_dir, spec, first, "--negatives", f"file:{groups_file}", "--pooling", "mean"))
    out = tmp_path / "ft"
    main(_args(tiny_bert_dir, spec, out, "--negatives", f"model:{first}", "--negatives-depth", "5"))
    # reference: encode everything with the first model (mean pooling, read from its training_args) and rank
    enc = encoder_mod.CPDAE.from_pretrained(str(first), pooling="mean", query_max_length=16, doc_max_length=24)
    docs = [json.loads(line) for line in open(tmp_path / "beir" / "corpus.jsonl")]
    queries = [json.loads(line) for line in open(tmp_path / "beir" / "queries.jsonl")]
    d = np.asarray(enc.encode_docs([f"{x['title']} {x['text']}" for x in docs]))
    q = np.asarray(enc.encode_queries([x["text"] for x in queries]))
    groups = {g.qid: g.negs for g in neg.read_groups(str(out / "groups" / "round-0.jsonl"))[0]}
    for i, row in enumerate(q @ d.T):
        ranked = [docs[j]["_id"] for j in np.argsort(-row, kind="stable")[:5]]
        assert groups[f"q{i}"] == [x for x in ranked if x != f"d{i}"]


def _low_resource_module():
    spec = importlib.util.spec_from_file_location("low_resource", REPO / "experiments" / "studies" / "low_resource.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_low_resource_grid_averages_over_seeds():
    import pandas as pd
    rows = [{"N": 0, "seed": "-", "nDCG@10": 0.5, "R@100": 0.9},
            {"N": 50, "seed": 1, "nDCG@10": 0.6, "R@100": 0.8},
            {"N": 50, "seed": 2, "nDCG@10": 0.7, "R@100": 1.0},
            {"N": 100, "seed": 1, "nDCG@10": 0.4, "R@100": 0.7},
            {"N": 100, "seed": 2, "nDCG@10": 0.5, "R@100": 0.7},
            {"N": 100, "seed": 3, "nDCG@10": 0.9, "R@100": 1.0}]
    table = _low_resource_module().average_over_seeds(pd.DataFrame(rows)).set_index("N")
    assert table.loc[50, "runs"] == 2 and table.loc[100, "runs"] == 3 and table.loc[0, "runs"] == 1
    assert table.loc[50, "nDCG@10 mean"] == pytest.approx(0.65)
    assert table.loc[100, "nDCG@10 mean"] == pytest.approx(0.6)
    assert table.loc[100, "R@100 mean"] == pytest.approx(0.8)
    assert table.loc[100, "nDCG@10 std"] == pytest.approx(0.264575, abs=1e-4)   # sample std of .4, .5, .9
    assert table.loc[0, "nDCG@10 mean"] == 0.5


@pytest.mark.multiproc
def test_finetune_under_torchrun_two_gloo_processes(tmp_path, tiny_bert_dir):
    """Rank 0 prepares the output and mines (a single dense index), both ranks train each round together."""
    import socket

    spec = _write_beir(tmp_path / "beir")
    groups_file = _write_groups(tmp_path / "negs.jsonl", lambda i: [f"d{i + 20}", f"d{(i + 1) % 40}"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ft"
    cmd = torchrun(["--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port)],
                   ["-m", "pretrain", "finetune",
                    *_args(tiny_bert_dir, spec, out, "--negatives", f"file:{groups_file}", "--mining-rounds", "1")])
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for r in (0, 1):
        trainer = json.loads((out / "rounds" / f"round-{r}" / "run_config.json").read_text())["trainer"]
        assert trainer["world_size"] == 2 and trainer["micro_batch_size"] == 2
    r1, _ = neg.read_groups(str(out / "groups" / "round-1.jsonl"))
    # mined over the whole corpus by rank 0 alone (not over a torchrun shard of it)
    assert len(r1) == 16 and all(len(g.negs) in (9, 10) and g.pos[0] not in g.negs for g in r1)
    mined = {int(d[1:]) for g in r1 for d in g.negs}
    assert {i % 2 for i in mined} == {0, 1}          # torchrun shard 0 alone would hold the even records only
    assert json.loads((out / "training_args.json").read_text())["finished"]
    assert (out / "config.json").exists() and not (out / "dense_index").exists()
