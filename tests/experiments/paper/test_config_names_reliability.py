"""A name is never a path.

``--eval-set NAME=SPEC`` took an absolute path or ``../..`` as NAME and wrote the corpus, qrels, indexes and runs
there, outside ``--work-dir``. Every name the experiments make a folder or file of (eval and fine-tuning sets,
objectives, selections, scales, system names, the module folders a model's ``modules.json`` names) is refused
unless it stays inside its root; the command-line options exit with status 2 and a line naming the option.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tests.helpers.warm_python import warm_python

REPO = Path(__file__).resolve().parents[3]
BAD_NAMES = ["/tmp/escape", "../..", "..", ".", "", "a/b", "x\\y", ".hidden", "-dash", "a" * 101]


def _write_trec(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "docs.trec").write_text("<DOC>\n<DOCNO>d0</DOCNO>\nphoton energy\n</DOC>\n"
                                      "<DOC>\n<DOCNO>d1</DOCNO>\nroman history\n</DOC>\n")
    (folder / "query-text.trec").write_text("<top>\n<num>1</num>\n<title>photon</title>\n</top>\n")
    (folder / "qrels").write_text("1 0 d0 1\n")
    return folder


def _files_under(root: Path) -> set:
    return {p for p in root.rglob("*")} if root.exists() else set()


@pytest.mark.parametrize("name", BAD_NAMES)
def test_eval_set_name_that_is_not_a_name_is_refused_with_status_2(name, capsys):
    from experiments.paper.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args([f"--eval-set={name}=trec:../shared/data/vaswani"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--eval-set" in err and "NAME: " in err and "is not a name" in err


def test_eval_set_outside_the_work_dir_writes_nothing_there(tmp_path):
    """The command itself: exit 2, one line naming the option, nothing written under --work-dir or beside it."""
    data = _write_trec(tmp_path / "data")
    work = tmp_path / "area" / "work"
    work.mkdir(parents=True)
    before = _files_under(tmp_path / "area")
    for name in (str(tmp_path / "area" / "escaped"), "../escaped"):
        proc = subprocess.run([warm_python(), "-m", "experiments.paper", "--scale", "smoke", "--work-dir", str(work),
                               "--eval-set", f"{name}=trec:{data}"], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "--eval-set" in proc.stderr and "is not a name" in proc.stderr
        assert "Traceback" not in proc.stderr
    assert _files_under(tmp_path / "area") == before


def test_a_config_whose_names_are_paths_is_refused(tmp_path):
    """A config (here through --stand-ins overrides.json) names the folders of its sets and objectives."""
    from experiments.paper.config import load_config

    for section, name in (("eval_sets", "../../evil"), ("finetune_sets", "/abs/evil"), ("objectives", "a/b")):
        stand = tmp_path / f"stand-{section}"
        stand.mkdir()
        entry = {"spec": "sample", "metrics": ["nDCG@10"], "blocks": ["zero-shot"]} if section == "eval_sets" else \
            {"spec": "sample"} if section == "finetune_sets" else {"objective": "mlm"}
        (stand / "overrides.json").write_text(json.dumps({section: {name: entry}}))
        with pytest.raises(ValueError, match=rf"a key of {section}: '{name}' is not a name"):
            load_config("smoke", stand_ins=stand, work_dir=tmp_path / "w")
    stand = tmp_path / "stand-select"
    stand.mkdir()
    (stand / "overrides.json").write_text(json.dumps({"objectives": {"cpdae": {"objective": "cpdae",
                                                                               "select": "../sel"}}}))
    with pytest.raises(ValueError, match=r"objectives.cpdae.select: '../sel' is not a name"):
        load_config("smoke", stand_ins=stand, work_dir=tmp_path / "w")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "w").exists()


@pytest.mark.parametrize("argv", [["--scale", "../../../tmp/x"], ["--scale", "smoke", "--sizes", "../x"]])
def test_scale_and_sizes_that_are_paths_are_refused(argv, capsys):
    from experiments.paper.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and "is not a name" in capsys.readouterr().err


def test_pilot_objective_that_is_a_path_is_refused(capsys):
    from experiments.paper.pilot import main

    with pytest.raises(SystemExit) as e:
        main(["--scale", "smoke", "--objective", "../../x"])
    assert e.value.code == 2 and "--objective" in capsys.readouterr().err


def test_every_path_the_evaluation_derives_from_a_set_name_stays_in_the_work_dir(tmp_path):
    """A plan built without load_config (a library caller) is checked where the paths are made: the set's indexes
    and runs, its materialised subset, its BM25 index, the pipeline's stage outputs."""
    from experiments.paper.config import under_work
    from experiments.paper.data import set_spec
    from experiments.paper.evaluation import evaluate

    data = _write_trec(tmp_path / "data")
    work = tmp_path / "area" / "work"
    plan = type("P", (), {"cfg": {"eval_sets": {}, "evaluation": {"pooling": "cls", "query_max_length": 8,
                                                                  "doc_max_length": 8, "num_results": 5,
                                                                  "batch_size": 4}}, "work": work})()
    entry = {"spec": f"trec:{data}", "metrics": ["nDCG@10"]}
    for name in ("../../escaped", str(tmp_path / "escaped")):
        with pytest.raises(ValueError, match="outside the work directory"):
            evaluate(plan, name, "zero-shot", {}, {}, entry=entry, log=lambda _: None)
        with pytest.raises(ValueError, match="outside the work directory"):
            set_spec(name, {**entry, "max_queries": 1}, work)
    with pytest.raises(ValueError, match="outside the work directory"):
        under_work(work, "bm25", "../../x", what="a BM25 index")
    assert under_work(work, "bm25", "eval_ok", what="x") == work / "bm25" / "eval_ok"
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "area" / "escaped").exists()


def test_a_system_name_that_is_a_path_gets_no_index_outside_the_index_root(tmp_path, tiny_bert_dir):
    from experiments.paper.retrievers import build_retrievers

    data = _write_trec(tmp_path / "data")
    for name in ("../out", "/abs", "", "."):
        with pytest.raises(ValueError, match="names no folder of its own"):
            build_retrievers({name: (tiny_bert_dir, "cls")}, f"trec:{data}", index_root=tmp_path / "i" / "root")
    assert not (tmp_path / "i" / "out").exists()


def test_overwrite_never_deletes_outside_the_model_directory_named_by_modules_json(tmp_path):
    """``--overwrite`` removes the module folders a previous run's ``modules.json`` names; ".." or "." named the
    parent directory or the output itself (with every file in it)."""
    from pyterrier_cpdae.encoder.st_export import exported_model_files, remove_exported_model

    parent = tmp_path / "parent"
    out = parent / "run"
    out.mkdir(parents=True)
    (parent / "keep.txt").write_text("a user's file beside the run")
    (out / "notes.txt").write_text("a user's file in the run")
    (out / "2_Dense").mkdir()
    (out / "2_Dense" / "config.json").write_text("{}")
    (out / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": ".."},
                                                  {"idx": 1, "name": "1", "path": "."},
                                                  {"idx": 2, "name": "2", "path": "2_Dense"}]))
    assert sorted(Path(p).name for p in exported_model_files(out)) == ["2_Dense", "modules.json"]
    remove_exported_model(out)
    assert (parent / "keep.txt").exists() and (out / "notes.txt").exists() and not (out / "2_Dense").exists()
