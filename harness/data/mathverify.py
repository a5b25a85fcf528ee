"""mathverify.py — the optional second grader, `--grader math-verify`: Hugging Face's Math-Verify, the convention
of the paper's and LUFFY's accuracy tables, so numbers can be put next to theirs. Ours (harness/data/grader.py)
stays the default: faster, and it never hands model text to a sympy parser (docs/grader.md, "Math-Verify").

Install: `pip install math-verify==0.9.0`. `for_name("math-verify")` stops in one line with that command when
it is missing, before any model loads.

How it is called, and why so:
1. Only Math-Verify's LaTeX extraction (`LatexExtractionConfig`: \\boxed{}, $...$, "the final answer is") is
   enabled, for the response and for the gold (wrapped in $...$). Its `ExprExtractionConfig` (on by default)
   hands the extracted text to sympy's `parse_expr`, an `eval`: it is never enabled here.
2. It runs in a child process (`MathVerifyGrader`): its time limits are SIGALRM-based and work only in a main
   thread, which the child's is; a sympy object built from model text never lives in the training process;
   and a call that outlives `hard_timeout` seconds, or kills the child, grades False (a new child starts).
3. Bad input (None, bytes, a gold with no parseable answer) grades False, as ours does.

Run: `python -m harness.data.mathverify --compare` grades the project's own grader cases (tests/test_grader.py,
tests/test_grader_numina.py) with both graders and prints the agreement and the speed of each.
"""
import argparse
import importlib.util
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

GRADERS = ("ours", "math-verify")
INSTALL = "pip install math-verify==0.9.0"


def _verify(response: str, gold: str, timeout: int) -> bool:
    """Math-Verify's verdict, LaTeX extraction only (module docstring, 1); runs in the child process."""
    from math_verify import LatexExtractionConfig, parse, verify

    if not isinstance(response, str) or not isinstance(gold, str):
        return False
    latex = [LatexExtractionConfig()]
    gold_parsed = parse(f"${gold}$", extraction_config=latex, parsing_timeout=timeout)
    if not gold_parsed:
        return False
    answer = parse(response, extraction_config=latex, parsing_timeout=timeout)
    return bool(verify(gold_parsed, answer, timeout_seconds=timeout))


def _verify_many(pairs: list[tuple[str, str]], timeout: int) -> list[bool]:
    return [_verify(r, g, timeout) for r, g in pairs]


class MathVerifyGrader:
    """grade(response, gold) -> bool through Math-Verify in one child process (module docstring, 2)."""

    def __init__(self, timeout: int = 5, hard_timeout: float = 60.0):
        self.timeout, self.hard_timeout = timeout, hard_timeout
        self.pool = None

    def _pool(self) -> ProcessPoolExecutor:
        if self.pool is None:
            import multiprocessing
            self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return self.pool

    def grade_many(self, pairs: list[tuple[str, str]]) -> list[bool]:
        """Verdicts for (response, gold) pairs in one round trip; a batch past its hard limit (or whose child
        died) is graded one by one, so only the pair that hangs or kills the child grades False."""
        if not pairs:
            return []
        future = self._pool().submit(_verify_many, list(pairs), self.timeout)
        try:
            return future.result(timeout=self.hard_timeout * len(pairs))
        except (FutureTimeout, BrokenProcessPool):   # a pair that hangs, or kills the child (memory)
            self.close(kill=True)
            if len(pairs) == 1:
                return [False]
            return [self.grade_many([p])[0] for p in pairs]

    def __call__(self, response: str, gold: str) -> bool:
        return self.grade_many([(response, gold)])[0]

    def close(self, kill: bool = False) -> None:
        if self.pool is None:
            return
        if kill:
            for proc in list((getattr(self.pool, "_processes", None) or {}).values()):
                proc.kill()
        self.pool.shutdown(wait=not kill, cancel_futures=True)
        self.pool = None


def installed() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def for_name(name: str):
    """The grade function of `--grader NAME`: ours (harness.data.grader.grade) or a MathVerifyGrader; a missing
    package or an unknown name stops in one line."""
    if name == "ours":
        from harness.data.grader import grade
        return grade
    if name != "math-verify":
        raise SystemExit(f"error: --grader {name}: choose one of {', '.join(GRADERS)}")
    if not installed():
        raise SystemExit(f"error: --grader math-verify needs the math-verify package: {INSTALL}")
    return MathVerifyGrader()


