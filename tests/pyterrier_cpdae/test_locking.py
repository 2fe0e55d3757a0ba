"""The build lock: a second writer in another process is refused at once, whatever path it takes to the artifact,
with a message naming the holder; a dead holder frees it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from pyterrier_cpdae._locking import ConcurrentBuildError, build_lock, holder, lock_path

_HOLD = textwrap.dedent("""
    import sys, time
    from pyterrier_cpdae._locking import build_lock
    with build_lock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
""")

# holds only an flock of the directory itself, as a build reaching it through another mount (a bind mount) does:
# its lock file would then lie beside the other mount point, where this process cannot see it
_HOLD_DIR = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def _holder(path, seconds, script=_HOLD):
    proc = subprocess.Popen([sys.executable, "-c", script, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_process_is_refused_while_the_first_holds_the_lock(tmp_path):
    target = tmp_path / "idx"
    proc = _holder(target, 30)
    try:
        with pytest.raises(ConcurrentBuildError, match=rf"idx is being built by pid {proc.pid} on host "
                                                       rf"{socket.gethostname()} since \d{{4}}-\d\d-\d\dT") as e:
            with build_lock(target):
                pass
        assert "overwrite" not in str(e.value)
        assert holder(target)["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert holder(target) is None  # the record of a dead holder is never reported
    # the OS dropped the dead holder's lock: no stale lock survives a kill -9
    with build_lock(target) as lock:
        assert lock == lock_path(target)
        assert holder(target)["pid"] == os.getpid()  # a probe sees this process's own build too
    assert holder(target) is None
    assert not target.exists()  # the lock lives beside the directory, never inside it


@pytest.mark.parametrize("spelling", ["symlink", "dotdot", "dir-symlink-dotdot"])
def test_the_same_directory_by_another_path_is_refused(tmp_path, spelling):
    """The lock was keyed on the unresolved path, so a symlink to the index got a second lock."""
    real = tmp_path / "a" / "idx"
    (real / "sub").mkdir(parents=True)
    if spelling == "symlink":
        other = tmp_path / "link"
        other.symlink_to(real, target_is_directory=True)
    elif spelling == "dotdot":
        other = tmp_path / "a" / ".." / "a" / "idx" / "sub" / ".."  # Path keeps '..': its last part was '..'
    else:
        (tmp_path / "b").symlink_to(real / "sub", target_is_directory=True)
        other = tmp_path / "b" / ".."  # '..' of a symlink is the parent of its target: a/idx
    assert os.path.samefile(other, real)
    proc = _holder(real, 30)
    try:
        with pytest.raises(ConcurrentBuildError, match=rf"being built by pid {proc.pid} "):
            with build_lock(other):
                pass
        assert holder(other)["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()
    # and the other way round: the holder reached it through the other spelling
    proc = _holder(other, 30)
    try:
        with pytest.raises(ConcurrentBuildError, match=rf"being built by pid {proc.pid} "):
            with build_lock(real):
                pass
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.name == "nt", reason="POSIX flock of a directory")
def test_a_lock_on_the_directory_itself_is_respected(tmp_path):
    """A build that reached the directory through another mount holds the directory's own lock."""
    target = tmp_path / "idx"
    target.mkdir()
    proc = _holder(target, 30, _HOLD_DIR)
    try:
        with pytest.raises(ConcurrentBuildError, match="being built by another process"):
            with build_lock(target):
                pass
        assert holder(target) == {}
    finally:
        proc.kill()
        proc.wait()
    with build_lock(target):
        pass


def test_lock_is_released_after_the_block(tmp_path):
    with build_lock(tmp_path / "a"):
        pass
    with build_lock(tmp_path / "a"):
        pass
    assert holder(tmp_path / "a") is None
