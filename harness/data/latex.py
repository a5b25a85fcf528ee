"""latex.py — the grader's maths: a LaTeX-subset parser, exact numbers and a bounded numeric identity test.

What it implements (used by grader.py; the SCOPE paper leaves its verifier unspecified):
  1. `Parser` / `to_sympy`: our own recursive-descent parser for the LaTeX that answers are written in
     (numbers, letters with subscripts, + - * / ^, \\frac, \\sqrt[n], \\binom, n!, |x|, \\pi, \\infty, e, i,
     trig / log / exp, implicit multiplication). It builds sympy objects directly, every node with
     evaluate=False, so model text never reaches eval/exec/sympify/parse_expr/parse_latex/lambdify, and
     sympy's automatic evaluation (which can call simplify() and run for minutes) never runs.
  2. `exact`: the exact rational value of a tree of numbers, + * and integer powers (a digit budget stops
     power towers); `as_number`: the exact value of a plain number string (decimal, a/b, \\frac{a}{b}, mixed
     number, scientific, repeating decimal).
  3. `sympy_equal`: two parsed answers are equal when exact rationals agree, else when they agree at 3
     fixed random points evaluated in a private 60-digit mpmath context (relative tolerance 1e-40,
     absolute 1e-55), else, for small polynomial-like expressions only, when expand(a - b) == 0.
  4. `proportional`: lhs - rhs of two equations differ by a constant nonzero factor (same test points).
  5. `linear_in`: k*v + m with rational k, m for an expression linear in one symbol (for inequalities).
  6. `decimal_matches`: a long decimal against a constant, by the digits it shows.

Safety limits (each checked before any sympy work): at most MAX_TOKENS tokens reach the parser, nesting
depth <= MAX_DEPTH, number literals <= MAX_DIGITS digits, n! and binomials only for n <= 1000, exact powers
stop past POW_DIGIT_BUDGET digits, the numeric evaluator refuses magnitudes beyond 2^MAX_MAG_BITS and trig
arguments beyond 1e6. Anything over a limit or not understood raises `Refuse`. No signals or threads.

Choices: 'e' is Euler's number and 'i' the imaginary unit, other letters are symbols; x^23 is x^2 * 3
(one character per script without braces); \\sin 2x is sin(2x); \\cos^{-1} is arccos; a decimal that
agrees with an irrational to 40 significant digits counts as equal (the identity test is numeric).
"""
import math
import re
from fractions import Fraction

import mpmath                   # bounded numeric identity test (ships with sympy)
import sympy                    # answers as objects, built by our own parser only

MAX_DEPTH = 40               # parser nesting depth
MAX_DIGITS = 300             # digits in one number literal
MAX_TOKENS = 400             # tokens of one expression handed to the parser
POW_DIGIT_BUDGET = 20000     # digits that exact integer powers may create in one answer
MAX_MAG_BITS = 4000          # |value| < 2**4000 in the numeric evaluator
_MP = mpmath.MPContext()     # private context: its precision never changes, so threads can share it
_MP.dps = 60
_TOL = _MP.mpf("1e-40")     # relative tolerance of the numeric identity test
_FLOOR = _MP.mpf("1e-55")   # absolute tolerance: rounding noise of a 60-digit sum that should be 0
_POINTS = ("0.5772156649015328606", "1.4142135623730950488", "-0.7390851332151606416")


class Refuse(Exception):
    """Raised inside the grader when an input exceeds a safety limit or is not understood."""


# ---- our LaTeX-subset parser (builds sympy objects; never evaluates text) ----
# Every node is built with evaluate=False: sympy's automatic evaluation (Pow._eval_power, Abs.eval, ...)
# can call simplify() internally and run for minutes, so nothing clever happens at construction. Exact
# values are computed by exact (with a digit budget) and numeric values by _num (with magnitude guards).

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
            if m.group(1) and sum(c.isdigit() for c in tok) > MAX_DIGITS:
                raise Refuse("number literal too long")
            tokens.append(tok)
            if len(tokens) > MAX_TOKENS:
                raise Refuse("too many tokens")
    return tokens


