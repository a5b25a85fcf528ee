"""grader.py — the verifier: the final answer of a response against the gold answer, 1/0.

What it implements: the outcome reward r_i of every rollout (SCOPE, Ren et al. 2026, arXiv 2602.24110,
step 2 "Verify"; the paper, like LUFFY, uses a math verifier it does not specify) and the regrading of
rectified trajectories. `grade(response, gold) -> bool`, `extract_answer(text)`,
`final_boxes(text)` and `grader_benchmark`.
The maths it relies on (our LaTeX-subset parser, exact numbers, the numeric identity test) is in latex.py.

How to run: `python -m harness.data.grader --bench` (or `python eval.py --grader-bench`) times the grader on generated
pairs and prints pairs/s, agreement with the intended labels and the slowest cases.

Pipeline of grade(response, gold):
  first_turn(response)      the text before the first ChatML turn marker ("<|im_end|>", "<|im_start|>",
                            "<|endoftext|>"): an answer written in an invented next turn is never read.
                            The backends already stop there (generate.stop_ids); this is the guard for text
                            from elsewhere (a stored sample, a server that kept special tokens).
  extract_answer(response)  the LAST \\boxed{...} / \\fbox{...} ("\\boxed 5" takes one token), else the text
                            after the last "(final) answer is"; an unbalanced last box (a truncated
                            response) or an empty one gives no answer, so the grade is False. A gold that
                            holds a \\boxed{} is reduced the same way.
  _normalize(both)          strip LaTeX dressing (the rules are listed in _normalize's docstring).
  _equiv(pred, gold)        exact string; multiple-choice letter; inequality -> interval; a label dropped;
                            structures (matrix, union, set, bracketed tuple/interval, named record, list);
                            equation; number; symbolic (latex.sympy_equal).
  fallbacks                 the two sides as whole equations; the final run of several boxes as a list;
                            a decimal comma.

The conventions (M1-M7 for MATH-style answers, N1-N8 for NuminaMath / OpenR1-style ones, the debatable
D1-D2), the known misses and the measured agreement are written out once, in docs/grader.md; each
convention has its tests in tests/test_grader.py and tests/test_grader_numina.py.

Safety rules: model text is never given to eval/exec/compile/sympify/parse_expr/parse_latex/lambdify
(tests/test_grader.py scans this file's and latex.py's syntax trees); it only meets regular expressions
that run in linear time, bounded loops, and latex.Parser. Limits, checked before any sympy work: answers
longer than _MAX_CHARS characters are compared as plain strings only; lists, sets, tuples, matrices, runs
of boxes hold at most _MAX_ITEMS items; structures nest at most 4 deep; an inequality has at most two
operators; plus latex.py's parser limits. No signals or threads, so the grader is safe in any thread.
Anything malformed or refused is False; grade never raises.
"""
import argparse
import json
import random                   # grader benchmark
import re
import sys
import time                     # grader benchmark
from fractions import Fraction

import sympy

from harness.data.latex import (Refuse, add, as_number, decimal_matches, exact, linear_in, mul, neg,
                                proportional, sympy_equal, to_sympy)

_MAX_CHARS = 1000            # longer answers: plain string comparison only
_MAX_ITEMS = 32              # elements of a list / set / tuple / matrix / run of boxes


# ---- extraction ----

_BOX_RE = re.compile(r"\\(?:boxed|fbox)")
_ANSWER_IS_RE = re.compile(r"(?:final answer|answer) is[:\s]*", re.IGNORECASE)


def _match_brace(s: str, i: int, end: int | None = None) -> int:
    """Index of the '}' matching the '{' at s[i], or -1 when the braces never balance before `end` (default:
    the end of s; \\{ \\} do not count)."""
    depth = 0
    for j in range(i, len(s) if end is None else end):
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


_BOX_GAP_RE = re.compile(r"(?:\s|\$|[,;.&]|\\[,;:! ]|\\q?quad(?![a-zA-Z])|\\\\|\\[\[\]()]|\\text\{\s*(?:and|or)?\s*\}"
                         r"|(?<![a-zA-Z])(?:and|or)(?![a-zA-Z]))*")
_MAX_GAP = 40                # characters between two boxes of one run


