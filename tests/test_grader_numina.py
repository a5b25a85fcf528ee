"""Tests of grader.py's NuminaMath / OpenR1 conventions: one test per kind of answer, each with
equal pairs and near misses that must stay wrong, plus the deliberate non-equalities, the two debatable
choices and adversarial inputs for every new path. All examples are our own.

Each case is (model's final answer, gold, expected); the answer is wrapped in a response with a \\boxed{}.
Equal pairs are also checked with the roles swapped: every new rule is symmetric."""
import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.data import grader as G


def boxed(answer: str) -> str:
    return f"We work it out.\n\nHence the answer is \\boxed{{{answer}}}."


def check(pred: str, gold: str, expected: bool):
    assert G.grade(boxed(pred), gold) is expected, (pred, gold)
    if expected:
        assert G.grade(boxed(gold), pred) is True, ("swapped", pred, gold)


NAMED = [  # N1: a label before "=" is dropped when the other side has no "="
    ("(2,9)", "(m,n)=(2,9)", True), ("7", "|PQ|=7", True), ("\\frac{2}{5}", "\\frac{AM}{MB}=\\frac{2}{5}", True),
    ("3:4", "S_{1}:S_{2}=3:4", True), ("45", "\\angle ABC = 45^\\circ", True),
    ("\\frac{\\pi}{6}", "\\alpha=\\frac{\\pi}{6}", True),
    ("12", "f(3)=12", True), ("\\sqrt{3}", "a_{n}=\\sqrt{3}", True), ("0.2", "P(A)=0.2", True),
    # near misses: a wrong named answer, a formula that is not a label, a tuple in the wrong order
    ("8", "|PQ|=7", False), ("(9,2)", "(m,n)=(2,9)", False), ("4:3", "S_{1}:S_{2}=3:4", False),
    ("5", "x+y=5", False), ("1", "x^2+y^2=1", False), ("0", "2x-3=0", False),
]
RECORDS = [  # N2: records with distinct labels, in order against lists and (...) tuples, by label otherwise
    ("6, 8", "AC=6, BD=8", True), ("(6, 8)", "AC=6,BD=8", True),
    ("-1, \\frac{7}{2}", "m = -1,\\ k = \\frac{7}{2}", True),
    ("BD=8, AC=6", "AC=6, BD=8", True), ("a=1, b=-2, c=3", "a=1,b=-2,c=3", True),
    ("8, 6", "AC=6, BD=8", False), ("[6, 8]", "AC=6, BD=8", False), ("\\{6, 8\\}", "AC=6, BD=8", False),
    ("x=2, y=-1", "(x, y) = (2, -1)", True), ("(y,x)=(-1,2)", "x=2, y=-1", True),
    ("x=-1, y=2", "(x, y) = (2, -1)", False), ("(x,y)=(2,1)", "x=2, y=-1", False),
    ("6, 8, 10", "AC=6, BD=8", False), ("AC=8, BD=6", "AC=6, BD=8", False), ("AC=6, CD=8", "AC=6, BD=8", False),
]
LISTS = [  # N3: ";" lists, ";" inside brackets, "or" / "and" with or without spaces
    ("\\{2, 3, 5, 7\\}", "2;3;5;7", True), ("7, 5, 3, 2", "2; 3; 5; 7", True), ("(1,-1,4)", "(1;-1;4)", True),
    ("(2,0,1),(1,2,0)", "(1;2;0),(2;0;1)", True), ("(4,1),(6,3)", "a=4,b=1;a=6,b=3", True),
    ("(6,3),(4,1)", "a=4,b=1;a=6,b=3", True), ("(5,8)\\text{ or }(8,5)", "(8,5), (5,8)", True),
    ("(5,8)or(8,5)", "(8,5),(5,8)", True), ("3 \\text{ and } 9", "9, 3", True), ("[0;1)", "[0,1)", True),
    ("2;3;5", "2;3;5;7", False), ("(1,4,-1)", "(1;-1;4)", False), ("(1,4),(6,3)", "a=4,b=1;a=6,b=3", False),
    ("(5,8)or(8,6)", "(8,5),(5,8)", False), ("(0,1)", "[0;1)", False),
]
INEQUALITIES = [  # N5: chained and two-sided inequalities compare as intervals or unions
    ("(-4, 17)", "-4 < t < 17", True), ("[2, 9)", "2 \\le b < 9", True), ("(-\\infty, 3]", "x \\leq 3", True),
    ("3 \\geq x", "x \\leq 3", True), ("x > -2", "-2 < x", True), ("-2x < 4", "x > -2", True),
    ("(\\frac{1}{2}, 1)", "0.5 < g(x) < 1", True), ("[3, \\infty)", "y \\geqslant 3", True),
    ("9 > x > 1", "1<x<9", True),
    ("[-4,-2]\\cup[2,4]", "2 \\le |w| \\le 4", True), ("(-5, 5)", "|u| < 5", True),
    ("(-\\infty,-1)\\cup(1,\\infty)", "|v| > 1", True), ("3x+1 \\le 7", "x \\le 2", True),
    ("x <= 4", "(-\\infty, 4]", True),
    ("x<-1 \\text{ or } x>3", "(-\\infty,-1)\\cup(3,\\infty)", True),
    ("x \\ge 3, x \\le -1", "x\\le-1 or x\\ge3", True),
    ("x<-1 or x>3", "(-\\infty,-1]\\cup(3,\\infty)", False), ("x<-1 or y>3", "(-\\infty,-1)\\cup(3,\\infty)", False),
    ("x<-1 or x>3", "(-\\infty,-1)", False),
    # near misses: a wrong interval (end, bracket, direction), another variable, a bound that is off
    ("(-4, 16)", "-4 < t < 17", False), ("[-4, 17)", "-4 < t < 17", False), ("(-\\infty, 3)", "x \\leq 3", False),
    ("x \\geq 3", "x \\leq 3", False), ("y \\le 3", "x \\le 3", False), ("[2,4]", "2 \\le |w| \\le 4", False),
    ("(-5, 5]", "|u| < 5", False), ("3x+1 \\le 8", "x \\le 2", False), ("x \\lt 1", "x \\gt 1", False),
]
EQUATIONS = [  # N6: equal when one side's lhs - rhs is a nonzero constant multiple of the other's
    ("y = 3x - 2", "6x - 2y - 4 = 0", True), ("3x - y = 2", "y = 3x - 2", True),
    ("\\frac{x^2}{9}+\\frac{y^2}{5}=1", "5x^2+9y^2=45", True), ("x^2+y^2-2x=0", "(x-1)^2+y^2=1", True),
    ("-2y = 6 - 4x", "y = 2x - 3", True),
    ("y = 3x + 2", "6x - 2y - 4 = 0", False), ("\\frac{x^2}{9}+\\frac{y^2}{5}=1", "5x^2+9y^2=9", False),
    ("x^2 - x = 0", "x - 1 = 0", False), ("y = x^2", "y = 2x^2", False),
    ("x - x = 0", "2x - 6 = 0", False), ("0x = 0", "x + y = 3", False),   # an identity is no multiple of a line
]
NOTATION = [  # N7
    ("\\cfrac{3}{8}", "0.375", True), ("\\cfrac{1}{1+\\cfrac{1}{2}}", "\\frac{2}{3}", True),
    ("14 \\textnormal{ km}", "14", True), ("\\textsf{yes}", "yes", True), ("\\texttt{7}", "7", True),
    ("35 pct", "35\\%", True), ("35 percentage points", "35\\%", True), ("35 percentage", "0.35", True),
    ("\\mathsf{B}", "B", True),
    ("36 pct", "35\\%", False), ("\\cfrac{3}{7}", "0.375", False), ("15 \\textnormal{ km}", "14", False),
]
LONG_DECIMALS = [  # N8: >= 12 significant digits compare by the digits they show
    ("0.142857142857143", "\\frac{1}{7}", True), ("0.14285714285714", "\\frac17", True),
    ("2.6457513110645906", "\\sqrt{7}", True), ("2.6457513110645907", "\\sqrt{7}", True),   # a double's repr
    ("-0.0909090909090909", "-\\frac{1}{11}", True),
    ("1.7320508075688772", "\\sqrt{3}", True), ("0.7853981633974483", "\\frac{\\pi}{4}", True),
    # near misses: a shown digit differs, short decimals stay exact, a sign, another value
    ("0.142857142857243", "\\frac{1}{7}", False), ("0.142857142859", "\\frac17", False),
    ("2.6457513110655906", "\\sqrt{7}", False), ("2.6457513110645957", "\\sqrt{7}", False),
    ("0.0909090909090909", "-\\frac{1}{11}", False),
    ("0.1428571", "\\frac17", False), ("0.142857142857143", "\\frac{1}{6}", False),
    ("1.7320508075688772", "\\sqrt{2}", False),
]
DELIBERATE = [  # non-equalities kept on purpose
    ("0.33", "\\frac{1}{3}", False), ("0.3333333333", "\\frac13", False), ("0.666667", "\\frac23", False),
    ("(3, 1)", "(1, 3)", False), ("(1, 3]", "(1, 3)", False), ("\\{3, 1\\}", "\\{1, 3\\}", True),
    ("2,345,678", "2345678", True), ("12,34", "1234", False), ("1,2345", "12345", False), ("123,456", "123456", True),
    ("12, 345", "12345", False), ("12, 345", "12,345", False),   # regression: a space after the comma makes a list
    ("12,\\! 345", "12345", True), ("1,\\!000,\\!000", "10^6", True),          # MATH's ",\\!" stays a thousands comma
]
DEBATABLE = [
    # D1: "a,b" (no space, not the 1,234 pattern) is the decimal a.b against one number; with a space a list
    ("1000,99", "1000.99", True), ("0,25", "\\frac{1}{4}", True), ("-3,5", "-3.5", True),
    ("1000,99", "1000.98", False), ("0, 25", "0.25", False), ("1,500", "1.5", False), ("1,500", "1500", True),
    ("0,25", "0,25", True), ("2,7", "7, 2", True),
    # D2: a chain "x = a = b" is graded on its last part
    ("x = 5+5+1 = 11", "11", True), ("S = 2 \\cdot 6 = 12", "12", True), ("x = 2+3 = 6", "5", False),
    ("x = 5+5+1 = 11", "12", False), ("n = 4 = 4", "4", True),
]


