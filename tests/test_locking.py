"""The build lock: a second writer in another process is refused at once; a dead holder frees it."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pyterrier_cpdae._locking import ConcurrentBuildError, build_lock, lock_path

_HOLD = textwrap.dedent("""
    import sys, time
    from pyterrier_cpdae._locking import build_lock
    with build_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
""")


def _holder(path, seconds):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_process_is_refused_while_the_first_holds_the_lock(tmp_path):
    target = tmp_path / "idx"
    proc = _holder(target, 30)
    try:
        with pytest.raises(ConcurrentBuildError, match=r"another process is building .*idx"):
            with build_lock(target):
                pass
    finally:
        proc.kill()
        proc.wait()
    # the OS dropped the dead holder's lock: no stale lock survives a kill -9
    with build_lock(target) as lock:
        assert lock == lock_path(target)
    assert not target.exists()  # the lock lives beside the directory, never inside it


def test_lock_is_released_after_the_block(tmp_path):
    with build_lock(tmp_path / "a"):
        pass
    with build_lock(tmp_path / "a"):
        pass
