"""``python -m pretrain finetune`` on sentence-transformers' trainer: the export, its records, the mining model's
pooling, the loss's scale, and the kept guarantees (resume after kill -9, locked output, non-finite loss, stale
negatives, resumed rounds)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.tiny_sets import tiny_beir
from pretrain.finetune import negatives as neg
from pretrain.finetune import train as ft
from pretrain.finetune.arguments import parse_args

ROOT = Path(__file__).resolve().parents[3]


def _argv(model, train, out, *extra):
    return ["--model", str(model), "--train", train, "--output_dir", str(out), "--num_negatives", "2",
            "--per_device_train_batch_size", "4", "--max_steps", "4", "--save_steps", "2", "--max_seq_length", "32",
            "--negatives_depth", "10", "--learning_rate", "1e-3", *extra]


def _weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(path, "model.safetensors"))


def _st_base(tmp_path, tiny_bert_dir, pooling, normalize) -> str:
    """The tiny BERT described as a sentence-transformers model (its own pooling and normalisation)."""
    import shutil

    from pyterrier_cpdae.encoder.st_export import write_st_config

    base = tmp_path / f"base-{pooling}-{int(normalize)}"
    shutil.copytree(tiny_bert_dir, base)
    write_st_config(base, pooling=pooling, normalize=normalize, max_seq_length=32, hidden_size=32)
    return str(base)


# ----------------------------------------------------------------------------- the export
def test_tiny_run_writes_a_portable_sentence_transformers_folder(tmp_path, tiny_bert_dir):
    from pyterrier_cpdae import CPDAE
    from sentence_transformers import SentenceTransformer

    data = tiny_beir(tmp_path / "beir", docs=40, queries=6)
    out = tmp_path / "run"
    record = ft.main(_argv(tiny_bert_dir, f"beir:{data}:train", out, "--negatives", "bm25"))
    assert record["finished"] and record["rounds"][0]["steps"] == 4
    card = (out / "README.md").read_text()
    assert "MultipleNegativesRankingLoss" in card and '"scale": 1.0' in card and "dot_score" in card
    assert record["rounds"][0]["scale"] == 1.0 and record["rounds"][0]["similarity"] == "dot_score"
    # no file of the run names the run's own directory (nor the tmp folder it sits in)
    for f in out.rglob("*"):
        if f.is_file():
            assert str(out).encode() not in f.read_bytes(), f
            assert str(tmp_path).encode() not in f.read_bytes(), f
    # loads identically in sentence-transformers and in the plugin
    texts = ["alpha beta doc3", "gamma delta epsilon zeta theta doc7 " * 8]
    a = SentenceTransformer(str(out), device="cpu").encode(texts)
    b = CPDAE.from_pretrained(str(out), device="cpu").encode_docs(texts)
    assert np.abs(a - b).max() < 1e-6
    # the export is round 0's model, trained away from the base
    assert not torch.equal(_weights(out)["embeddings.word_embeddings.weight"],
                           _weights(tiny_bert_dir)["bert.embeddings.word_embeddings.weight"])
    groups = neg.load_pools(str(out / "negatives" / "round-0.parquet"),
                            json.loads((out / "negatives" / "round-0.parquet.key.json").read_text()))
    assert groups and all(g.pos[0] not in g.negs for g in groups)


# ----------------------------------------------------------------------------- the model and the loss
def test_normalize_base_trains_cosine_at_scale_20(tmp_path, tiny_bert_dir):
    """A base ending in Normalize: the model keeps it and the loss is 20 x cosine; a base without: dot product at 1;
    --scale overrides. The loss value is the hand-computed softmax cross-entropy over the scaled scores."""
    from sentence_transformers.sentence_transformer.modules import Normalize

    fa, _ = parse_args(["--output_dir", str(tmp_path / "x"), "--pooling", "cls"])
    normed = _st_base(tmp_path, tiny_bert_dir, "cls", True)
    model, normalize = ft.build_model(normed, fa)
    assert normalize and isinstance(model[-1], Normalize)
    loss, rec = ft.build_loss(model, fa, normalize)
    assert (rec["scale"], rec["similarity"]) == (20.0, "cos_sim") and loss.scale == 20.0
    plain, normalize2 = ft.build_model(tiny_bert_dir, fa)
    assert not normalize2 and not isinstance(plain[-1], Normalize)
    assert ft.build_loss(plain, fa, False)[1]["scale"] == 1.0
    fa.scale = 5.0
    assert ft.build_loss(model, fa, True)[1]["scale"] == 5.0 and ft.build_loss(model, fa, True)[1]["scale_from"] == \
        "--scale"
    fa.scale = None
    # the loss value on one batch of 2 queries x (pos, 1 neg), against the equation
    q, p, n = ["alpha beta", "gamma delta"], ["alpha beta doc1", "gamma delta doc2"], ["zeta", "theta kappa"]
    feats = [model.preprocess(t) for t in (q, p, n)]
    got = loss(feats, None)
    with torch.no_grad():
        e = [torch.nn.functional.normalize(model.encode(t, convert_to_tensor=True), dim=-1) for t in (q, p, n)]
    scores = 20.0 * e[0] @ torch.cat([e[1], e[2]]).T
    want = torch.nn.functional.cross_entropy(scores, torch.arange(2))
    assert got.item() == pytest.approx(want.item(), rel=1e-4)


def test_without_in_batch_negatives_each_query_sees_its_own_group_only(tiny_bert_dir, tmp_path):
    """The paper's loss: softmax over 1 positive + its own negatives (no other query's passages)."""
    fa, _ = parse_args(["--output_dir", str(tmp_path / "x"), "--in_batch_negatives", "false", "--num_negatives", "2"])
    model, normalize = ft.build_model(tiny_bert_dir, fa)
    loss, rec = ft.build_loss(model, fa, normalize)
    assert not rec["in_batch_negatives"]
    cols = [["alpha beta", "gamma delta", "kappa"], ["alpha doc1", "delta doc2", "kappa doc3"],
            ["zeta", "theta", "beta"], ["epsilon", "alpha", "gamma"]]
    got = loss([model.preprocess(c) for c in cols], None)
    with torch.no_grad():
        e = [model.encode(c, convert_to_tensor=True) for c in cols]
    own = torch.stack([e[0][i] @ torch.stack([e[1][i], e[2][i], e[3][i]]).T for i in range(3)])
    want = torch.nn.functional.cross_entropy(own, torch.zeros(3, dtype=torch.long))
    assert got.item() == pytest.approx(want.item(), rel=1e-4)


def test_cached_loss_gives_the_same_gradients(tiny_bert_dir, tmp_path):
    fa, _ = parse_args(["--output_dir", str(tmp_path / "x")])
    cols = [["alpha beta", "gamma delta", "kappa", "zeta doc"], ["alpha doc1", "delta doc2", "kappa doc3", "zeta"],
            ["zeta", "theta", "beta", "alpha"]]
    grads = []
    for kind in ("mnrl", "cached"):
        fa.loss, fa.mini_batch_size = kind, 2
        torch.manual_seed(0)
        model, normalize = ft.build_model(tiny_bert_dir, fa)
        model.eval()  # no dropout: both see the same network
        loss, _ = ft.build_loss(model, fa, normalize)
        loss([model.preprocess(c) for c in cols], None).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert (grads[0] - grads[1]).abs().max() <= 1e-3 * grads[0].abs().max(), (grads[0] - grads[1]).abs().max()


def test_cls_training_runs_the_last_layer_at_cls_only_with_the_full_models_gradients(tiny_bert_dir, tmp_path):
    """Under [CLS] pooling the model built for training computes its last layer at [CLS] only (as CPDAE encodes): the
    loss and every gradient are the full transformers model's (float64), and the weights keep their own names."""
    fa, _ = parse_args(["--output_dir", str(tmp_path / "x"), "--pooling", "cls"])
    model, normalize = ft.build_model(tiny_bert_dir, fa)
    model.double().eval()  # no dropout: both passes see the same network
    hf, keys = model[0].model, set(model.state_dict())
    x = model.preprocess(["alpha beta gamma", "delta"])
    assert hf.forward(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).last_hidden_state.shape[1] == 1
    loss, _ = ft.build_loss(model, fa, normalize)
    cols = [["alpha beta", "gamma delta"], ["alpha doc1 zeta", "delta doc2"], ["zeta theta kappa", "beta"]]

    def loss_and_grads():
        model.zero_grad()
        value = loss([model.preprocess(c) for c in cols], None)
        value.backward()
        return value.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    trimmed = loss_and_grads()
    del hf.forward  # the transformers model's own forward: every position of the last layer
    full = loss_and_grads()
    assert trimmed[0] == pytest.approx(full[0], abs=1e-12) and trimmed[1].keys() == full[1].keys()
    assert all(torch.allclose(trimmed[1][k], full[1][k], rtol=0, atol=1e-12) for k in full[1])
    mean = ft.build_model(tiny_bert_dir, parse_args(["--output_dir", str(tmp_path / "x"), "--pooling", "mean"])[0])
    forward = vars(mean[0][0].model)["forward"]  # mean pooling: the full last layer (in length-sorted chunks)
    assert set(model.state_dict()) == keys and forward.__wrapped__.__self__ is mean[0][0].model


