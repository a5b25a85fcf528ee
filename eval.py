"""eval.py — answers, grading, benchmarks and the paper's evaluation metrics.

What it implements (SCOPE, Ren et al. 2026, arXiv 2602.24110):
  1. `extract_answer` / `grade`: the verifier that gives every rollout its 0/1 outcome reward (last
     \\boxed{} against the gold answer; exact numbers, a safe own-parser sympy check, MC letters).
  2. `load_problems` / `BENCHMARKS`: training sets and the paper's benchmarks by name (Table 1: AIME24,
     AIME25, AMC, MATH-500, Minerva, OlympiadBench; out of domain: ARC-c, GPQA-diamond, MMLU-Pro), any
     Hugging Face dataset id, a local .jsonl/.json file, or "toy" (the CPU toy world).
  3. Metrics, as pure functions: unbiased pass@k (Chen et al. 2021); the Table-4 diversity metrics
     distinct-1/4, self-BLEU, self-ROUGE-L and div-score; Near-miss@k (r = 0) (Fig. 7); the share of
     discarded valid trajectories (Fig. 3); median with p10/p90 across prompts (Table 4).
  4. `evaluate` (avg@n and pass@k of any generator backend), training curves from metrics.jsonl
     (Figs. 3-7) and the rectification viewer for traces.jsonl (Fig. 12); the command line.

How to run:
  python eval.py --model Qwen/Qwen2.5-Math-1.5B --benchmarks math500,aime24,aime25,amc,minerva,olympiad \\
      --ood arc-c,gpqa,mmlu-pro --n 8 --temperature 0.6 --max-new-tokens 1024 --out results.json
  python eval.py --model runs/NAME/checkpoint --benchmarks toy --n 4      # a toy-world checkpoint
  python eval.py --model ckpt --benchmarks my_problems.jsonl --limit 50    # any local JSONL file
  python eval.py --diversity --model ckpt --benchmarks aime24 --n 10 --temperature 1.0   # Table 4
  python eval.py --plot runs/scope runs/grpo --out curves.png
  python eval.py --trace runs/scope --step 40 --html trace.html
  python eval.py --grader-bench

Departures and choices (the grader's own list is in the comment under section 1):
  1. avg@n is the mean over problems of c/n with n samples at T = 0.6, top-p 1.0 (the LUFFY harness);
     LUFFY's rows duplicate AIME/AMC 32 times instead, which is avg@32 with n = 32 here.
  2. pass@k is reported for k = 1, 2, 4, ... up to n and for n, from the same n samples.
  3. All diversity metrics tokenise responses by whitespace; the paper does not say which tokens it uses.
  4. Self-BLEU is BLEU-4 of each sample against the other samples of its prompt, smoothed with Chen &
     Cherry's method 1 (ε = 0.1, as NLTK/Texygen); self-ROUGE-L is the mean ROUGE-L F1 over all pairs.
  5. div-score = mean(distinct-1, distinct-4, 1 − self-BLEU, 1 − self-ROUGE-L): our reading of the
     paper, which names the score without a definition we could read.
  6. Near-miss@k (r = 0) takes K = the cut point of prm.cut_point (a wrong answer with no flagged step
     counts its last step as the error); "discarded valid" means a zero-reward sample with keep ratio
     K / N ≥ 0.5. Both are our definitions of quantities the paper plots.
  7. Multiple-choice questions are asked with lettered options and graded on the boxed letter.
  8. Samples come from the training backends (vLLM when importable with CUDA, else HF generate), with
     generate.format_prompt: the model's chat template and the \\boxed{} instruction.
"""
# ==== imports ====
import argparse
import hashlib                  # section 2: deterministic choice shuffles
import html
import json
import math
import os
import random                   # section 2: grader benchmark
import re
import sys
import time                     # section 2: grader benchmark
import warnings                 # section 2: skipped-row reports
from collections import Counter
from fractions import Fraction  # section 1: exact number comparison

import mpmath                   # section 1: bounded numeric identity test (ships with sympy)
import numpy as np
import sympy                    # section 1: symbolic answers (built by our own parser only)

# ==== 1. answer extraction and grading ====
# The grader decides the reward of every rollout, so it is written to be (a) exact where maths is exact,
# (b) impossible to make hang or execute anything, (c) readable. Pipeline of `grade(response, gold)`:
#   extract_answer(response)  -> the last \boxed{...} / \fbox{...} / "\boxed 5" / "the answer is X"
#   _normalize(both)          -> strip LaTeX dressing (rules listed in _normalize's docstring)
#   _equiv(pred, gold)        -> exact string; multiple-choice letter; structures (matrix, union, set,
#                                bracketed tuple/interval, comma list); equation; number; symbolic.
# Numbers compare EXACTLY as fractions.Fraction (0.33 != 1/3; 0.5 == \frac12 == 50\%).
# Symbolic answers go through _Parser, our own recursive-descent parser for a LaTeX subset, which builds
# sympy objects directly (model text never reaches eval/exec/sympify/parse_expr/parse_latex). Two sympy
# expressions are equal when sympy's canonical forms match, else when they agree at 3 fixed random points,
# evaluated with a private 60-digit mpmath context by _num (relative tolerance 1e-40, absolute 1e-55),
# else — only for small polynomial-like expressions — when expand(a - b) == 0.
# Safety limits (checked BEFORE any sympy work, so every call is provably small):
#   answers longer than _MAX_CHARS characters are compared as plain strings only; at most _MAX_TOKENS
#   tokens reach the parser; nesting depth <= _MAX_DEPTH; number literals <= _MAX_DIGITS digits; n! and
#   binomials only for n <= 1000; sympy nodes are built with evaluate=False (sympy's own evaluation can call
#   simplify and run for minutes); exact values stop when integer powers would create more than
#   _POW_DIGIT_BUDGET digits; the numeric evaluator refuses magnitudes beyond 2^_MAX_MAG_BITS and trig
#   arguments beyond 1e6; lists/sets hold at most _MAX_ITEMS items. No signals or threads are used, so the
#   grader is safe to call from any thread. Anything malformed or refused returns False (never raises).
# Departures / choices (the paper leaves its verifier unspecified):
#   1. An unbalanced last \boxed{ (a truncated response) yields no answer, even if an earlier box exists.
#   2. A percentage p% equals p and p/100 (the Qwen/Math-Verify convention); otherwise numbers are exact.
#   3. Symbolic equality is decided numerically (probabilistic identity test at 3 points, 60 digits;
#      so a decimal that matches an irrational to 40 significant digits would count as equal),
#      not by sympy.simplify, whose run time cannot be bounded.
#   4. Bare comma lists and sets compare as multisets; tuples, points and intervals compare in order and
#      their bracket types must match; a bare list never equals a bracketed tuple.
#   5. 'e' is Euler's number and 'i' the imaginary unit; other single letters are variables.
#   6. A gold that is a single letter A-J is a multiple-choice key: the response's letter is compared.
#   7. Trailing unit words (a fixed list) and a trailing \text{...} after a number are dropped; Minerva's
#      "keep units" exception is not reproduced.

_MAX_CHARS = 1000            # longer answers: plain string comparison only
_MAX_DEPTH = 40              # parser nesting depth
_MAX_DIGITS = 300            # digits in one number literal
_MAX_TOKENS = 400            # tokens of one expression handed to the parser
_POW_DIGIT_BUDGET = 20000    # digits that exact integer powers may create in one answer
_MAX_ITEMS = 32              # elements of a list / set / tuple / matrix
_MAX_MAG_BITS = 4000         # |value| < 2**4000 in the numeric evaluator
_MP = mpmath.MPContext()     # private context: its precision never changes, so threads can share it
_MP.dps = 60
_TOL = _MP.mpf("1e-40")     # relative tolerance of the numeric identity test
_FLOOR = _MP.mpf("1e-55")   # absolute tolerance: rounding noise of a 60-digit sum that should be 0
_POINTS = ("0.5772156649015328606", "1.4142135623730950488", "-0.7390851332151606416")


class _Refuse(Exception):
    """Raised inside the grader when an input exceeds a safety limit or is not understood."""


# ---- extraction ----

_BOX_RE = re.compile(r"\\(?:boxed|fbox)")
_ANSWER_IS_RE = re.compile(r"(?:final answer|answer) is[:\s]*", re.IGNORECASE)


