"""Rebuild ``pyterrier-cpdae-bm25.jar`` from ``src/`` (run after editing the Java source).

Usage::

    python -m pyterrier_cpdae.bm25.java.build [--javac PATH] [--out JAR]

Compiles with ``javac --release 21`` (Anserini 1.7.1's Java version) against the Anserini jar that Pyserini
ships, and writes a jar holding the class files and the sources' hash (:data:`~pyterrier_cpdae.bm25.java.SOURCE_HASH_ENTRY`).
Entries get a fixed timestamp, so rebuilding unchanged sources with the same ``javac`` gives the same bytes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

from pyterrier_cpdae.bm25.java import JAR, SOURCE_HASH_ENTRY, SOURCES, source_hash

_JAVA_RELEASE = "21"
_FIXED_TIME = (2024, 1, 1, 0, 0, 0)


def find_javac() -> Optional[str]:
    """A ``javac`` of Java 21 or newer: ``$JAVA_HOME/bin/javac``, then ``javac`` on the PATH, then JDKs under /usr/lib/jvm."""
    candidates = []
    if os.environ.get("JAVA_HOME"):
        candidates.append(str(Path(os.environ["JAVA_HOME"]) / "bin" / "javac"))
    on_path = shutil.which("javac")
    if on_path:
        candidates.append(on_path)
    candidates += sorted((str(p) for p in Path("/usr/lib/jvm").glob("*/bin/javac")), reverse=True)
    for javac in candidates:
        if not os.access(javac, os.X_OK):
            continue
        out = subprocess.run([javac, "-version"], capture_output=True, text=True)
        version = (out.stdout + out.stderr).split()[-1] if out.returncode == 0 else ""
        if version.split(".")[0].isdigit() and int(version.split(".")[0]) >= int(_JAVA_RELEASE):
            return javac
    return None


def build(out: Path = JAR, javac: Optional[str] = None) -> Path:
    """Compiles ``src/`` into the jar ``out``; returns ``out``.

    Raises:
        RuntimeError: no Java 21+ ``javac`` was found, or compilation failed (javac's message included).
    """
    from pyterrier_cpdae.bm25.jvm import _anserini_jar

    javac = javac or find_javac()
    if javac is None:
        raise RuntimeError("no javac of Java 21 or newer found (set JAVA_HOME to a JDK, or pass --javac)")
    sources = sorted(str(p) for p in SOURCES.rglob("*.java"))
    with tempfile.TemporaryDirectory() as classes:
        done = subprocess.run([javac, "--release", _JAVA_RELEASE, "-encoding", "UTF-8", "-cp", _anserini_jar(),
                               "-d", classes, *sources], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"javac failed:\n{done.stdout}{done.stderr}")
        tmp = out.with_name(out.name + ".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as jar:
            manifest = zipfile.ZipInfo("META-INF/MANIFEST.MF", _FIXED_TIME)
            jar.writestr(manifest, "Manifest-Version: 1.0\r\nCreated-By: pyterrier_cpdae.bm25.java.build\r\n\r\n")
            for cls in sorted(Path(classes).rglob("*.class")):
                jar.writestr(zipfile.ZipInfo(cls.relative_to(classes).as_posix(), _FIXED_TIME), cls.read_bytes())
            jar.writestr(zipfile.ZipInfo(SOURCE_HASH_ENTRY, _FIXED_TIME), source_hash() + "\n")
        os.replace(tmp, out)
    return out


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--javac", help="the javac to use (default: found as find_javac() says)")
    parser.add_argument("--out", type=Path, default=JAR, help=f"jar to write (default: {JAR})")
    args = parser.parse_args(argv)
    print(build(args.out, args.javac))
    return 0


if __name__ == "__main__":
    sys.exit(main())
