"""Tests of grader.py and latex.py: extract_answer and the safe grader.

Each case is (model's final answer, gold, expected verdict); the model's answer is wrapped in a short
response with a \\boxed{} so that extraction runs too. Cases are grouped by the rule they exercise."""
import ast
import pathlib
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eval as E
from harness.data import grader as G
from harness.data import latex as L
from harness.data import problems as P
from conftest import pace

GRADER_FILES = [pathlib.Path(m.__file__) for m in (G, L, E, P)]   # files that hold grader code or read gold answers


def boxed(answer: str) -> str:
    return f"Let me think.\n\nSo the result is \\boxed{{{answer}}}."


NORMALISATION = [  # each normalisation rule, both directions where it matters
    ("\\left( 1, 2 \\right)", "(1,2)", True),               # \left / \right
    ("\\left[0, 1\\right)", "[0,1)", True),
    ("\\dfrac{3}{4}", "\\frac{3}{4}", True),                # \dfrac
    ("\\tfrac{3}{4}", "\\frac34", True),                    # \tfrac, \frac34
    ("\\text{Monday}", "Monday", True),                     # \text{}
    ("\\textbf{7}", "7", True),
    ("\\mathrm{blue}", "blue", True),
    ("5 \\text{ cm}", "5", True),                           # units
    ("5\\text{ cm}^2", "5", True),
    ("12 meters", "12", True),
    ("12cm", "12", True),
    ("2.5m^2", "2.5", True),
    ("3 square feet", "3", True),
    ("90 degrees", "90", True),
    ("30^\\circ", "30", True),                              # degrees
    ("30^{\\circ}", "30", True),
    ("30°", "30", True),
    ("45", "45^\\circ", True),
    ("25\\%", "25", True),                                  # percent
    ("25\\%", "0.25", True),
    ("25%", "\\frac{1}{4}", True),
    ("25 percent", "25\\%", True),
    ("$7$", "7", True),                                     # $ delimiters
    ("\\(7\\)", "7", True),
    ("\\$12.50", "12.5", True),                             # dollar sign
    ("  7  ", "7", True),                                   # spacing
    ("\\frac { 1 } { 2 }", "\\frac{1}{2}", True),
    ("1\\,000", "1000", True),                              # thin space
    ("1,000,000", "1000000", True),                         # thousands separators
    ("7,425,000", "7425000", True),
    ("1{,}000", "1000", True),
    ("x = 5", "5", True),                                   # x = prefix
    ("y=-3", "-3", True),
    ("k = \\frac{1}{2}", "0.5", True),
    ("x \\in [1, 2]", "[1,2]", True),
    ("f(x) = x^2", "x^2", True),
    ("1\\!000", "1000", True),                              # \!
    ("5.", "5", True),                                      # trailing period
    ("\\displaystyle \\frac{1}{2}", "1/2", True),
    ("x \\leq 3", "x \\le 3", True),                        # \leq -> \le
    ("x \\neq 3", "x\\ne3", True),
    ("infinity", "\\infty", True),
    ("\\emptyset", "\\{\\}", True),
    ("\\varnothing", "\\emptyset", True),
    ("\\mathbb{R}", "(-\\infty, \\infty)", True),
    ("3 − 1", "2", True),                                   # unicode minus
    ("2π", "2\\pi", True),                                  # unicode pi
    ("1011_{2}", "1011_2", True),                           # single-character scripts
    ("x^{2}", "x^2", True),
    ("4\\frac{2}{3}", "\\frac{14}{3}", True),                # mixed numbers
    ("-1\\frac{1}{2}", "-1.5", True),
    ("4\\frac{2}{3}", "\\frac{8}{3}", False),
]

NUMBERS = [
    ("42", "42", True), ("42.0", "42", True), ("042", "42", True), ("12.500", "12.5", True),
    (".5", "0.5", True), ("0.5", "\\frac12", True), ("\\frac{6}{8}", "\\frac{3}{4}", True),
    ("3/4", "0.75", True), ("-\\frac{1}{2}", "\\frac{-1}{2}", True), ("-0.5", "-\\frac{1}{2}", True),
    ("1.5e3", "1500", True), ("1.5 \\times 10^{3}", "1500", True), ("2.5\\cdot10^{-2}", "0.025", True),
    ("142.0", "142", True), ("2^{10}", "1024", True), ("10^{-3}", "0.001", True),
    ("\\frac{1}{3}", "\\frac{2}{6}", True), ("1/3", "\\frac{1}{3}", True),
    # near misses
    ("0.33", "\\frac{1}{3}", False), ("0.333", "1/3", False), ("0.3333333333", "\\frac{1}{3}", False),
    ("-2", "2", False), ("2", "-2", False), ("\\frac{3}{2}", "\\frac{2}{3}", False), ("1.5", "15", False),
    ("41", "42", False), ("42.01", "42", False), ("1.4142", "\\sqrt{2}", False), ("3.14", "\\pi", False),
    ("25", "0.25", False), ("1000", "100", False), ("1e3", "1e4", False),
]

