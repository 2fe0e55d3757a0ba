"""``--config`` files (pre-training, fine-tuning) and the paper pipeline's config files are read by one loader,
:func:`pyterrier_cpdae._files.read_config_file` (a key given twice, a YAML alias bomb,
a ``!!python`` tag, bytes that are not UTF-8, truncated JSON).

The promise (docs/reliability.md, "Config files"): a config file holds plain values, each key once; anything else is
one line naming the file and the line (``error: ValueError: <file>:<line>: ...``, exit code 2), before anything is
built, trained or printed at length.
"""
from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.arguments import parse_args
from tests.helpers.warm_python import warm_python
from tests.helpers.cli import run_cli
from tests.helpers.errors import at

ROOT = Path(__file__).resolve().parents[2]



# ------------------------------------------------------------------ a key given twice (class 2)

def test_a_yaml_key_given_twice_is_refused_not_last_one_wins(tmp_path: Path) -> None:
    """It trained at 5.0: the second ``learning_rate`` won without a word."""
    f = tmp_path / "run.yaml"
    f.write_text("learning_rate: 1e-3\nbatch_size: 4\nlearning_rate: 5.0\n")
    with pytest.raises(ValueError, match=at(f, 3) + r" key 'learning_rate' is given twice .*first on line 1"):
        parse_args(["--output_dir", str(tmp_path / "run"), "--config", str(f)])


def test_a_key_given_twice_in_a_flow_mapping_and_in_a_nested_object(tmp_path: Path) -> None:
    from pyterrier_cpdae._files import read_config_file

    flow = tmp_path / "flow.yaml"
    flow.write_text("{a: 1, b: 2, a: 3}\n")
    with pytest.raises(ValueError, match=at(flow, 1) + r" key 'a' is given twice"):
        read_config_file(flow)
    nested = tmp_path / "nested.json"
    nested.write_text('{"a": {"x": 1,\n "y": 2,\n "x": 3}}\n')
    with pytest.raises(ValueError, match=at(nested, 3) + r" key 'x' is given twice .*first on line 1"):
        read_config_file(nested)


@pytest.mark.parametrize("name,text,line", [("run.yaml", "learning-rate: 1e-3\nlearning_rate: 5.0\n", 2),
                                            ("run.json", '{"learning_rate": 1e-3,\n"learning-rate": 5.0}', 2)])
def test_two_spellings_of_one_option_are_refused(tmp_path: Path, name: str, text: str, line: int) -> None:
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ValueError, match=at(f, line) + r" key .* sets 'learning_rate', which key .* \(line 1\) sets"):
        parse_args(["--output_dir", str(tmp_path / "run"), "--config", str(f)])


def test_a_yaml_merge_may_still_be_overridden(tmp_path: Path) -> None:
    """``<<: *base`` then an own key is YAML's override, not a key given twice."""
    from pyterrier_cpdae._files import read_config_file

    f = tmp_path / "m.yaml"
    f.write_text("base: &b {x: 1, y: 2}\nrun:\n  <<: *b\n  x: 3\n")
    assert read_config_file(f) == {"base": {"x": 1, "y": 2}, "run": {"x": 3, "y": 2}}


def test_the_paper_pipeline_refuses_a_key_given_twice_in_an_overlay(tmp_path: Path) -> None:
    from experiments.paper.config import load_config

    f = tmp_path / "overlay.json"
    f.write_text('{"pretrain": {"max_steps": 2,\n  "max_steps": 200}}\n')
    with pytest.raises(ValueError, match=at(f, 2) + r" key 'max_steps' is given twice"):
        load_config("smoke", overlay=f, work_dir=tmp_path / "w")


# ------------------------------------------------------------------ one line, the right cause (class 6)