def _match_brace(s: str, i: int) -> int:
    """Index of the '}' matching the '{' at s[i], or -1 when the braces never balance (\\{ \\} do not count)."""
    depth = 0
    for j in range(i, len(s)):
        if s[j] not in "{}" or (j > 0 and s[j - 1] == "\\"):
            continue
        depth += 1 if s[j] == "{" else -1
        if depth == 0:
            return j
    return -1


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the content of the LAST \\boxed{...} or \\fbox{...} (nested braces
    balanced; "\\boxed 5" without braces takes the next token, up to a space or '$'); if there is no box, the
    text after the last "(final) answer is" up to the sentence end ("$...$" content when it starts with $).
    None when there is no answer, when the last box never closes (truncated output), or when it is empty."""
    if not isinstance(text, str):
        return None
    starts = [m.end() for m in _BOX_RE.finditer(text)]
    if starts:
        i = starts[-1]
        while i < len(text) and text[i].isspace():
            i += 1
        if i < len(text) and text[i] == "{":
            j = _match_brace(text, i)
            answer = text[i + 1:j] if j >= 0 else ""
        else:  # "\boxed 5" form: one whitespace-delimited token, stopping at '$'
            answer = re.split(r"[\s$]", text[i:], maxsplit=1)[0].rstrip(".,")
        answer = answer.strip()
        return answer or None
    matches = list(_ANSWER_IS_RE.finditer(text))
    if not matches:
        return None
    rest = text[matches[-1].end():]
    if rest.startswith("$"):
        end = rest.find("$", 1)
        answer = rest[1:end] if end > 0 else rest[1:]
    else:
        answer = re.split(r"\.(?:\s|$)|\n", rest, maxsplit=1)[0]
    answer = answer.strip().rstrip(".").strip()
    return answer or None


# ---- normalisation ----

_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00b7": "\\cdot ", "\u00d7": "\\times ", "\u03c0": "\\pi ",
            "\u221e": "\\infty ", "\u2264": "\\le ", "\u2265": "\\ge ", "\u2260": "\\ne ", "\u221a": "\\sqrt",
            "\u00b0": "", "\u222a": "\\cup ", "\u2205": "\\emptyset "}
_UNITS = ("cm|mm|km|m|meters?|metres?|centimeters?|kilometers?|inch(?:es)?|in|ft|feet|foot|yards?|miles?|"
          "seconds?|sec|s|minutes?|mins?|hours?|hrs?|days?|weeks?|months?|years?|degrees?|deg|radians?|rad|"
          "dollars?|cents?|units?|sq|square|cubic|mph|kg|g|grams?|kilograms?|lbs?|pounds?|ounces?|oz|"
          "liters?|litres?|ml|l|people|students?|ways|points?|times|coins?|marbles?|apples?")
_UNIT_WORD_RE = re.compile(r"\s+(?:" + _UNITS + r")(?:\^\{?\d\}?)?\.?$")        # searched at the end only
_UNIT_GLUED_RE = re.compile(r"^[-+]?[\d.,]*\d(" + _UNITS + r")(?:\^\{?\d\}?)?$")     # "5cm", "12m^2"
_UNIT_TEXT_RE = re.compile(r"\\(?:text|mbox|mathrm)\{\s*[a-zA-Z][a-zA-Z .]*\}(?:\^\{?\d\}?)?$")
_TEXT_CMD_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname|mathit)\s*\{([^{}]*)\}")
_PREFIX_RE = re.compile(r"^(?:[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?|\\[a-zA-Z]+)\s*(?:=|\\in\b)\s*(?=\S)")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")


def _normalize(s: str, strip_prefix: bool = True) -> str:
    """Canonical text of an answer. Rules, in order: unicode maths -> LaTeX; drop $, \\( \\), \\[ \\],
    \\displaystyle, \\left/\\right (and \\big...); \\dfrac/\\tfrac -> \\frac; \\neq/\\leq/\\geq -> \\ne/\\le/\\ge;
    spacing commands (\\! \\, \\; \\: \\quad ~) -> space; degrees (^\\circ, ^{\\circ}, \\circ, \\degree) dropped;
    \\$ dropped; "1{,}000" -> "1000"; \\{ \\} -> { }; \\emptyset -> {}; \\mathbb{R} -> (-\\infty,\\infty);
    "infinity"/"inf" -> \\infty; a trailing \\text{unit} or unit word after a number dropped; \\text{X} etc.
    -> X; " and " between items -> ","; a leading "x =" / "x \\in" / "f(x) =" removed; a trailing "." removed;
    whitespace removed (one space kept after a command before a letter: \\pi r); x^{2} -> x^2, a_{1} -> a_1;
    "1,000,000" -> "1000000". ("12.500" == "12.5" is left to the number comparison.)"""
    for u, r in _UNICODE.items():
        s = s.replace(u, r)
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", "", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![a-zA-Z])\s*", "", s)
    s = re.sub(r"\\(?:displaystyle|quad|qquad)(?![a-zA-Z])|(?<!\\)\\[!,;: ]|~", " ", s)
    s = re.sub(r"\s+", " ", s)                                  # one space per run (keeps regexes linear)
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\[dt]binom(?![a-zA-Z])", r"\\binom", s)
    s = re.sub(r"\\(neq|leq|geq)(?![a-zA-Z])", lambda m: "\\" + m.group(1)[:2], s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])", "", s)
    s = s.replace("{,}", "")
    s = s.replace("\\{", "{").replace("\\}", "}")
    s = re.sub(r"\\(?:emptyset|varnothing)(?![a-zA-Z])", "{}", s)
    s = re.sub(r"\\mathbb\{R\}", r"(-\\infty,\\infty)", s)
    s = re.sub(r"\b(?:infinity|inf)\b", r"\\infty", s)
    s = re.sub(r"\s*percent$", "\\%", s.strip())
    s = _strip_units(s)
    for _ in range(3):  # nested \text{\textbf{..}}
        s = _TEXT_CMD_RE.sub(lambda m: m.group(1), s)
    s = _strip_units(s)
    s = re.sub(r"\s+(?:and|or)\s+", ",", s)
    s = s.strip().rstrip(".").strip()
    s = re.sub(r"^[a-zA-Z]\([a-zA-Z]\)\s*=\s*(?=\S)", "", s)   # f(x) = ...
    if strip_prefix and (s.count("=") == 1 or "\\in" in s):
        s = _PREFIX_RE.sub("", s, count=1)
    s = re.sub(r"\s+", _space, s)
    s = re.sub(r"([_^])\{(\w)\}", r"\1\2", s)                 # x^{2} -> x^2, 1011_{2} -> 1011_2
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    return s


def _strip_units(s: str) -> str:
    """Drop trailing unit words / a trailing \\text{unit} when what precedes them contains a digit."""
    m = _UNIT_GLUED_RE.match(s)
    if m:
        return s[:m.start(1)]
    for _ in range(3):                                      # "square feet", "cm^2", ...
        m = _UNIT_TEXT_RE.search(s) or _UNIT_WORD_RE.search(s)
        if not m or not re.search(r"\d", s[:m.start()]):
            return s
        s = s[:m.start()].rstrip()
    return s


def _space(m: re.Match) -> str:
    """Whitespace is dropped, except one space between a command and a letter (\\sin x, \\pi r)."""
    before, after = m.string[max(0, m.start() - 30):m.start()], m.string[m.end():m.end() + 1]
    return " " if re.search(r"\\[a-zA-Z]+$", before) and after.isalpha() else ""


# ---- our LaTeX-subset parser (builds sympy objects; never evaluates text) ----
# Every node is built with evaluate=False: sympy's automatic evaluation (Pow._eval_power, Abs.eval, ...)
# can call simplify() internally and run for minutes, so nothing clever happens at construction. Exact
# values are computed by _exact (with a digit budget) and numeric values by _num (with magnitude guards).

_TOKEN_RE = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|(\\[a-zA-Z]+|\\.)|(.))", re.DOTALL)
_FUNCS = {"\\sin": sympy.sin, "\\cos": sympy.cos, "\\tan": sympy.tan, "\\cot": sympy.cot,
          "\\sec": sympy.sec, "\\csc": sympy.csc, "\\arcsin": sympy.asin, "\\arccos": sympy.acos,
          "\\arctan": sympy.atan, "\\ln": sympy.log, "\\log": sympy.log, "\\exp": sympy.exp}
_INVERSE = {"\\sin": sympy.asin, "\\cos": sympy.acos, "\\tan": sympy.atan}
_MUL_OPS = {"*", "\\cdot", "\\times"}
_DIV_OPS = {"/", "\\div"}
_MINUS_ONE = sympy.Integer(-1)


def _tokenize(s: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if m is None or m.end() == pos:     # only trailing whitespace is left
            break
        pos = m.end()
        tok = m.group(1) or m.group(2) or m.group(3)
        if tok and not tok.isspace():
            if m.group(1) and sum(c.isdigit() for c in tok) > _MAX_DIGITS:
                raise _Refuse("number literal too long")
            tokens.append(tok)
            if len(tokens) > _MAX_TOKENS:
                raise _Refuse("too many tokens")
    return tokens


def _add(*terms):
    return terms[0] if len(terms) == 1 else sympy.Add(*terms, evaluate=False)


def _mul(*factors):
    return factors[0] if len(factors) == 1 else sympy.Mul(*factors, evaluate=False)


def _neg(x):
    return _mul(_MINUS_ONE, x)


def _pow(base, exponent):
    return sympy.Pow(base, exponent, evaluate=False)


def _small_int(expr, lo: int, hi: int) -> int:
    """The exact integer value of expr, which must lie in [lo, hi]; _Refuse otherwise."""
    value = _exact(expr)
    if value is None or value.denominator != 1 or not lo <= value <= hi:
        raise _Refuse(f"expected an integer in [{lo}, {hi}]")
    return int(value)


class _Parser:
    """Recursive descent over a LaTeX subset:
        expr   := term (('+'|'-') term)*
        term   := unary ((mul|div) unary | <implicit multiplication> power)*
        unary  := ('-'|'+') unary | power
        power  := primary ['!'] ('^' script)?
        primary:= number | letter['_' script] | ( expr ) | [ expr ] | { expr } | |expr|
                | \\frac s s | \\sqrt[expr]? s | \\binom s s | \\pi | \\infty
                | func['^' script] arg | \\log_b arg          (\\sin 2x = sin(2x); \\cos^{-1} = arccos)
        script := { expr } | one character or command   (x^23 is x^2 * 3)"""

    def __init__(self, text: str):
        self.toks = _tokenize(text)
        self.i = 0
        self.depth = 0

    def parse(self):
        if not self.toks:
            raise _Refuse("empty")
        value = self.expr()
        if self.i != len(self.toks):
            raise _Refuse(f"unexpected {self.peek()!r}")
        return value

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected=None):
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _Refuse(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def enter(self):
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Refuse("nesting too deep")

    def expr(self):
        self.enter()
        terms = [self.term()]
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            terms.append(rhs if op == "+" else _neg(rhs))
        self.depth -= 1
        return _add(*terms)

    def starts_primary(self, tok) -> bool:
        if tok is None:
            return False
        return (tok[0].isdigit() or tok[0] == "." or tok.isalpha() or tok in ("(", "{", "\\frac", "\\sqrt",
                "\\pi", "\\infty", "\\binom") or tok in _FUNCS)

    def term(self):
        factors = [self.unary()]
        while True:
            tok = self.peek()
            if tok in _MUL_OPS:
                self.take()
                factors.append(self.unary())
            elif tok in _DIV_OPS:
                self.take()
                den = self.unary()
                if _exact(den) == 0:
                    raise _Refuse("division by zero")
                factors.append(_pow(den, _MINUS_ONE))
            elif self.starts_primary(tok):
                factors.append(self.power())
            else:
                return _mul(*factors)

    def unary(self):
        tok = self.peek()
        if tok in ("-", "+"):
            self.take()
            self.enter()
            value = self.unary()
            self.depth -= 1
            return _neg(value) if tok == "-" else value
        return self.power()

    def power(self):
        base = self.primary()
        if self.peek() == "!":                                 # factorial of a small integer
            self.take()
            base = sympy.Integer(math.factorial(_small_int(base, 0, 1000)))
        if self.peek() == "^":
            self.take()
            return _pow(base, self.script())
        return base

    def script(self):
        tok = self.peek()
        if tok == "{":
            self.take()
            value = self.expr()
            self.take("}")
            return value
        if tok is not None and tok[0].isdigit() and len(tok) > 1:
            self.toks[self.i] = tok[1:]          # split "23" -> "2", "3"
            return sympy.Integer(int(tok[0]))
        if tok == "-":                            # x^-1 (common sloppy LaTeX)
            self.take()
            return _neg(self.script())
        return self.primary()

    def primary(self):
        self.enter()
        value = self._primary()
        self.depth -= 1
        return value

    def _primary(self):
        tok = self.take()
        if tok[0].isdigit() or tok[0] == ".":
            value = Fraction(tok.rstrip(".") or "0")
            return sympy.Rational(value.numerator, value.denominator)
        if tok.isalpha() and len(tok) == 1:
            if self.peek() == "_":
                self.take()
                sub = self.take()
                if sub == "{":
                    parts = []
                    while self.peek() not in ("}", None):
                        parts.append(self.take())
                    self.take("}")
                    sub = "".join(parts)
                return sympy.Symbol(f"{tok}_{sub}")
            return {"e": sympy.E, "i": sympy.I}.get(tok) or sympy.Symbol(tok)
        if tok in ("(", "[", "{"):
            value = self.expr()
            self.take({"(": ")", "[": "]", "{": "}"}[tok])
            return value
        if tok == "|":
            value = self.expr()
            self.take("|")
            return sympy.Abs(value, evaluate=False)
        if tok == "\\frac":
            num, den = self.script(), self.script()
            if _exact(den) == 0:
                raise _Refuse("division by zero")
            return _mul(num, _pow(den, _MINUS_ONE))
        if tok == "\\sqrt":
            index = 2
            if self.peek() == "[":
                self.take()
                index = _small_int(self.expr(), 2, 100)
                self.take("]")
            return _pow(self.script(), sympy.Rational(1, index))
        if tok == "\\pi":
            return sympy.pi
        if tok == "\\infty":
            return sympy.oo
        if tok == "\\binom":
            n, k = _small_int(self.script(), 0, 1000), _small_int(self.script(), -1000, 1000)
            return sympy.Integer(math.comb(n, k) if k >= 0 else 0)
        if tok in _FUNCS:
            base = exponent = None
            if tok == "\\log" and self.peek() == "_":
                self.take()
                base = self.script()
            if self.peek() == "^":
                self.take()
                exponent = self.script()
            bracketed = self.peek() in ("(", "{", "[")
            args = [self.power()]
            while not bracketed and self.starts_primary(self.peek()) and self.peek() not in _FUNCS:
                args.append(self.power())                                   # \sin 2x = sin(2x)
            arg = _mul(*args)
            if exponent is not None and _exact(exponent) == -1 and tok in _INVERSE:   # \cos^{-1} = arccos
                return _INVERSE[tok](arg, evaluate=False)
            if base is not None:
                value = _mul(sympy.log(arg, evaluate=False), _pow(sympy.log(base, evaluate=False), _MINUS_ONE))
            else:
                value = _FUNCS[tok](arg, evaluate=False)
            return _pow(value, exponent) if exponent is not None else value
        raise _Refuse(f"unsupported token {tok!r}")


# ---- exact values (digit budget) and the numeric identity test (magnitude guards) ----

def _digits(q: Fraction) -> int:
    """Decimal digits of the larger of numerator/denominator (cheap upper bound)."""
    return max(abs(q.numerator).bit_length(), q.denominator.bit_length()) * 30103 // 100000 + 1


def _exact(expr, budget: list | None = None) -> Fraction | None:
    """The exact rational value of a tree of numbers, +, *, and integer powers; None when the tree holds
    anything else or when integer powers would create more than _POW_DIGIT_BUDGET digits in total."""
    budget = [_POW_DIGIT_BUDGET] if budget is None else budget
    if expr.is_Rational:
        return Fraction(int(expr.p), int(expr.q))
    if expr.is_Add or expr.is_Mul:
        values = [_exact(a, budget) for a in expr.args]
        if any(v is None for v in values):
            return None
        total = values[0]
        for v in values[1:]:
            total = total + v if expr.is_Add else total * v
        return total
    if expr.is_Pow:
        base, exponent = _exact(expr.args[0], budget), _exact(expr.args[1], budget)
        if base is None or exponent is None or exponent.denominator != 1 or (base == 0 and exponent < 0):
            return None
        if base not in (0, 1, -1):
            budget[0] -= abs(int(exponent)) * _digits(base)
            if budget[0] < 0:
                return None
        return base ** int(exponent)
    return None


def _num(expr, point: dict):
    """Value of a sympy expression at `point` (symbol name -> mpf), with magnitude guards."""
    ctx = _MP
    if expr.is_Rational:
        value = ctx.mpf(int(expr.p)) / int(expr.q)
    elif expr.is_Symbol:
        value = point[expr.name]
    elif expr is sympy.pi:
        value = ctx.pi
    elif expr is sympy.E:
        value = ctx.e
    elif expr is sympy.I:
        value = ctx.mpc(0, 1)
    elif expr.is_Add:
        value = ctx.fsum(_num(a, point) for a in expr.args)
    elif expr.is_Mul:
        value = ctx.mpf(1)
        for a in expr.args:
            value = value * _num(a, point)
            _check_mag(value)
    elif expr.is_Pow:
        b, e = _num(expr.args[0], point), _num(expr.args[1], point)
        if b == 0:
            if ctx.re(e) <= 0:
                raise _Refuse("0 to a non-positive power")
            return ctx.mpf(0)
        if abs(e) * (abs(ctx.log(abs(b))) + 1) > _MAX_MAG_BITS * 0.69:
            raise _Refuse("power too large to evaluate")
        value = ctx.power(b, e)
    elif isinstance(expr, sympy.Abs):
        value = abs(_num(expr.args[0], point))
    elif isinstance(expr, sympy.log):
        x = _num(expr.args[0], point)
        if x == 0:
            raise _Refuse("log 0")
        value = ctx.log(x)
    elif isinstance(expr, sympy.exp):
        x = _num(expr.args[0], point)
        if abs(x) > _MAX_MAG_BITS * 0.69:
            raise _Refuse("exp too large")
        value = ctx.exp(x)
    elif expr.func in _MP_TRIG:
        x = _num(expr.args[0], point)
        if abs(x) > 1e6:
            raise _Refuse("trig argument too large")
        value = getattr(ctx, _MP_TRIG[expr.func])(x)
    else:  # oo, zoo, nan, unknown functions
        raise _Refuse(f"cannot evaluate {type(expr).__name__}")
    _check_mag(value)
    return value


_MP_TRIG = {sympy.sin: "sin", sympy.cos: "cos", sympy.tan: "tan", sympy.cot: "cot", sympy.sec: "sec",
            sympy.csc: "csc", sympy.asin: "asin", sympy.acos: "acos", sympy.atan: "atan"}


def _check_mag(value):
    if not _MP.isfinite(value) or (value != 0 and _MP.mag(value) > _MAX_MAG_BITS):
        raise _Refuse("value out of range")


def _numeric_equal(a, b) -> bool | None:
    """True/False when the two expressions agree/disagree at the test points; None when undecided.

    A point where only one side can be evaluated counts as disagreement; points where neither can are
    skipped. A constant needs one agreeing point, an expression with symbols two."""
    names = sorted({s.name for s in (a.free_symbols | b.free_symbols)})
    agreed = 0
    for k in range(len(_POINTS)):
        # each symbol gets its own value: shift the base points by symbol index
        point = {n: _MP.mpf(_POINTS[(k + j) % len(_POINTS)]) + j * _MP.mpf("0.31830988618379067")
                 for j, n in enumerate(names)}
        va, vb = _num_or_none(a, point), _num_or_none(b, point)
        if va is None and vb is None:
            continue
        if va is None or vb is None or abs(va - vb) > _TOL * max(abs(va), abs(vb)) + _FLOOR:
            return False
        agreed += 1
        if not names:
            break
    return True if agreed >= (2 if names else 1) else None


def _num_or_none(expr, point):
    try:
        return _num(expr, point)
    except (_Refuse, ZeroDivisionError, ValueError, OverflowError):
        return None


def _small_polynomial(expr) -> bool:
    """Cheap to expand (checked structurally, nothing is evaluated): <= 60 nodes, <= 3 symbols, no
    functions, only integer exponents, summing to <= 24 in absolute value."""
    nodes = []
    for node in sympy.preorder_traversal(expr):
        nodes.append(node)
        if len(nodes) > 60:
            return False
    if len(expr.free_symbols) > 3 or any(isinstance(n, sympy.Function) for n in nodes):
        return False
    exponents = [n.args[1] for n in nodes if n.is_Pow]
    return all(e.is_Integer for e in exponents) and sum(abs(int(e)) for e in exponents) <= 24


def _sympy_equal(a, b) -> bool:
    """Equality of two parsed answers: exact rationals when both are numbers, else the numeric identity
    test, else (small polynomials only) expand(a - b) == 0."""
    if a == b:
        return True
    xa, xb = _exact(a), _exact(b)
    if xa is not None and xb is not None:     # exact numbers: 0.33 != 1/3
        return xa == xb
    if a.has(sympy.oo, sympy.zoo, sympy.nan) or b.has(sympy.oo, sympy.zoo, sympy.nan):
        return False
    verdict = _numeric_equal(a, b)
    if verdict is not None:
        return verdict
    diff = _add(a, _neg(b))
    return _small_polynomial(diff) and sympy.expand(diff) == 0


def _to_sympy(s: str):
    return _Parser(s).parse()


# ---- numbers ----

_NUMBER_RE = re.compile(r"^([-+]?)(\d+\.?\d*|\.\d+)(?:(?:e|E|\\times10\^|\\cdot10\^|\*10\^)\{?([-+]?\d{1,4})\}?)?$")
_MIXED_RE = re.compile(r"^([-+]?)(\d+)\\frac(?:\{(\d+)\}\{(\d+)\}|(\d)(\d))$")   # 4\frac{2}{3} = 14/3
_REPEATING_RE = re.compile(r"^([-+]?)(\d*)\.(\d*)\\overline\{?(\d{1,50})\}?$")   # 0.1\overline{6} = 1/6
_FRACTION_RE = re.compile(r"^([-+]?)(?:\\frac\{(-?\d+)\}\{(-?\d+)\}|\\frac(\d)(\d)|(\d+)/(\d+))$")


def _as_number(s: str) -> Fraction | None:
    """Exact value of a plain number: integer, decimal, scientific (1.5e3, 1.5\\times10^{3}), a/b, \\frac{a}{b},
    a mixed number 4\\frac{2}{3} (proper fraction part), a repeating decimal 0.\\overline{3}."""
    if len(s) > _MAX_DIGITS + 20:
        return None
    m = _NUMBER_RE.match(s)
    if m:
        sign, mantissa, exp = m.groups()
        value = Fraction(mantissa.rstrip(".") if mantissa.endswith(".") else mantissa)
        if exp is not None:
            value *= Fraction(10) ** int(exp)
        return -value if sign == "-" else value
    m = _MIXED_RE.match(s)
    if m:
        num, den = (int(g) for g in (m.group(3, 4) if m.group(3) else m.group(5, 6)))
        if 0 <= num < den:                                   # proper fraction part only
            value = int(m.group(2)) + Fraction(num, den)
            return -value if m.group(1) == "-" else value
    m = _REPEATING_RE.match(s)
    if m:                                                    # a.b(c): (abc - ab) / (10^|b| (10^|c| - 1))
        sign, whole, fixed, rep = m.groups()
        value = Fraction(int(whole + fixed + rep) - int(whole + fixed or "0"),
                         10 ** len(fixed) * (10 ** len(rep) - 1))
        return -value if sign == "-" else value
    m = _FRACTION_RE.match(s)
    if m:
        sign = m.group(1)
        num, den = [g for g in m.groups()[1:] if g is not None]
        if int(den) == 0:
            return None
        value = Fraction(int(num), int(den))
        return -value if sign == "-" else value
    return None


# ---- equivalence ----

_LETTER_RE = re.compile(r"^\(?([A-J])\)?$")
_PRED_LETTER_RE = re.compile(r"^\(?([A-Ja-j])(?:\)|\.|:|$)")
_WORDY_RE = re.compile(r"(?<!\\)[a-zA-Z]{2,}")


def _split_top(s: str, sep: str) -> list[str]:
    """Split at `sep` outside (), [], {} (bracket types are not matched, so intervals like [0,1) work)."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _outer_close(s: str) -> int:
    """Index where the bracket opened at s[0] closes (any bracket type), or -1."""
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _top_pm(s: str) -> int:
    """Index of the first \\pm outside brackets, or -1."""
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith("\\pm", i) and not s[i + 3:i + 4].isalpha():
            return i
    return -1