SYMBOLIC = [
    ("(x+1)^2", "x^2+2x+1", True), ("x^2 + 2x + 1", "(1+x)^2", True), ("2\\pi", "\\pi \\cdot 2", True),
    ("\\pi r^2", "r^2\\pi", True), ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\sqrt{8}", "2\\sqrt{2}", True), ("\\sqrt[3]{8}", "2", True), ("\\sqrt[3]{27}", "3", True),
    ("8^{1/3}", "2", True), ("\\sin^2 x + \\cos^2 x", "1", True), ("\\sin x", "\\sin(x)", True),
    ("\\ln(e^2)", "2", True), ("\\log_2 8", "3", True), ("e^{i\\pi}", "-1", True), ("3+4i", "4i+3", True),
    ("\\frac{x}{x}", "1", True), ("|{-3}|", "3", True), ("2 \\times 3", "6", True), ("6 \\div 4", "1.5", True),
    ("a b", "ba", True), ("\\frac{a+b}{2}", "\\frac{a}{2}+\\frac{b}{2}", True), ("x^{-1}", "\\frac{1}{x}", True),
    ("\\frac{1}{2}x", "\\frac{x}{2}", True), ("2(x+1)", "2x+2", True), ("[x+1]", "x+1", True),
    ("x+y=3", "3=y+x", True), ("2x - y = 1", "y = 2x - 1", True),
    ("\\binom{5}{2}", "10", True), ("\\dbinom{6}{3}", "20", True), ("5!", "120", True), ("0!", "1", True),
    ("\\cos^{-1}(0.5)", "\\frac{\\pi}{3}", True), ("\\sin 2x", "2\\sin x\\cos x", True),
    ("0.\\overline{3}", "\\frac13", True), ("0.1\\overline{6}", "\\frac{1}{6}", True),
    ("4\\frac23", "\\frac{14}{3}", True),
    ("\\{1+\\sqrt5, 1-\\sqrt5\\}", "\\{1\\pm\\sqrt{5}\\}", True), ("1.4142135623", "\\sqrt{2}", False),
    ("0.\\overline{3}", "0.33", False), ("\\binom{5}{3}", "5", False), ("4!", "120", False),
    # near misses
    ("(x+1)^2", "x^2+2x+2", False), ("x^2-1", "(x-1)^2", False), ("\\sqrt{2}", "2", False),
    ("\\frac{\\pi}{2}", "\\frac{\\pi}{3}", False), ("-x", "x", False), ("\\frac{1}{x}", "x", False),
    ("x", "y", False), ("2\\pi", "\\pi", False), ("\\sin x", "\\cos x", False), ("x^2", "x^3", False),
    ("\\sqrt{x^2}", "x", False), ("3-4i", "3+4i", False), ("\\frac{1}{x+1}", "\\frac{1}{x}+1", False),
]

