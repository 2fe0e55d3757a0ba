"""tests/helpers/warm_python.py's launcher behaves as the real interpreter does in what the tests rely on, compared with
``sys.executable`` run the same way: ``python FILE``, ``python -m MODULE`` and ``python -c CODE`` get the same
``__main__``, ``argv``, ``sys.path`` (``[0]`` and ``PYTHONPATH``'s entries), working directory, environment, standard streams (stdin included) and exit
status, in a process of their own with torch already imported and this project's packages not; a launcher killed by
a timeout takes its program with it; signals are forwarded; an environment the server was not started with gets a
cold interpreter; programs run side by side; ``python`` in a shell script is the launcher with :func:`warm_path`;
inherited file descriptors keep their numbers, and ``multiprocessing``'s spawn children start warm
(:func:`warm_spawn`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.warm_python import COLD, warm_path, warm_python, warm_spawn

pytestmark = pytest.mark.skipif(COLD, reason="CPDAE_TESTS_COLD_PYTHON=1: every python is the real interpreter")

REPO = Path(__file__).resolve().parents[2]

PROGRAM = r"""
import json, os, sys
print(json.dumps({"pid": os.getpid(), "name": __name__, "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(),
                  "var": os.environ.get("WARM_TEST_VAR"), "stdin": sys.stdin.read(),
                  "ours": sorted(m for m in ("pretrain", "pyterrier_cpdae", "experiments") if m in sys.modules),
                  "torch": "torch" in sys.modules}))
print("to stderr", file=sys.stderr)
sys.exit(3 if os.environ.get("WARM_TEST_VAR") == "exit3" else 0)
"""


@pytest.fixture
def program(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "prog.py").write_text(PROGRAM)
    return tmp_path


def _both(argv: list[str], cwd: Path, env: dict, **kw) -> tuple[subprocess.CompletedProcess, ...]:
    return tuple(subprocess.run([exe, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, **kw)
                 for exe in (sys.executable, warm_python()))


@pytest.mark.parametrize("how", ["file", "module", "code"])
def test_a_program_runs_as_under_the_real_interpreter(program, how):
    env = {**os.environ, "WARM_TEST_VAR": "exit3", "PYTHONPATH": os.pathsep.join([str(program / "sub"), str(REPO)])}
    argv = {"file": [str(program / "sub" / "prog.py"), "a", "b"], "module": ["-m", "prog", "a", "b"],
            "code": ["-c", PROGRAM, "a", "b"]}[how]
    cold, warm = _both(argv, program, env, input="from stdin")
    seen, want = json.loads(warm.stdout), json.loads(cold.stdout)
    assert warm.returncode == cold.returncode == 3 and warm.stderr == cold.stderr == "to stderr\n"
    for key in ("name", "argv", "path", "cwd", "var", "stdin", "ours"):  # sys.path: [0] and PYTHONPATH's
        assert seen[key] == want[key], key
    assert want["argv"][1:] == ["a", "b"] and want["stdin"] == "from stdin"
    assert seen["pid"] not in (os.getpid(), want["pid"]) and seen["ours"] == []
    assert seen["torch"] and not want["torch"]                   # the warm one had torch imported beforehand


def test_an_exception_is_a_traceback_and_status_1(tmp_path):
    cold, warm = _both(["-c", "raise RuntimeError('boom at line 1')"], tmp_path, dict(os.environ))
    assert warm.returncode == cold.returncode == 1
    assert warm.stderr == cold.stderr and "RuntimeError: boom at line 1" in warm.stderr


def test_a_timeout_kills_the_program_too(tmp_path):
    code = "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)\n"
    out = tmp_path / "out"
    with open(out, "w") as f, pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([warm_python(), "-c", code], stdout=f, timeout=5)
    pid = int(out.read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the program {pid} outlived its killed launcher")


def test_signals_are_forwarded_and_a_signal_death_is_the_status(tmp_path):
    handled = ("import os, signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *a: (print('got', a[0], flush=True), sys.exit(7)))\n"
               "print('ready', flush=True)\ntime.sleep(600)\n")
    for code, want_status, want_out in ((handled, 7, "ready\ngot 15\n"),
                                        (handled.replace("signal.signal(", "0 and signal.signal("), -15, "ready\n")):
        proc = subprocess.Popen([warm_python(), "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == want_status
        assert "ready\n" + proc.stdout.read() == want_out


def test_an_environment_the_server_did_not_start_with_gets_a_cold_interpreter(tmp_path):
    code = "import json, os, sys; print(json.dumps(['torch' in sys.modules, os.environ.get('HF_HUB_OFFLINE')]))"
    flipped = "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"   # read by huggingface_hub at import
    cold = subprocess.run([warm_python(), "-c", code], env={**os.environ, "HF_HUB_OFFLINE": flipped},
                          capture_output=True, text=True, timeout=120)
    assert cold.returncode == 0 and json.loads(cold.stdout) == [False, flipped]
    same = subprocess.run([warm_python(), "-c", code], env={**os.environ, "WARM_TEST_VAR": "nothing reads me"},
                          capture_output=True, text=True, timeout=120)
    assert json.loads(same.stdout) == [True, os.environ.get("HF_HUB_OFFLINE")]


def test_a_server_started_with_the_programs_variables_and_another_pythonpath_start_warm(tmp_path):
    """Programs that set a variable read at import get a server started with it (``start_env``: the docs blocks'
    ``MPLBACKEND``, ``HF_HUB_OFFLINE``); a ``PYTHONPATH`` other than the server's starts warm (tqdm reads the whole
    environment at import) and its entries are on the program's ``sys.path``."""
    code = ("import json, os, sys; print(json.dumps(['torch' in sys.modules, os.environ.get('HF_HUB_OFFLINE'), "
            f"{str(tmp_path)!r} in sys.path]))")
    flipped = "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1"   # read by huggingface_hub at import
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    own = subprocess.run([warm_python({"HF_HUB_OFFLINE": flipped}), "-c", code],
                         env={**os.environ, "HF_HUB_OFFLINE": flipped, "PYTHONPATH": path},
                         capture_output=True, text=True, timeout=120)
    assert own.returncode == 0 and json.loads(own.stdout) == [True, flipped, True], own.stderr
    assert warm_python({"HF_HUB_OFFLINE": flipped}) != warm_python()    # a server of its own, kept for the next
    other_path = subprocess.run([warm_python(), "-c", code], env={**os.environ, "PYTHONPATH": path},
                                capture_output=True, text=True, timeout=120)
    assert json.loads(other_path.stdout) == [True, os.environ.get("HF_HUB_OFFLINE"), True], other_path.stderr


