"""A run directory found elsewhere than where its run started (moved or copied between two sessions): continued there
with ``--resume_from_checkpoint`` (a warning names the place it started in), refused in one line without it."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from pretrain.training.run_dir import RUN_FORMAT, check_run_dir


def _run(tmp_path, started_in: str):
    out = tmp_path / "run"
    out.mkdir()
    options = {"objective": "mlm", "learning_rate": 1e-4}
    (out / "run_config.json").write_text(json.dumps({"format": RUN_FORMAT, "config": options,
                                                     "output_path": started_in}))
    return SimpleNamespace(output=str(out), options=lambda: dict(options))


def test_a_moved_run_is_refused_without_a_resume_and_continued_with_one(tmp_path, caplog):
    config = _run(tmp_path, "/somewhere/else/run")
    with pytest.raises(ValueError, match=r"holds a run that was started in /somewhere/else/run .*"
                                         r"--resume_from_checkpoint true .*--overwrite_output_dir"):
        check_run_dir(config, resume=False, overwrite=False)
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        check_run_dir(config, resume=True, overwrite=False)
    assert "was started in /somewhere/else/run and has been moved (or copied) here" in caplog.text


def test_a_run_in_the_place_it_started_is_not_called_moved(tmp_path, caplog):
    config = _run(tmp_path, str((tmp_path / "run").resolve()))
    with caplog.at_level(logging.WARNING, logger="pretrain"):
        check_run_dir(config, resume=False, overwrite=False)  # no checkpoint, no export: nothing to refuse
        check_run_dir(config, resume=True, overwrite=False)
    assert "moved" not in caplog.text