STRUCTURES = [
    # tuples / points: ordered
    ("(1, 2)", "(1,2)", True), ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("(0.5, -1)", "(\\frac{1}{2}, -1)", True), ("(2, 1)", "(1, 2)", False), ("(1, 2, 3)", "(1, 2)", False),
    ("(1, -2)", "(1, 2)", False),
    # intervals: bracket types matter
    ("[0, 1)", "[0,1)", True), ("(-\\infty, 3]", "(-\\infty,3]", True), ("(0, 1)", "[0, 1)", False),
    ("[0, 1]", "[0, 1)", False), ("(0, 1]", "(0, 1)", False), ("[1,2]", "(1,2)", False),
    ("(-\\infty, 2) \\cup (3, \\infty)", "(3,\\infty)\\cup(-\\infty,2)", True),
    ("(-\\infty, 2) \\cup (3, \\infty)", "(-\\infty,2]\\cup(3,\\infty)", False),
    ("(-\\infty, 0.5)", "(-\\infty, \\frac{1}{2})", True),
    # sets: unordered
    ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}", True), ("\\{1, 2\\}", "\\{1, 2, 3\\}", False),
    ("\\{\\frac{1}{2}, 2\\}", "\\{2, 0.5\\}", True), ("\\{1, 2\\}", "\\{1, -2\\}", False),
    ("\\left\\{ -1, 1 \\right\\}", "\\{1,-1\\}", True),
    # comma lists: unordered, each item may carry "x ="
    ("1, 2", "2, 1", True), ("x = 1, x = 2", "1, 2", True), ("1 and 2", "1, 2", True), ("1, 2", "1, 3", False),
    ("1, 2", "\\{1, 2\\}", True), ("1, 2", "(1, 2)", False), ("1, 2, 2", "1, 2", False),
    ("x = 1, 2", "2, 1", True), ("a = 2, b = 3", "b = 3, a = 2", True), ("a = 2, b = 3", "a = 3, b = 2", False),
    # plus-minus
    ("\\pm 3", "3, -3", True), ("1 \\pm \\sqrt{2}", "1-\\sqrt{2}, 1+\\sqrt{2}", True), ("\\pm 3", "3", False),
    # matrices
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True),
    ("\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", True),
    ("\\begin{pmatrix} \\frac12 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}0.5\\\\2\\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 5 \\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", False),
    ("\\begin{pmatrix} 1 & 3 \\\\ 2 & 4 \\end{pmatrix}", "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", False),
    ("\\begin{pmatrix} 1 & 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", False),
    # multiple choice letters
    ("C", "C", True), ("(C)", "C", True), ("\\text{(C)}", "C", True), ("\\textbf{C}", "(C)", True),
    ("C) 42", "C", True), ("c", "C", True), ("B", "C", False), ("(B)", "C", False), ("Cat", "C", False),
    # plain text, case-insensitive
    ("Monday", "monday", True), ("\\text{No solution}", "no solution", True), ("even", "odd", False),
    ("\\text{Tuesday}", "Monday", False),
]

GRADE_CASES = NORMALISATION + NUMBERS + SYMBOLIC + STRUCTURES


def test_at_least_150_grading_cases():
    assert len(GRADE_CASES) >= 150, len(GRADE_CASES)


@pytest.mark.parametrize("pred,gold,expected", GRADE_CASES)
def test_grade(pred, gold, expected):
    assert G.grade(boxed(pred), gold) is expected


@pytest.mark.parametrize("pred,gold,expected", [c for c in GRADE_CASES if c[2]][:40])
def test_grade_symmetric_for_equal_pairs(pred, gold, expected):
    """Equal pairs stay equal with the roles swapped (except MC keys, whose gold must be a letter)."""
    if len(gold) > 1 and not gold.startswith("("):
        assert G.grade(boxed(gold), pred)