def _expand_pm(items: list[str]) -> list[str]:
    """Items of a set/list with "a \\pm b" written out as the two items a+b, a-b."""
    out = []
    for item in items:
        _, parts = _structure(item) if _top_pm(item) >= 0 else ("scalar", [item])
        out.extend(parts)
    return out


def _structure(s: str):
    """(kind, payload) of a normalised answer: matrix | union | set | seq | list | scalar."""
    m = re.fullmatch(r"\\begin\{(?:pmatrix|bmatrix|matrix|vmatrix|array)\}(?:\{[lcr|]*\})?(.*)"
                     r"\\end\{(?:pmatrix|bmatrix|matrix|vmatrix|array)\}", s)
    if m:
        rows = [r for r in m.group(1).split("\\\\") if r != ""]
        return "matrix", [r.split("&") for r in rows]
    parts = _split_top(s, "\\cup")
    if len(parts) > 1:
        return "union", parts
    if s[:1] in "([{" and s[-1:] in ")]}" and _outer_close(s) == len(s) - 1:
        inner = _split_top(s[1:-1], ",")
        if s[0] == "{" and s[-1] == "}":
            return "set", [] if inner == [""] else _expand_pm(inner)
        if len(inner) > 1:
            return "seq", (s[0], s[-1], inner)
        return "scalar", s
    parts = _split_top(s, ",")
    if len(parts) > 1:
        names = {m.group(0).split("=")[0].split("\\in")[0] if m else None
                 for m in (_PREFIX_RE.match(p) for p in parts)}
        if len(names - {None}) <= 1:                      # "x=1, x=2": solutions of one variable
            parts = [_PREFIX_RE.sub("", p, count=1) for p in parts]
        return "list", _expand_pm(parts)
    k = _top_pm(s)
    if k >= 0:                                            # a \pm b -> the list a+b, a-b
        lhs, rhs = s[:k], s[k + 3:]
        return "list", ([rhs, f"-({rhs})"] if not lhs else [f"{lhs}+({rhs})", f"{lhs}-({rhs})"])
    return "scalar", s


