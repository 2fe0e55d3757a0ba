"""A stage finished outside the pipeline is timed by its files (``adopted_wall``)."""
from __future__ import annotations

import os
from pathlib import Path

from experiments.paper.stages import adopted_wall


def _file(path: Path, mtime: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x")
    os.utime(path, (mtime, mtime))
    return path


def test_wall_runs_from_the_earliest_file_to_config_json(tmp_path: Path) -> None:
    """A fine-tuning writes its negatives first and its reproduction record after config.json: the wall time is
    the span from the earliest file (1,000 s) to config.json (1,175 s), not reproduction.json -> config.json (< 0)."""
    _file(tmp_path / "negatives" / "round-0.parquet", 1000.0)
    _file(tmp_path / "rounds" / "round-0" / "trainer_state.json", 1100.0)
    end = _file(tmp_path / "config.json", 1175.0)
    _file(tmp_path / "reproduction.json", 1175.5)
    assert adopted_wall(tmp_path, end) == 175.0


def test_no_wall_where_the_files_cannot_tell_it(tmp_path: Path) -> None:
    end = _file(tmp_path / "config.json", 500.0)
    assert adopted_wall(tmp_path, end) is None  # no earlier file
    _file(tmp_path / "model.safetensors", 400.0)
    assert adopted_wall(tmp_path, end) == 100.0
    os.utime(end, (300.0, 300.0))  # config.json older than every other file: no negative time
    _file(tmp_path / "model.safetensors", 400.0)
    assert adopted_wall(tmp_path, end) is None
