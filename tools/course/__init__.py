"""The course: turn this repository into an assignment (a student copy, its handout) and grade it held out.

The reference code marks each exercise's solution region with two comment lines,

    # BEGIN SOLUTION <exercise name>
    ...                                  (the reference solution)
    # END SOLUTION

(nbgrader's convention, keyed by name so that one exercise may span several functions). `--out` copies the
repository (the files git tracks plus untracked files it does not ignore; without git, every file but
caches) and replaces each region of the chosen exercises by

    raise NotImplementedError("exercise N (name): <what to write>; <names the code after it reads>; check with: ...")

keeping the signature, the docstring, any argument checks and any code outside the region (problem 12's region
is the body of the micro-batch loop: the loop, torchrun's padding micro-batch, the single gradient exchange and
the backward pass are given). Regions of exercises not
chosen keep their reference code (marker lines removed), so `--only` makes a smaller assignment. The copy
gets HANDOUT.md (setup, time, a policy placeholder, background, the problems in pipeline order, the written
and experiment questions with points and deliverables; the same text as docs/course.md), WRITEUP.md (the
write-up's template), figures/ and a one-line submit.sh. The teacher's key, tools/course_key.py, holds the
rubric, the redactions applied to the copy (docstrings, docs rows and test helpers that answer a question or
hold a stubbed solution) and the answer phrases the generator refuses to ship. The copy leaves out the
teacher's files (this package, tools/exercises.py, the key, the contract tests, tests/test_references.py, which holds the answer
references the copy's tests were stored from), the toy study's results (results/, docs/results.md, the
README's results section) and docs/course.md (HANDOUT.md is its student part).

    python -m tools.exercises --list                         # the problems: points, tests, depends on
    python -m tools.exercises --out ../assignment            # every exercise (outside the repository)
    python -m tools.exercises --out ../hw1 --only first_error,group_advantages
    python -m tools.exercises --handout                      # print the handout (docs/course.md holds it)
    python -m tools.exercises --rubric                       # teacher: the written questions' rubric
    python -m tools.exercises --fixtures held_out --seed 7   # teacher: inputs + reference outputs per problem
    python -m tools.exercises --grade ../assignment --fixtures held_out     # points per problem; exit 1 unless full
    python -m tools.exercises --grade submission.tar.gz --fixtures held_out --verbose --for-credit
    python -m tools.exercises --grade submission.tar.gz --fixtures held_out --json grade.json   # a script reads this
    python -m tools.exercises --grade submission.tar.gz --fixtures held_out --draw N   # again on a report's inputs
    python -m tools.exercises --time-checks                  # each problem's own check, timed

Held-out grading: `--fixtures` draws inputs from the teacher's seed (and trains a byte-level BPE tokenizer on
a corpus drawn from it) and stores them with the reference's outputs, one file per problem. `--grade` resolves
the hand-in once (no link on the way, nothing under /proc) and copies the handed-in files it needs as regular
files only, never through a link, a tarball read in a limited child (`grade.submission_folder`); it draws this
grading's own inputs from the fixtures' seed, the hand-in's digest and a fresh nonce and runs the reference on
them itself (`grade.held_out`; `--draw` re-grades on a report's inputs), and grades each problem in its own
sealed process (`grade.grade_problem`, `worker.py`): a folder holding the student's modules as handed in, the
reference's harness/, the runners and the inputs, never a reference solution nor an expected output
(`grade.grading_folder`). The functions a problem depends on answer from a reference process of the grader's
over plain-data pipes (`wire.py`). `seal.py` says what that process can and cannot touch, and why a relay out
of it carries nothing that scores; where the machine cannot seal (`seal.missing`) it grades unsealed with a
warning, and `--for-credit` refuses. The process writes its answers to a file that the parent loads as plain
data and compares; stdout is never counted. A problem scores its points only when every case matches (float
tolerance 1e-4 relative), so one wrong exercise costs exactly its own points. Every problem's cases have
outputs that differ from one another and from zero, so an all-zero or constant answer scores 0 (the contract
test checks this).

Modules: `problems.py` (the table below, the written questions), `student_copy.py` (the copy, the handout),
`fixtures.py` (held-out inputs and each problem's runner), `grade.py` (grading and its report), `seal.py`,
`worker.py` (the graded process), `wire.py` (what crosses between it and the grader), `cli.py` (the command
line).

`problems.EXERCISES` is the one table (the tests each problem maps to are there): each exercise's functions, paper concept, equation, the names the code
around its region expects, points, the tests that grade it (pytest node ids; a parametrised test is named
once), difficulty (1 easy … 4 challenge), hints, its slow end-to-end check. "Depends on" is computed from
what its tests call (`reached_exercises`). `breaks` lists every other test that fails while the exercise is
a stub, so on a generated copy exactly `expected_failures` fail, each with NotImplementedError, and all
others pass (tests/test_exercises.py). When a new test calls an exercise's function, add its node id to that
exercise's `tests` (or `breaks`, for a test of something else that merely runs through it).
"""