@pytest.mark.parametrize("pred,gold,expected", NAMED)
def test_numina_named_answers(pred, gold, expected):
    check(pred, gold, expected)


@pytest.mark.parametrize("pred,gold,expected", RECORDS)
def test_numina_named_records(pred, gold, expected):
    check(pred, gold, expected)


@pytest.mark.parametrize("pred,gold,expected", LISTS)
def test_numina_lists_written_other_ways(pred, gold, expected):
    check(pred, gold, expected)


@pytest.mark.parametrize("pred,gold,expected", INEQUALITIES)
def test_numina_inequalities_as_intervals(pred, gold, expected):
    check(pred, gold, expected)


@pytest.mark.parametrize("pred,gold,expected", EQUATIONS)
def test_numina_equations_up_to_a_constant_factor(pred, gold, expected):
    check(pred, gold, expected)


@pytest.mark.parametrize("pred,gold,expected", NOTATION)
def test_numina_notation(pred, gold, expected):
    check(pred, gold, expected)


@pytest.mark.parametrize("pred,gold,expected", LONG_DECIMALS)
def test_numina_long_decimals_by_their_digits(pred, gold, expected):
    check(pred, gold, expected)


@pytest.mark.parametrize("pred,gold,expected", DELIBERATE)
def test_numina_deliberate_non_equalities_kept(pred, gold, expected):
    check(pred, gold, expected)