# ---------------------------------------------------------------- the comparison on the project's own cases

def project_cases() -> list[tuple[str, str, bool]]:
    """(response, gold, expected) of tests/test_grader.py's GRADE_CASES and tests/test_grader_numina.py's
    convention lists, each answer in the sentence those tests box it in."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "tests"))
    try:
        import test_grader
        import test_grader_numina as numina
    finally:
        sys.path.pop(0)
    lists = [test_grader.GRADE_CASES] + [getattr(numina, n) for n in (
        "NAMED", "RECORDS", "LISTS", "INEQUALITIES", "EQUATIONS", "NOTATION", "LONG_DECIMALS", "DELIBERATE",
        "DEBATABLE")]
    return [(test_grader.boxed(pred), gold, expected) for cases in lists for pred, gold, expected in cases]


def compare(cases: list[tuple[str, str, bool]], repeats: int = 3) -> dict:
    """Both graders on `cases`: agreement with each other and with the cases' labels, pairs per second (the
    best of `repeats` passes; Math-Verify's in its child process, one batch, so its IPC is one round trip)."""
    from harness.data.grader import grade

    pairs = [(r, g) for r, g, _ in cases]
    ours_s, mv_s = float("inf"), float("inf")
    mv = MathVerifyGrader()
    try:
        mv.grade_many(pairs[:1])   # start the child and import math_verify before timing
        for _ in range(repeats):
            t0 = time.perf_counter()
            ours = [grade(r, g) for r, g in pairs]
            ours_s = min(ours_s, time.perf_counter() - t0)
            t0 = time.perf_counter()
            theirs = mv.grade_many(pairs)
            mv_s = min(mv_s, time.perf_counter() - t0)
    finally:
        mv.close()
    labels = [e for _, _, e in cases]
    n = len(cases)
    return {"pairs": n,
            "agree": sum(a == b for a, b in zip(ours, theirs)),
            "ours_match_labels": sum(a == e for a, e in zip(ours, labels)),
            "mv_match_labels": sum(a == e for a, e in zip(theirs, labels)),
            "mv_false_positives": sum(t and not e for t, e in zip(theirs, labels)),
            "mv_false_negatives": sum(e and not t for t, e in zip(theirs, labels)),
            "ours_pairs_per_s": n / ours_s, "mv_pairs_per_s": n / mv_s,
            "disagreements": [(r, g, e, t) for (r, g, e), t in zip(cases, theirs) if t != e]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Math-Verify next to our grader on the project's grader cases.")
    p.add_argument("--compare", action="store_true", help="print the agreement and speed of both graders")
    p.add_argument("--show", type=int, default=10, help="disagreements to print")
    args = p.parse_args(argv)
    if not args.compare:
        p.print_help()
        return 0
    if not installed():
        print(f"error: math-verify is not installed: {INSTALL}", file=sys.stderr)
        return 2
    r = compare(project_cases())
    n = r["pairs"]
    print(f"{n} labelled pairs (tests/test_grader.py, tests/test_grader_numina.py)")
    print(f"ours:         {r['ours_match_labels']}/{n} match the labels ({100 * r['ours_match_labels'] / n:.1f} %), "
          f"{r['ours_pairs_per_s']:,.0f} pairs/s")
    print(f"math-verify:  {r['mv_match_labels']}/{n} match the labels ({100 * r['mv_match_labels'] / n:.1f} %; "
          f"{r['mv_false_positives']} false positives, {r['mv_false_negatives']} false negatives), "
          f"{r['mv_pairs_per_s']:,.0f} pairs/s")
    print(f"the two agree on {r['agree']}/{n} ({100 * r['agree'] / n:.1f} %)")
    for resp, gold, expected, theirs in r["disagreements"][:args.show]:
        answer = resp.split("\\boxed{", 1)[1][:-2]
        print(f"  math-verify {'accepts' if theirs else 'rejects'} {answer!r} vs gold {gold!r} (label {expected})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
