"""A ``python`` that starts with torch and transformers already imported: for the tests' many short interpreters.

Most of this suite's CPU time is spent in the Python processes its tests start (``python -m pretrain ...``,
``python -m experiments.paper ...``, the documentation's blocks), and about 8 CPU-seconds of each go to importing
torch and transformers. :func:`warm_python` returns the path of an executable, ``python``, that behaves as the real
interpreter does for ``python -m MODULE ARGS``, ``python -c CODE ARGS`` and ``python FILE ARGS``, but runs the
program in a fork of a server that imported the third-party libraries once (:data:`PRELOAD`: numpy, pandas, torch,
transformers' modelling code, tokenizers, matplotlib). The program still gets a process of its own: its own pid,
process group, memory, working directory, environment, umask, standard input/output/error and every other file
descriptor the launcher inherited, at the same numbers (the caller's own, passed over a Unix socket: e.g. the pipes of
a ``multiprocessing`` "spawn" child, :func:`warm_spawn`), exit status, and the same ``sys.argv``, ``sys.path`` and
``__main__`` as under the real interpreter. This project's own packages are not imported beforehand: the program imports them
itself, in its own order.

What the launcher forwards and what it does not:

- Signals sent to the launcher (SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2) are sent on to the program, also
  one that arrives as soon as the program runs (they are blocked from the request until the handlers are in place;
  before, one sent right after the program's first output could kill the launcher, seen once under load); when
  the launcher dies (even by SIGKILL), the program's process group is killed. The exit status is the program's
  (``-N`` when signal N ended it: the launcher then ends by the same signal).
- A launcher whose environment differs from the server's in a variable the preloaded libraries read while they were
  imported, or in ``PYTHON*`` (but ``PYTHONPATH``, whose entries the program's ``sys.path`` gets, and
  ``PYTHONUNBUFFERED``), or whose arguments use interpreter options (``-X``, ``-O``, ...; but ``-B`` and ``-u``,
  which the program applies itself) runs the real interpreter instead (``exec``): a cold start, the same behaviour. Variables nothing read at import (a test's own
  ``IR_DATASETS_HOME``, ``PYTEST_CURRENT_TEST``, the ``PATH`` that puts this launcher first) may differ.
- The launcher's pid is not the program's (``Popen.pid`` is the launcher's), and the program's parent is the server.
  Tests that check a process's pid or what a fresh interpreter prints or imports use the real ``sys.executable``.

``WARM_PYTHON_DEBUG=1`` makes the launcher say why it starts a cold interpreter. ``CPDAE_TESTS_COLD_PYTHON=1`` makes
:func:`warm_python` return ``sys.executable`` (every process a cold start).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Optional

#: imported by the server before it forks: third-party libraries only (see the module docstring)
PRELOAD = ["numpy", "pandas", "torch", "transformers.modeling_utils", "transformers.models.bert.modeling_bert",
           "tokenizers", "matplotlib.pyplot"]

#: may differ between the server's environment and a program's although read when the libraries were imported
#: (some libraries copy the whole environment at import, which reads every variable: tqdm looks for its ``TQDM_*``
#: variables so, which made every program whose ``PYTHONPATH`` was not the server's a cold start where pytest itself
#: was started with a ``PYTHONPATH``; the program's ``sys.path`` gets its own ``PYTHONPATH``'s entries)
MAY_DIFFER = {"PATH", "PWD", "OLDPWD", "SHLVL", "_", "PYTEST_CURRENT_TEST", "COLUMNS", "LINES", "PYTHONPATH",
              "CPDAE_TESTS_SHARED",  # the guard of ../shared (tests/conftest.py): set for each test
              "PS1", "PS2"}  # prompts: a non-interactive bash drops them from its children's environment

#: ``CPDAE_TESTS_COLD_PYTHON=1``: :func:`warm_python` is the real interpreter
COLD = bool(os.environ.get("CPDAE_TESTS_COLD_PYTHON"))

_SERVER = r"""
import fcntl, importlib, json, os, select, signal, socket, sys
sock_path, preload = sys.argv[1], json.loads(sys.argv[2])
MAX_FDS = 64  # fds 0-2 and up to 61 inherited ones (a launcher with more starts cold)
env_class, read = type(os.environ), set()
server_env = dict(os.environ)  # as started: what a program's environment is compared with
_getitem = env_class.__getitem__
def _recording_getitem(self, key):
    read.add(key)
    return _getitem(self, key)