EXTRACTION = [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                         # nested braces
    ("\\boxed{\\frac{\\sqrt{\\frac{1}{2}}}{3}}", "\\frac{\\sqrt{\\frac{1}{2}}}{3}"),
    ("First \\boxed{1}, then corrected: \\boxed{2}", "2"),            # last box wins
    ("\\fbox{7}", "7"),
    ("$\\boxed 5$", "5"),                                              # no braces
    ("so \\boxed 12 is it.", "12"),
    ("so \\boxed {9}", "9"),
    ("so \\boxed\n{9}", "9"),
    ("The answer is \\(\\frac{1}{2}\\).", "\\(\\frac{1}{2}\\)"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                             # escaped braces inside
    ("The final answer is $42$. I hope it is correct.", "42"),        # fallback (Minerva style)
    ("Therefore, the answer is 3.5.", "3.5"),
    ("The answer is: (1, 2)\nDone", "(1, 2)"),
    ("no answer here", None),
    ("", None),
    ("\\boxed{}", None),                                               # empty box
    ("\\boxed{\\frac{1}{2}", None),                                    # unbalanced: truncated output
    ("\\boxed{1} and then \\boxed{\\frac{1}{2", None),                 # last box unbalanced
]


@pytest.mark.parametrize("text,expected", EXTRACTION)
def test_extract_answer(text, expected):
    assert G.extract_answer(text) == expected


def test_last_box_wins_in_grading():
    text = "Maybe \\boxed{3}. No wait, it is \\boxed{4}."
    assert G.grade(text, "4") and not G.grade(text, "3")


def test_no_answer_and_unbalanced_are_false():
    assert not G.grade("I do not know.", "4")
    assert not G.grade("\\boxed{4", "4")
    assert not G.grade("\\boxed{}", "4")
    assert not G.grade(boxed("4"), "")


def test_gold_with_box_is_extracted():
    assert G.grade(boxed("\\frac12"), "The solution gives \\boxed{0.5}.")


@pytest.mark.parametrize("bad", [None, 3, b"\\boxed{1}", ["\\boxed{1}"]])
def test_non_string_inputs_are_false(bad):
    assert G.grade(bad, "1") is False
    assert G.grade(boxed("1"), bad) is False


ADVERSARIAL = [
    "9^{9^{9^{9}}}", "2^{2^{2^{2^{2^{2}}}}}", "10^{10^{10}}", "1" * 100_000, "9" * 5000 + "^{9999}",
    "(" * 5000 + "1" + ")" * 5000, "{" * 5000 + "1" + "}" * 5000, "\\frac{" * 300 + "1" + "}{2}" * 300,
    "\\sqrt{" * 200 + "2" + "}" * 200, "x^{x^{x^{x^{x^{x^{x^{x}}}}}}}", "e^{e^{e^{e^{100}}}}",
    "\\sin(10^{300})", "(x+1)^{1000} - (x+1)^{1000}", "2^{99999}", "\\sqrt[100]{" + "9" * 300 + "}",
    "-" * 5000 + "1", "\\left(" * 1000 + "1" + "\\right)" * 1000, "1/0", "0^{-1}", "\\log 0", "|" * 999,
    "x" * 999, "\\frac{1}{" + "x" * 400 + "}", "(" * 45 + "1" + ")" * 45, "1e9999", "1000!", "100000!",
    "\\binom{1000}{500}", "\\binom{10^{9}}{3}", ",".join(f"(x+{k})^2" for k in range(32)),
    "|" + "x+" * 300 + "x|", "\\sqrt{" + "(x+1)" * 150 + "}", "0.\\overline{" + "9" * 50 + "}",
]


@pytest.mark.parametrize("answer", ADVERSARIAL, ids=lambda a: a[:20])
def test_adversarial_inputs_are_fast_and_do_not_raise(answer):
    """Guards against a grader hang (power towers, huge literals, deep nesting): each call < 2 s."""
    for response, gold in [(boxed(answer), "1"), (boxed("1"), answer), (boxed(answer), answer + "+1")]:
        start = time.perf_counter()
        verdict = G.grade(response, gold)
        elapsed = time.perf_counter() - start
        assert isinstance(verdict, bool)
        assert elapsed < 2.0 * pace(), f"{elapsed:.2f} s for {answer[:40]!r}"


def test_grade_from_threads():
    """Guards against signal-based timeouts, which only work in the main thread."""
    results = []

    def work():
        results.append(all(G.grade(boxed("(x+1)^2"), "x^2+2x+1") for _ in range(5)))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True, True, True]


def test_identical_huge_answers_still_match_as_strings():
    assert G.grade(boxed("9^{9^{9^{9}}}"), "9^{9^{9^{9}}}")
    assert G.grade(boxed("1" * 100_000), "1" * 100_000)


def test_power_tower_is_never_computed():
    """9^(9^9) has ~370 million digits: the parser builds it unevaluated, the exact evaluator refuses it
    (digit budget) and the numeric one too (magnitude guard)."""
    tree = L.Parser("9^{9^{9^{9}}}").parse()
    assert L.exact(tree) is None
    assert L.num_or_none(tree, {}) is None
    assert L.numeric_equal(tree, L.Parser("1").parse()) is False   # only one side evaluates


def test_construction_never_evaluates():
    """Guards against sympy's automatic evaluation, which can call simplify() and hang (found by fuzzing:
    a nested root of a power built with evaluate=True ran for minutes)."""
    tree = L.Parser("\\sqrt[3]{{(x+1)^{\\frac{1}{2}}}^{3}}").parse()
    assert tree.is_Pow and tree.args[0].is_Pow


def test_nesting_depth_is_capped():
    with pytest.raises(L.Refuse):
        L.Parser("(" * 100 + "1" + ")" * 100).parse()


