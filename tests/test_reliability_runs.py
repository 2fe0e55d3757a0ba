"""Run-level reliability: a run's directory moved or removed, a moved run resumed, a docno
Lucene cannot index.

* class 7: ``mv`` or ``rm -rf`` of a running pre-training (or fine-tuning) run's ``--output`` let it finish with exit 0,
  re-creating the old path with checkpoints and an export but no ``run_config.json``; now the run stops with a
  :class:`~pretrain.training.run_dir.RunDirectoryError` naming what happened (and where the directory went), writing nothing;
* class 6: ``--resume`` of a moved run directory failed with "options differ: --output"; now the run is continued in
  its new place (a warning names both places), and without ``--resume`` the error says it was moved and how to go on;
* class 6: a BM25 docno over Lucene's term limit (32766 bytes of UTF-8) failed inside Java ("immense term"); now it is
  refused naming the document and the limit, before it reaches Lucene.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from _train_worker import RegressionData, TinyRegressor, collate
from pretrain.config import TrainConfig
from pretrain.logging_utils import read_metrics
from pretrain.training.checkpoint import list_checkpoints
from pretrain.training.run_dir import RUN_CONFIG, RunDirectoryError, config_dict
from pretrain.training.trainer import Trainer

def _cfg(output: Path, **kw) -> TrainConfig:
    base = dict(output=str(output), batch_size=8, max_steps=8, learning_rate=0.05, warmup_ratio=0.1, logging_steps=1,
                save_steps=4, save_total_limit=3, seed=3, report_to="csv")
    base.update(kw)
    return TrainConfig(**base)


class _Mover(TinyRegressor):
    """Does ``action`` to the run's directory right after optimizer step ``at`` (as a user's ``mv``/``rm -rf``)."""

    def __init__(self, at: int, action):
        super().__init__(dropout=0.0)
        self.at, self.action = at, action

    def on_step(self, step: int, total_steps: int) -> None:
        super().on_step(step, total_steps)
        if step == self.at:
            self.action()


def _losses(output) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(os.path.join(output, "logs", "metrics.csv"))]


# ----------------------------------------------------------------------------- class 7: moved or removed while running
def test_a_run_whose_output_is_moved_while_running_stops_and_resumes_in_its_new_place(tmp_path, caplog):
    """`mv OUT NEW` during the run: it used to finish with exit 0, re-creating OUT with checkpoints and an export but
    no run_config.json. Now it stops at the next write naming NEW, OUT is not re-created, and --resume at NEW
    finishes the run with the losses of an uninterrupted one (checked against a run nobody moved)."""
    out, new = tmp_path / "run", tmp_path / "elsewhere" / "run"
    new.parent.mkdir()
    module = _Mover(5, lambda: shutil.move(str(out), str(new)))  # after checkpoint-4 was saved
    with pytest.raises(RunDirectoryError, match=rf"the output directory {out} was moved to {new} while the run was "
                                                rf"writing into it.*--output {new} --resume"):
        Trainer(module, RegressionData(64), collate, _cfg(out)).train()
    assert not out.exists()  # nothing re-created at the old path
    assert (new / RUN_CONFIG).is_file() and not (new / "config.json").exists()  # not exported: not finished
    assert [s for s, _ in list_checkpoints(str(new))] == [4]

    with caplog.at_level(logging.WARNING, logger="pretrain"):
        result = Trainer(TinyRegressor(dropout=0.0), RegressionData(64), collate, _cfg(new, resume=True)).train()
    assert result["step"] == 8 and (new / "config.json").is_file() and not out.exists()
    assert any(f"started in {out}" in r.getMessage() and "moved" in r.getMessage() for r in caplog.records)
    assert json.loads((new / RUN_CONFIG).read_text())["output_path"] == os.path.realpath(new)

    ref = tmp_path / "reference"
    Trainer(TinyRegressor(dropout=0.0), RegressionData(64), collate, _cfg(ref)).train()
    got, want = dict(_losses(new)), dict(_losses(ref))
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(1, 9)] == pytest.approx([want[s] for s in range(1, 9)], rel=1e-5)


@pytest.mark.parametrize("replaced", [False, True], ids=["removed", "removed-and-recreated-empty"])
def test_a_run_whose_output_is_removed_while_running_stops_and_writes_nothing(tmp_path, replaced):
    """`rm -rf OUT` (and `rm -rf OUT; mkdir OUT`) during the run: it stops before its next log row, checkpoint or
    export instead of writing checkpoints and a model into a directory without its run_config.json."""
    out = tmp_path / "run"

    def remove():
        shutil.rmtree(out)
        if replaced:
            out.mkdir()
    expect = (rf"{out} was removed while the run was writing into it \(and {out} is now another directory\)" if replaced
              else rf"{out} was removed while the run was writing into it; .*start it again")
    with pytest.raises(RunDirectoryError, match=expect):
        Trainer(_Mover(2, remove), RegressionData(64), collate, _cfg(out)).train()
    assert (list(out.iterdir()) == []) if replaced else not out.exists()


def test_a_run_whose_record_is_deleted_stops(tmp_path):
    """The directory is still there but its run_config.json was deleted: a checkpoint written now could not be
    resumed (no record), so the run stops naming the file."""
    out = tmp_path / "run"
    with pytest.raises(RunDirectoryError, match=rf"{out} no longer holds the run's {RUN_CONFIG}"):
        Trainer(_Mover(3, lambda: os.remove(out / RUN_CONFIG)), RegressionData(64), collate, _cfg(out)).train()
    assert not list_checkpoints(str(out))  # checkpoint-4 was not written


def test_the_cli_reports_a_moved_output_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    """Through `python -m pretrain`'s own error handling (pretrain.__main__._run): one line, exit 2, never exit 0."""
    import pretrain.__main__ as cli

    out, new = tmp_path / "run", tmp_path / "moved"

    def main():
        Trainer(_Mover(2, lambda: shutil.move(str(out), str(new))), RegressionData(32), collate,
                _cfg(out, max_steps=4, save_steps=100)).train()
    monkeypatch.setattr(cli, "main", main)
    monkeypatch.delenv("PRETRAIN_DEBUG", raising=False)
    assert cli._run() == 2
    err = capsys.readouterr().err.strip().splitlines()  # the progress bar's lines, then the error on its own
    errors = [line for line in err if "error" in line]
    assert errors == err[-1:] and err[-1].startswith("error: RunDirectoryError: refusing to write the log of step 2: the "
                                               f"output directory {out} was moved to {new}")
    assert not out.exists()