# ----------------------------------------------------------------------------- mining with the run's pooling
def _naive_pools(model_dir, data, pooling, depth, judged):
    """Exact ranking by a hand-written encoder: AutoModel, the asked pooling, numpy dot products."""
    from pyterrier_cpdae import load_dataset
    from transformers import AutoModel, AutoTokenizer

    ds = load_dataset(data)
    docs = list(ds.get_corpus_iter())
    model, tok = AutoModel.from_pretrained(model_dir).eval(), AutoTokenizer.from_pretrained(model_dir)

    def enc(texts, n):
        x = tok(texts, max_length=n, truncation=True, padding=True, return_tensors="pt")
        with torch.no_grad():
            h = model(**x).last_hidden_state
        m = x["attention_mask"].unsqueeze(-1).float()
        return (h[:, 0] if pooling == "cls" else (h * m).sum(1) / m.sum(1)).numpy()

    d = enc([x["text"] for x in docs], 32)
    topics = ds.get_topics()
    q = enc(topics["query"].tolist(), 32)
    pools = {}
    for qid, row in zip(topics["qid"], q @ d.T):
        ranked = [docs[i]["docno"] for i in np.argsort(-row, kind="stable")[:depth]]
        pools[qid] = [x for x in ranked if x not in judged[qid]]
    return pools