def test_programs_run_side_by_side_and_python_in_a_script_is_the_launcher(tmp_path):
    code = "import time, sys; t = time.time(); time.sleep(3); print(t, 'torch' in sys.modules)"
    t0 = time.monotonic()
    procs = [subprocess.Popen([warm_python(), "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs) and all(o[1] == "True" for o in outs)
    assert max(float(o[0]) for o in outs) - min(float(o[0]) for o in outs) < 2.5   # they overlapped
    assert time.monotonic() - t0 < 60
    (tmp_path / "s.sh").write_text("python -c \"import sys; print('torch' in sys.modules)\"\n")
    sh = subprocess.run(["bash", "-euo", "pipefail", str(tmp_path / "s.sh")], env=warm_path(dict(os.environ)),
                        capture_output=True, text=True, timeout=120)
    assert sh.returncode == 0 and sh.stdout == "True\n", sh.stderr


def test_inherited_fds_keep_their_numbers_and_b_u_flags_apply(tmp_path):
    """A program started with extra fds (``pass_fds``) finds them at the same numbers, as under the real interpreter;
    ``-B``/``-u`` (which multiprocessing passes) keep the launch warm and take effect."""
    code = ("import os, sys, json; fd = int(sys.argv[1]); os.write(fd, b'through ' + sys.argv[1].encode());"
            "print(json.dumps({'b': sys.dont_write_bytecode, 'torch': 'torch' in sys.modules}))")
    for exe in (sys.executable, warm_python()):
        r, w = os.pipe()
        high = os.dup2(w, 47)  # a number no other fd of the caller has
        os.close(w)
        try:
            out = subprocess.run([exe, "-B", "-u", "-c", code, str(high)], pass_fds=[high], capture_output=True,
                                 text=True, timeout=120)
        finally:
            os.close(high)
        assert out.returncode == 0, out.stderr
        assert os.read(r, 100) == b"through 47"
        os.close(r)
        seen = json.loads(out.stdout)
        assert seen["b"] is True and seen["torch"] is (exe != sys.executable)


def _spawned_child(rank: int, out: str, fail: bool) -> None:
    import torch

    torch.save({"rank": rank, "warm": "transformers.modeling_utils" in sys.modules, "ppid": os.getppid()},
               os.path.join(out, f"{rank}.pt"))
    if fail and rank == 1:
        raise ValueError("rank 1 fails")


def test_multiprocessing_spawn_children_start_warm(tmp_path):
    """:func:`warm_spawn`: ``torch.multiprocessing.spawn``'s children (which read their task through inherited pipes)
    run from the server, and their results and failures come back as under the real interpreter; the executable is
    restored after the block."""
    import multiprocessing.spawn

    import torch
    import torch.multiprocessing as mp

    before = multiprocessing.spawn.get_executable()
    with warm_spawn():
        mp.spawn(_spawned_child, args=(str(tmp_path), False), nprocs=2, join=True)
    parents = set()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["rank"] == rank and got["warm"]  # preloaded: a fork of the server, not a fresh interpreter
        parents.add(got["ppid"])
    assert len(parents) == 2 and os.getpid() not in parents  # each under its own supervisor, not under this process
    with warm_spawn(), pytest.raises(mp.ProcessRaisedException, match="rank 1 fails"):
        mp.spawn(_spawned_child, args=(str(tmp_path), True), nprocs=2, join=True)
    assert multiprocessing.spawn.get_executable() == before
