"""``python SCRIPT`` in a fresh process that starts with the third-party libraries already imported.

A test that runs many short Python scripts (the runnable documentation blocks) pays about 8 CPU-seconds per script
for importing torch and transformers. :class:`WarmPython` imports them once, in a server process that does nothing
else, and runs each script in a fork of it: a new process (its own pid, memory, working directory, output files and
exit status) in which ``import torch`` costs nothing. Only third-party libraries are imported beforehand (numpy,
pandas, torch, transformers' modelling code, tokenizers, matplotlib's Agg backend): this project's own packages are
imported by the script itself, in its own order, exactly as in ``python SCRIPT``. Libraries that read environment
variables when imported see the server's environment, so a server serves only scripts run with the environment it
was started with (:meth:`WarmPython.run` refuses another one).

The protocol (one request at a time, one JSON line each way): the client writes ``{"script", "cwd", "out",
"err", "env"}`` (the script's environment: the server's, up to :data:`VOLATILE`); the server forks, answers ``{"pid"}`` at once (so that a client can kill a script that overruns) and
``{"status"}`` when the script has ended (the exit status, or ``-signal`` when it was killed).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Optional

#: imported by the server before it forks: third-party libraries only (see the module docstring)
PRELOAD = ["numpy", "pandas", "torch", "transformers.modeling_utils", "transformers.models.bert.modeling_bert",
           "tokenizers", "matplotlib.pyplot"]

_SERVER = r"""
import importlib, json, os, sys
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except ImportError:  # not installed here: the scripts import it themselves (or fail as under python FILE)
        pass
import threading
assert threading.active_count() == 1, "a preloaded library started a thread: forking would be unsafe"
proto_in, proto_out = sys.stdin, os.fdopen(int(sys.argv[2]), "w", buffering=1)
proto_out.write(json.dumps({"ready": True}) + "\n")
for line in proto_in:
    req = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import atexit, runpy, traceback
            proto_out.close()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, req["out"]), (2, req["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
            os.environ.clear()
            os.environ.update(req["env"])
            os.chdir(req["cwd"])
            script = os.path.abspath(req["script"])
            sys.argv = [req["script"]]
            sys.path[0] = os.path.dirname(script)
            try:
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            atexit._run_exitfuncs()
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(code)
    proto_out.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    proto_out.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
"""


class WarmPython:
    """A server process with :data:`PRELOAD` imported, started with ``env``; :meth:`run` runs one script in a fork."""

    def __init__(self, env: dict[str, str]):
        self.env = dict(env)
        read, write = os.pipe()
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, json.dumps(PRELOAD), str(write)],
                                      env=self.env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, pass_fds=(write,), text=True)
        os.close(write)
        self._answers = os.fdopen(read, "r")
        self._lock = threading.Lock()
        if not self._answer().get("ready"):
            raise RuntimeError("the warm Python server did not start")

    def _answer(self) -> dict:
        line = self._answers.readline()
        if not line:
            raise RuntimeError(f"the warm Python server ended (exit status {self._proc.poll()})")
        return json.loads(line)

    def run(self, script: str, *, cwd: str, env: dict[str, str], out: str, err: str,
            timeout: Optional[float] = None) -> int:
        """Runs ``python script`` in ``cwd`` with stdout/stderr written to the files ``out``/``err``; returns its exit
        status (``-N`` when signal N ended it). Raises ``subprocess.TimeoutExpired`` (the script killed) after
        ``timeout`` seconds, and ``ValueError`` when ``env`` is not the server's."""
        if _stable(env) != _stable(self.env):
            raise ValueError("this warm Python server was started with another environment")
        with self._lock:
            self._proc.stdin.write(json.dumps({"script": script, "cwd": cwd, "out": out, "err": err,
                                               "env": dict(env)}) + "\n")
            self._proc.stdin.flush()
            pid = self._answer()["pid"]
            killed = threading.Event()
            timer = threading.Timer(timeout, lambda: (killed.set(), _kill(pid))) if timeout is not None else None
            if timer is not None:
                timer.start()
            try:
                status = self._answer()["status"]
            finally:
                if timer is not None:
                    timer.cancel()
            if killed.is_set():
                raise subprocess.TimeoutExpired([sys.executable, script], timeout)
            return status

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._answers.close()


#: set by pytest for each test: not read by any library at import, so it may differ from the server's
VOLATILE = {"PYTEST_CURRENT_TEST"}


def _stable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in VOLATILE}


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
