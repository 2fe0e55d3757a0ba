"""The tests' guard of ``../shared``: only real-data tests may read the real data (docs/development.md, "Real data").

``tests/conftest.py`` loads this file and puts its folder first on ``PYTHONPATH``, so that every Python process a test
starts (directly or through the warm interpreter, ``tests/helpers/warm_python.py``) imports it as ``sitecustomize`` too. It
adds an audit hook (:func:`sys.addaudithook`) that refuses to open or list anything under ``CPDAE_TESTS_SHARED_ROOT``
(the real path of ``../shared``) while ``CPDAE_TESTS_SHARED`` is ``deny``, which conftest sets for each test that is
neither given the ``shared_data`` fixture (or one of its collections) nor marked ``real_data``. A refused access
raises :class:`SharedDataTouched` (not an ``OSError``, so that no ``except OSError`` takes it for an absent file) and
is recorded in :data:`SEEN` (``sys._cpdae_shared_guard``), which conftest checks after each test phase. Cheap: one string test per ``open`` event.
Existence checks (``os.stat``, ``Path.exists``) are not audited, so a test may still look whether the data is there.
"""
import os
import sys

ROOT_ENV, MODE_ENV = "CPDAE_TESTS_SHARED_ROOT", "CPDAE_TESTS_SHARED"
EVENTS = {"open", "os.listdir", "os.scandir", "shutil.copytree"}
#: paths refused in this process (conftest fails the test that touched them, even if the error was caught)
SEEN = []


class SharedDataTouched(RuntimeError):
    pass


def touches(path, root):
    """Whether ``path`` (str, bytes or path-like; relative to the working directory) lies under ``root``."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    elif hasattr(path, "__fspath__"):
        path = os.fspath(path)
    if not isinstance(path, str) or not path or os.path.basename(root) not in path:
        return False   # the cheap test first: every import opens files
    real = os.path.realpath(path)
    return real == root or real.startswith(root + os.sep)


def _hook(event, args):
    if event not in EVENTS or not args or os.environ.get(MODE_ENV) != "deny":
        return
    root = os.environ.get(ROOT_ENV)
    if root and touches(args[0], root):
        path = os.fsdecode(os.fspath(args[0])) if not isinstance(args[0], str) else args[0]
        SEEN.append(path)
        raise SharedDataTouched(f"{path} is under ../shared, which only real-data tests may read: give the test the "
                                "shared_data fixture (or one of its collections) or mark it real_data, so that it "
                                "skips with its reason where ../shared/data is absent (docs/development.md)")


def _chain():
    """Run the ``sitecustomize`` this one hides (a later entry of ``sys.path``), if there is one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == here:
            continue
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [entry])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if os.environ.get(ROOT_ENV) and not hasattr(sys, "_cpdae_shared_guard"):
    sys._cpdae_shared_guard = SEEN   # one hook per process, whichever way this file was loaded first
    sys.addaudithook(_hook)
if __name__ == "sitecustomize":
    _chain()