@pytest.mark.parametrize("subcommand", [[], ["finetune"]])
def test_a_python_yaml_tag_is_one_line_and_runs_nothing(tmp_path: Path, monkeypatch, capsys,
                                                        subcommand: list[str]) -> None:
    marker = tmp_path / "ran"
    f = tmp_path / "run.yaml"
    f.write_text(f"batch_size: 4\nmodel: !!python/object/apply:os.system ['touch {marker}']\n")
    code, line = run_cli(monkeypatch, capsys, [*subcommand, "--config", str(f), "--output_dir", str(tmp_path / "out")])
    assert code == 2 and line.startswith(f"error: ValueError: {f}:2: YAML tag '!!python/object/apply:os.system' "
                                         "is refused"), line
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("subcommand", [[], ["finetune"]])
def test_a_non_utf8_byte_names_the_file_and_line(tmp_path: Path, monkeypatch, capsys, subcommand: list[str]) -> None:
    f = tmp_path / "run.yaml"
    f.write_bytes(b"batch_size: 4\nrun_name: caf\xe9\n")
    code, line = run_cli(monkeypatch, capsys, [*subcommand, "--config", str(f)])
    assert code == 2 and line.startswith(f"error: ValueError: {f}:2: not valid UTF-8"), line


@pytest.mark.parametrize("subcommand", [[], ["finetune"]])
def test_a_truncated_json_config_names_the_file_and_line(tmp_path: Path, monkeypatch, capsys,
                                                         subcommand: list[str]) -> None:
    f = tmp_path / "run.json"
    f.write_text('{"batch_size": 4,\n "learning_rate": ')
    code, line = run_cli(monkeypatch, capsys, [*subcommand, "--config", str(f)])
    assert code == 2 and line.startswith(f"error: ValueError: {f}:2: not valid JSON"), line


def test_a_config_that_is_not_a_mapping_names_the_file(tmp_path: Path, monkeypatch, capsys) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("- batch_size\n- 4\n")
    code, line = run_cli(monkeypatch, capsys, ["--config", str(f)])
    assert code == 2 and line.startswith(f"error: ValueError: {f}: a config file must hold a mapping"), line


# ------------------------------------------------------------------ sizes bounded before anything is built (class 5)

def _bomb(levels: int = 7) -> str:
    """A YAML value of 9**(levels + 1) strings in about 300 bytes: each anchor is 9 aliases of the previous one."""
    parts = ['&a [' + ",".join(['"lol"'] * 9) + ']']
    for prev, name in zip("abcdefghij", "bcdefghijk"[:levels - 1]):
        parts.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    parts.append("[" + ",".join([f"*{chr(ord('a') + levels - 1)}"] * 9) + "]")
    return "model: [" + ", ".join(parts) + "]\n"


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    """The 300-byte bomb (9**8 strings) ran until the memory was gone; now the loader refuses it before building
    anything. Run in a child process with 1 GiB of address space, so that a regression cannot take the machine."""
    f = tmp_path / "bomb.yaml"
    f.write_text(_bomb())
    assert len(f.read_bytes()) < 400
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30)); "
            "from pyterrier_cpdae._files import read_config_file; read_config_file(sys.argv[1])")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(f)], cwd=ROOT, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the alias bomb was still being expanded after 120 s")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith(f"ValueError: {f}:1: YAML aliases expand this value to more than "
                                                    "100000 values"), proc.stderr[-2000:]


def test_a_yaml_alias_bomb_in_a_string_option_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """A smaller bomb (9**6 strings: its whole repr, which the message used to print, is 4 MB) through
    ``python -m pretrain`` and ``finetune``: one short line, exit code 2."""
    f = tmp_path / "bomb.yaml"
    f.write_text(_bomb(levels=5))
    for subcommand in ([], ["finetune"]):
        t0 = time.perf_counter()
        code, line = run_cli(monkeypatch, capsys, [*subcommand, "--config", str(f), "--output_dir", str(tmp_path / "o")])
        assert code == 2 and line.startswith(f"error: ValueError: {f}:1: YAML aliases expand"), line[:300]
        assert len(line) < 400 and time.perf_counter() - t0 < 5


def test_aliases_within_the_bound_are_read(tmp_path: Path) -> None:
    from pyterrier_cpdae._files import read_config_file

    f = tmp_path / "ok.yaml"
    f.write_text("a: &x [1, 2, 3]\nb: *x\n")
    assert read_config_file(f) == {"a": [1, 2, 3], "b": [1, 2, 3]}
    f.write_text("a: &x [*x]\n")
    with pytest.raises(ValueError, match=at(f, 1) + " a YAML alias refers to the value that holds it"):
        read_config_file(f)


