"""The documentation cannot rot: every code block of README.md and docs/*.md marked runnable is run, and
every relative link (file and #anchor) resolves.

The convention (docs/development.md, "Runnable documentation"): a fenced block whose info string is
``python runnable`` or ``bash runnable`` (optionally followed by ``needs-shared-data``) is run.  The
blocks of one page run in order, each in a fresh process (``python FILE`` or ``bash -euo pipefail FILE``;
``python`` in both is ``tests/helpers/warm_python.py``'s launcher: a process of its own forked from an interpreter that
imported the third-party libraries, torch and transformers among them, once, about 8 CPU-seconds less per
``python``, the project's own packages still imported by the program; ``CPDAE_TESTS_COLD_PYTHON=1`` runs the real
interpreter),
all in the same new temporary working directory, so a block can use the files an earlier block of its
page wrote (a model, an index).  ``PYTHONPATH`` holds the repository root; ``../shared`` (the real data
beside the project) and ``experiments/configs`` are linked into place, so paths written relative to the
repository root work.  A ``needs-shared-data`` block is skipped when ``../shared/data`` is absent (no
other block may depend on it).  Pages run two at a time (``DOCS_EXAMPLES_WORKERS``).

``python -m tests.project.test_docs_examples`` lists the runnable blocks (``--run PAGE`` runs one page's).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.warm_python import warm_path, warm_python

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
DOCS = REPO / "docs"
#: the pages whose code blocks and links are checked
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
#: pages that need no runnable example of their own (a table of contents)
NO_EXAMPLE_NEEDED = {DOCS / "index.md"}
LANGS = {"python", "bash"}
FLAGS = {"needs-shared-data"}
#: the most one block may take (seconds); a busy machine may need more: DOCS_EXAMPLES_TIMEOUT
BLOCK_TIMEOUT_S = int(os.environ.get("DOCS_EXAMPLES_TIMEOUT", 600))
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass
class Block:
    path: Path
    line: int           # 1-based line of the opening fence
    lang: str
    flags: frozenset
    code: str

    @property
    def where(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def fenced_blocks(text: str):
    """Yield ``(line, info_words, code_lines)`` for every fenced code block (line of the opening fence, 1-based)."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start, body = m["fence"], i, []
        i += 1
        while i < len(lines) and not (lines[i].startswith(fence[0] * len(fence)) and not lines[i].strip(fence[0]).strip()):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"line {start + 1}: code block opened with {fence} is never closed")
        yield start + 1, m["info"].split(), body
        i += 1


def runnable_blocks(path: Path) -> list[Block]:
    """The blocks of one Markdown file marked runnable; a malformed marker is an error naming file and line."""
    found = []
    for line, words, body in fenced_blocks(path.read_text(encoding="utf-8")):
        if not any("run" in w.lower() or w in FLAGS for w in words):       # near misses ("runable") are refused below
            continue
        where = f"{_rel(path)}:{line}"
        if len(words) < 2 or words[1] != "runnable" or words[0] not in LANGS:
            raise ValueError(f"{where}: a runnable block's info string is 'python runnable' or 'bash runnable' "
                             f"(then optional flags {sorted(FLAGS)}), got {' '.join(words)!r}")
        unknown = set(words[2:]) - FLAGS
        if unknown:
            raise ValueError(f"{where}: unknown flag(s) {sorted(unknown)} after 'runnable'; known: {sorted(FLAGS)}")
        found.append(Block(path, line, words[0], frozenset(words[2:]), "\n".join(body) + "\n"))
    return found


def _workdir(root: Path) -> Path:
    """``root/work`` with ``root/shared`` -> ../shared and ``work/experiments/configs`` linked into place."""
    work = root / "work"
    (work / "experiments").mkdir(parents=True)
    (work / "experiments" / "configs").symlink_to(REPO / "experiments" / "configs", target_is_directory=True)
    if SHARED.exists():
        (root / "shared").symlink_to(SHARED, target_is_directory=True)
    return work