@pytest.mark.parametrize("pred,gold,expected", DEBATABLE)
def test_numina_debatable_choices(pred, gold, expected):
    check(pred, gold, expected)


SEVERAL_BOXES = [  # N4: (response, gold, expected)
    ("So $\\boxed{(1, 4)}$ \\quad \\text{and} \\quad $\\boxed{(4, 1)}$.", "(4,1),(1,4)", True),
    ("The roots are \\boxed{-2}, \\boxed{0}, \\boxed{5}.", "\\{-2, 0, 5\\}", True),
    ("\\boxed{x=3} or \\boxed{x=-1}", "-1, 3", True),
    ("\\boxed{m=2} \\boxed{n=7}", "m=2, n=7", True),
    ("Only one box: \\boxed{3}", "3", True),
    # the last box alone still wins when it is right; a run must match the whole list
    ("\\boxed{-2}, \\boxed{0}", "\\{-2, 0, 5\\}", False),
    ("\\boxed{-2}, \\boxed{0}, \\boxed{5}, \\boxed{6}", "\\{-2, 0, 5\\}", False),
    # boxes separated by words are not one run: the earlier box is a rejected guess
    ("First I guessed \\boxed{-2}, but that fails the check. The answer is \\boxed{0}, \\boxed{5}.",
     "-2, 0, 5", False),
    ("\\boxed{(1, 4)} \\quad \\text{and} \\quad \\boxed{(4, 1)}", "(1,4)", False),
    ("\\boxed{1}, \\boxed{2}", "(1, 2)", False),
    # regression: a gold "77,71" (no space) once ended grading through the decimal-comma rule (D1) with
    # False before the run of boxes was read
    ("The answer is \\boxed{71}, \\boxed{77}.", "77,71", True),
]