def test_dense_negatives_are_mined_with_the_asked_pooling(tmp_path, tiny_bert_dir):
    """--pooling mean on a base that declares [CLS]: the negatives are the mean-pooled model's ranking (the old stack
    mined with the base's declared pooling)."""
    base = _st_base(tmp_path, tiny_bert_dir, "cls", False)
    data = f"beir:{tiny_beir(tmp_path / 'beir', docs=30, queries=6)}:train"
    fa, ta = parse_args(_argv(base, data, tmp_path / "run", "--negatives", "model", "--pooling", "mean"))
    loaded = ft.load_training_data(fa, ta.seed)
    out = str(tmp_path / "run")
    os.makedirs(out)
    groups = ft.mine(fa, out, 0, loaded, normalize=False)
    judged = {q: set(p) for q, p in loaded["positives"].items()}
    mean = _naive_pools(base, data, "mean", 10, judged)
    cls = _naive_pools(base, data, "cls", 10, judged)
    got = {g.qid: g.negs for g in groups}
    assert got == mean
    assert got != cls


def test_judged_documents_are_never_negatives(tmp_path, tiny_bert_dir):
    data = tiny_beir(tmp_path / "beir", docs=30, queries=6)
    with open(data / "qrels" / "train.tsv", "a") as f:  # a second, lower-graded judgement and a judged-0 one
        f.write("q0\td1\t1\nq0\td2\t0\n")
    fa, ta = parse_args(_argv(tiny_bert_dir, f"beir:{data}:train", tmp_path / "run", "--negatives", "model",
                              "--pooling", "mean", "--negatives_depth", "30"))
    loaded = ft.load_training_data(fa, ta.seed)
    os.makedirs(tmp_path / "run")
    groups = {g.qid: g for g in ft.mine(fa, str(tmp_path / "run"), 0, loaded, normalize=False)}
    assert not {"d0", "d1", "d2"} & set(groups["q0"].negs) and len(groups["q0"].negs) == 27