env_class.__getitem__ = _recording_getitem
for name in preload:
    try:
        importlib.import_module(name)
    except ImportError:  # not installed here: the programs import it themselves (or fail as under python)
        pass
env_class.__getitem__ = _getitem
import atexit, io, runpy, threading, types
assert threading.active_count() == 1, "a preloaded library started a thread: forking would be unsafe"
may_differ = set(json.loads(sys.argv[3]))
#: what the imports themselves set (e.g. torch's TORCHINDUCTOR_CACHE_DIR): set again in each program, as they would be
set_by_imports = {k: v for k, v in os.environ.items() if server_env.get(k) != v}
must_match = {k for k in read if k not in may_differ}


def incompatible(env):
    for key in set(env) | set(server_env):
        if key in set_by_imports and env.get(key) in (server_env.get(key), set_by_imports[key]):
            continue  # a caller that imported torch itself has torch's own setting
        interpreter = key.startswith("PYTHON") and key not in ("PYTHON", "PYTHONPATH", "PYTHONUNBUFFERED")
        if (key in must_match or interpreter) and env.get(key) != server_env.get(key):
            return key
    return None


def _pythonpath(env):
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


#: sys.path after [0] without the server's PYTHONPATH entries: a program's PYTHONPATH entries go before it
site_path = list(sys.path[1:])
for _entry in _pythonpath(server_env):
    if _entry in site_path:
        site_path.remove(_entry)