@pytest.mark.parametrize("response,gold,expected", SEVERAL_BOXES)
def test_numina_several_boxes(response, gold, expected):
    assert G.grade(response, gold) is expected


def test_numina_gold_with_several_boxes():
    gold = "The pairs are $\\boxed{(2, 5)}$ and $\\boxed{(5, 2)}$."
    assert G.grade(boxed("(5,2), (2,5)"), gold)
    assert G.grade("\\boxed{(5, 2)}, \\boxed{(2, 5)}", gold)
    assert not G.grade(boxed("(5,2)"), gold)
    assert not G.grade(boxed("(2,5), (5,3)"), gold)


def test_final_boxes_reads_only_the_final_run():
    assert G.final_boxes("a \\boxed{1} then text \\boxed{2}, \\boxed{3}") == ["2", "3"]
    assert G.final_boxes("\\boxed{1} \\text{ or } \\boxed{2}") == ["1", "2"]
    assert G.final_boxes("\\boxed{1}, \\boxed{2") == []          # a truncated last box: no answer
    assert G.final_boxes("no box") == [] and G.final_boxes(None) == []


ADVERSARIAL = [  # every new path: long chains, many boxes, deep inequalities, labels, records
    ";".join(["1"] * 400), " or ".join(["(1,2)"] * 200), "or" * 400, ",".join(f"a_{k}={k}" for k in range(40)),
    "<".join(["1"] * 300), "1<" * 100 + "x", "\\le x \\le" * 50, "0<x<" + "9" * 300,
    "=".join(["x"] * 300), "(" * 200 + ";" * 200 + ")" * 200, "|" * 300 + "x" + "|" * 300,
    "x^{2^{2^{2^{2^{2}}}}}=y", "2^{9^{9^{9}}}x+1<5", "1<|x|<9^{9^{9^{9}}}", "0." + "3" * 299,
    "0." + "1" * 60 + "\\sqrt{2}", "|x|>" + "(" * 39 + "1" + ")" * 39, "f(" * 100 + "x" + ")" * 100 + "=1",
]