def _multiset_equal(xs: list[str], ys: list[str], depth: int) -> bool:
    if len(xs) != len(ys):
        return False
    left = list(ys)
    for x in xs:
        for k, y in enumerate(left):
            if _equiv(x, y, depth + 1):
                del left[k]
                break
        else:
            return False
    return True


def _equiv(pred: str, gold: str, depth: int = 0) -> bool:
    """Equivalence of two NORMALISED answers (see the section comment for the order of the checks)."""
    if pred == gold:
        return True
    if depth > 4 or len(pred) > _MAX_CHARS or len(gold) > _MAX_CHARS:
        return False
    kp, p = _structure(pred)
    kg, g = _structure(gold)
    if kp != kg:
        unordered = {"set", "list"}
        if kp in unordered and kg in unordered:
            return _multiset_equal(p, g, depth)
        return False
    if kg != "scalar" and max(len(p[2] if kg == "seq" else p), len(g[2] if kg == "seq" else g)) > _MAX_ITEMS:
        return False
    if kg == "matrix":
        return (len(p) == len(g) and all(len(rp) == len(rg) for rp, rg in zip(p, g))
                and all(_equiv(x, y, depth + 1) for rp, rg in zip(p, g) for x, y in zip(rp, rg)))
    if kg in ("union", "set", "list"):
        return _multiset_equal(p, g, depth)
    if kg == "seq":
        (po, pc, pitems), (go, gc, gitems) = p, g
        return (po == go and pc == gc and len(pitems) == len(gitems) <= _MAX_ITEMS
                and all(_equiv(x, y, depth + 1) for x, y in zip(pitems, gitems)))
    return _scalar_equal(pred, gold)


def _strip_percent(s: str) -> tuple[str, bool]:
    if s.endswith("\\%"):
        return s[:-2], True
    if s.endswith("%"):
        return s[:-1], True
    return s, False


def _scalar_equal(pred: str, gold: str) -> bool:
    if _WORDY_RE.search(gold) and not gold.startswith("\\") and pred.casefold() == gold.casefold():
        return True                                   # plain-text answers, case-insensitive
    if pred.count("=") == 1 and gold.count("=") == 1:  # equations: compare lhs - rhs up to sign
        (pl, pr), (gl, gr) = pred.split("="), gold.split("=")
        try:
            dp, dg = _add(_to_sympy(pl), _neg(_to_sympy(pr))), _add(_to_sympy(gl), _neg(_to_sympy(gr)))
        except _Refuse:
            return False
        return _sympy_equal(dp, dg) or _sympy_equal(dp, _neg(dg))
    pred, p_pct = _strip_percent(pred)
    gold, g_pct = _strip_percent(gold)
    np_, ng = _as_number(pred), _as_number(gold)
    if np_ is not None and ng is not None:
        candidates = [(np_, ng)]
        if p_pct:
            candidates.append((np_ / 100, ng))
        if g_pct:
            candidates.append((np_, ng / 100))
        return any(x == y for x, y in candidates)
    try:
        a, b = _to_sympy(pred), _to_sympy(gold)
    except _Refuse:
        return pred == gold
    if _sympy_equal(a, b):
        return True
    hundredth = sympy.Rational(1, 100)
    if p_pct and _sympy_equal(_mul(a, hundredth), b):
        return True
    return bool(g_pct and _sympy_equal(a, _mul(b, hundredth)))


def grade(response: str, gold: str) -> bool:
    """True when the final answer of `response` is equivalent to `gold` (an answer string; if it holds a
    \\boxed{}, its last box is used). Never raises: malformed or over-limit input gives False."""
    try:
        if not isinstance(response, str) or not isinstance(gold, str):
            return False
        if _BOX_RE.search(gold):
            gold = extract_answer(gold) or ""
        pred = extract_answer(response)
        if pred is None or not gold.strip():
            return False
        if len(pred) > _MAX_CHARS or len(gold) > _MAX_CHARS:
            return pred.strip() == gold.strip()
        p, g = _normalize(pred), _normalize(gold)
        if not p or not g:
            return False
        if p == g:
            return True
        m = _LETTER_RE.match(g)
        if m:  # multiple choice: compare letters
            mp = _PRED_LETTER_RE.match(p)
            return bool(mp) and mp.group(1).upper() == m.group(1)
        if _equiv(p, g):
            return True
        if "=" in pred and "=" in gold:  # "2x - y = 1" vs "y = 2x - 1": compare as whole equations
            return _equiv(_normalize(pred, strip_prefix=False), _normalize(gold, strip_prefix=False))
        return False
    except Exception:  # noqa: BLE001 — the grader's contract is "never raises"; RecursionError included
        return False


# ==== 2. problems and benchmarks ====
# load_problems(source) turns a local file, a known benchmark name (BENCHMARKS), any Hugging Face dataset id
# or "toy" into a list of {"id", "question", "answer"} records (+ "choices" for multiple choice, whose
# answer is then the letter). Field names are read from the BENCHMARKS row, else auto-detected from
# _QUESTION_FIELDS / _ANSWER_FIELDS / _SOLUTION_FIELDS (a solution gives its last \boxed{}). Bad rows raise
# ValueError naming the source and the row (1-based; the line number for JSONL) unless skip_bad=True, in
# which case they are dropped and their count is reported with warnings.warn (one line on stderr).
# Multiple-choice questions get their options appended as "A. ...", one per line, and an instruction to box
# the letter; GPQA's options are shuffled deterministically from the record id (the dataset lists the
# correct answer first).

_MC_INSTRUCTION = "Answer with the letter of the correct option in \\boxed{}."
_LETTERS = "ABCDEFGHIJKLMNOP"