def test_file_negatives_are_the_files_minus_the_judged_documents(tmp_path, tiny_bert_dir):
    data = tiny_beir(tmp_path / "beir", docs=30, queries=6)
    negs = tmp_path / "negs.jsonl"
    negs.write_text("".join(json.dumps({"qid": f"q{q}", "query": "x", "pos": [f"d{q * 3}"], "negs": [
        f"d{q * 3}", "d1", "d2", {"docno": "n9", "text": "inline"}]}) + "\n" for q in range(6)))
    fa, ta = parse_args(_argv(tiny_bert_dir, f"beir:{data}:train", tmp_path / "run", "--negatives", f"file:{negs}"))
    loaded = ft.load_training_data(fa, ta.seed)
    groups = ft.mine(fa, str(tmp_path / "run"), 0, loaded, normalize=False)
    assert {g.qid: g.negs for g in groups} == {f"q{q}": ["d1", "d2", "n9"] for q in range(6)}  # d<3q> is judged
    assert loaded["texts"]["n9"] == "inline"
    with pytest.raises(ValueError, match="unknown --negatives 'bm26'"):  # refused at parsing, before any reading
        parse_args(_argv(tiny_bert_dir, f"beir:{data}:train", tmp_path / "run", "--negatives", "bm26"))


# ----------------------------------------------------------------------------- kept guarantees
def _cli(argv, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "pretrain", "finetune", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_resume_after_kill_9_gives_bit_identical_weights(tmp_path, tiny_bert_dir):
    groups = tmp_path / "groups.jsonl"
    with open(groups, "w") as f:
        for i in range(24):
            f.write(json.dumps({"qid": f"q{i}", "query": f"query {i} alpha",
                                "pos": [{"text": f"passage {i} alpha beta"}],
                                "negs": [{"text": f"other {i + j} gamma"} for j in range(3)]}) + "\n")
    common = ["--model", tiny_bert_dir, "--train", f"groups:{groups}", "--num_negatives", "2",
              "--per_device_train_batch_size", "4", "--max_steps", "30", "--save_steps", "5", "--max_seq_length",
              "32", "--num_train_epochs", "10"]
    full = _cli([*common, "--output_dir", str(tmp_path / "full")])
    assert full.wait(600) == 0, full.stderr.read()[-2000:]
    cut = _cli([*common, "--output_dir", str(tmp_path / "cut")])
    ckpt = tmp_path / "cut" / "rounds" / "round-0" / "checkpoint-10"
    deadline = time.time() + 600
    while not (ckpt / "trainer_state.json").exists() and time.time() < deadline and cut.poll() is None:
        time.sleep(0.05)
    os.kill(cut.pid, signal.SIGKILL)
    cut.wait()
    assert not (tmp_path / "cut" / "model.safetensors").exists()  # killed before the end
    again = _cli([*common, "--output_dir", str(tmp_path / "cut"), "--resume"])
    assert again.wait(600) == 0, again.stderr.read()[-2000:]
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_loss_stops_with_one_line(tmp_path, tiny_bert_dir):
    data = tiny_beir(tmp_path / "beir", docs=30, queries=6)
    p = _cli(_argv(tiny_bert_dir, f"beir:{data}:train", tmp_path / "run", "--negatives", "model", "--scale", "1e39"))
    assert p.wait(600) == 1
    err = [x for x in p.stderr.read().splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "NonFiniteLossError" in err[0] and "non-finite loss" in err[0], err
    assert not (tmp_path / "run" / "model.safetensors").exists()


def test_output_is_locked_while_a_run_writes_it(tmp_path, tiny_bert_dir):
    from pyterrier_cpdae._locking import ConcurrentBuildError, build_lock

    data = tiny_beir(tmp_path / "beir", docs=30, queries=6)
    out = tmp_path / "run"
    with build_lock(str(out), "fine-tuning run", "written"):
        with pytest.raises(ConcurrentBuildError):
            ft.main(_argv(tiny_bert_dir, f"beir:{data}:train", out, "--negatives", "model"))


def test_stale_negatives_are_mined_again_and_resumed_rounds_train_to_the_asked_length(tmp_path, tiny_bert_dir,
                                                                                       caplog):
    data = tiny_beir(tmp_path / "beir", docs=30, queries=6)
    out = tmp_path / "run"
    argv = _argv(tiny_bert_dir, f"beir:{data}:train", out, "--negatives", "model", "--mining_rounds", "1")
    first = ft.main(argv)
    assert [r["steps"] for r in first["rounds"]] == [4, 4]
    key1 = json.loads((out / "negatives" / "round-1.parquet.key.json").read_text())
    with pytest.raises(ValueError, match="already holds this run"):
        ft.main(argv)
    # round 0 continued to 6 steps: its model changes, so round 1's negatives are stale: mined again, round 1 retrained
    again = ft.main([*argv, "--resume", "--max_steps", "6"])
    assert [r["steps"] for r in again["rounds"]] == [6, 6]
    state = json.loads((out / "rounds" / "round-0" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    key2 = json.loads((out / "negatives" / "round-1.parquet.key.json").read_text())
    assert key1["model"]["weights"] != key2["model"]["weights"] and key1["data"] == key2["data"]
    # the data edited in place: every round's negatives are mined again
    tiny_beir(tmp_path / "beir", docs=30, queries=6, extra=" kappa kappa")
    with caplog.at_level("WARNING", logger="pretrain.finetune.negatives"):
        ft.main([*argv, "--resume", "--max_steps", "6"])
    assert "round-0.parquet: made from other data" in caplog.text


def test_bad_options_are_one_line_errors(tmp_path, tiny_bert_dir):
    with pytest.raises(ValueError, match="--train is required"):
        ft.main(["--model", tiny_bert_dir, "--output_dir", str(tmp_path / "o")])
    with pytest.raises(ValueError, match="--loss cached needs in-batch negatives"):
        ft.main(_argv(tiny_bert_dir, "sample", tmp_path / "o", "--loss", "cached", "--in_batch_negatives", "false"))
    with pytest.raises(ValueError, match="--scale must be > 0"):
        ft.main(_argv(tiny_bert_dir, "sample", tmp_path / "o", "--scale", "0"))


def test_paper_preset_sets_the_papers_recipe_and_flags_override_it(tmp_path):
    fa, ta = parse_args(["--preset", "paper", "--output_dir", str(tmp_path)])
    assert (fa.num_negatives, fa.in_batch_negatives, fa.pooling, fa.mining_rounds, fa.round_init) == \
        (7, False, "cls", 1, "previous")
    assert (ta.learning_rate, ta.per_device_train_batch_size) == (5e-6, 64)
    fa, ta = parse_args(["--preset", "paper", "--output_dir", str(tmp_path), "--learning-rate", "1e-5"])
    assert ta.learning_rate == 1e-5


def test_probe_evaluates_during_training_and_keeps_the_best_checkpoint(tmp_path, tiny_bert_dir):
    """--probe: the trainer evaluates with the probe evaluator, selects the best checkpoint by probe nDCG@10 and stops
    early; the round's record holds the probe's figures of the model it exported."""
    from transformers import AutoModel, AutoTokenizer

    from pretrain.evaluation.probe import RetrievalProbe

    data = tiny_beir(tmp_path / "beir", docs=30, queries=6)
    out = tmp_path / "run"
    record = ft.main(_argv(tiny_bert_dir, f"beir:{data}:train", out, "--negatives", "model", "--probe", "sample",
                           "--probe_max_queries", "10", "--eval_strategy", "steps", "--eval_steps", "2",
                           "--load_best_model_at_end", "true", "--metric_for_best_model", "probe_ndcg_cut_10",
                           "--early_stopping_patience", "5", "--max_steps", "6"))
    state = json.loads((out / "rounds" / "round-0" / "checkpoint-6" / "trainer_state.json").read_text())
    evals = [h for h in state["log_history"] if "eval_probe_ndcg_cut_10" in h]
    assert [h["step"] for h in evals] == [2, 4, 6]
    best = max(h["eval_probe_ndcg_cut_10"] for h in evals)
    assert state["best_metric"] == pytest.approx(best) and not os.path.isabs(state["best_model_checkpoint"])
    # the exported model is the best checkpoint's: its probe figure is the best one, recomputed independently
    probe = RetrievalProbe("sample", 10, seed=42)
    got = probe.evaluate(AutoModel.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(out)),
                         pooling="cls", max_length=32, query_max_length=32)
    assert got["ndcg_cut_10"] == pytest.approx(best, abs=1e-4)
    assert record["rounds"][0]["probe_ndcg_cut_10"] == pytest.approx(best, abs=1e-4)