def add(*terms):
    return terms[0] if len(terms) == 1 else sympy.Add(*terms, evaluate=False)


def mul(*factors):
    return factors[0] if len(factors) == 1 else sympy.Mul(*factors, evaluate=False)


def neg(x):
    return mul(_MINUS_ONE, x)


def _pow(base, exponent):
    return sympy.Pow(base, exponent, evaluate=False)


def _small_int(expr, lo: int, hi: int) -> int:
    """The exact integer value of expr, which must lie in [lo, hi]; Refuse otherwise."""
    value = exact(expr)
    if value is None or value.denominator != 1 or not lo <= value <= hi:
        raise Refuse(f"expected an integer in [{lo}, {hi}]")
    return int(value)


class Parser:
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
            raise Refuse("empty")
        value = self.expr()
        if self.i != len(self.toks):
            raise Refuse(f"unexpected {self.peek()!r}")
        return value

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected=None):
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise Refuse(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Refuse("nesting too deep")

    def expr(self):
        self.enter()
        terms = [self.term()]
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.term()
            terms.append(rhs if op == "+" else neg(rhs))
        self.depth -= 1
        return add(*terms)

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
                if exact(den) == 0:
                    raise Refuse("division by zero")
                factors.append(_pow(den, _MINUS_ONE))
            elif self.starts_primary(tok):
                factors.append(self.power())
            else:
                return mul(*factors)

    def unary(self):
        tok = self.peek()
        if tok in ("-", "+"):
            self.take()
            self.enter()
            value = self.unary()
            self.depth -= 1
            return neg(value) if tok == "-" else value
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
            return neg(self.script())
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
            if exact(den) == 0:
                raise Refuse("division by zero")
            return mul(num, _pow(den, _MINUS_ONE))
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
            arg = mul(*args)
            if exponent is not None and exact(exponent) == -1 and tok in _INVERSE:   # \cos^{-1} = arccos
                return _INVERSE[tok](arg, evaluate=False)
            if base is not None:
                value = mul(sympy.log(arg, evaluate=False), _pow(sympy.log(base, evaluate=False), _MINUS_ONE))
            else:
                value = _FUNCS[tok](arg, evaluate=False)
            return _pow(value, exponent) if exponent is not None else value
        raise Refuse(f"unsupported token {tok!r}")


# ---- exact values (digit budget) and the numeric identity test (magnitude guards) ----

def _digits(q: Fraction) -> int:
    """Decimal digits of the larger of numerator/denominator (cheap upper bound)."""
    return max(abs(q.numerator).bit_length(), q.denominator.bit_length()) * 30103 // 100000 + 1


def exact(expr, budget: list | None = None) -> Fraction | None:
    """The exact rational value of a tree of numbers, +, *, and integer powers; None when the tree holds
    anything else or when integer powers would create more than POW_DIGIT_BUDGET digits in total."""
    budget = [POW_DIGIT_BUDGET] if budget is None else budget
    if expr.is_Rational:
        return Fraction(int(expr.p), int(expr.q))
    if expr.is_Add or expr.is_Mul:
        values = [exact(a, budget) for a in expr.args]
        if any(v is None for v in values):
            return None
        total = values[0]
        for v in values[1:]:
            total = total + v if expr.is_Add else total * v
        return total
    if expr.is_Pow:
        base, exponent = exact(expr.args[0], budget), exact(expr.args[1], budget)
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
                raise Refuse("0 to a non-positive power")
            return ctx.mpf(0)
        if abs(e) * (abs(ctx.log(abs(b))) + 1) > MAX_MAG_BITS * 0.69:
            raise Refuse("power too large to evaluate")
        value = ctx.power(b, e)
    elif isinstance(expr, sympy.Abs):
        value = abs(_num(expr.args[0], point))
    elif isinstance(expr, sympy.log):
        x = _num(expr.args[0], point)
        if x == 0:
            raise Refuse("log 0")
        value = ctx.log(x)
    elif isinstance(expr, sympy.exp):
        x = _num(expr.args[0], point)
        if abs(x) > MAX_MAG_BITS * 0.69:
            raise Refuse("exp too large")
        value = ctx.exp(x)
    elif expr.func in _MP_TRIG:
        x = _num(expr.args[0], point)
        if abs(x) > 1e6:
            raise Refuse("trig argument too large")
        value = getattr(ctx, _MP_TRIG[expr.func])(x)
    else:  # oo, zoo, nan, unknown functions
        raise Refuse(f"cannot evaluate {type(expr).__name__}")
    _check_mag(value)
    return value


_MP_TRIG = {sympy.sin: "sin", sympy.cos: "cos", sympy.tan: "tan", sympy.cot: "cot", sympy.sec: "sec",
            sympy.csc: "csc", sympy.asin: "asin", sympy.acos: "acos", sympy.atan: "atan"}


def _check_mag(value):
    if not _MP.isfinite(value) or (value != 0 and _MP.mag(value) > MAX_MAG_BITS):
        raise Refuse("value out of range")


def numeric_equal(a, b) -> bool | None:
    """True/False when the two expressions agree/disagree at the test points; None when undecided.

    A point where only one side can be evaluated counts as disagreement; points where neither can are
    skipped. A constant needs one agreeing point, an expression with symbols two."""
    names = sorted({s.name for s in (a.free_symbols | b.free_symbols)})
    agreed = 0
    for point in _points(names):
        va, vb = num_or_none(a, point), num_or_none(b, point)
        if va is None and vb is None:
            continue
        if va is None or vb is None or abs(va - vb) > _TOL * max(abs(va), abs(vb)) + _FLOOR:
            return False
        agreed += 1
        if not names:
            break
    return True if agreed >= (2 if names else 1) else None


def num_or_none(expr, point):
    try:
        return _num(expr, point)
    except (Refuse, ZeroDivisionError, ValueError, OverflowError):
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


def sympy_equal(a, b) -> bool:
    """Equality of two parsed answers: exact rationals when both are numbers, else the numeric identity
    test, else (small polynomials only) expand(a - b) == 0."""
    if a == b:
        return True
    xa, xb = exact(a), exact(b)
    if xa is not None and xb is not None:     # exact numbers: 0.33 != 1/3
        return xa == xb
    if a.has(sympy.oo, sympy.zoo, sympy.nan) or b.has(sympy.oo, sympy.zoo, sympy.nan):
        return False
    verdict = numeric_equal(a, b)
    if verdict is not None:
        return verdict
    diff = add(a, neg(b))
    return _small_polynomial(diff) and sympy.expand(diff) == 0


def to_sympy(s: str):
    return Parser(s).parse()



# ---- numbers ----

_NUMBER_RE = re.compile(r"^([-+]?)(\d+\.?\d*|\.\d+)(?:(?:e|E|\\times10\^|\\cdot10\^|\*10\^)\{?([-+]?\d{1,4})\}?)?$")
_MIXED_RE = re.compile(r"^([-+]?)(\d+)\\frac(?:\{(\d+)\}\{(\d+)\}|(\d)(\d))$")   # 4\frac{2}{3} = 14/3
_REPEATING_RE = re.compile(r"^([-+]?)(\d*)\.(\d*)\\overline\{?(\d{1,50})\}?$")   # 0.1\overline{6} = 1/6
_FRACTION_RE = re.compile(r"^([-+]?)(?:\\frac\{(-?\d+)\}\{(-?\d+)\}|\\frac(\d)(\d)|(\d+)/(\d+))$")


def as_number(s: str) -> Fraction | None:
    """Exact value of a plain number: integer, decimal, scientific (1.5e3, 1.5\\times10^{3}), a/b, \\frac{a}{b},
    a mixed number 4\\frac{2}{3} (proper fraction part), a repeating decimal 0.\\overline{3}."""
    if len(s) > MAX_DIGITS + 20:
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


# ---- equations, inequalities and long decimals ----

def _points(names: list[str]):
    """The test points of the identity tests: each symbol gets its own value (base points shifted by index)."""
    for k in range(len(_POINTS)):
        yield {n: _MP.mpf(_POINTS[(k + j) % len(_POINTS)]) + j * _MP.mpf("0.31830988618379067")
               for j, n in enumerate(names)}


def proportional(a, b) -> bool:
    """True when a = c * b for one constant c != 0 (lhs - rhs of two equations: the same curve or solution
    set). Decided at the test points: the ratio a/b must be the same nonzero number at >= 2 points where
    both sides evaluate; a point where only one side evaluates, or only one side is 0, is a disagreement.
    Both sides must hold a symbol (two constant equations are never compared this way)."""
    names = sorted({s.name for s in (a.free_symbols | b.free_symbols)})
    if not a.free_symbols or not b.free_symbols:
        return False
    ratio, agreed = None, 0
    for point in _points(names):
        va, vb = num_or_none(a, point), num_or_none(b, point)
        if va is None and vb is None:
            continue
        if va is None or vb is None:
            return False
        a_zero, b_zero = abs(va) <= _FLOOR, abs(vb) <= _FLOOR
        if a_zero != b_zero:
            return False
        if a_zero:
            continue
        r = va / vb
        if ratio is None:
            ratio = r
        elif abs(r - ratio) > _TOL * abs(ratio):
            return False
        agreed += 1
    return agreed >= 2


def linear_in(expr, name: str) -> tuple[Fraction, Fraction] | None:
    """(k, m) with expr == k * name + m exactly, k and m rational; None when expr is anything else
    (a product of two terms with the symbol, a power of it, a function of it, another symbol)."""
    if expr.is_Symbol:
        return (Fraction(1), Fraction(0)) if expr.name == name else None
    value = exact(expr)
    if value is not None:
        return Fraction(0), value
    if expr.is_Add or expr.is_Mul:
        parts = [linear_in(arg, name) for arg in expr.args]
        if any(p is None for p in parts):
            return None
        k, m = parts[0]
        for pk, pm in parts[1:]:
            if expr.is_Add:
                k, m = k + pk, m + pm
            elif k != 0 and pk != 0:              # x * x is not linear
                return None
            else:
                k, m = k * pm + pk * m, m * pm
        return k, m
    if expr.is_Pow and expr.args[1] == -1:        # 1 / constant only
        base = exact(expr.args[0])
        return (Fraction(0), 1 / base) if base else None
    return None


def decimal_matches(decimal: str, expr) -> bool:
    """A decimal as stated ("0.0833333333333333") against an exact value: True when the two differ by less
    than one unit of the decimal's last shown digit (the value truncated or rounded to the digits shown,
    or a float's last digit), or by less than 1e-15 relative (a double printed with 16-17 digits: Python
    prints sqrt(7) as 2.6457513110645907, the true value is 2.64575131106459059...). The caller decides
    which decimals are long enough for this (grader: >= 12 significant digits)."""
    mantissa = decimal.lstrip("+-")
    if not mantissa.replace(".", "", 1).isdigit() or len(mantissa) > MAX_DIGITS:
        return False
    places = len(mantissa.split(".")[1]) if "." in mantissa else 0
    shown = Fraction(decimal)
    target = exact(expr)
    if target is not None:
        return abs(shown - target) < max(Fraction(1, 10 ** places), abs(target) / 10 ** 15)
    if expr.free_symbols or places > 45:          # beyond the 60-digit evaluator's resolution
        return False
    value = num_or_none(expr, {})
    if value is None or isinstance(value, _MP.mpc):
        return False
    return abs(_MP.mpf(shown.numerator) / shown.denominator - value) < max(_MP.mpf(10) ** (-places),
                                                                          abs(value) * _MP.mpf("1e-15"))