# name -> where the data lives and how to read it. "answer_from": "field" (the answer column as is),
# "boxed" (last \boxed{} of the column), "gsm8k" (text after the last "####"), "letter" (a letter/index key
# into "choices"), "first_choice" (the correct option is the first of "choices"; shuffled per id).
# Field names marked (auto) were not verified against the Hub: the auto-detection lists are tried too.
BENCHMARKS: dict[str, dict] = {
    "math500":    {"hf_id": "HuggingFaceH4/MATH-500", "config": None, "split": "test", "kind": "math",
                   "question": "problem", "answer": "answer", "answer_from": "field", "id": "unique_id"},
    "aime24":     {"hf_id": "HuggingFaceH4/aime_2024", "config": None, "split": "train", "kind": "math",
                   "question": "problem", "answer": "answer", "answer_from": "field", "id": "id"},
    "aime25":     {"hf_id": "opencompass/AIME2025", "config": ["AIME2025-I", "AIME2025-II"], "split": "test",
                   "kind": "math", "question": "question", "answer": "answer", "answer_from": "field", "id": None},
    "amc":        {"hf_id": "AI-MO/aimo-validation-amc", "config": None, "split": "train", "kind": "math",
                   "question": "problem", "answer": "answer", "answer_from": "field", "id": "id"},
    "minerva":    {"hf_id": "math-ai/minervamath", "config": None, "split": "test", "kind": "math",
                   "question": "question", "answer": "answer", "answer_from": "field", "id": None},  # (auto)
    "olympiad":   {"hf_id": "math-ai/olympiadbench", "config": None, "split": "test", "kind": "math",
                   "question": "question", "answer": "final_answer", "answer_from": "field", "id": "id"},  # (auto)
    "math-train": {"hf_id": "DigitalLearningGmbH/MATH-lighteval", "config": "default", "split": "train",
                   "kind": "math", "question": "problem", "answer": "solution", "answer_from": "boxed", "id": None},
    "gsm8k":      {"hf_id": "openai/gsm8k", "config": "main", "split": "test", "kind": "math",
                   "question": "question", "answer": "answer", "answer_from": "gsm8k", "id": None},
    "arc-c":      {"hf_id": "allenai/ai2_arc", "config": "ARC-Challenge", "split": "test", "kind": "mc",
                   "question": "question", "answer": "answerKey", "answer_from": "letter", "id": "id",
                   "choices": "choices"},                  # choices = {"text": [...], "label": [...]}
    "gpqa":       {"hf_id": "Idavidrein/gpqa", "config": "gpqa_diamond", "split": "train", "kind": "mc",
                   "question": "Question", "answer": "Correct Answer", "answer_from": "first_choice",
                   "id": "Record ID", "gated": True,
                   "choices": ["Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]},
    "mmlu-pro":   {"hf_id": "TIGER-Lab/MMLU-Pro", "config": None, "split": "test", "kind": "mc",
                   "question": "question", "answer": "answer", "answer_from": "letter", "id": "question_id",
                   "choices": "options"},
}
_QUESTION_FIELDS = ("question", "problem", "prompt", "Problem", "Question", "query")
_ANSWER_FIELDS = ("answer", "final_answer", "Answer", "ground_truth", "gt", "target")
_SOLUTION_FIELDS = ("solution", "Solution", "reference_solution")
_ID_FIELDS = ("id", "unique_id", "ID", "idx", "problem_idx", "question_id")


def _answer_text(value) -> str:
    """A gold answer as a string: 142.0 -> "142"; a list (OlympiadBench final_answer) -> its first item."""
    if isinstance(value, (list, tuple)):
        value = value[0] if len(value) else ""
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    return value.strip().strip("$").strip() if isinstance(value, str) else ""


def _pick(row: dict, preferred, candidates):
    """(field name, value) of the first present, non-empty field: `preferred` first, then `candidates`."""
    for name in ([preferred] if preferred else []) + list(candidates):
        value = row.get(name)
        if value not in (None, "", [], ()):
            return name, value
    return None, None


def _mc_options(row: dict, spec: dict, rid: str) -> tuple[list[str], str]:
    """(option texts, gold letter) of a multiple-choice row."""
    field = spec.get("choices")
    if spec.get("answer_from") == "first_choice":                     # GPQA: one column per option
        options = [str(row.get(f, "")).strip() for f in field]
        order = list(range(len(options)))
        random.Random(int(hashlib.sha256(rid.encode()).hexdigest()[:16], 16)).shuffle(order)
        return [options[k] for k in order], _LETTERS[order.index(0)]
    choices = row.get(field if field else "choices", row.get("options"))
    labels = None
    if isinstance(choices, dict):                                     # ARC: {"text": [...], "label": [...]}
        labels, choices = [str(x) for x in choices.get("label", [])], choices.get("text", [])
    if not isinstance(choices, (list, tuple)) or not choices or len(choices) > len(_LETTERS):
        raise ValueError("no usable list of choices")
    key = row.get(spec.get("answer") or "answer")
    if isinstance(key, bool) or key in (None, ""):
        raise ValueError("missing answer key")
    key = str(key).strip()
    if labels and key in labels:
        index = labels.index(key)
    elif key.isdigit() and not labels:
        index = int(key)                                              # a 0-based answer index
    elif len(key) == 1 and key.upper() in _LETTERS:
        index = _LETTERS.index(key.upper())
    else:
        raise ValueError(f"answer key {key!r} is not a letter or index")
    if not 0 <= index < len(choices):
        raise ValueError(f"answer key {key!r} out of range for {len(choices)} choices")
    return [str(c).strip() for c in choices], _LETTERS[index]


def _record(row, spec: dict, index: int, name: str) -> dict:
    """One {"id", "question", "answer"(, "choices")} record; ValueError (without the location) if bad."""
    if not isinstance(row, dict):
        raise ValueError(f"row is a {type(row).__name__}, not an object")
    _, question = _pick(row, spec.get("question"), _QUESTION_FIELDS)
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"missing or empty question (looked for {spec.get('question') or _QUESTION_FIELDS})")
    _, rid = _pick(row, spec.get("id"), _ID_FIELDS)
    rid = str(rid) if rid is not None else f"{name}-{index}"
    record = {"id": rid, "question": question.strip()}
    mc = spec.get("kind") == "mc" or (not spec and isinstance(row.get("choices", row.get("options")), (list, dict)))
    if mc:
        choices, letter = _mc_options(row, spec, rid)
        lines = "\n".join(f"{_LETTERS[k]}. {c}" for k, c in enumerate(choices))
        record.update(question=f"{record['question']}\n\n{lines}\n\n{_MC_INSTRUCTION}", answer=letter,
                      choices=choices)
        return record
    how = spec.get("answer_from", "field")
    if how == "boxed":
        answer = extract_answer(str(row.get(spec["answer"], ""))) or ""
    elif how == "gsm8k":                                              # "...reasoning...\n#### 1,234"
        text = str(row.get(spec["answer"], ""))
        answer = text.rsplit("####", 1)[-1].replace(",", "") if "####" in text else ""
    else:
        field, value = _pick(row, spec.get("answer"), _ANSWER_FIELDS)
        if field is None:                                             # no answer column: box of a solution
            _, solution = _pick(row, None, _SOLUTION_FIELDS)
            value = extract_answer(solution) if isinstance(solution, str) else None
        answer = _answer_text(value)
        if "####" in answer:                                          # GSM8K-style answer column
            answer = answer.rsplit("####", 1)[-1]
        elif _BOX_RE.search(answer):
            answer = extract_answer(answer) or ""
    answer = _answer_text(answer)
    if not answer:
        looked = spec.get("answer") or _ANSWER_FIELDS + _SOLUTION_FIELDS
        raise ValueError(f"missing or empty answer (looked for {looked})")
    record["answer"] = answer
    return record


class _BadLine(str):
    """A .jsonl line that could not be read (invalid JSON, not UTF-8): the reason. load_problems raises it
    with the file and line, or skips it with skip_bad=True."""


def _read_local(path: str) -> list[tuple[int, object]]:
    """[(row number, row)] of a .jsonl (row number = line number; an unreadable line is a _BadLine) or .json
    (a list, or {"...": [rows]}). Text must be UTF-8: an error names the file and the line."""
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".jsonl"):
        rows = []
        for lineno, line in enumerate(raw.split(b"\n"), start=1):
            try:
                text = line.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                rows.append((lineno, _BadLine(f"not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1})")))
                continue
            if text.strip():
                try:
                    rows.append((lineno, json.loads(text)))
                except json.JSONDecodeError as e:
                    rows.append((lineno, _BadLine(f"invalid JSON ({e.msg})")))
        return rows
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line}: not UTF-8 text (byte {raw[e.start]:#04x})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno} ({e.msg})") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: expected a list of rows or an object holding one list")
        data = lists[0]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of rows")
    return list(enumerate(data, start=1))


def _read_hf(hf_id: str, config, split: str | None) -> list[tuple[int, object]]:
    """[(row number, row)] of a Hugging Face dataset (several configs are concatenated)."""
    import datasets  # lazy: only the HF path needs it

    rows = []
    for cfg in (config if isinstance(config, list) else [config]):
        ds = datasets.load_dataset(hf_id, cfg, split=split) if split else datasets.load_dataset(hf_id, cfg)
        if isinstance(ds, dict):                                      # no split given: prefer test, then train
            key = next((k for k in ("test", "validation", "train") if k in ds), next(iter(ds), None))
            if key is None:
                raise ValueError(f"{hf_id}: the dataset has no splits")
            ds = ds[key]
        rows.extend(dict(r) for r in ds)
    return list(enumerate(rows, start=1))


def load_problems(source: str, split: str | None = None, limit: int | None = None, *,
                  skip_bad: bool = False) -> list[dict]:
    """Problems as [{"id", "question", "answer"}] (+ "choices" for multiple choice; the answer is a letter).

    source: "toy" (toy.make_problems; split "train" uses seed 1, anything else seed 0), a name in
    BENCHMARKS, a local .jsonl/.json file, or a Hugging Face dataset id ("owner/name" or "owner/name:config";
    split defaults to test, else validation, else train). limit keeps the first `limit` good rows.
    A row with a missing/empty question or answer raises ValueError naming the source and row number
    (the line number for JSONL); with skip_bad=True such rows are skipped and their count is reported
    through warnings.warn. Split is ignored for local files. Multiple-choice rows (a "choices"/"options"
    list, or {"text", "label"} as in ARC) take their key as a letter, a label, or a 0-based index."""
    if limit is not None and limit < 0:
        raise ValueError(f"load_problems: limit must be >= 0, got {limit}")
    if source == "toy":
        import toy  # lazy: the toy world is only needed for the toy benchmark

        return toy.make_problems(500 if limit is None else limit, seed=1 if split == "train" else 0)
    spec, name = {}, os.path.splitext(os.path.basename(source))[0]
    if source in BENCHMARKS:
        spec, name = BENCHMARKS[source], source
        try:
            rows = _read_hf(spec["hf_id"], spec["config"], split or spec["split"])
        except Exception as e:
            if not spec.get("gated"):
                raise
            raise RuntimeError(f"load_problems: {source} ({spec['hf_id']}) is gated on the Hugging Face hub: "
                               f"accept its terms on the dataset page and log in (`hf auth login` or "
                               f"`huggingface-cli login`). "
                               f"[{type(e).__name__}: {e}]") from e
    elif os.path.exists(source):
        rows = _read_local(source)
    elif source.endswith((".json", ".jsonl")):
        raise FileNotFoundError(f"load_problems: no such file {source!r}")
    elif "/" in source:
        hf_id, _, config = source.partition(":")
        rows = _read_hf(hf_id, config or None, split)
    else:
        raise ValueError(f"load_problems: unknown source {source!r}: not a file, not 'toy', not one of "
                         f"{sorted(BENCHMARKS)} and not a Hugging Face id 'owner/name'")
    problems, bad = [], []
    for rowno, row in rows:
        if limit is not None and len(problems) >= limit:
            break
        try:
            if isinstance(row, _BadLine):   # an unreadable .jsonl line: reported or skipped like a bad row
                raise ValueError(str(row))
            problems.append(_record(row, spec, rowno, name))
        except ValueError as e:
            where = "line" if source.endswith(".jsonl") else "row"
            if not skip_bad:
                raise ValueError(f"{source}: {where} {rowno}: {e}") from None
            bad.append(f"{where} {rowno}: {e}")
    if bad:
        warnings.warn(f"load_problems: skipped {len(bad)} bad row(s) of {source} (first: {bad[0]})", stacklevel=2)
    return problems


def grader_benchmark(n_pairs: int = 3000, seed: int = 0) -> dict:
    """Grade n_pairs synthetic (response, gold) pairs and time each call.

    The pairs mix equal answers written differently, near misses, structures (tuples, intervals, sets,
    matrices, MC letters, text) and adversarial inputs (power towers, 100k-digit numbers, deep nesting).
    Returns {"pairs", "seconds", "pairs_per_s", "agree" (share of verdicts matching the label the
    generator intended), "max_seconds", "slowest": [{"seconds", "gold", "response"} x 5]}."""
    rng = random.Random(seed)
    pairs = [_bench_pair(rng) for _ in range(n_pairs)]
    times, agree = [], 0
    start = time.perf_counter()
    for response, gold, label in pairs:
        t0 = time.perf_counter()
        verdict = grade(response, gold)
        times.append(time.perf_counter() - t0)
        agree += verdict == label
    total = time.perf_counter() - start
    order = sorted(range(len(pairs)), key=lambda k: -times[k])[:5]
    return {"pairs": n_pairs, "seconds": round(total, 3), "pairs_per_s": round(n_pairs / max(total, 1e-9), 1),
            "agree": round(agree / max(n_pairs, 1), 4), "max_seconds": round(max(times, default=0.0), 4),
            "slowest": [{"seconds": round(times[k], 4), "gold": pairs[k][1][:60],
                         "response": pairs[k][0][-80:]} for k in order]}


def _bench_pair(rng: random.Random) -> tuple[str, str, bool]:
    """One (response, gold, intended verdict) for grader_benchmark."""
    a, b = rng.randint(1, 99), rng.randint(2, 99)
    x = rng.choice("xyt")
    equal = [  # (written by the model, gold)
        (f"\\dfrac{{{a}}}{{{b}}}", f"\\frac{{{a}}}{{{b}}}"), (f"{a / 4:g}", f"\\frac{{{a}}}{{4}}"),
        (f"{a * 1000:,}", f"{a * 1000}"), (f"{a}\\%", f"{a}"), (f"{a}^\\circ", f"{a}"),
        (f"{a} \\text{{ cm}}", f"{a}"), (f"{x} = {a}", f"{a}"), (f"({x}+{a})^2", f"{x}^2+{2 * a}{x}+{a * a}"),
        (f"\\left({a}, {b}\\right)", f"({a},{b})"), (f"\\{{{a}, {b}\\}}", f"\\{{{b},{a}\\}}"),
        (f"[{a}, {a + b})", f"[{a},{a + b})"), (f"\\frac{{\\sqrt{{{a}}}}}{{{b}}}", f"\\sqrt{{{a}}}/{b}"),
        (f"{a}\\pi", f"\\pi \\cdot {a}"), ("\\text{(C)}", "C"), ("\\textbf{Monday}", "monday"),
        (f"\\begin{{pmatrix}} {a} & {b} \\\\ 0 & 1 \\end{{pmatrix}}",
         f"\\begin{{pmatrix}}{a}&{b}\\\\0&1\\end{{pmatrix}}"),
        (f"\\sin^2 {x} + \\cos^2 {x}", "1"), (f"{a}e{b}".replace("e", "\\times 10^{") + "}", f"{a}e{b}"),
    ]
    near = [
        (f"-{a}", f"{a}"), (f"\\frac{{{b}}}{{{a}}}", f"\\frac{{{a}}}{{{b}}}" if a != b else "0"),
        (f"({b},{a})", f"({a},{b})" if a != b else f"({a},{b + 1})"), (f"({a},{a + b})", f"[{a},{a + b})"),
        ("0.33", "\\frac{1}{3}"), (f"({x}+{a})^2", f"{x}^2+{a}{x}+{a * a}"), ("(B)", "C"),
        (f"{a}.{b}", f"{a}"), (f"\\sqrt{{{a * a + 1}}}", f"{a}"),
    ]
    adversarial = [
        ("9^{9^{9^{9}}}", "1"), ("1" * 100000, "1"), ("(" * 5000 + "1" + ")" * 5000, "1"),
        ("2^{2^{2^{2^{2^{2}}}}}", "2"), ("\\frac{" * 300 + "1" + "}{2}" * 300, "1"),
        ("x^{x^{x^{x^{x^{x^{x}}}}}}", "x"), ("e^{e^{e^{e^{100}}}}", "1"), ("\\sin(10^{300})", "0"),
    ]
    roll = rng.random()
    if roll < 0.55:
        pred, gold = rng.choice(equal)
        label = True
    elif roll < 0.9:
        pred, gold = rng.choice(near)
        label = False
    else:
        pred, gold = rng.choice(adversarial)
        label = False
    lead = rng.choice(["", "Let us compute step by step.\n\n", "We have $a = 2$, so \\boxed{3} is wrong.\n\n"])
    tail = rng.choice(["The answer is \\boxed{%s}.", "Therefore $\\boxed{%s}$", "The final answer is $%s$."])
    if "boxed" not in tail:                      # an earlier box would win over "the final answer is"
        lead = lead.replace("\\boxed{3}", "3")
    return lead + tail.replace("%s", pred), gold, label



# ==== 3. metrics: pass@k, diversity, near misses ====
# Pure functions: numbers or strings in, a number out. The diversity metrics all tokenise a response the
# same way, by whitespace (`text.split()`): cheap, model-independent, and the same for every checkpoint.


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem (Chen et al. 2021, eq. 1): 1 − C(n−c, k) / C(n, k).

    n samples were drawn and c of them are correct; the value is the chance that a k-subset drawn
    without replacement holds at least one correct sample. Computed in the product form
    1 − Π_{i=n−c+1}^{n} (1 − k/i), which never forms the (huge) binomials; it is exactly 1 when fewer
    than k samples are wrong, because then every k-subset holds a correct one.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    all_wrong = 1.0  # C(n−c, k) / C(n, k): probability that all k drawn samples are wrong
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, 8, ... up to n, and n itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else ks + [n]


def _ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: list[str], n: int) -> float:
    """distinct-n (Li et al. 2016) of one prompt's samples: |unique n-grams| / |all n-grams|.

    n-grams are counted inside each sample (never across two samples) over whitespace tokens, and pooled
    over the samples. A sample shorter than n tokens adds none; no n-grams at all gives 0.0.
    k identical samples (no n-gram repeated inside) give 1/k; samples sharing no n-gram give 1.
    """
    grams = [g for text in texts for g in _ngrams(text.split(), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def bleu(hypothesis: list[str], references: list[list[str]], max_n: int = 4, epsilon: float = 0.1) -> float:
    """Sentence BLEU-4 (Papineni et al. 2002) of a token list against several references, smoothed.

    p_n  = Σ_g min(count_hyp(g), max_ref count_ref(g)) / Σ_g count_hyp(g)    (clipped n-gram precision)
    BLEU = BP · exp(Σ_{n=1..4} ¼ · log p_n),   BP = 1 if h > r else exp(1 − r/h)
    with h = |hypothesis| and r the reference length closest to h (the shorter on a tie).
    Smoothing: Chen & Cherry (2014) method 1, as in NLTK's SmoothingFunction().method1 that Texygen's
    self-BLEU uses: a p_n with no clipped match becomes ε / max(1, Σ_g count_hyp(g)), ε = 0.1.
    Like NLTK, a hypothesis with no unigram match at all (or an empty one) scores 0.
    """
    if not hypothesis:
        return 0.0
    log_p = 0.0
    for n in range(1, max_n + 1):
        hyp_counts = Counter(_ngrams(hypothesis, n))
        max_ref = Counter()
        for ref in references:
            max_ref |= Counter(_ngrams(ref, n))  # `|` keeps the max count per n-gram
        matched = sum(min(c, max_ref[g]) for g, c in hyp_counts.items())
        total = max(1, sum(hyp_counts.values()))
        if matched == 0 and n == 1:
            return 0.0
        log_p += math.log((matched if matched else epsilon) / total) / max_n
    h = len(hypothesis)
    r = min((len(ref) for ref in references), key=lambda length: (abs(length - h), length))
    brevity = 1.0 if h > r else math.exp(1.0 - r / h)
    return brevity * math.exp(log_p)


def self_bleu(texts: list[str]) -> float:
    """Self-BLEU (Zhu et al. 2018, Texygen): (1/k) Σ_i BLEU-4(y_i; references = the other k−1 samples).

    Whitespace tokens, smoothing as in `bleu`. High = the samples repeat each other; diversity is
    1 − self-BLEU. Needs at least two samples.
    """
    if len(texts) < 2:
        raise ValueError(f"self_bleu needs at least 2 samples, got {len(texts)}")
    tokens = [t.split() for t in texts]
    return sum(bleu(tokens[i], tokens[:i] + tokens[i + 1:]) for i in range(len(tokens))) / len(tokens)


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of two token lists (bit-parallel, Hyyrö 2004).

    Bit i of `match[token]` is set where a[i] == token. V starts as all ones over |a| bits; for each
    token of b, U = V & match, V = (V + U) | (V − U). The LCS length is the number of zero bits of V.
    Same result as the O(|a|·|b|) dynamic programme (tested), with one big-integer update per token of b.
    """
    match: dict[str, int] = {}
    for i, token in enumerate(a):
        match[token] = match.get(token, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for token in b:
        u = v & match.get(token, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")


def rouge_l_f1(a: list[str], b: list[str]) -> float:
    """ROUGE-L F1 (Lin 2004) of two token lists: 2PR/(P+R), P = LCS/|a|, R = LCS/|b| (symmetric).

    0.0 when there is no common token (including an empty side).
    """
    lcs = lcs_length(a, b)
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def self_rouge_l(texts: list[str]) -> float:
    """Self-ROUGE-L: mean ROUGE-L F1 over all pairs of one prompt's samples (pairwise mean).

    (1/k) Σ_i mean_{j≠i} F1(y_i, y_j); F1 is symmetric, so this is the mean over the k(k−1)/2 pairs.
    (Taking the max over references is the other convention in use; we take the mean.) Diversity is
    1 − self-ROUGE. Needs at least two samples.
    """
    if len(texts) < 2:
        raise ValueError(f"self_rouge_l needs at least 2 samples, got {len(texts)}")
    tokens = [t.split() for t in texts]
    pairs = [(i, j) for i in range(len(tokens)) for j in range(i + 1, len(tokens))]
    return sum(rouge_l_f1(tokens[i], tokens[j]) for i, j in pairs) / len(pairs)


def diversity_metrics(texts: list[str]) -> dict[str, float]:
    """The five Table-4 diversity numbers for one prompt's samples (≥ 2), each in [0, 1], higher = more diverse.

    div_score = mean(distinct-1, distinct-4, 1 − self-BLEU, 1 − self-ROUGE-L): our reading of the
    paper's "div-score", which it does not define in the parts we could read.
    """
    out = {
        "distinct_1": distinct_n(texts, 1),
        "distinct_4": distinct_n(texts, 4),
        "one_minus_self_bleu": 1.0 - self_bleu(texts),
        "one_minus_self_rouge": 1.0 - self_rouge_l(texts),
    }
    out["div_score"] = sum(out.values()) / 4
    return out


def div_score(texts: list[str]) -> float:
    """div-score = (distinct-1 + distinct-4 + (1 − self-BLEU) + (1 − self-ROUGE-L)) / 4; see diversity_metrics."""
    return diversity_metrics(texts)["div_score"]


def near_miss_at_k(steps_and_kept: list[tuple[int, int]], k: int) -> float:
    """Near-miss@k (r = 0), paper Fig. 7: the share of zero-reward samples with N − K ≤ k.

    Pass one (N, K) pair per zero-reward sample: N = its number of steps, K = the number of steps judged
    correct before the first error, i.e. `prm.cut_point(scores, tau)` (the first step scored below tau;
    when none is, the last step counts as the error, so K = N − 1). 0.0 when there are no samples.
    """
    for n_steps, kept in steps_and_kept:
        if not 0 <= kept <= n_steps:
            raise ValueError(f"near_miss_at_k: need 0 <= K <= N, got (N, K) = ({n_steps}, {kept})")
    if not steps_and_kept:
        return 0.0
    return sum(n_steps - kept <= k for n_steps, kept in steps_and_kept) / len(steps_and_kept)


def discarded_valid_share(keep_ratios: list[float], threshold: float = 0.5) -> float:
    """Share of zero-reward samples that are "discarded valid trajectories" (paper Fig. 3).

    Pass the keep ratio κ = K / N of each zero-reward sample; it counts as valid reasoning that an
    outcome-only reward throws away when κ ≥ threshold (0.5). 0.0 when there are no samples.
    """
    if not keep_ratios:
        return 0.0
    return sum(ratio >= threshold for ratio in keep_ratios) / len(keep_ratios)


def median_p10_p90(values: list[float]) -> tuple[float, float, float]:
    """(median, 10th percentile, 90th percentile) with linear interpolation, as Table 4 reports across prompts."""
    if len(values) == 0:
        return (math.nan, math.nan, math.nan)
    med, p10, p90 = np.percentile(np.asarray(values, dtype=float), [50, 10, 90])
    return (float(med), float(p10), float(p90))


# ==== 4. evaluation, plots, trace viewer, command line ====
# Everything heavy (torch, transformers, vLLM, matplotlib, tqdm, generate.py) is imported inside the
# function that needs it, so `import eval` stays cheap for the training loop and the grader tests.


def evaluate(generator, tokenizer, problems: list[dict], *, n: int = 1, temperature: float = 0.6,
             top_p: float = 1.0, max_new_tokens: int = 1024, seed: int | None = 0, batch_size: int = 64,
             keep_samples: bool = False) -> dict:
    """avg@n accuracy and unbiased pass@k of `generator` on `problems` ({"id", "question", "answer"}).

    Prompts come from `generate.format_prompt` (chat template + "put your answer in \\boxed{}" when the
    tokenizer has one), n samples per problem in one generate call per `batch_size` problems, each
    sample graded by `grade` (multiple-choice answers are letters, which `grade` compares as such).
    Returns {"acc": mean over problems of c/n (avg@n), "pass@k": {k: mean pass_at_k(n, c, k)} for
    k in pass_ks(n), "n", "num_problems", "truncated": share of samples cut at max_new_tokens,
    "response_len": mean sampled tokens, "per_problem": [{"id", "correct": c, "n"}]}; with
    keep_samples each per_problem row also holds "samples" (texts) and "sample_correct" (bools).
    """
    from tqdm.auto import tqdm

    from generate import format_prompt

    if not problems:
        raise ValueError("evaluate: `problems` is empty")
    if n < 1:
        raise ValueError(f"evaluate: n must be >= 1, got {n}")
    per_problem, n_truncated, n_tokens = [], 0, 0
    bar = tqdm(total=len(problems), desc="eval", unit="problem", disable=len(problems) <= batch_size)
    for start in range(0, len(problems), batch_size):
        batch = problems[start:start + batch_size]
        prompts = [format_prompt(tokenizer, p["question"]) for p in batch]
        outputs = generator.generate(prompts, n=n, temperature=temperature, top_p=top_p,
                                     max_tokens=max_new_tokens,
                                     seed=None if seed is None else seed + start)  # [prompt][sample]
        for problem, completions in zip(batch, outputs):
            marks = [grade(c.text, problem["answer"]) for c in completions]
            row = {"id": problem["id"], "correct": sum(marks), "n": len(completions)}
            if keep_samples:
                row["samples"] = [c.text for c in completions]
                row["sample_correct"] = marks
            per_problem.append(row)
            n_truncated += sum(not c.finished for c in completions)
            n_tokens += sum(len(c.ids) for c in completions)
        bar.update(len(batch))
    bar.close()
    n_samples = sum(row["n"] for row in per_problem)
    return {
        "acc": sum(row["correct"] / row["n"] for row in per_problem) / len(per_problem),
        "pass@k": {k: sum(pass_at_k(row["n"], row["correct"], k) for row in per_problem) / len(per_problem)
                   for k in pass_ks(n)},
        "n": n,
        "num_problems": len(per_problem),
        "truncated": n_truncated / n_samples,
        "response_len": n_tokens / n_samples,
        "per_problem": per_problem,
    }


def diversity_summary(per_problem: list[dict]) -> dict[str, dict[str, float]]:
    """Table 4 across prompts: for each diversity metric, {"median", "p10", "p90"} over the prompts.

    `per_problem` rows need "samples" (evaluate(..., keep_samples=True)) with at least 2 samples each.
    """
    rows = [diversity_metrics(row["samples"]) for row in per_problem]
    summary = {}
    for key in rows[0]:
        med, p10, p90 = median_p10_p90([r[key] for r in rows])
        summary[key] = {"median": med, "p10": p10, "p90": p90}
    return summary


def make_generator(name_or_path: str, backend: str, *, seed: int = 0, vllm_mem: float = 0.85):
    """(generator, tokenizer) for evaluation: vLLM when asked, or with `auto` when vLLM imports and CUDA
    is present; else Hugging Face generate on CUDA or CPU."""
    import torch

    from generate import HFGenerator, VLLMGenerator, load_causal_lm, load_tokenizer, vllm_importable

    if backend == "auto":
        backend = "vllm" if vllm_importable() and torch.cuda.is_available() else "hf"
    if backend == "vllm":

        try:
            tokenizer = load_tokenizer(name_or_path)
        except (OSError, ValueError) as err:
            raise RuntimeError(f"could not load the tokenizer of model '{name_or_path}' "
                               f"(no local directory and no network?). [{err}]") from err
        return VLLMGenerator(name_or_path, tokenizer=tokenizer, gpu_memory_utilization=vllm_mem,
                             seed=seed), tokenizer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_causal_lm(name_or_path, device)
    return HFGenerator(model.eval(), tokenizer), tokenizer


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain text table, columns padded to their widest cell."""
    widths = [max(len(str(cell)) for cell in col) for col in zip(headers, *rows)]

    def line(cells):  # first column left-aligned, numbers right-aligned
        return "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _label(name: str) -> str:
    """A benchmark's name for a table: its file name when it is a path."""
    return os.path.basename(name) if os.sep in name else name


def accuracy_table(results: dict[str, dict]) -> str:
    """One row per benchmark: problems, avg@n, pass@k for k in pass_ks(n), share of samples cut at
    max_new_tokens (all in percent), plus the unweighted mean over benchmarks (the paper's "Avg.")."""
    n = next(iter(results.values()))["n"]
    ks = pass_ks(n)
    headers = ["benchmark", "problems", f"avg@{n}"] + [f"pass@{k}" for k in ks] + ["truncated"]
    rows = [[_label(name), str(r["num_problems"]), f"{100 * r['acc']:.1f}"]
            + [f"{100 * r['pass@k'][k]:.1f}" for k in ks] + [f"{100 * r['truncated']:.1f}"]
            for name, r in results.items()]
    if len(results) > 1:
        def mean(key, k=None):
            return f"{100 * sum(r[key] if k is None else r[key][k] for r in results.values()) / len(results):.1f}"

        rows.append(["average", "", mean("acc")] + [mean("pass@k", k) for k in ks] + [mean("truncated")])
    return format_table(headers, rows)


DIVERSITY_COLUMNS = [("distinct_1", "distinct-1"), ("distinct_4", "distinct-4"),
                     ("one_minus_self_bleu", "1-self-BLEU"), ("one_minus_self_rouge", "1-self-ROUGE"),
                     ("div_score", "div-score")]


def diversity_table(results: dict[str, dict], model: str) -> str:
    """Paper Table 4: per benchmark, each diversity metric as median [p10, p90] across prompts, plus
    pass@1 and pass@n (percent)."""
    n = next(iter(results.values()))["n"]
    headers = ["model", "benchmark"] + [label for _, label in DIVERSITY_COLUMNS] + ["pass@1", f"pass@{n}"]
    rows = []
    for name, r in results.items():
        d = r["diversity"]
        rows.append([model, _label(name)]
                    + [f"{d[key]['median']:.2f} [{d[key]['p10']:.2f}, {d[key]['p90']:.2f}]"
                       for key, _ in DIVERSITY_COLUMNS]
                    + [f"{100 * r['pass@k'][1]:.1f}", f"{100 * r['pass@k'][n]:.1f}"])
    return format_table(headers, rows)


def read_jsonl(path: str) -> list[dict]:
    """The records of a JSON-lines file; a bad line raises ValueError naming the file and line number."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}, line {line_no}: not valid JSON ({err})") from err
    return records


def _run_file(run: str, name: str) -> str:
    """runs/A -> runs/A/<name>; a file path is taken as is. FileNotFoundError names what is missing."""
    path = os.path.join(run, name) if os.path.isdir(run) else run
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (expected a run directory holding {name}, or the file)")
    return path


def _field(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _acceptance(row: dict) -> float | None:
    tried, accepted = _field(row, "rectify_tried"), _field(row, "rectify_accepted")
    return accepted / tried if tried and accepted is not None else None


# (panel title, value of one metrics.jsonl row or None when the row lacks it)
PLOT_PANELS = [
    ("reward (mean)", lambda row: _field(row, "reward_mean")),
    ("eval accuracy", lambda row: _field(row, "eval_acc")),
    ("keep ratio (steps)", lambda row: _field(row, "keep_ratio_steps")),
    ("rectification acceptance", _acceptance),
    ("entropy", lambda row: _field(row, "entropy")),
    ("response length (tokens)", lambda row: _field(row, "response_len")),
    ("near-miss share (r=0)", lambda row: _field(row, "near_miss_frac")),
    ("discarded valid share (r=0)", lambda row: _field(row, "discarded_valid_frac")),
]


def plot_runs(runs: list[str], out: str) -> str:
    """One PNG with the training curves of several runs side by side (paper Figs. 3-7), from each run's
    metrics.jsonl. x = "step" (the row index when absent); rows without a field are skipped; a panel no
    run has data for says so. Returns `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = {}
    for run in runs:
        path = _run_file(run, "metrics.jsonl")
        logs[os.path.basename(os.path.dirname(os.path.abspath(path)))] = read_jsonl(path)  # label: run dir name
    cols = 4
    fig, axes = plt.subplots((len(PLOT_PANELS) + cols - 1) // cols, cols,
                             figsize=(4.5 * cols, 3.4 * ((len(PLOT_PANELS) + cols - 1) // cols)), squeeze=False)
    colors = {label: f"C{i % 10}" for i, label in enumerate(logs)}  # one colour per run in every panel
    for ax, (title, value) in zip(axes.flat, PLOT_PANELS):
        any_data = False
        for label, rows in logs.items():
            points = [(row.get("step", i), value(row)) for i, row in enumerate(rows)]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                any_data = True
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) <= 30 else None, markersize=3, color=colors[label])
        if not any_data:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(PLOT_PANELS):]:
        ax.axis("off")
    # one legend naming every run (a run without data in the first panel, e.g. grpo's keep ratio, still gets its
    # entry; regression: per-panel colour cycles used to shift and the legend then mislabelled later panels)
    handles = [plt.Line2D([], [], color=colors[label], label=label) for label in logs]
    if handles:
        axes.flat[0].legend(handles=handles, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


ANSI = {"green": "\033[32m", "red": "\033[31m", "blue": "\033[34m", "dim": "\033[2m", "bold": "\033[1m"}


def _paint(text: str, style: str, color: bool) -> str:
    """Wrap each line in an ANSI style (per line, so pagers like `less -R` keep it)."""
    if not color:
        return text
    return "\n".join(f"{ANSI[style]}{line}\033[0m" for line in text.split("\n"))


def _printable(text: str) -> str:
    """Model text made safe for a terminal: control characters (an ESC could recolour or move the cursor)
    shown as \\xNN, newlines and tabs kept."""
    return "".join(c if c in "\n\t" or (c >= " " and c != "\x7f") else f"\\x{ord(c):02x}" for c in str(text))


def _indent(text: str, prefix: str = "    ") -> str:
    lines = _printable(text).strip("\n").split("\n")
    return "\n".join(prefix + line if line.strip() else "" for line in lines)


def _attempt_labels(record: dict) -> list[str]:
    """'correct' / 'wrong' per refiner attempt; the first correct one of an accepted record is the one kept."""
    correct = record.get("attempt_correct") or []
    n_attempts = len(record.get("suffixes") or [])
    labels = ["correct" if j < len(correct) and correct[j] else "wrong" for j in range(n_attempts)]
    if record.get("accepted") and "correct" in labels:
        labels[labels.index("correct")] = "correct, accepted"
    return labels


def _score(score) -> str:
    return "  -  " if score is None else f"{score:.2f}"


def _ratio(value) -> str:
    return "?" if value is None else f"{value:.2f}"


def render_trace_text(record: dict, color: bool = False) -> str:
    """One rectification (a traces.jsonl record) for the terminal, as in the paper's Fig. 12: the
    policy's steps with their PRM scores (green = kept, red = the first step not kept, dim = discarded),
    the cut, then each refiner attempt (blue) marked correct or not."""
    steps, scores, cut = record.get("steps") or [], record.get("scores") or [], record.get("cut") or 0
    verdict = "ACCEPTED" if record.get("accepted") else "rejected"
    out = [_paint(f"== step {record.get('step', '?')} | group {record.get('group', '?')} | "
                  f"mode {record.get('mode', 'scope')} | {verdict} | reward {record.get('reward_before', '?')}"
                  f" -> {record.get('reward_after', '?')} | kept {cut}/{len(steps)} steps "
                  f"(keep ratio {_ratio(record.get('keep_ratio'))}, tokens "
                  f"{_ratio(record.get('keep_ratio_tokens'))})", "bold", color),
           "question:", _indent(record.get("question", "")),
           f"gold answer: {_printable(record.get('answer', ''))}",
           "policy steps [PRM score]:"]
    for i, step in enumerate(steps):
        score = scores[i] if i < len(scores) else None
        if i == cut:
            out.append(_paint("  ---- cut: the refiner rewrites from here ----", "bold", color))
        tag, style = ("kept", "green") if i < cut else ("FIRST ERROR", "red") if i == cut else ("discarded", "dim")
        out.append(_paint(f"  [{_score(score)}] {tag}\n{_indent(step)}", style, color))
    if cut >= len(steps):
        out.append(_paint("  ---- cut: the refiner continues after the last step ----", "bold", color))
    for j, (suffix, label) in enumerate(zip(record.get("suffixes") or [], _attempt_labels(record))):
        out.append(_paint(f"  refiner attempt {j + 1} ({label}):\n{_indent(suffix)}", "blue", color))
    return "\n".join(out) + "\n"


HTML_STYLE = """body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;color:#222}
section{border:1px solid #ccc;border-radius:6px;padding:1rem;margin-bottom:1.5rem}
.step,.refined{white-space:pre-wrap;font-family:monospace;padding:.3rem .5rem;margin:.2rem 0;border-radius:4px}
.kept{background:#e6f4ea;border-left:4px solid #2e7d32}.error{background:#fdecea;border-left:4px solid #c62828}
.discarded{color:#888;background:#f5f5f5;border-left:4px solid #bbb}
.refined{background:#e8f0fe;border-left:4px solid #1a56db}.score{font-weight:bold;margin-right:.6rem}
.cut{color:#c62828;font-weight:bold;margin:.4rem 0}.q{white-space:pre-wrap}"""


def render_traces_html(records: list[dict], title: str = "SCOPE rectifications") -> str:
    """A self-contained HTML page of rectifications (inline CSS, no scripts); all model text is escaped."""
    def esc(value) -> str:
        return html.escape(str(value).strip("\n"), quote=True)

    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
             f"<style>{HTML_STYLE}</style></head><body><h1>{esc(title)}</h1>"]
    for rec in records:
        steps, scores, cut = rec.get("steps") or [], rec.get("scores") or [], rec.get("cut") or 0
        parts.append(f"<section><h2>step {esc(rec.get('step', '?'))}, group {esc(rec.get('group', '?'))}: "
                     f"{'accepted' if rec.get('accepted') else 'rejected'}</h2>"
                     f"<p>mode {esc(rec.get('mode', 'scope'))}; reward {esc(rec.get('reward_before', '?'))} "
                     f"&rarr; {esc(rec.get('reward_after', '?'))}; kept {cut}/{len(steps)} steps "
                     f"(keep ratio {_ratio(rec.get('keep_ratio'))}, "
                     f"tokens {_ratio(rec.get('keep_ratio_tokens'))})</p>"
                     f"<p><b>Question</b></p><div class='q'>{esc(rec.get('question', ''))}</div>"
                     f"<p><b>Gold answer:</b> {esc(rec.get('answer', ''))}</p>")
        for i, step in enumerate(steps):
            if i == cut:
                parts.append("<div class='cut'>&#9986; cut: the refiner rewrites from here</div>")
            kind = "kept" if i < cut else "error" if i == cut else "discarded"
            score = scores[i] if i < len(scores) else None
            parts.append(f"<div class='step {kind}'><span class='score'>{esc(_score(score))}</span>"
                         f"{esc(step)}</div>")
        if cut >= len(steps):
            parts.append("<div class='cut'>&#9986; cut: the refiner continues after the last step</div>")
        for j, (suffix, label) in enumerate(zip(rec.get("suffixes") or [], _attempt_labels(rec))):
            parts.append(f"<p>refiner attempt {j + 1} ({label})</p><div class='refined'>{esc(suffix)}</div>")
        parts.append("</section>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def select_traces(records: list[dict], step: int | None) -> list[dict]:
    """The records of training step `step`; without one, those of the last step that has any."""
    if not records:
        return []
    if step is None:
        step = max(r.get("step", 0) for r in records)
    return [r for r in records if r.get("step", 0) == step]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="eval.py", description="Evaluate a checkpoint on math / OOD benchmarks (avg@n, pass@k, diversity), "
        "plot training runs, or view rectification traces.")
    p.add_argument("--model", help="HF model id or local checkpoint directory to evaluate")
    p.add_argument("--benchmarks", default="math500,aime24,aime25,amc,minerva,olympiad",
                   help="comma-separated names from BENCHMARKS, 'toy', or local .jsonl paths")
    p.add_argument("--ood", default="", help="comma-separated out-of-domain benchmarks, e.g. arc-c,gpqa,mmlu-pro")
    p.add_argument("--n", type=int, default=8, help="samples per problem (avg@n, pass@k for k <= n)")
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling top-p")
    p.add_argument("--max-new-tokens", type=int, default=1024,
                   help="new tokens per sample (clamped to the context)")
    p.add_argument("--batch-size", type=int, default=64, help="problems per generate call")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--limit", type=int, default=None,
                   help="first K problems of each benchmark (with --trace: show at most K traces)")
    p.add_argument("--backend", choices=["auto", "vllm", "hf"], default="auto",
                   help="generation backend; auto = vLLM when importable and CUDA is present, else HF")
    p.add_argument("--vllm-mem", type=float, default=0.85, help="vLLM gpu_memory_utilization")
    p.add_argument("--out", default=None,
                   help="output file: results JSON (default: eval_<folder>.json next to a local model folder, else "
                        "eval_<hub id>.json) or the PNG of --plot (curves.png)")
    p.add_argument("--save-samples", action="store_true", help="keep every sampled text in the results JSON")
    p.add_argument("--diversity", action="store_true",
                   help="also print the Table-4 diversity table (needs --n >= 2; paper: --n 10 --temperature 1.0)")
    p.add_argument("--grader-bench", action="store_true", help="time the grader on generated pairs and exit")
    p.add_argument("--plot", nargs="+", metavar="RUN", help="run directories (or metrics.jsonl files) to plot")
    p.add_argument("--trace", metavar="RUN", help="run directory (or traces.jsonl) whose rectifications to show")
    p.add_argument("--step", type=int, default=None, help="with --trace: training step (default: the last one)")
    p.add_argument("--html", metavar="FILE", help="with --trace: also write a self-contained HTML page")
    p.add_argument("--no-color", action="store_true", help="with --trace: no ANSI colours")
    args = p.parse_args(argv)
    if not (args.grader_bench or args.plot or args.trace or args.model):
        p.error("--model is required (or use --plot, --trace or --grader-bench)")
    if args.diversity and args.n < 2:
        p.error("--diversity needs --n >= 2 samples per prompt")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.grader_bench:
            print(json.dumps(grader_benchmark(), indent=2, default=str))
        elif args.plot:
            print(f"wrote {plot_runs(args.plot, args.out or 'curves.png')}")
        elif args.trace:
            show_traces(args.trace, step=args.step, limit=args.limit, html_out=args.html,
                        color=sys.stdout.isatty() and not args.no_color and "NO_COLOR" not in os.environ)
        else:
            run_evaluation(args)
    except (OSError, ValueError, RuntimeError) as err:  # missing files, bad rows, unloadable models: one line
        print(f"eval.py: {err}", file=sys.stderr)
        return 2
    return 0


def show_traces(run: str, *, step: int | None, limit: int | None, html_out: str | None, color: bool) -> None:
    """Print the rectifications of one training step of a run (and write them as HTML when asked)."""
    records = select_traces(read_jsonl(_run_file(run, "traces.jsonl")), step)[:limit]
    if not records:
        print(f"no rectification traces in {run}" + ("" if step is None else f" at step {step}"))
    for record in records:
        print(render_trace_text(record, color=color))
    if html_out:
        with open(html_out, "w", encoding="utf-8") as f:
            f.write(render_traces_html(records, title=f"SCOPE rectifications: {run}"))
        print(f"wrote {html_out}")


def report_path(model: str) -> str:
    """Where the results JSON goes without --out: next to the evaluated run (a local checkpoint folder
    runs/X/checkpoint gives runs/X/eval_checkpoint.json), so evaluating two runs never overwrites one file;
    a hub id gives eval_<owner_name>.json in the working directory."""
    if os.path.isdir(model):
        folder = os.path.normpath(model)
        return os.path.join(os.path.dirname(folder) or ".", f"eval_{os.path.basename(folder)}.json")
    return f"eval_{re.sub(r'[^A-Za-z0-9_.-]+', '_', model.strip('/'))}.json"


def run_evaluation(args: argparse.Namespace) -> dict:
    """Load every benchmark first (so a bad name fails before the model loads), then the model, then
    evaluate, print the tables and write the JSON report."""
    groups = {"benchmarks": args.benchmarks, "ood": args.ood}
    problems = {group: {name.strip(): load_problems(name.strip(), limit=args.limit)
                        for name in names.split(",") if name.strip()} for group, names in groups.items()}
    generator, tokenizer = make_generator(args.model, args.backend, seed=args.seed, vllm_mem=args.vllm_mem)
    model_name = os.path.basename(os.path.normpath(args.model))
    settings = dict(n=args.n, temperature=args.temperature, top_p=args.top_p,
                    max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=args.batch_size)
    report = {"model": args.model, **settings, "limit": args.limit}
    keep = args.diversity or args.save_samples
    for group, benchmarks in problems.items():
        results = {}
        for name, items in benchmarks.items():
            result = evaluate(generator, tokenizer, items, keep_samples=keep, **settings)
            if args.diversity:
                result["diversity"] = diversity_summary(result["per_problem"])
            if keep and not args.save_samples:
                for row in result["per_problem"]:
                    del row["samples"], row["sample_correct"]
            results[name] = result
        if results:
            title = "math benchmarks" if group == "benchmarks" else "out-of-domain benchmarks"
            print(f"\n{title} ({args.model}, n={args.n}, T={args.temperature}; accuracy in %)")
            print(accuracy_table(results))
            if args.diversity:
                print("\ndiversity across prompts: median [p10, p90] (paper Table 4)")
                print(diversity_table(results, model_name))
        report[group] = results
    out = args.out or report_path(args.model)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    sys.exit(main())