def _box_at(text: str, start: int, end: int) -> tuple[str, int] | None:
    """(content, index after the box) of the box whose command ends at `start`; the box must close before
    `end`. "\\boxed 5" takes one token. None when it does not close."""
    i = start
    while i < end and text[i].isspace():
        i += 1
    if i < end and text[i] == "{":
        j = _match_brace(text, i, end)
        return (text[i + 1:j].strip(), j + 1) if j >= 0 else None
    token = re.split(r"[\s$]", text[i:min(end, i + _MAX_CHARS)], maxsplit=1)[0].rstrip(".,")
    return token, i + len(token)


def final_boxes(text: str) -> list[str]:
    """The contents of the final run of boxes (convention N4): the last box, and each box before it whose
    gap to the next box holds only spaces, punctuation, $, \\quad, \\text{and} or "and"/"or" (at most
    _MAX_GAP characters). At most _MAX_ITEMS + 1 boxes are read; [] when the last box is unbalanced or
    there is none. Each scan stops at the next box, so the work is linear in the text."""
    if not isinstance(text, str):
        return []
    spans = [(m.start(), m.end()) for m in _BOX_RE.finditer(text)]
    boxes, limit = [], len(text)
    for start, after in reversed(spans):
        box = _box_at(text, after, limit)
        if box is None or not box[0]:
            break
        if boxes:
            gap = text[box[1]:limit]
            if len(gap) > _MAX_GAP or not _BOX_GAP_RE.fullmatch(gap):
                break
        boxes.append(box[0])
        limit = start
        if len(boxes) > _MAX_ITEMS:
            break
    return boxes[::-1]


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
_TEXT_WRAPPERS = "text|textbf|textit|textrm|textnormal|textsf|texttt|textup|mathrm|mathbf|mathsf|mathtt|mbox|hbox"
_UNIT_TEXT_RE = re.compile(r"\\(?:" + _TEXT_WRAPPERS + r")\{\s*[a-zA-Z][a-zA-Z .]*\}(?:\^\{?\d\}?)?$")
_TEXT_CMD_RE = re.compile(r"\\(?:" + _TEXT_WRAPPERS + r"|operatorname|mathit)\s*\{([^{}]*)\}")
_PREFIX_RE = re.compile(r"^(?:[a-zA-Z](?:_\{?[a-zA-Z0-9]+\}?)?|\\[a-zA-Z]+)\s*(?:=|\\in\b)\s*(?=\S)")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PERCENT_RE = re.compile(r"\s*(?:percent(?:age)?|pct)(?:\s*points?)?\.?$")           # N7: 28 pct, 28 percentage
_JOINER_RE = re.compile(r"\s*,?\s*(?<![a-zA-Z\\])(?:and|or)(?![a-zA-Z])\s*,?\s*")   # N3: (11,7)or(7,11)


