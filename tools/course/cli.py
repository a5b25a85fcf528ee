"""The course's command line: `python -m tools.exercises` (tools/exercises.py calls `main`); the commands are
listed in this package's docstring."""
import argparse
import os
import sys

from .fixtures import write_fixtures
from .grade import grade, grade_json, grade_report, write_json
from .problems import EXERCISES, ROOT
from .student_copy import generate, handout, rubric, table, time_checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Write a course copy of this repository, its held-out fixtures, "
                                             "or grade a submission.")
    ap.add_argument("--out", help="output folder (new or empty) for the student copy")
    ap.add_argument("--only", help="comma-separated exercise names (default: all); see --list")
    ap.add_argument("--list", action="store_true", help="print the problem table and exit")
    ap.add_argument("--handout", action="store_true", help="print the handout (HANDOUT.md of a full copy)")
    ap.add_argument("--fixtures", help="held-out fixture folder: written with --seed, read with --grade")
    ap.add_argument("--seed", type=int, help="the teacher's seed for --fixtures (keep it private)")
    ap.add_argument("--grade", help="a student copy (folder) or a submission.tar.gz to grade with --fixtures")
    ap.add_argument("--time-checks", nargs="?", const=ROOT, metavar="FOLDER",
                    help="time each problem's own check in FOLDER (default: this repository)")
    ap.add_argument("--slow", action="store_true", help="with --time-checks: also the end-to-end checks")
    ap.add_argument("--rubric", action="store_true", help="print the written questions' rubric (the teacher's)")
    ap.add_argument("--verbose", action="store_true", help="with --grade: per wrong case, the function and the "
                                                             "first differing value")
    ap.add_argument("--json", metavar="FILE", help="with --grade: also write the report as JSON to FILE (what a "
                                                   "script should parse)")
    ap.add_argument("--draw", type=int, help="with --grade: grade on the inputs a report names (its last line), "
                                             "to re-grade exactly; by default each grading draws its own")
    ap.add_argument("--for-credit", action="store_true", help="with --grade: refuse to grade unless each "
                    "problem's process can be sealed (namespaces, Landlock)")
    args = ap.parse_args(argv)
    only = [x.strip() for x in args.only.split(",") if x.strip()] if args.only else None
    try:
        if args.list:
            print(table())
            return 0
        if args.handout:
            print(handout(), end="")
            return 0
        if args.time_checks:
            for label, seconds, rc in time_checks(args.time_checks, args.slow):
                print(f"{label:<32} {seconds:6.1f} s  {'passed' if rc == 0 else f'pytest exit {rc}'}")
            return 0
        if args.rubric:
            print(rubric(), end="")
            return 0
        if args.grade:
            if not args.fixtures:
                ap.error("--grade needs --fixtures DIR")
            if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
                ap.error(f"--json {args.json}: its folder does not exist")
            results = grade(args.grade, args.fixtures, verbose=args.verbose, for_credit=args.for_credit,
                            draw=args.draw)
            if args.json:
                write_json(grade_json(results, args.grade, args.fixtures), args.json)
            print(grade_report(results, verbose=args.verbose, json_path=args.json or ""))
            return 0 if all(r["points"] == r["max"] for r in results.values()) else 1
        if args.fixtures:
            if args.seed is None:
                ap.error("--fixtures DIR writes fixtures with --seed N (or grades with --grade COPY)")
            counts = write_fixtures(args.fixtures, args.seed, only)
            print(f"wrote {args.fixtures}: {sum(counts.values())} held-out cases for {len(counts)} problems "
                  f"(seed {args.seed}); grade with: python -m tools.exercises --grade COPY --fixtures {args.fixtures}")
            return 0
        if not args.out:
            ap.error("--out, --list, --handout, --fixtures or --grade is required")
        changed = generate(args.out, only)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # the grader's own failure (a full disk, a folder it cannot remove): one line
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    names = only or [e.name for e in EXERCISES]
    print(f"wrote {args.out}: {len(names)} problem(s) ({', '.join(names)}) in {', '.join(changed)}, HANDOUT.md, "
          f"submit.sh")
    print(f"students: cd {args.out} && python -m pytest tests -q   (the stubbed problems fail with "
          f"NotImplementedError until written); HANDOUT.md describes each problem")
    return 0


if __name__ == "__main__":
    sys.exit(main())