#: what every block's environment sets; matplotlib and huggingface_hub read some of them when imported, so the blocks'
#: warm interpreter is a server started with them (``warm_python(BLOCK_ENV)``): with the tests' own server, whose
#: environment lacks them, every ``python`` of a block would be a cold start
BLOCK_ENV = {"MPLBACKEND": "Agg", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(BLOCK_ENV)
    return env


def _text(out) -> str:
    return out.decode("utf-8", "replace") if isinstance(out, bytes) else (out or "")


def run_blocks(blocks: list[Block], root: Path) -> list[Block]:
    """Run ``blocks`` (one page's, in order) in a new working directory under ``root``.

    Returns the blocks skipped for want of ``../shared/data``; a failing block fails the test with its file,
    line and output."""
    work, scripts = _workdir(root), root / "blocks"
    scripts.mkdir()
    env, skipped = _env(), []
    for b in blocks:
        if "needs-shared-data" in b.flags and not (SHARED / "data").is_dir():
            skipped.append(b)
            continue
        script = scripts / f"line{b.line}.{'py' if b.lang == 'python' else 'sh'}"
        script.write_text(b.code, encoding="utf-8")
        cmd = [warm_python(BLOCK_ENV), str(script)] if b.lang == "python" else ["bash", "-euo", "pipefail", str(script)]
        # the guard of ../shared (tests/conftest.py): only a block flagged needs-shared-data may read it
        block_env = env if "CPDAE_TESTS_SHARED" not in env else {
            **env, "CPDAE_TESTS_SHARED": "allow" if "needs-shared-data" in b.flags else "deny"}
        try:
            out = subprocess.run(cmd, cwd=work, env=warm_path(block_env, BLOCK_ENV), capture_output=True, text=True,
                                 timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{b.where}: the {b.lang} block did not finish within {BLOCK_TIMEOUT_S} s\n"
                        f"{_text(e.stdout)[-3000:]}\n{_text(e.stderr)[-3000:]}", pytrace=False)
        if out.returncode != 0:
            pytest.fail(f"{b.where}: the {b.lang} block failed (exit status {out.returncode})\n"
                        f"--- code ---\n{b.code}--- stdout (tail) ---\n{out.stdout[-3000:]}\n"
                        f"--- stderr (tail) ---\n{out.stderr[-5000:]}", pytrace=False)
    return skipped


# --------------------------------------------------------------------------------------------- the examples
PAGES_WITH_EXAMPLES = [p for p in PAGES if p not in NO_EXAMPLE_NEEDED]
#: pages run at the same time (each block is mostly one busy core: imports, a small model)
WORKERS = int(os.environ.get("DOCS_EXAMPLES_WORKERS", min(2, os.cpu_count() or 1)))


def run_page(page: Path, root: Path) -> str:
    """Run one page's runnable blocks; returns a skip reason ('' if none was skipped), fails on a failing block."""
    blocks = runnable_blocks(page)
    if not blocks:
        pytest.fail(f"{_rel(page)} has no runnable example (mark one 'python runnable' or 'bash runnable')",
                    pytrace=False)
    skipped = run_blocks(blocks, root)
    if not skipped:
        return ""
    return (f"{len(blocks) - len(skipped)} block(s) passed; skipped {', '.join(b.where for b in skipped)}: "
            f"real data not available ({SHARED / 'data'} is absent)")


class _LazyRuns(dict):
    """``{page: future}`` that starts a page's run when its test asks for it (one page at a time)."""

    def __init__(self, pool, root_of):
        super().__init__()
        self.pool, self.root_of = pool, root_of

    def __missing__(self, page):
        self[page] = self.pool.submit(run_page, page, self.root_of(page))
        return self[page]


def _whole_file_on_this_process(config) -> bool:
    """Whether every selected test of this file runs in this process: no pytest-xdist worker, or one that is given
    whole files (``--dist loadfile``/``loadscope``, the configured default). Under ``--dist load`` a worker gets
    only some pages, and starting all of them would run every page once per worker."""
    if not hasattr(config, "workerinput"):
        return True
    return config.getoption("dist", "no") in ("loadfile", "loadscope")


@pytest.fixture(scope="module")
def page_runs(request, tmp_path_factory):
    """The selected pages' runs, started together on ``WORKERS`` threads (one subprocess each at a time); on a
    pytest-xdist worker that gets single tests, each page is run when its test comes."""
    root_of = lambda page: tmp_path_factory.mktemp(page.stem)  # noqa: E731
    if not _whole_file_on_this_process(request.config):
        pool = ThreadPoolExecutor(max_workers=1)
        yield _LazyRuns(pool, root_of)
        pool.shutdown(wait=True, cancel_futures=True)
        return
    selected = [item.callspec.params["page"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_runnable_blocks_of_page"]
    pool = ThreadPoolExecutor(max_workers=max(1, WORKERS))
    runs = {page: pool.submit(run_page, page, root_of(page)) for page in selected}
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.multiproc
@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=[_rel(p) for p in PAGES_WITH_EXAMPLES])
def test_runnable_blocks_of_page(page: Path, page_runs):
    skipped = page_runs[page].result()          # re-raises the page's failure (file:line, code, output)
    if skipped:
        pytest.skip(skipped)


def test_every_page_has_a_well_formed_runnable_example():
    for page in PAGES_WITH_EXAMPLES:
        assert runnable_blocks(page), f"{_rel(page)} has no runnable example"


def test_all_pages_are_checked():
    """docs/index.md and the README link every docs page, and this test covers each one."""
    index, readme = (DOCS / "index.md").read_text(), (REPO / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "index.md":
            assert f"]({page.name})" in index, f"docs/index.md does not link {page.name}"
            assert f"](docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"


def test_a_failing_block_is_reported_with_file_and_line(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python runnable\nprint('ok')\nopen('made.txt', 'w').write('x')\n```\n\n"
                    "text\n\n```bash runnable\ntest -f made.txt   # the earlier block's file is here\n"
                    "false\n```\n\n```python\nraise SystemExit(1)  # not runnable: never run\n```\n")
    blocks = runnable_blocks(page)
    assert [(b.line, b.lang) for b in blocks] == [(3, "python"), (10, "bash")]
    with pytest.raises(pytest.fail.Exception, match=rf"{re.escape(str(page))}:10: the bash block failed \(exit status 1\)"):
        run_blocks(blocks, tmp_path / "run")


def test_malformed_markers_are_refused(tmp_path: Path):
    page = tmp_path / "page.md"
    for info, msg in [("python runable", "info string"), ("runnable python", "info string"),
                      ("ruby runnable", "info string"), ("python runnable needs-data", "unknown flag")]:
        page.write_text(f"intro\n\n```{info}\npass\n```\n")
        with pytest.raises(ValueError, match=rf"page.md:3: .*{msg}"):
            runnable_blocks(page)
    page.write_text("```python runnable\npass\n")
    with pytest.raises(ValueError, match="never closed"):
        runnable_blocks(page)


# --------------------------------------------------------------------------------------------- links
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*(?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text without markup, lower-cased, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # a link: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    code = {ln for start, _, body in fenced_blocks(text) for ln in range(start, start + len(body) + 2)}
    seen: dict[str, int] = {}
    for n, line in enumerate(text.split("\n"), 1):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and n not in code:
            slug = github_slug(m[1])
            k = seen.get(slug, 0)
            seen[slug] = k + 1
            if k:
                seen[f"{slug}-{k}"] = 1
    return set(seen)


def relative_links(path: Path):
    """``(line, target)`` of every link and image outside code (fenced blocks and inline code spans)."""
    text = path.read_text(encoding="utf-8")
    code = {ln for start, _, body in fenced_blocks(text) for ln in range(start, start + len(body) + 2)}
    for n, line in enumerate(text.split("\n"), 1):
        if n in code:
            continue
        for m in _LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = m["target"]
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto: ...
                yield n, target


@pytest.mark.parametrize("page", PAGES, ids=[_rel(p) for p in PAGES])
def test_relative_links_resolve(page: Path):
    broken = []
    for line, target in relative_links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{_rel(page)}:{line}: {target}: no such file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{_rel(page)}:{line}: {target}: no heading with anchor #{anchor} in {_rel(dest)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_link_checker_finds_broken_links_and_anchors(tmp_path: Path):
    (tmp_path / "b.md").write_text("# Decoder bias (default: `prior`)\n\n## Two\n\n## Two\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#decoder-bias-default-prior) [dup](b.md#two-1) `[code](nowhere.md)`\n"
                    "[gone](missing.md) ![img](b.md#nope) [web](https://example.org/x)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert list(relative_links(page)) == [(1, "b.md#decoder-bias-default-prior"), (1, "b.md#two-1"),
                                          (2, "missing.md"), (2, "b.md#nope")]
    assert anchors(tmp_path / "b.md") == {"decoder-bias-default-prior", "two", "two-1"}


# --------------------------------------------------------------------------------------------- the two commands
def test_readme_opens_with_the_two_commands_that_ci_runs():
    """The README's first two code blocks are the main job and the tests; .ci/run runs the second."""
    blocks = list(fenced_blocks((REPO / "README.md").read_text()))
    (_, info1, main_job), (_, info2, tests) = blocks[:2]
    assert info1 == info2 == ["bash"]
    assert main_job == ['pip install -c requirements/lock.txt "torch==2.13.0" -e ".[demo]" && python experiments/main.py']
    install, run = tests[0].split(" && ")
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert install in ci and run in ci, f".ci/run does not run the README's test command {tests[0]!r}"


if __name__ == "__main__":      # list the runnable blocks, or run one page's: python -m tests.project.test_docs_examples [--run PAGE]
    if len(sys.argv) == 3 and sys.argv[1] == "--run":
        page = Path(sys.argv[2]).resolve()
        with tempfile.TemporaryDirectory() as d:
            left = run_blocks(runnable_blocks(page), Path(d))
        print(f"{_rel(page)}: all runnable blocks passed" + (f" ({len(left)} skipped: no ../shared/data)" if left else ""))
    else:
        for p in PAGES:
            for b in runnable_blocks(p):
                print(f"{b.where}\t{b.lang}\t{' '.join(sorted(b.flags))}")