def _normalize(s: str, strip_prefix: bool = True) -> str:
    """Canonical text of an answer. Rules, in order: unicode maths -> LaTeX; drop $, \\( \\), \\[ \\],
    \\displaystyle, \\left/\\right (and \\big...); \\dfrac/\\tfrac -> \\frac; \\neq/\\leq/\\geq -> \\ne/\\le/\\ge;
    spacing commands (\\! \\, \\; \\: \\quad ~) -> space; degrees (^\\circ, ^{\\circ}, \\circ, \\degree) dropped;
    \\$ dropped; "1{,}000" -> "1000"; \\{ \\} -> { }; \\emptyset -> {}; \\mathbb{R} -> (-\\infty,\\infty);
    "infinity"/"inf" -> \\infty; a trailing \\text{unit} or unit word after a number dropped; \\text{X} etc.
    -> X; "and" / "or" between items -> ","; ";" inside brackets -> ","; a chain "x = a = b" -> b; a leading
    "x =" / "x \\in" / "f(x) =" removed; a trailing "." or ";" removed; \\cfrac -> \\frac; \\lt \\gt -> < >;
    "pct" / "percentage (points)" -> \\%;
    whitespace removed (one space kept after a command before a letter: \\pi r); x^{2} -> x^2, a_{1} -> a_1;
    "1,000,000" -> "1000000". ("12.500" == "12.5" is left to the number comparison.)"""
    for u, r in _UNICODE.items():
        s = s.replace(u, r)
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", "", s)
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![a-zA-Z])\s*", "", s)
    s = re.sub(r"(?<!\\)\\!\s*", "", s)                     # negative thin space: "10,\\! 000" stays 10,000
    s = re.sub(r"\\(?:displaystyle|quad|qquad)(?![a-zA-Z])|(?<!\\)\\[,;: ]|~", " ", s)
    s = re.sub(r"\s+", " ", s)                                  # one space per run (keeps regexes linear)
    s = re.sub(r"\\[dtc]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\\[dt]binom(?![a-zA-Z])", r"\\binom", s)
    s = re.sub(r"\\(neq|leq|geq|leqslant|geqslant|leqq|geqq)(?![a-zA-Z])", lambda m: "\\" + m.group(1)[:2], s)
    s = re.sub(r"\\([lg])t(?![a-zA-Z])", lambda m: "<" if m.group(1) == "l" else ">", s)
    s = s.replace("<=", "\\le ").replace(">=", "\\ge ")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])", "", s)
    s = s.replace("{,}", "")
    s = s.replace("\\{", "{").replace("\\}", "}")
    s = re.sub(r"\\(?:emptyset|varnothing)(?![a-zA-Z])", "{}", s)
    s = re.sub(r"\\mathbb\{R\}", r"(-\\infty,\\infty)", s)
    s = re.sub(r"\b(?:infinity|inf)\b", r"\\infty", s)
    s = _PERCENT_RE.sub("\\%", s.strip())
    s = _strip_units(s)
    for _ in range(3):  # nested \text{\textbf{..}}
        s = _TEXT_CMD_RE.sub(lambda m: m.group(1), s)
    s = _PERCENT_RE.sub("\\%", s.strip())
    s = _strip_units(s)
    if _JOINER_RE.search(s):
        s = _JOINER_RE.sub(",", s).strip(",") or s
    s = _semicolons(s).strip().rstrip(".").strip()
    s = re.sub(r"(?<=.);+$", "", s)
    if (strip_prefix and s.count("=") >= 2 and len(_split_top(s, ",")) == len(_split_top(s, ";")) == 1
            and all(part.strip() for part in s.split("="))):
        s = s[s.rindex("=") + 1:]                            # D2: x = 5+5+1 = 11 -> 11
    s = re.sub(r"^[a-zA-Z]\([a-zA-Z]\)\s*=\s*(?=\S)", "", s)   # f(x) = ...
    if strip_prefix and (s.count("=") == 1 or "\\in" in s):
        s = _PREFIX_RE.sub("", s, count=1)
    thousands = _THOUSANDS_RE.match(s)                    # M3: "32, 349" (a space) is a list, not 32349
    s = re.sub(r"\s+", _space, s)
    s = re.sub(r"([_^])\{(\w)\}", r"\1\2", s)                 # x^{2} -> x^2, 1011_{2} -> 1011_2
    if thousands:
        s = s.replace(",", "")
    return s


def _semicolons(s: str) -> str:
    """N3: a ";" inside brackets separates coordinates, so it becomes ","; at top level it stays (a list)."""
    if ";" not in s:
        return s
    out, depth = [], 0
    for c in s:
        depth += (c in "([{") - (c in ")]}")
        out.append("," if c == ";" and depth > 0 else c)
    return "".join(out)


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


# ---- equivalence ----

_LETTER_RE = re.compile(r"^\(?([A-J])\)?$")
_PRED_LETTER_RE = re.compile(r"^\(?([A-Ja-j])(?:\)|\.|:|$)")
_WORDY_RE = re.compile(r"(?<!\\)[a-zA-Z]{2,}")
_GREEK = ("alpha|beta|gamma|delta|epsilon|varepsilon|zeta|eta|theta|vartheta|iota|kappa|lambda|mu|nu|xi|rho|"
          "sigma|tau|upsilon|phi|varphi|chi|psi|omega|Gamma|Delta|Theta|Lambda|Xi|Sigma|Phi|Psi|Omega")
_LABEL_CMD_RE = re.compile(r"\\(?:frac|angle|measuredangle|triangle|overline|overrightarrow|vec|hat|widehat|bar|"
                           r"tilde|sin|cos|tan|cot|sec|csc|" + _GREEK + r")(?![a-zA-Z])")
