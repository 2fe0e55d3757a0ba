"""The package's Java helper for BM25 indexing (``pyterrier_cpdae.BlobIndexer``), shipped as a small jar.

``src/`` holds the Java source; ``pyterrier-cpdae-bm25.jar`` is its compiled form (Java 21 class files), built by
``python -m pyterrier_cpdae.bm25.java.build`` (needs a JDK: ``javac``). The jar records the SHA-256 of the sources it
was built from (:data:`SOURCE_HASH_ENTRY`), so a test can tell when the shipped jar is stale.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["JAR", "SOURCES", "SOURCE_HASH_ENTRY", "source_hash"]

HERE = Path(__file__).resolve().parent
#: The compiled helper; :func:`pyterrier_cpdae.bm25.jvm.ensure_java` puts it on the JVM's class path.
JAR = HERE / "pyterrier-cpdae-bm25.jar"
#: The Java sources the jar is built from.
SOURCES = HERE / "src"
#: Entry in the jar that holds :func:`source_hash` of the sources it was compiled from.
SOURCE_HASH_ENTRY = "pyterrier_cpdae/SOURCE.sha256"


def source_hash(root: Path = SOURCES) -> str:
    """SHA-256 over the ``.java`` files under ``root`` (their paths relative to ``root`` and their bytes, sorted)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.java")):
        digest.update(path.relative_to(root).as_posix().encode("utf-8") + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()
