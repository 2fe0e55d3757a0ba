"""tests/_warm_python.py (the docs examples' ``python FILE`` in a fork of a warm interpreter) behaves as ``python FILE``
does in what the blocks rely on: a new process, the script as ``__main__`` with its own ``argv``, ``sys.path[0]``,
working directory and environment, its output and exit status, this project's packages not imported beforehand; an
overrunning script is killed; a server refuses an environment it was not started with."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _warm_python import WarmPython

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, os, sys
print(json.dumps({"pid": os.getpid(), "name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "var": os.environ.get("WARM_TEST_VAR"), "test": os.environ.get("PYTEST_CURRENT_TEST"),
                  "ours": sorted(m for m in ("pretrain", "pyterrier_cpdae", "experiments") if m in sys.modules),
                  "torch": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[0].endswith("exit3.py")) * 3)
"""


@pytest.fixture(scope="module")
def warm():
    env = {**os.environ, "WARM_TEST_VAR": "x", "PYTHONPATH": str(REPO)}
    server = WarmPython(env)
    yield server, env
    server.close()


def _run(server, env, script: Path, tmp_path: Path, **kw) -> tuple[int, str, str]:
    out, err = tmp_path / f"{script.stem}.out", tmp_path / f"{script.stem}.err"
    status = server.run(str(script), cwd=str(tmp_path), env=env, out=str(out), err=str(err), **kw)
    return status, out.read_text(), err.read_text()


def test_a_script_runs_as_python_file_would_run_it(warm, tmp_path, monkeypatch):
    server, env = warm
    (tmp_path / "sub").mkdir()
    for name in ("ok.py", "exit3.py"):
        (tmp_path / "sub" / name).write_text(SCRIPT)
    cold = subprocess.run([sys.executable, str(tmp_path / "sub" / "ok.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    status, out, err = _run(server, {**env, "PYTEST_CURRENT_TEST": "another test"}, tmp_path / "sub" / "ok.py",
                            tmp_path)
    seen, want = json.loads(out), json.loads(cold.stdout)
    assert status == cold.returncode == 0 and err == cold.stderr == "to stderr\n"
    assert seen["pid"] not in (os.getpid(), want["pid"])                 # a process of its own
    for key in ("name", "argv", "path0", "cwd", "var", "ours"):
        assert seen[key] == want[key], key                                # __main__, argv, sys.path[0], cwd, env
    assert seen["ours"] == [] and seen["torch"] and seen["test"] == "another test"
    assert _run(server, env, tmp_path / "sub" / "exit3.py", tmp_path)[0] == 3


def test_an_exception_is_a_traceback_and_status_1(warm, tmp_path):
    server, env = warm
    (tmp_path / "boom.py").write_text("raise RuntimeError('boom at line 1')\n")
    status, _, err = _run(server, env, tmp_path / "boom.py", tmp_path)
    assert status == 1 and "Traceback" in err and "RuntimeError: boom at line 1" in err


def test_an_overrunning_script_is_killed_and_the_server_serves_on(warm, tmp_path):
    server, env = warm
    (tmp_path / "slow.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        _run(server, env, tmp_path / "slow.py", tmp_path, timeout=2)
    assert time.monotonic() - t0 < 60 and (tmp_path / "slow.out").read_text() == "started\n"
    (tmp_path / "after.py").write_text("print('after')\n")
    assert _run(server, env, tmp_path / "after.py", tmp_path)[:2] == (0, "after\n")


def test_another_environment_is_refused(warm, tmp_path):
    server, env = warm
    (tmp_path / "x.py").write_text("")
    with pytest.raises(ValueError, match="another environment"):
        _run(server, {**env, "WARM_TEST_VAR": "y"}, tmp_path / "x.py", tmp_path)