_SUBSCRIPT_RE = re.compile(r"_(?:\{[^{}]*\}|\\?[a-zA-Z0-9])")
_ARGUMENT_RE = re.compile(r"(?<=[a-zA-Z])\([a-zA-Z0-9,]*\)")                  # f(x), P(2), g(a,b)
_INEQ_RE = re.compile(r"<|>|\\le(?![a-zA-Z])|\\ge(?![a-zA-Z])")
_ABS_VAR_RE = re.compile(r"\|([a-zA-Z](?:_[a-zA-Z0-9]|_\{[a-zA-Z0-9]+\})?)\|")


def _is_label(s: str) -> bool:
    """N1: a name, not a formula: letters, subscripts, primes, |..|, ':' '/' ',' brackets, \\frac of names,
    f(x), \\angle / \\overline / greek letters; no digit outside subscripts and arguments, no + - * ^ = < >."""
    if not s or len(s) > 60:
        return False
    t = _ARGUMENT_RE.sub("", _SUBSCRIPT_RE.sub("", s))
    had_command = bool(_LABEL_CMD_RE.search(t))
    t = _LABEL_CMD_RE.sub("", t)
    return bool(re.fullmatch(r"[a-zA-Z(){}|:/,' ]+", t)) and (had_command or bool(re.search(r"[a-zA-Z]", t)))


def _label_of(item: str) -> tuple[str, str] | None:
    """(label, value) of a named item "AB=4" (N1), else None."""
    parts = _split_top(item, "=")
    if len(parts) == 2 and parts[1] and _is_label(parts[0]):
        return parts[0], parts[1]
    return None


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
    """(kind, payload) of a normalised answer: matrix | list (top-level ";") | union | set | seq | record | list
    | scalar."""
    m = re.fullmatch(r"\\begin\{(?:pmatrix|bmatrix|matrix|vmatrix|array)\}(?:\{[lcr|]*\})?(.*)"
                     r"\\end\{(?:pmatrix|bmatrix|matrix|vmatrix|array)\}", s)
    if m:
        rows = [r for r in m.group(1).split("\\\\") if r != ""]
        return "matrix", [r.split("&") for r in rows]
    parts = [p for p in _split_top(s, ";") if p]
    if len(parts) > 1:                                    # N3: "-12;-11;-10", one record per item
        return "list", _expand_pm(parts)
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
        labelled = [_label_of(p) for p in parts]
        if all(labelled) and len({label for label, _ in labelled}) == len(labelled):
            return "record", labelled                     # N2: "AB=4, CD=5": ordered by its labels
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
    """Equivalence of two NORMALISED answers (see the module docstring for the order of the checks)."""
    if pred == gold:
        return True
    if depth > 4 or len(pred) > _MAX_CHARS or len(gold) > _MAX_CHARS:
        return False
    ip = _intervals(pred) if _INEQ_RE.search(pred) else None
    ig = _intervals(gold) if _INEQ_RE.search(gold) else None
    if ip or ig:                                          # N5: inequalities as intervals
        if ip and ig and ip[0] != ig[0]:
            return False
        return _equiv(ip[1] if ip else pred, ig[1] if ig else gold, depth + 1)
    if "=" in pred and "=" in gold:                       # N2: "(x,y)=(1,2)" is the record "x=1,y=2"
        tp, tg = _tuple_record(pred), _tuple_record(gold)
        if tp or tg:
            return _equiv(tp or pred, tg or gold, depth + 1)
    if ("=" in pred) != ("=" in gold):                    # N1: a label is dropped when the other side has none
        named = _label_of(pred if "=" in pred else gold)
        if named:
            return (_equiv(named[1], gold, depth + 1) if "=" in pred else _equiv(pred, named[1], depth + 1))
    kp, p = _structure(pred)
    kg, g = _structure(gold)
    if "record" in (kp, kg):
        return _record_equal(kp, p, kg, g, depth)
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


