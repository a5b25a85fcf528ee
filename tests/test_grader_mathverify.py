"""harness/data/mathverify.py: Math-Verify next to our grader on the project's own grader cases, its safety setting,
and `--grader math-verify` in eval.py. math-verify is a test dependency (README, Tests)."""
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.data import mathverify

ROOT = Path(__file__).resolve().parent.parent
# every test but the missing-package one runs Math-Verify itself: without it they skip, naming the package
needs_math_verify = pytest.mark.skipif(not mathverify.installed(), reason=f"needs math-verify ({mathverify.INSTALL})")


@pytest.fixture(scope="module")
def comparison():
    return mathverify.compare(mathverify.project_cases(), repeats=1)


@needs_math_verify
def test_the_comparison_covers_every_labelled_case_and_docs_state_its_agreement(comparison):
    """Both graders on tests/test_grader.py's and tests/test_grader_numina.py's cases; docs/grader.md states the
    agreement this measures (math-verify is pinned, so the count is exact)."""
    import test_grader
    import test_grader_numina

    assert comparison["pairs"] == len(test_grader.GRADE_CASES) + sum(
        len(getattr(test_grader_numina, n)) for n in ("NAMED", "RECORDS", "LISTS", "INEQUALITIES", "EQUATIONS",
                                                       "NOTATION", "LONG_DECIMALS", "DELIBERATE", "DEBATABLE"))
    assert comparison["ours_match_labels"] == comparison["pairs"]
    assert comparison["agree"] == comparison["mv_match_labels"]   # ours = the labels, so agreement = theirs
    assert 0.80 <= comparison["agree"] / comparison["pairs"] < 1.0
    doc = (ROOT / "docs" / "grader.md").read_text()
    stated = re.search(r"agree on (\d+) of (\d+)\s+pairs", doc)
    assert stated and (int(stated[1]), int(stated[2])) == (comparison["agree"], comparison["pairs"])


@needs_math_verify
def test_the_two_agree_on_plain_answers():
    grade = mathverify.MathVerifyGrader()
    try:
        verdicts = grade.grade_many([("So \\boxed{\\frac{1}{2}}", "0.5"), ("The answer is \\boxed{42}.", "42"),
                                     ("\\boxed{41}", "42"), ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"), ("no box", "7")])
    finally:
        grade.close()
    assert verdicts == [True, True, False, True, False]


@needs_math_verify
def test_model_text_never_reaches_parse_expr(monkeypatch):
    """Only the LaTeX extraction is on: math-verify's ExprExtractionConfig (sympy's parse_expr, an eval) is not."""
    import math_verify.parser as mv_parser

    calls = []
    monkeypatch.setattr(mv_parser, "parse_expr", lambda *a, **k: calls.append(a) or 0)
    monkeypatch.setattr(mv_parser, "parse_expr_cached", lambda *a, **k: calls.append(a) or 0)
    for text in ("__import__('os').system('true')", "2*x + 1", "The answer is x**2", "\\boxed{x^2}"):
        mathverify._verify(text, "x^2", timeout=5)
    assert calls == []


@needs_math_verify
def test_bad_input_grades_false():
    assert mathverify._verify(None, "1", 5) is False and mathverify._verify("\\boxed{1}", b"1", 5) is False


@needs_math_verify
def test_a_call_past_the_hard_limit_grades_false_and_the_grader_goes_on():
    grade = mathverify.MathVerifyGrader(hard_timeout=0.001)   # shorter than starting the child process
    try:
        assert grade.grade_many([("\\boxed{1}", "1"), ("\\boxed{2}", "2")]) == [False, False]
        grade.hard_timeout = 60.0
        assert grade("\\boxed{3}", "3") is True
    finally:
        grade.close()


def test_missing_package_and_unknown_name_are_one_line(monkeypatch):
    from harness.data.grader import grade

    assert mathverify.for_name("ours") is grade
    with pytest.raises(SystemExit, match="--grader nope: choose one of ours, math-verify"):
        mathverify.for_name("nope")
    monkeypatch.setattr(mathverify, "installed", lambda: False)
    with pytest.raises(SystemExit, match="pip install math-verify==0.9.0"):
        mathverify.for_name("math-verify")


@needs_math_verify
def test_eval_grades_with_the_grader_it_is_given():
    import eval
    from harness.run import eval_cli

    class Generator:
        def generate(self, prompts, **kw):
            return [[SimpleNamespace(text="so \\boxed{0.3333333333}", ids=[1], finished=True)] for _ in prompts]

    tokenizer = SimpleNamespace(chat_template=None, encode=lambda text, add_special_tokens=False: [1])
    problems = [{"id": 0, "question": "q", "answer": "\\frac13"}]
    assert eval.evaluate(Generator(), tokenizer, problems)["acc"] == 0.0   # ours: a short decimal is not 1/3
    grade = mathverify.for_name("math-verify")
    try:   # Math-Verify rounds to 6 digits: equal
        assert eval.evaluate(Generator(), tokenizer, problems, grade_fn=grade)["acc"] == 1.0
    finally:
        grade.close()
    assert eval_cli.parse_args(["--model", "m", "--grader", "math-verify"]).grader == "math-verify"