def test_a_deeply_nested_or_huge_file_is_refused(tmp_path: Path, monkeypatch) -> None:
    from pyterrier_cpdae import _files

    deep = tmp_path / "deep.json"
    deep.write_text("{\"a\": " + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=re.escape(f"{deep}: nested too deeply")):
        _files.read_config_file(deep)
    digits = tmp_path / "digits.yaml"
    digits.write_text("batch_size: " + "9" * 5000 + "\n")  # more digits than Python converts to an int
    with pytest.raises(ValueError, match=re.escape(f"{digits}: cannot be read") + ".*4300 digits"):
        _files.read_config_file(digits)
    monkeypatch.setattr(_files, "CONFIG_MAX_BYTES", 10)
    big = tmp_path / "big.json"
    big.write_text('{"batch_size": 4}')
    with pytest.raises(ValueError, match=re.escape(f"{big}: a config file of 17 bytes is refused")):
        _files.read_config_file(big)
    packed = tmp_path / "packed.json.gz"  # small on disk, large once decompressed
    packed.write_bytes(gzip.compress(b'{"a": "' + b"x" * 100 + b'"}'))
    monkeypatch.setattr(_files, "CONFIG_MAX_BYTES", 50)
    with pytest.raises(ValueError, match=re.escape(f"{packed}: a config file of more than 50 characters")):
        _files.read_config_file(packed)


def test_an_objective_of_the_wrong_type_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """``objective: [a, b]`` was looked up among the objectives before its type was checked (TypeError traceback)."""
    f = tmp_path / "run.yaml"
    f.write_text("objective: [cpdae, mlm]\n")
    code, line = run_cli(monkeypatch, capsys, ["--config", str(f)])
    assert code == 2 and line == f"error: ValueError: option 'objective' in the config file {f} must be a string, " \
                                 "got list ['cpdae', 'mlm']"


def test_the_paper_pipeline_names_a_bad_config_file_in_one_line(tmp_path):
    """``python -m experiments.paper --scale FILE`` with a key twice in FILE: one line naming the file, the line and the
    key, exit 2 (it was a traceback with exit 1)."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    bad = tmp_path / "paper_bad.json"
    bad.write_text('{"scale": "bad",\n "extends": "smoke",\n "extends": "cpu"}\n')
    run = subprocess.run([warm_python(), "-m", "experiments.paper", "--scale", str(bad), "--dry-run",
                          "--work-dir", str(tmp_path / "w")], cwd=repo, capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith("error: ConfigFileError: ") and f"{bad}:3" in lines[0] and "'extends'" in lines[0]


def test_a_finetune_config_file_sets_options_between_the_preset_and_the_flags(tmp_path: Path) -> None:
    """``python -m pretrain finetune --config``: the file's values replace the preset's, a flag replaces the file's;
    the Trainer's options (``learning_rate``) and ours (``num_negatives``) alike; an unknown key names the file."""
    from pretrain.finetune.arguments import PRESETS, parse_args as finetune_args

    f = tmp_path / "ft.yaml"
    f.write_text("preset: paper-warmup\nnum_negatives: 3\nlearning-rate: 2.0e-5\nmax_steps: 7\n")
    fa, ta = finetune_args(["--config", str(f), "--output_dir", str(tmp_path / "o"), "--max_steps", "9"])
    assert (fa.preset, fa.num_negatives, ta.learning_rate, ta.max_steps) == ("paper-warmup", 3, 2e-5, 9)
    assert fa.mining_rounds == PRESETS["paper-warmup"]["mining_rounds"]  # the preset's value the file leaves alone
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_negatives: 3\nno_such_option: 1\n")
    with pytest.raises(ValueError, match=re.escape(f"unknown option(s) in config file {bad}: no_such_option")):
        finetune_args(["--config", str(bad), "--output_dir", str(tmp_path / "o")])