def _tuple_record(s: str) -> str | None:
    """"(x,y)=(1,2)" -> "x=1,y=2" when the labels and values pair up one to one; else None."""
    sides = _split_top(s, "=")
    if len(sides) != 2 or not all(x[:1] == "(" and _outer_close(x) == len(x) - 1 for x in sides):
        return None
    labels, values = _split_top(sides[0][1:-1], ","), _split_top(sides[1][1:-1], ",")
    if not 2 <= len(labels) == len(values) <= _MAX_ITEMS or not all(map(_is_label, labels)):
        return None
    return ",".join(f"{label}={value}" for label, value in zip(labels, values))


def _record_equal(kp: str, p, kg: str, g, depth: int) -> bool:
    """N2: two records match value by label; a record against a bare list or a (...) tuple matches in order."""
    if kp == kg:
        gold = dict(g)
        return (len(p) == len(g) == len(gold) <= _MAX_ITEMS and set(gold) == {label for label, _ in p}
                and all(_equiv(value, gold[label], depth + 1) for label, value in p))
    kind, other = (kg, g) if kp == "record" else (kp, p)
    if kind == "seq" and other[0] == "(" and other[1] == ")":
        other = other[2]
    elif kind != "list":
        return False
    values = [value for _, value in (p if kp == "record" else g)]
    if len(values) != len(other) or len(values) > _MAX_ITEMS:
        return False
    pairs = zip(values, other) if kp == "record" else zip(other, values)
    return all(_equiv(x, y, depth + 1) for x, y in pairs)


def _variable(s: str):
    """(name, k, m, is_abs) of the middle of an inequality: |v|, a label (k = 1, m = 0), or an expression
    k*v + m linear in one symbol; None otherwise."""
    m = _ABS_VAR_RE.fullmatch(s)
    if m:
        return m.group(1), Fraction(1), Fraction(0), True
    if _is_label(s):
        return s, Fraction(1), Fraction(0), False
    expr = to_sympy(s)
    symbols = expr.free_symbols
    if len(symbols) != 1:
        return None
    name = next(iter(symbols)).name
    km = linear_in(expr, name)
    return (name, km[0], km[1], False) if km and km[0] != 0 else None


def _sign(text: str) -> int | None:
    """Sign of a constant bound, or None when it is not a known real number."""
    try:
        value = exact(to_sympy(text))
    except Refuse:
        return None
    return None if value is None else (value > 0) - (value < 0)


def _interval(s: str) -> tuple[str, str] | None:
    """N5: (variable, interval or union text) of an inequality with one or two operators, else None.
    "a < x \\le b" -> "(a,b]"; "x \\ge a" -> "[a,\\infty)"; "-x > -1" -> "(-\\infty,((-1)-(0))/(-1))";
    "a \\le |x| \\le b" with a > 0 -> "[-(b),-(a)]\\cup[a,b]"; "|x| < b" -> "(-(b),b)"."""
    ops = list(_INEQ_RE.finditer(s))
    if not 1 <= len(ops) <= 2:
        return None
    cuts = [0] + [x for m in ops for x in m.span()] + [len(s)]
    parts = [s[cuts[k]:cuts[k + 1]].strip() for k in range(0, len(cuts), 2)]
    kinds = [(1 if m.group(0) in ("<", "\\le") else -1, m.group(0) in ("<", ">")) for m in ops]  # (up?, strict)
    if not all(parts):
        return None
    try:
        if len(ops) == 1:
            var, side = _variable(parts[0]), 0
            if var is None or to_sympy(parts[1]).free_symbols:
                var, side = _variable(parts[1]), 1
                if var is None or to_sympy(parts[0]).free_symbols:
                    return None
            up, strict = kinds[0]
            bound = parts[1 - side]
            up = up if side == 0 else -up                 # "5 \\ge x" is "x \\le 5"
            lo, hi = (None, (bound, strict)) if up == 1 else ((bound, strict), None)
        else:
            var = _variable(parts[1])
            if var is None or kinds[0][0] != kinds[1][0] or any(to_sympy(parts[k]).free_symbols for k in (0, 2)):
                return None
            lo, hi = (parts[0], kinds[0][1]), (parts[2], kinds[1][1])
            if kinds[0][0] == -1:                         # "b > x > a"
                lo, hi = hi, lo
    except Refuse:
        return None
    name, k, m, is_abs = var
    if is_abs:
        text = _abs_interval(lo, hi)
        return (name, text) if text else None
    if (k, m) != (1, 0):                                  # k x + m in (lo, hi) -> x in ((lo - m)/k, (hi - m)/k)
        if any(b and "\\infty" in b[0] for b in (lo, hi)):
            return None
        shift = lambda b: b and (f"(({b[0]})-({m.numerator}/{m.denominator}))/({k.numerator}/{k.denominator})", b[1])
        lo, hi = (shift(hi), shift(lo)) if k < 0 else (shift(lo), shift(hi))
    return name, _bracket(lo, hi)