FORBIDDEN = {"eval", "exec", "compile", "sympify", "parse_expr", "parse_latex", "S", "lambdify"}
FORBIDDEN_METHODS = {"sympify", "parse_expr", "parse_latex", "S", "lambdify", "eval", "exec"}  # as x.name(...)


@pytest.mark.parametrize("path", GRADER_FILES, ids=lambda p: p.name)
def test_grader_files_never_call_eval_or_sympy_parsers(path):
    """The safety rule: no eval/exec/sympify/parse_expr/parse_latex/lambdify anywhere in
    grader.py, latex.py, eval.py or problems.py (a torch `model.eval()` is a method of a model object and is
    allowed)."""
    tree = ast.parse(path.read_text())
    offenders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id in FORBIDDEN:
                offenders.append(f"line {node.lineno}: {fn.id}(...)")
            if (isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name)
                    and fn.value.id in {"sympy", "builtins", "sp"} and fn.attr in FORBIDDEN_METHODS):
                offenders.append(f"line {node.lineno}: {fn.value.id}.{fn.attr}(...)")
        if isinstance(node, ast.ImportFrom) and node.module and "parsing" in node.module:
            offenders.append(f"line {node.lineno}: from {node.module} import ...")
        if isinstance(node, ast.ImportFrom) and node.module == "sympy":
            names = {a.name for a in node.names} & FORBIDDEN
            if names:
                offenders.append(f"line {node.lineno}: from sympy import {sorted(names)}")
    assert offenders == []


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200), st.text(max_size=40))
def test_grade_never_raises_on_random_text(response, gold):
    assert G.grade(response, gold) in (True, False)
    assert G.grade("\\boxed{" + response + "}", gold) in (True, False)


LATEX_ALPHABET = st.sampled_from(list("0123456789+-*/^_{}()[]|,.=xye ") +
                                 ["\\frac", "\\sqrt", "\\pi", "\\cdot", "\\left(", "\\right)", "\\sin",
                                  "\\log", "\\infty", "\\{", "\\}", "\\%", "\\text{cm}", "&", "\\\\"])


@settings(max_examples=300, deadline=None)
@given(st.lists(LATEX_ALPHABET, max_size=40), st.lists(LATEX_ALPHABET, max_size=20))
def test_grade_never_raises_on_random_latex(pred_tokens, gold_tokens):
    pred, gold = "".join(pred_tokens), "".join(gold_tokens)
    start = time.perf_counter()
    assert G.grade(boxed(pred), gold) in (True, False)
    assert time.perf_counter() - start < 2.0


def test_grade_is_reflexive_on_random_latex_strings():
    for text in ["\\frac{x}{y}", "(1,2]", "\\{a\\}", "x^{2}_{1}", "\\sqrt[3]{x}"]:
        assert G.grade(boxed(text), text)


def test_grader_benchmark_runs_and_agrees_with_labels():
    result = G.grader_benchmark(n_pairs=200, seed=1)
    assert result["pairs"] == 200 and result["pairs_per_s"] > 0
    assert result["agree"] == 1.0
    assert len(result["slowest"]) == 5 and result["max_seconds"] < 2.0
    assert {"seconds", "gold", "response"} <= set(result["slowest"][0])


def test_safety_scan_catches_a_forbidden_call(tmp_path):
    """The AST scan itself can fail: a file that calls sympify on text is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sympy\nsympy.sympify(text)\neval(text)\n")
    with pytest.raises(AssertionError):
        test_grader_files_never_call_eval_or_sympy_parsers(bad)


def test_grade_never_reads_past_the_first_turn_end():
    """Regression: a base model prompted in ChatML closed its turn, then wrote an invented user turn with
    another box; the grader read the LAST box. It now grades what came before the first turn marker."""
    assert G.grade("x=\\boxed{5}<|im_end|>\nuser\n...\\boxed{4}", "5")
    assert not G.grade("x=\\boxed{5}<|im_end|>\nuser\n...\\boxed{4}", "4")
    assert not G.grade("x=\\boxed{4}<|endoftext|>\\boxed{5}", "5")
    assert G.grade("so \\boxed{7}<|im_start|>user\n\\boxed{8}", "7")
    assert G.first_turn("a<|im_start|>b<|im_end|>c") == "a" and G.first_turn("no marker") == "no marker"
    assert not G.grade("<|im_end|>\\boxed{5}", "5")   # nothing before the stop: no answer
