"""The contract of exercises.py (the generated course assignment).

- On a copy with every exercise stubbed, exactly the tests `exercises.expected_failures` names fail, each
  with NotImplementedError (for a subprocess run: in its output), and every other test passes. One pytest
  subprocess over the whole copy (about as long as the suite itself).
- `--only` stubs one exercise and leaves every other line of the repository as it is.
- The markers in the reference are balanced, each exercise has a region, and removing the markers
  leaves the reference code unchanged; bad markers are errors naming the file and line.
- `--list` prints the table; unknown names are one-line errors.
When this test fails after a new test was added, its message lists the unexpected and the missing
failures: add the new node ids to the right exercise's `tests` or `breaks` in exercises.EXERCISES.
"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import exercises  # noqa: E402


def run_pytest(copy, args, junit):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           "-o", "junit_logging=all", *args], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=1800)


def outcomes(junit):
    """{node id: (failed, NotImplementedError seen in its failure text or captured output)}"""
    out = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        node = tc.get("classname").replace(".", "/") + ".py::" + tc.get("name")
        node = node if node.startswith("tests/") else "tests/" + node    # ids relative to tests/ (pytest.ini's folder)
        failed = any(c.tag in ("failure", "error") for c in tc)
        text = " ".join((c.get("message") or "") + (c.text or "") for c in tc)
        out[node] = (failed, "NotImplementedError" in text)
    return out


def contract_problems(results, expected, files=None):
    """Lines describing every breach of the contract (empty: it holds). `files` limits `expected` to the
    test files that were run."""
    def listed(node):
        return any(node == t or node.startswith(t + "[") for t in expected)

    if files is not None:
        expected = {t for t in expected if t.split("::")[0] in files}
    failed = {n for n, (f, _) in results.items() if f}
    problems = [f"unexpected failure (not in exercises.EXERCISES): {n}" for n in sorted(failed) if not listed(n)]
    problems += [f"failed without NotImplementedError: {n}" for n in sorted(failed)
                 if listed(n) and not results[n][1]]
    for t in sorted(expected):
        matching = [n for n in results if n == t or n.startswith(t + "[")]
        if not matching:
            problems.append(f"mapped test not collected (renamed or removed?): {t}")
        problems += [f"expected to fail but passed: {n}" for n in matching if not results[n][0]]
    return problems


def test_stubbed_copy_fails_exactly_the_mapped_tests(tmp_path):
    out = tmp_path / "assignment"
    changed = exercises.generate(str(out))
    assert sorted(changed) == ["grpo.py", "prm.py", "refine.py"]
    assert not (out / "tools" / "exercises.py").exists() and not (out / "tests" / "test_exercises.py").exists()
    for name in ("grpo.py", "prm.py", "refine.py"):
        lines = (out / name).read_text().splitlines()
        assert not any(exercises.BEGIN.match(ln) or exercises.END.match(ln) for ln in lines), name
    assert "| `step_token_spans` |" in (out / "EXERCISES.md").read_text()
    junit = tmp_path / "junit.xml"
    proc = run_pytest(out, ["tests"], junit)
    results = outcomes(junit)
    assert len(results) > 100, proc.stdout[-3000:]
    problems = contract_problems(results, exercises.expected_failures([e.name for e in exercises.EXERCISES]))
    assert not problems, "the generated assignment breaks the contract:\n" + "\n".join(problems)
    n_failed = sum(f for f, _ in results.values())
    assert n_failed >= 9 and proc.returncode == 1


def test_only_one_exercise_changes_only_its_region(tmp_path):
    out = tmp_path / "hw"
    proc = subprocess.run([sys.executable, "-m", "tools.exercises", "--out", str(out),
                           "--only", "keep_ratio"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for rel in exercises.repo_files(ROOT):
        if not rel.endswith(".py"):
            continue
        ref = open(os.path.join(ROOT, rel), encoding="utf-8").read()
        unmarked, _ = exercises.stub_source(ref, set(), rel)
        got = (out / rel).read_text(encoding="utf-8")
        if rel != "prm.py":
            assert got == unmarked, f"{rel} changed although only keep_ratio was chosen"
    prm = (out / "prm.py").read_text()
    assert prm.count("raise NotImplementedError('exercise 2 (keep_ratio)") == 2
    assert "NotImplementedError('exercise 1" not in prm and "for k, s in enumerate(scores)" in prm
    junit = tmp_path / "junit.xml"
    run_pytest(out, ["tests/test_prm.py", "tests/test_grpo.py"], junit)
    results = outcomes(junit)
    problems = contract_problems(results, exercises.expected_failures(["keep_ratio"]),
                                 files={"tests/test_prm.py", "tests/test_grpo.py"})
    assert not problems, "--only keep_ratio breaks the contract:\n" + "\n".join(problems)
    assert {n for n, (f, _) in results.items() if f} == {"tests/test_prm.py::test_keep_ratio",
                                                          "tests/test_prm.py::test_select_candidate"}


def test_reference_markers_are_balanced_and_cover_every_exercise():
    found = set()
    for rel in exercises.repo_files(ROOT):
        if rel.endswith(".py") and rel not in exercises.NOT_COPIED:
            text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
            unmarked, names = exercises.stub_source(text, set(), rel)
            found |= names
            kept = [ln for ln in text.splitlines() if not exercises.BEGIN.match(ln) and not exercises.END.match(ln)]
            assert unmarked.splitlines() == kept  # nothing but the marker lines is removed
    assert found == set(exercises.BY_NAME)
    for e in exercises.EXERCISES:
        assert e.tests and set(e.depends) <= set(exercises.BY_NAME) and 1 <= e.difficulty <= 4
    assert [e.difficulty for e in exercises.EXERCISES][0] == 1 and exercises.EXERCISES[-1].difficulty == 4


@pytest.mark.parametrize("text, match", [
    ("def f():\n    # BEGIN SOLUTION update\n    return 1\n", "has no END SOLUTION"),
    ("    # END SOLUTION\n", "without a BEGIN"),
    ("# BEGIN SOLUTION update\n# BEGIN SOLUTION splice\n# END SOLUTION\n", "inside the region"),
    ("# BEGIN SOLUTION no_such_exercise\n# END SOLUTION\n", "unknown exercise 'no_such_exercise'"),
])
def test_bad_markers_name_file_and_line(text, match):
    with pytest.raises(ValueError, match=match) as err:
        exercises.stub_source(text, set(), "x.py")
    assert str(err.value).startswith("x.py:")


def test_stub_keeps_indentation_and_names_the_tests(tmp_path):
    src = "def f(x):\n    '''doc'''\n    if x:\n        # BEGIN SOLUTION splice\n        return 2\n        # END SOLUTION\n    return 1\n"
    out, names = exercises.stub_source(src, {"splice"}, "x.py")
    assert names == {"splice"}
    assert out.startswith("def f(x):\n    '''doc'''\n    if x:\n        raise NotImplementedError('exercise 9 (splice)")
    assert "tests/test_refine.py::test_splice_eos_and_truncation" in out and out.endswith("    return 1\n")
    (tmp_path / "stubbed_mod.py").write_text(out)  # the stubbed file is valid Python and raises when called
    sys.path.insert(0, str(tmp_path))
    try:
        import stubbed_mod
        with pytest.raises(NotImplementedError, match="exercise 9"):
            stubbed_mod.f(True)
        assert stubbed_mod.f(False) == 1
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("stubbed_mod", None)


def test_cli_list_and_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tools.exercises", "--list"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0
    for e in exercises.EXERCISES:
        assert f"`{e.name}`" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "tools.exercises", "--out", str(tmp_path / "x"),
                           "--only", "keep_ratio,nope"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "unknown exercise(s) ['nope']" in proc.stderr
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        exercises.generate(str(tmp_path / "full"))