def _intervals(s: str) -> tuple[str, str] | None:
    """N5: one inequality, or a list of inequalities in one variable ("x<-1 or x>3" became "x<-1,x>3"),
    as (variable, interval or union text); None otherwise."""
    parts = _split_top(s, ",")
    if len(parts) == 1:
        return _interval(s)
    if len(parts) > _MAX_ITEMS:
        return None
    pieces = [_interval(part) for part in parts]
    if not all(pieces) or len({name for name, _ in pieces}) != 1:
        return None
    return pieces[0][0], "\\cup".join(text for _, text in pieces)


def _bracket(lo, hi) -> str:
    """Interval text from (bound, strict) ends; None is an infinite end."""
    left = "(-\\infty" if lo is None else ("(" if lo[1] else "[") + lo[0]
    right = "\\infty)" if hi is None else hi[0] + (")" if hi[1] else "]")
    return f"{left},{right}"


def _abs_interval(lo, hi) -> str | None:
    """|x| between lo and hi (either may be None): an interval or a union of two, or None when unsure."""
    if lo is not None and _sign(lo[0]) == 1:              # a <= |x| (<= b): two pieces
        neg_lo = (f"-({lo[0]})", lo[1])
        neg_hi = None if hi is None else (f"-({hi[0]})", hi[1])
        return _bracket(neg_hi, neg_lo) + "\\cup" + _bracket(lo, hi)
    if hi is not None and (lo is None or _sign(lo[0]) == -1 or (_sign(lo[0]) == 0 and not lo[1])):
        return _bracket((f"-({hi[0]})", hi[1]), hi)       # |x| <= b (a <= 0 adds nothing)
    return None


def _strip_percent(s: str) -> tuple[str, bool]:
    if s.endswith("\\%"):
        return s[:-2], True
    if s.endswith("%"):
        return s[:-1], True
    return s, False


_DECIMAL_RE = re.compile(r"[-+]?\d*\.(\d+)")
_LONG_DECIMAL = 12           # N8: significant digits from which a decimal is compared by the digits it shows
_DECIMAL_COMMA_RE = re.compile(r"\s*\$?\s*(-?\d+),(\d+)\s*\$?\s*")                # D1: "1000,99"


def _is_long_decimal(s: str) -> bool:
    return bool(_DECIMAL_RE.fullmatch(s)) and len(s.lstrip("+-").replace(".", "").lstrip("0")) >= _LONG_DECIMAL


def _scalar_equal(pred: str, gold: str) -> bool:
    if _WORDY_RE.search(gold) and not gold.startswith("\\") and pred.casefold() == gold.casefold():
        return True                                   # plain-text answers, case-insensitive
    if pred.count("=") == 1 and gold.count("=") == 1:  # equations: compare lhs - rhs up to sign
        (pl, pr), (gl, gr) = pred.split("="), gold.split("=")
        try:
            dp, dg = add(to_sympy(pl), neg(to_sympy(pr))), add(to_sympy(gl), neg(to_sympy(gr)))
        except Refuse:
            return False
        return sympy_equal(dp, dg) or sympy_equal(dp, neg(dg)) or proportional(dp, dg)   # N6
    pred, p_pct = _strip_percent(pred)
    gold, g_pct = _strip_percent(gold)
    np_, ng = as_number(pred), as_number(gold)
    long_p, long_g = _is_long_decimal(pred), _is_long_decimal(gold)
    if np_ is not None and ng is not None:              # M1: exact fractions
        candidates = [(np_, ng)]
        if p_pct:
            candidates.append((np_ / 100, ng))
        if g_pct:
            candidates.append((np_, ng / 100))
        if any(x == y for x, y in candidates):
            return True
        if long_p == long_g or p_pct or g_pct:
            return False
    try:
        a, b = to_sympy(pred), to_sympy(gold)
    except Refuse:
        return pred == gold
    if long_p != long_g and not (p_pct or g_pct):        # N8: a long decimal by the digits it shows
        if decimal_matches(pred, b) if long_p else decimal_matches(gold, a):
            return True
    if sympy_equal(a, b):
        return True
    hundredth = sympy.Rational(1, 100)
    if p_pct and sympy_equal(mul(a, hundredth), b):
        return True
    return bool(g_pct and sympy_equal(a, mul(b, hundredth)))