@pytest.mark.parametrize("answer", ADVERSARIAL, ids=lambda a: a[:20])
def test_new_paths_are_bounded(answer):
    """Guards against a slow new rule: each call stays under 2 s and returns a bool."""
    for response, gold in [(boxed(answer), "1"), (boxed("1"), answer), (boxed(answer), answer + ";2"),
                           (boxed(answer), "(0,1)"), (boxed(answer), "x=1")]:
        start = time.perf_counter()
        assert G.grade(response, gold) in (True, False)
        assert time.perf_counter() - start < 2.0, answer[:40]


def test_many_boxes_are_bounded():
    """1,000 boxes in a run: only _MAX_ITEMS + 1 are read and the run is refused as a list; 20,000
    unbalanced boxes (each scan stops at the next box) stay fast."""
    many = ", ".join(f"\\boxed{{{k}}}" for k in range(1000))
    gold = ", ".join(str(k) for k in range(1000))
    start = time.perf_counter()
    assert G.grade(many, gold) is False
    assert len(G.final_boxes(many)) == G._MAX_ITEMS + 1
    assert G.grade("\\boxed{" * 20000 + "1}", "1") in (True, False)
    assert G.grade("\\boxed{1}, " * 20000, "1") is True
    assert time.perf_counter() - start < 2.0


def test_numina_rules_are_counted():
    cases = NAMED + RECORDS + LISTS + INEQUALITIES + EQUATIONS + NOTATION + LONG_DECIMALS + DELIBERATE + DEBATABLE
    assert len(cases) >= 120 and sum(not c[2] for c in cases) >= 50


def test_benchmark_numina_mix_agrees_and_is_bounded():
    result = G.grader_benchmark(n_pairs=300, seed=2, mix="numina")
    assert result["mix"] == "numina" and result["agree"] == 1.0 and result["max_seconds"] < 2.0
    with pytest.raises(ValueError, match="mix"):
        G.grader_benchmark(n_pairs=10, mix="gsm8k")


def test_grader_cli_smoke():
    """`python -m harness.data.grader --bench` and the one-pair form, run as a user would."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(G.__file__))))
    out = subprocess.run([sys.executable, "-m", "harness.data.grader", "--bench", "--pairs", "60", "--mix", "numina"], cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["pairs"] == 60 and report["agree"] == 1.0
    one = subprocess.run([sys.executable, "-m", "harness.data.grader", "\\boxed{x = 5+5+1 = 11}", "11"], cwd=root,
                         capture_output=True, text=True, timeout=60)
    assert one.stdout.strip() == "True"
    bad = subprocess.run([sys.executable, "-m", "harness.data.grader", "--bench", "--pairs", "0"], cwd=root,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--pairs" in bad.stderr


NEW_PATH_ALPHABET = st.sampled_from(list("0123456789+-/^_{}()[]|,;.=<>xyabAB ") +
                                    ["\\le", "\\ge", "\\leq", "\\lt", " or ", " and ", "or", "\\boxed{", "}, \\boxed{",
                                     "\\frac", "\\sqrt", "\\infty", "\\cup", "\\{", "\\}", "\\quad", "pct", "\\cfrac",
                                     "\\textnormal{", "0.142857142857143", "\\!", "\\angle "])


@settings(max_examples=300, deadline=None)
@given(st.lists(NEW_PATH_ALPHABET, max_size=40), st.lists(NEW_PATH_ALPHABET, max_size=25))
def test_new_paths_never_raise_and_stay_fast_on_random_text(pred_tokens, gold_tokens):
    pred, gold = "".join(pred_tokens), "".join(gold_tokens)
    start = time.perf_counter()
    assert G.grade(boxed(pred), gold) in (True, False)
    assert G.grade("\\boxed{" + pred, gold) in (True, False)
    assert G.grade(boxed(pred), boxed(gold)) in (True, False)
    assert time.perf_counter() - start < 2.0
    if G.extract_answer(boxed(pred)) == pred.strip() and G._normalize(pred):
        assert G.grade(boxed(pred), pred) is True                  # reflexive whatever the new rules do
