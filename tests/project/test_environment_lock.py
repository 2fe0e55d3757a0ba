"""The environment lock (requirements/lock.txt) is what the README's commands and CI install."""
from __future__ import annotations

import os
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "lock.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)$")


def locked() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for n, line in enumerate(LOCK.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        m = PIN.match(line.strip())
        assert m, f"requirements/lock.txt line {n}: {line!r} is not an exact pin name==version"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"requirements/lock.txt line {n}: {name} is pinned twice"
        pins[name] = Version(m.group(2))
    return pins


def project_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra, items in project["optional-dependencies"].items():
        if extra != "gpu":              # faiss-gpu is for GPU machines: the lock is the CPU environment
            reqs += [Requirement(r) for r in items]
    return reqs


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)[:2]]


def test_every_project_requirement_is_locked_within_its_range():
    pins = locked()
    for req in project_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req} (pyproject.toml) is not in requirements/lock.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"requirements/lock.txt pins {name}=={pins[name]}, outside pyproject.toml's {req}"


def test_the_readme_commands_and_ci_install_from_the_lock_with_its_torch():
    torch = f'"torch=={locked()["torch"]}"'
    commands = readme_commands()
    assert len(commands) == 2, "the README opens with two bash blocks: the main job and the tests"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    for command in commands:
        install, run = command.split(" && ")
        assert install.startswith("pip install -c requirements/lock.txt ") and torch in install, \
            f"the README's {install!r} does not install from the lock with {torch}"
        assert install in ci and run in ci, f".ci/run does not run the README's command {command!r}"
    assert any(re.match(r"python3? -m venv ", line) for line in ci), ".ci/run does not build a new virtualenv"
    assert "requirements/lock.txt" in (REPO / "requirements" / "refresh_lock.sh").read_text()


def test_a_pin_outside_the_project_range_is_reported(tmp_path, monkeypatch):
    """The range check itself: a lock pinning pyterrier 2.0 breaks pyproject's ``pyterrier==1.1.*``."""
    fake = tmp_path / "lock.txt"
    fake.write_text(LOCK.read_text().replace(f"pyterrier=={locked()['pyterrier']}", "pyterrier==2.0.0"))
    monkeypatch.setattr(sys.modules[__name__], "LOCK", fake)
    with pytest.raises(AssertionError, match=r"pins pyterrier==2\.0\.0, outside"):
        test_every_project_requirement_is_locked_within_its_range()


@pytest.mark.skipif(not os.environ.get("CI"), reason="not the locked environment: CI (.ci/run) installs it afresh")
def test_the_installed_environment_is_the_lock():
    """In CI's new virtualenv every locked package that got installed has exactly the locked version."""
    differ = []
    for name, want in locked().items():
        try:
            have = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue                    # an extra this command did not ask for (e.g. bench)
        if Version(have.base_version if name == "torch" else str(have)) != want:
            differ.append(f"{name} {have} (lock: {want})")
    assert not differ, "installed versions differ from requirements/lock.txt: " + ", ".join(differ)