TURN_MARKERS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")


def first_turn(text: str) -> str:
    """`text` up to its first ChatML turn marker (TURN_MARKERS), all of it when there is none."""
    cut = min((i for i in (text.find(m) for m in TURN_MARKERS) if i >= 0), default=len(text))
    return text[:cut]


def grade(response: str, gold: str) -> bool:
    """True when the final answer of `response` is equivalent to `gold` (an answer string; if it holds a
    \\boxed{}, its last box is used). Never raises: malformed or over-limit input gives False."""
    try:
        if not isinstance(response, str) or not isinstance(gold, str):
            return False
        if _BOX_RE.search(gold):
            boxes = final_boxes(gold)                     # N4: a gold run of boxes is one list
            gold = ";".join(boxes) if 1 < len(boxes) <= _MAX_ITEMS else (extract_answer(gold) or "")
        response = first_turn(response)                   # never past the first stop
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
            if _equiv(_normalize(pred, strip_prefix=False), _normalize(gold, strip_prefix=False)):
                return True
        for raw, other in ((pred, g), (gold, p)):         # D1: "1000,99" against one number
            m = _DECIMAL_COMMA_RE.fullmatch(raw)
            if (m and not _THOUSANDS_RE.match(raw.strip(" $")) and as_number(other) is not None
                    and as_number(f"{m.group(1)}.{m.group(2)}") == as_number(other)):
                return True
        boxes = final_boxes(response)                     # N4: the final run of boxes as one list
        if 1 < len(boxes) <= _MAX_ITEMS and sum(map(len, boxes)) <= _MAX_CHARS:
            return _equiv(";".join(_normalize(b) for b in boxes), g)
        return False
    except Exception:  # noqa: BLE001 — the grader's contract is "never raises"; RecursionError included
        return False