def run_program(req):
    # the caller's stdin/stdout/stderr are fds 0-2 already; the rest of the process is made the caller's
    os.setpgid(0, 0)
    os.umask(req["umask"])
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.update(set_by_imports)
    os.chdir(req["cwd"])
    sys.path[1:] = _pythonpath(req["env"]) + site_path
    unbuffered = bool(req["env"].get("PYTHONUNBUFFERED")) or "-u" in req["flags"]
    if "-B" in req["flags"]:
        sys.dont_write_bytecode = True
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=os.isatty(1),
                                  write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, errors="backslashreplace",
                                  write_through=unbuffered)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    try:
        import numpy
        numpy.random.seed(None)  # as a fresh interpreter's: not the server's state
    except ImportError:
        pass
    argv, code = req["argv"], 1
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            main.__dict__["__builtins__"] = __builtins__
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        code = -signal.SIGINT
    except BaseException:
        kind, err, tb = sys.exc_info()
        while tb is not None and (tb.tb_frame.f_code is run_program.__code__
                                  or "runpy" in tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next  # the traceback starts in the program, as under python FILE / -c
        sys.excepthook(kind, err.with_traceback(tb), tb)
        code = 1
    try:
        threading._shutdown()  # non-daemon threads are joined before atexit, as at interpreter exit
    except Exception:
        pass
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def supervise(conn):
    # one program: receive the request and the caller's open fds (0-2 and those it inherited, e.g. the pipes of a
    # multiprocessing "spawn" child), fork the program, forward signals, report its end
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            os._exit(1)
        data += more
    req = json.loads(data)
    key = incompatible(req["env"])
    if key is not None:
        conn.sendall((json.dumps({"cold": f"{key} differs from the server's"}) + "\n").encode())
        os._exit(0)
    targets = [0, 1, 2] + req["fds"]
    if len(fds) != len(targets):
        conn.sendall((json.dumps({"cold": f"{len(fds)} of {len(targets)} file descriptors arrived"}) + "\n").encode())
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        # each fd at the caller's number: first all moved above every number in play, then placed
        above = max(targets + fds) + 1
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
        for fd in fds:
            os.close(fd)
        for fd_to, fd_from in zip(targets, moved):
            os.dup2(fd_from, fd_to)
        for fd in moved:
            os.close(fd)
        run_program(req)
    for fd in fds:
        os.close(fd)
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    pidfd, pending = os.pidfd_open(pid), b""
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            _, status = os.waitpid(pid, 0)
            try:
                conn.sendall((json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n").encode())
            except OSError:
                pass
            os._exit(0)
        chunk = conn.recv(4096)
        if not chunk:  # the launcher died: so does the program (and what it started in its group)
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            os.waitpid(pid, 0)
            os._exit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                os.kill(pid, json.loads(line)["signal"])
            except ProcessLookupError:
                pass


def reap(signum, frame):
    # supervisors are waited for, so that their and their programs' CPU time is counted in the server's children
    # (and so in the test process's, as for a real interpreter it starts)
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


signal.signal(signal.SIGCHLD, reap)
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(sock_path)
server.listen(64)
sys.stdout.write(json.dumps({"ready": True}) + "\n")
sys.stdout.flush()
while True:
    ready, _, _ = select.select([server, sys.stdin], [], [])
    if sys.stdin in ready and not sys.stdin.readline():
        os._exit(0)  # the test process closed our stdin: it is done (no interpreter finalisation to wait for)
    if server in ready:
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            supervise(conn)
        conn.close()
"""

#: the launcher: the real interpreter without site-packages (a few milliseconds); ``{real}``/``{sock}`` filled in
_LAUNCHER = r"""#!{real} -S
import json, os, signal, socket, sys
REAL, SOCK = {real!r}, {sock!r}
args = sys.argv[1:]
flags = []  # the interpreter options a forked program can apply itself (multiprocessing passes -B)
while args and args[0] in ("-B", "-u"):
    flags.append(args.pop(0))


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def cold():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # (the mask would outlive the exec)
    os.execv(REAL, [REAL, *flags, *args])


if not args or (args[0].startswith("-") and args[0] not in ("-m", "-c")) or (args[0] in ("-m", "-c") and len(args) < 2):
    cold()
inherited = []  # fds beyond 0-2 that this process was started with (os.listdir's own fd is closed by now)
try:
    open_fds = sorted(int(name) for name in os.listdir("/proc/self/fd"))
except (OSError, ValueError):  # no /proc (not Linux): which fds to pass is unknown, so run the real interpreter
    cold()
for fd in open_fds:
    try:
        if fd > 2 and os.get_inheritable(fd):
            inherited.append(fd)
    except OSError:
        pass
if len(inherited) > 61:
    cold()
try:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(SOCK)
except OSError:
    cold()
umask = os.umask(0)
os.umask(umask)
req = json.dumps({{"argv": args, "cwd": os.getcwd(), "env": dict(os.environ), "umask": umask, "fds": inherited,
                  "flags": flags}})
# from here the program may start (and print) before this process can forward a signal: signals wait until it can
signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
socket.send_fds(conn, [(req + "\n").encode()], [0, 1, 2, *inherited])
answers = conn.makefile("r")
first = json.loads(answers.readline() or '{{"cold": "no answer"}}')
if "cold" in first:
    conn.close()
    if os.environ.get("WARM_PYTHON_DEBUG"):
        print("warm python: a cold start:", first["cold"], file=sys.stderr)
    cold()


def forward(signum, frame):
    try:
        conn.sendall((json.dumps({{"signal": signum}}) + "\n").encode())
    except OSError:
        pass


for s in SIGNALS:
    signal.signal(s, forward)
signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # a signal that arrived meanwhile is forwarded now
line = answers.readline()
status = json.loads(line)["status"] if line else 1
if status < 0:
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status)
"""


class WarmServer:
    """The server (started with ``env``) and its launcher, :attr:`python`; :meth:`close` ends the server."""

    def __init__(self, env: dict[str, str]):
        self.dir = tempfile.mkdtemp(prefix="warm-python-")
        sock = os.path.join(self.dir, "server.sock")
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER, sock, json.dumps(PRELOAD),
                                       json.dumps(sorted(MAY_DIFFER))], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self._proc.stdout.readline()
        if not line or not json.loads(line).get("ready"):
            raise RuntimeError(f"the warm Python server did not start (exit status {self._proc.poll()})")
        self.bin = os.path.join(self.dir, "bin")
        os.mkdir(self.bin)
        #: the launcher: use it as ``sys.executable`` would be used
        self.python = os.path.join(self.bin, "python")
        with open(self.python, "w") as f:
            f.write(_LAUNCHER.format(real=sys.executable, sock=sock))
        os.chmod(self.python, os.stat(self.python).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.symlink("python", os.path.join(self.bin, "python3"))

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)  # the socket and the launcher


#: this process's servers, by the variables set on top of :data:`_START_ENV` (``()``: none, the tests' own server)
_SERVERS: dict[tuple, WarmServer] = {}
_FAILED = False
_LOCK = threading.Lock()
#: the environment the server is started with: this process's at import (before any test changed it)
_START_ENV = dict(os.environ)


def warm_server(start_env: Optional[dict[str, str]] = None) -> Optional[WarmServer]:
    """This process's server (started on first use), or ``None`` with ``CPDAE_TESTS_COLD_PYTHON``.

    ``start_env``: variables that the programs' environment sets on top of this process's at import and that the
    preloaded libraries read while they are imported (e.g. the docs blocks' ``MPLBACKEND`` and ``HF_HUB_OFFLINE``):
    a server of its own is started with them, so that those programs start warm too (with the server of the
    process's own environment they would all be cold starts)."""
    global _FAILED
    if COLD or _FAILED:
        return None
    key = tuple(sorted((start_env or {}).items()))
    with _LOCK:
        if key not in _SERVERS:
            try:
                server = WarmServer({**_START_ENV, **dict(key)})
            except (OSError, RuntimeError) as e:  # e.g. a socket path too long: every python is the real one
                _FAILED = True
                warnings.warn(f"the warm Python server did not start ({e}); tests start the real interpreter")
                return None
            atexit.register(server.close)
            _SERVERS[key] = server
        return _SERVERS[key]


def warm_python(start_env: Optional[dict[str, str]] = None) -> str:
    """The launcher's path (``sys.executable`` with ``CPDAE_TESTS_COLD_PYTHON``): ``[warm_python(), "-m", ...]``
    (``start_env``: see :func:`warm_server`)."""
    server = warm_server(start_env)
    return sys.executable if server is None else server.python


def warm_path(env: dict[str, str], start_env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``env`` with the launcher's directory first on ``PATH``: ``python`` in a shell script is the launcher
    (``start_env``: see :func:`warm_server`)."""
    server = warm_server(start_env)
    if server is None:
        return dict(env)
    return {**env, "PATH": server.bin + os.pathsep + env.get("PATH", "")}


@contextlib.contextmanager
def warm_spawn():
    """Within the block, ``multiprocessing``'s "spawn" children (``torch.multiprocessing.spawn``) start from the
    launcher: ``python -c 'from multiprocessing.spawn import spawn_main; ...' --multiprocessing-fork`` with the
    pipes it inherits at their numbers."""
    import multiprocessing
    from multiprocessing import spawn

    before = spawn.get_executable()
    multiprocessing.set_executable(warm_python())
    try:
        yield
    finally:
        multiprocessing.set_executable(before)


def torchrun(options: list[str], program: list[str]) -> list[str]:
    """``python -m torch.distributed.run OPTIONS PROGRAM`` (``PROGRAM``: ``["-m", MODULE, ...]`` or ``[FILE, ...]``)
    with torchrun and each of its workers started by the launcher: torchrun's ``--no-python`` makes a worker
    ``launcher PROGRAM`` instead of ``python PROGRAM``."""
    py = warm_python()
    if py == sys.executable:
        return [py, "-m", "torch.distributed.run", *options, *program]
    return [py, "-m", "torch.distributed.run", *options, "--no-python", py, *program]