# ----------------------------------------------------------------------------- class 6: --resume of a moved run
def _record(cfg, name=RUN_CONFIG, **extra) -> None:
    os.makedirs(cfg.output, exist_ok=True)
    with open(os.path.join(cfg.output, name), "w") as f:
        json.dump({"config": config_dict(cfg), "output_path": os.path.realpath(cfg.output), **extra}, f)


def test_a_moved_pretraining_run_is_resumed_and_refused_without_resume(tmp_path, caplog):
    """Was: 'options differ: --output' (as if it were another run). The moved directory holds the run's own
    run_config.json: --resume continues it there with a warning naming both places; without --resume the error says
    where it was started and to pass --resume. Another option changed is still another run."""
    old, new = tmp_path / "a" / "run", tmp_path / "b" / "run"
    _record(_cfg(old))
    (old / "checkpoints").mkdir()
    new.parent.mkdir()
    shutil.move(str(old), str(new))
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        check_output_dir(_cfg(new, resume=True))  # no error
    assert any(f"{new}: this run was started in {os.path.realpath(old)} and has been moved" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match=rf"holds a run that was started in {os.path.realpath(old)} \(the directory "
                                         rf"was moved or copied to {new}\); pass --resume"):
        check_output_dir(_cfg(new))
    with pytest.raises(ValueError, match=r"different run \(options differ: --learning-rate"):
        check_output_dir(_cfg(new, resume=True, learning_rate=0.5))


def test_a_run_recorded_before_output_path_was_recorded_is_compared_by_its_output(tmp_path):
    """Older records hold only config.output: the same directory by another spelling is the same place; another
    directory is a moved run."""
    out = tmp_path / "run"
    os.makedirs(out)
    with open(out / RUN_CONFIG, "w") as f:
        json.dump({"config": config_dict(_cfg(tmp_path / "x" / ".." / "run"))}, f)
    check_output_dir(_cfg(out, resume=True))  # same place: no warning needed, no error
    with open(out / RUN_CONFIG, "w") as f:
        json.dump({"config": config_dict(_cfg(tmp_path / "gone"))}, f)
    with pytest.raises(ValueError, match=rf"started in {tmp_path / 'gone'} .*pass --resume"):
        check_output_dir(_cfg(out))


# ----------------------------------------------------------------------------- class 7 for fine-tuning
# ----------------------------------------------------------------------------- class 6: a docno Lucene cannot index
@pytest.mark.parametrize("docno,chars,size", [
    ("x" * 40_000, 40_000, 40_000),
    ("€" * 10_922 + "a", 10_923, 32_767),  # fewer characters than the limit, more bytes: bytes are what count
], ids=["40000-ascii", "32767-bytes-utf8"])
def test_a_docno_over_lucenes_term_limit_is_refused_naming_the_document(tmp_path, docno, chars, size):
    """Was: a JavaException ('Document contains at least one immense term in field="id"') from inside Lucene."""
    from pyterrier_cpdae.bm25 import BM25Index

    index = BM25Index(tmp_path / "index")
    prefix = repr(docno[:40])
    with pytest.raises(ValueError, match=rf"document #1 \(docno {prefix}\.\.\., {chars} characters\): the docno is "
                                         rf"{size} bytes in UTF-8, longer than Lucene's limit of 32766 bytes"):
        index.indexer().index([{"docno": "ok", "text": "apple"}, {"docno": docno, "text": "apple pie"}])
    assert not index.built() and not Path(index.path).exists()


def test_a_docno_of_exactly_32766_bytes_is_indexed_and_found(tmp_path):
    """The limit is Lucene's own (measured: 32766 bytes index, 32767 fail): the longest docno still works."""
    import pandas as pd

    from pyterrier_cpdae.bm25 import BM25Index

    docno = "€" * 10_922  # 32766 bytes
    index = BM25Index(tmp_path / "index")
    index.indexer().index([{"docno": "ok", "text": "apple"}, {"docno": docno, "text": "apple pie"}])
    res = index.bm25()(pd.DataFrame({"qid": ["1"], "query": ["pie"]}))
    assert res["docno"].tolist() == [docno]