# ---- benchmark and command line ----
def grader_benchmark(n_pairs: int = 3000, seed: int = 0, mix: str = "math") -> dict:
    """Grade n_pairs synthetic (response, gold) pairs and time each call.

    mix="math" (the default): equal answers written differently, near misses,
    structures (tuples, intervals, sets, matrices, MC letters, text) and adversarial inputs (power towers,
    100k-digit numbers, deep nesting). mix="numina": half of the pairs come from _numina_pair instead (named
    answers, records, ";" lists, several boxes, inequalities, equations, pct, long decimals, chains, and
    adversarial inputs for those paths). Returns {"mix", "pairs", "seconds", "pairs_per_s", "agree" (share
    of verdicts matching the label the generator intended), "max_seconds", "slowest": [{"seconds", "gold",
    "response"} x 5]}."""
    if mix not in ("math", "numina"):
        raise ValueError(f"grader_benchmark: mix must be 'math' or 'numina', got {mix!r}")
    rng = random.Random(seed)
    pairs = [_numina_pair(rng) if mix == "numina" and rng.random() < 0.5 else _bench_pair(rng)
             for _ in range(n_pairs)]
    times, agree = [], 0
    start = time.perf_counter()
    for response, gold, label in pairs:
        t0 = time.perf_counter()
        verdict = grade(response, gold)
        times.append(time.perf_counter() - t0)
        agree += verdict == label
    total = time.perf_counter() - start
    order = sorted(range(len(pairs)), key=lambda k: -times[k])[:5]
    return {"mix": mix, "pairs": n_pairs, "seconds": round(total, 3),
            "pairs_per_s": round(n_pairs / max(total, 1e-9), 1),
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


def _numina_pair(rng: random.Random) -> tuple[str, str, bool]:
    """One (response, gold, intended verdict) in the NuminaMath / OpenR1 style (conventions N1-N8, D2)."""
    a, b = rng.randint(1, 99), rng.randint(2, 99)
    c = a + b
    p = rng.choice([3, 7, 11, 13, 17])
    equal = [  # (written by the model, gold)
        (f"({a},{b})", f"(p,q)=({a},{b})"), (f"{a}, {b}", f"AB={a},\\ CD={b}"), (f"{a}", f"|AB|={a}"),
        (f"\\{{{a}, {c}\\}}", f"{a};{c}"), (f"({a},{b}),({b},{a})", f"({b};{a}),({a};{b})"),
        (f"({a},{b})", f"m={a},n={b}"), (f"{a}}}, \\boxed{{{c}", f"{c},{a}"), (f"(-{a}, {c})", f"-{a} < x < {c}"),
        (f"{b} \\ge x", f"x \\le {b}"), (f"y = {a}x + {b}", f"{2 * a}x - 2y + {2 * b} = 0"),
        (f"{a} pct", f"{a}\\%"), (f"\\cfrac{{{a}}}{{{b}}}", f"\\frac{{{a}}}{{{b}}}"),
        (repr(1 / p), f"\\frac{{1}}{{{p}}}"), (f"x = {a}+{b} = {c}", f"{c}"), (f"{a}\\textnormal{{ miles}}", f"{a}"),
    ]
    near = [
        (f"({b},{a})", f"(p,q)=({a},{a + 2 * b})"), (f"{b}, {a}", f"AB={a},\\ CD={c}"), (f"{c}", f"|AB|={a}"),
        (f"(-{a}, {c}]", f"-{a} < x < {c}"), (f"{b} \\le x", f"x \\le {b}"), (f"y = {a}x + {c}", f"{a}x - y + {b} = 0"),
        (f"{round(1 / p, 4)}", f"\\frac{{1}}{{{p}}}"), (f"{1 / p + 1e-9!r}", f"\\frac{{1}}{{{p}}}"),
        (f"x = {a}+{b} = {c + 1}", f"{c}"), (f"{a}}}, \\boxed{{{c}", f"{a},{c},{b}"),
    ]
    adversarial = [
        (";".join(["1"] * 400), "1"), ("<".join(["x"] * 300), "(0,1)"), ("=".join(["x"] * 300), "y"),
        (" or ".join(["(1,2)"] * 200), "(1,2)"), ("1}, \\boxed{" * 500 + "1", "1,1"),
        ("1<|x|<9^{9^{9^{9}}}", "(1,2)"), ("x^{2^{2^{2^{2^{2}}}}}=y", "y=x"),
    ]
    roll = rng.random()
    if roll < 0.55:
        (pred, gold), label = rng.choice(equal), True
    elif roll < 0.9:
        (pred, gold), label = rng.choice(near), False
    else:
        (pred, gold), label = rng.choice(adversarial), False
    lead = rng.choice(["", "Let us compute step by step.\n\n",
                       "We have $a = 2$, so the guess \\boxed{3} is wrong.\n\n"])
    tail = rng.choice(["The answer is \\boxed{%s}.", "Therefore $\\boxed{%s}$"])
    return lead + tail.replace("%s", pred), gold, label


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="grader.py", description="Grade one response against a gold answer, or "
                                "time the grader on generated pairs (--bench).")
    p.add_argument("--bench", action="store_true", help="time the grader on generated pairs and print JSON")
    p.add_argument("--pairs", type=int, default=3000, help="number of generated pairs for --bench")
    p.add_argument("--mix", choices=["math", "numina"], default="math",
                   help="--bench pairs: MATH-style only (default) or half NuminaMath/OpenR1-style")
    p.add_argument("response", nargs="?", help="a response (its last \\boxed{} is graded)")
    p.add_argument("gold", nargs="?", help="the gold answer")
    args = p.parse_args(argv)
    if args.bench:
        if args.pairs < 1:
            p.error("--pairs must be >= 1")
        print(json.dumps(grader_benchmark(n_pairs=args.pairs, mix=args.mix), indent=2))
        return 0
    if args.response is None or args.gold is None:
        p.error("give RESPONSE and GOLD, or --bench")
    print(grade(args.response, args.gold))
    return 0


if __name__ == "__main__":
    sys.exit(main())
