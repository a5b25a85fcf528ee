"""Grading: the handed-in files read as regular files, a folder per problem, one sealed process per problem
(`seal.py`, `worker.py`); the parent compares the answers and writes the report."""
import ast
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import time

from . import seal
from .fixtures import matches
from .problems import BY_NAME, EXERCISES, MODULES, ROOT, SUBMITTED, reached_exercises
from .student_copy import stub_source
from .worker import OWN_GRPO


def read_regular(folder: str, rel: str) -> bytes:
    """The bytes of the regular file `rel` inside `folder`, opened without following a link anywhere on the way
    (each folder with O_NOFOLLOW | O_DIRECTORY, the file with O_NOFOLLOW, then fstat: a regular file only).
    ValueError naming the file otherwise."""
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"--grade {folder}: {rel} is not a plain path inside the submission")
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | (0 if last else os.O_DIRECTORY),
                              dir_fd=fd)
            except OSError as err:
                kind = "a symbolic link" if os.path.islink(os.path.join(folder, *parts[:i + 1])) else err.strerror
                raise ValueError(f"--grade {folder}: {'/'.join(parts[:i + 1])} is refused ({kind}): hand in "
                                 f"the file itself") from None
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--grade {folder}: {rel} is refused (not a regular file): hand in the file itself")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def submission_folder(path: str, tmp: str, needed: set) -> str:
    """`tmp`, holding the submission's `needed` files as the grader read them: from a folder, regular files
    only, never through a link (`read_regular`); from a submit.sh tarball, its regular members only (a link,
    a device or a folder under a needed name is refused). The modules a submission lacks are the reference's
    (`grading_folder`)."""
    if os.path.isdir(path):
        missing = sorted(f for f in needed if not os.path.lexists(os.path.join(path, f)))
        if missing:
            raise ValueError(f"--grade {path}: missing {', '.join(missing)}")
        files = {name: read_regular(path, name) for name in sorted(needed)}
    elif not tarfile.is_tarfile(path):
        raise ValueError(f"--grade {path}: neither a folder nor a .tar.gz from submit.sh")
    else:
        with tarfile.open(path) as tar:
            members = {}
            for m in tar.getmembers():
                name = os.path.normpath(m.name).lstrip("/")
                if name in needed and (not m.isfile() or name in members):
                    raise ValueError(f"--grade {path}: {name} is refused (not one regular file in the tarball)")
                members[name] = m
            missing = sorted(needed - set(members))
            if missing:
                raise ValueError(f"--grade {path}: the submission lacks {', '.join(missing)}")
            files = {name: tar.extractfile(members[name]).read() for name in needed}
    for name, data in files.items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
    return tmp


# ---------------------------------------------------------------------------------------------------
# Grading: one sandboxed process per problem; the parent compares
# ---------------------------------------------------------------------------------------------------
# what each problem's runner returns, named for --verbose (tuple positions or dict keys)
OUTPUT_NAMES = {
    "first_error": ("first_error", "cut_point", "keep_ratio", "select_candidate"),
    "logprob_entropy": ("logprobs_and_entropy: log π(target)", "logprobs_and_entropy: entropy",
                        "logprobs_and_entropy: d(Σ log π + Σ H)/d logits", "entropy_from_logprobs"),
    "clipped_surrogate": ("clipped_surrogate: per-token loss", "clipped_surrogate: ratio ρ",
                          "clipped_surrogate: clipped", "clipped_surrogate: d Σ loss / d logp",
                          "clipped_surrogate: no gradient reaches old_logp"),
    "shaped_offpolicy": ("shaped_offpolicy_loss: per-token loss", "shaped_offpolicy_loss: f(π)",
                         "shaped_offpolicy_loss: d Σ loss / d logp"),
    "policy_loss": ("policy_loss: loss", "policy_loss: d loss / d logp", "policy_loss: d loss / d entropy",
                    "policy_loss: loss_metrics(terms)", "loss_normaliser: Z"),
    "update": ("update: returned metrics", "update: parameter change"),
    "scope_step": {"located": "locate_first_errors: (steps, step_scores, cut, keep_ratio, keep_ratio_tokens, "
                              "prefix tokens) per trajectory",
                   "picks": "select_failures", "merged": "repair: (group, response_ids, offpolicy_mask, reward, "
                                                          "source) per trajectory",
                   "traces": "repair: traces", "unavailable": "repair: unavailable",
                   "advantages": "group_advantages over the merged groups"},
}


def _short(x) -> str:
    import torch

    if isinstance(x, torch.Tensor):
        x = x.item() if x.numel() == 1 else x
        if isinstance(x, torch.Tensor):
            return f"tensor of shape {tuple(x.shape)}, dtype {str(x.dtype).replace('torch.', '')}"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def first_difference(got, want, where: str = "", rtol=1e-4, atol=1e-6):
    """Where `got` first differs from `want` (as `matches` judges) and the two values there, or None."""
    import torch

    if matches(got, want, rtol, atol):
        return None
    at = where or "the output"
    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(want.shape) \
            and want.numel() and got.dtype.is_floating_point == want.dtype.is_floating_point:
        if want.is_floating_point():
            bad = ~torch.isclose(got.double(), want.double(), rtol=rtol, atol=atol, equal_nan=True)
        else:
            bad = got != want
        if got.dtype != want.dtype and not want.is_floating_point():
            return f"{at}: dtype {got.dtype}, expected {want.dtype}"
        idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.any() else None
        if idx is not None:
            return f"{at}[{', '.join(map(str, idx))}]: got {got[idx].item()!r}, expected {want[idx].item()!r}"
    if isinstance(want, dict) and isinstance(got, dict) and set(got) == set(want):
        for k in want:
            d = first_difference(got[k], want[k], f"{at}[{k!r}]", rtol, atol)
            if d:
                return d
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)) and len(got) == len(want):
        for i, (a, b) in enumerate(zip(got, want)):
            d = first_difference(a, b, f"{at}[{i}]", rtol, atol)
            if d:
                return d
    return f"{at}: got {_short(got)}, expected {_short(want)}"


def describe_difference(name: str, got, want) -> str:
    """`first_difference` with the problem's output named by the function that produced it."""
    names = OUTPUT_NAMES.get(name)
    fn = ", ".join(f.split(":")[1] for f in BY_NAME[name].functions)
    if isinstance(names, tuple) and isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)) \
            and len(got) == len(want) == len(names):
        for label, a, b in zip(names, got, want):
            d = first_difference(a, b, label)
            if d:
                return d
    if isinstance(names, dict) and isinstance(got, dict) and isinstance(want, dict) and set(got) == set(want):
        for key, label in names.items():
            d = first_difference(got[key], want[key], label)
            if d:
                return d
    return first_difference(got, want, fn) or ""


def function_spans(text: str) -> dict:
    """{name: (first line, last line)} (1-based, decorators included) of the top-level functions in `text`."""
    spans = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[node.name] = (start, node.end_lineno)
    return spans


def mixed_source(student: str, reference: str, replace: set, path: str) -> str:
    """The student's module with the top-level functions in `replace` swapped for the reference's (appended
    when the student removed them): the module a problem is graded with, its own functions the student's."""
    try:
        mine = function_spans(student)
    except SyntaxError as err:
        raise ValueError(f"{path}:{err.lineno}: the submitted file is not valid Python ({err.msg})") from None
    theirs = function_spans(reference)
    ref_lines, lines = reference.splitlines(keepends=True), student.splitlines(keepends=True)
    tail = []
    for name in sorted(replace, key=lambda n: -mine.get(n, (0, 0))[0]):
        a, b = theirs[name]
        body = ref_lines[a - 1:b]
        if name in mine:
            s, e = mine[name]
            lines[s - 1:e] = body
        else:
            tail += ["\n\n"] + body
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines + tail)


# what a problem's runner calls beyond the problem's own functions: problem 6's runner goes on from the pick to
# the repair (refine.rectify, which splices) and the advantages over the merged groups, as scope.main does
RUNNER_CALLS = {"scope_step": ("refine.py::rectify", "grpo.py::group_advantages")}


def runner_reaches(problem: str, root: str = ROOT) -> set:
    """The other exercises whose functions the code of `problem`'s functions and its runner call (statically,
    through the reference's files and harness/): the only reference solutions its grading process holds."""
    calls = [f.replace(":", "::") for f in BY_NAME[problem].functions] + list(RUNNER_CALLS.get(problem, ()))
    return reached_exercises(calls, root) - {problem}


def grading_folder(folder: str, problem: str, dest: str) -> None:
    """Fill `dest` with what the process that grades `problem` may see: each graded module with the
    student's functions of `problem`, the reference's functions of the problems they reach
    (`runner_reaches`) and every other problem's functions as stubs; the reference's harness/ and this package
    (as `_course`, whose worker grades).
    Problem 12 also gets the student's grpo.py as written (`OWN_GRPO`). The reference's own functions of
    `problem` are nowhere in it."""
    own = {f.split(":")[1] for f in BY_NAME[problem].functions}
    reached = runner_reaches(problem)
    for n in MODULES:
        rel = n + ".py"
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            reference, _ = stub_source(f.read(), set(BY_NAME) - reached, rel)
        others = {fn.split(":")[1] for e in EXERCISES for fn in e.functions if fn.split(":")[0] == rel} - own
        src = os.path.join(folder, rel)
        if rel in SUBMITTED and os.path.isfile(src):   # grade() has checked that every file a problem needs is there
            with open(src, encoding="utf-8") as f:
                text = mixed_source(f.read(), reference, others, rel)
        else:
            text = reference
        with open(os.path.join(dest, rel), "w", encoding="utf-8") as f:
            f.write(text)
    if problem == "update":
        shutil.copy2(os.path.join(folder, "grpo.py"), os.path.join(dest, OWN_GRPO + ".py"))
    shutil.copytree(os.path.join(ROOT, "harness"), os.path.join(dest, "harness"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.dirname(os.path.abspath(__file__)), os.path.join(dest, "_course"),
                    ignore=shutil.ignore_patterns("__pycache__"))



def grade_problem(folder: str, name: str, data: dict, tokenizer: str, seconds: int = 90, verbose: bool = False,
                  hidden=(), sealed: bool = True):
    """Run problem `name` of the submission in `folder` in its own process on the held-out inputs and
    compare its answers with the reference's outputs here. `sealed`: inside `seal.NAMESPACES`, as
    `seal.IDENTITY` (a root grader), under `seal.limits`, and the worker seals itself before it runs anything of the
    student's (the caller has checked that the machine can: `seal.missing`). The process gets `seconds` from
    its start (its alarm; start-up included) and seal.GRACE more before it is killed. Returns {passed, cases, error, sealed, notes}; `sealed` is what
    the grader set up, false only when unsealed or when the worker could not seal itself (then nothing ran)."""
    import torch

    notes, first = [], ""
    for attempt in (1, 2):   # a process killed by a signal it did not earn is graded once more, in a new folder
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="grade-") as here:
            grading_folder(folder, name, here)
            torch.save(data["cases"], os.path.join(here, "cases.pt"))
            status_r, status_w = os.pipe()   # the worker's one byte: sealed or not, before any student code
            with open(os.path.join(here, "job.json"), "w", encoding="utf-8") as f:
                json.dump({"problem": name, "tokenizer": tokenizer, "seconds": seconds, "status_fd": status_w,
                           "hidden": [ROOT, folder] + list(hidden)}, f)
            proc = seal.run([sys.executable, "-m", "_course.worker", here], here, seconds, sealed, pass_fds=(status_w,))
            status = read_status(status_r, status_w)
            answers, stopped = [], (f"it ran past its time limit ({seconds + seal.GRACE} s) and was killed" if proc is None
                                    else "it could not seal itself, so nothing was graded" if status == seal.NOT_SEALED
                                    else stop_reason(proc.returncode, proc.stderr))
            path = os.path.join(here, "answers.pt")
            if os.path.isfile(path) and not os.path.islink(path):
                try:   # what the process wrote is untrusted: plain tensors and containers only, no code
                    answers = list(torch.load(path, weights_only=True)["answers"])
                except Exception as err:
                    stopped = stopped or f"its answers are not plain data ({type(err).__name__})"
        if attempt == 2 or proc is None or not killed_from_outside(proc.returncode) or \
                time.monotonic() - t0 > seconds:
            break
        first = stopped
    if first:
        notes.append(f"graded twice: the first process stopped ({first})")
    if status == seal.NOT_SEALED:   # the worker's own word, written before the student's code ran; never its exit status
        sealed = False
    stopped = stopped or ("" if answers else "it wrote no answers")
    passed, error = 0, ""
    for k, want in enumerate(data["outputs"]):
        answer = answers[k] if k < len(answers) and isinstance(answers[k], dict) else None
        if answer is None:
            error = error or (f"the grading process stopped: {stopped}" if stopped else f"case {k}: no answer")
            break
        if "output" in answer and matches(answer["output"], want):
            passed += 1
            continue
        why = answer.get("error") or describe_difference(name, answer.get("output"), want)
        error = error or (f"case {k}: {why}" if verbose else f"case {k} differs from the reference"
                          if "error" not in answer else f"case {k}: {answer['error']}")
        notes.append(f"case {k}: {why}")
    return {"passed": passed, "cases": len(data["outputs"]), "error": error, "sealed": sealed, "notes": notes}


def read_status(read_end: int, write_end: int) -> bytes:
    """The first byte the worker wrote to its status pipe (b"" when it never reached its seal), both ends closed.
    Non-blocking: an orphan still holding the write end cannot stall the grader."""
    os.close(write_end)
    os.set_blocking(read_end, False)
    try:
        return os.read(read_end, 1)
    except BlockingIOError:
        return b""
    finally:
        os.close(read_end)


def killed_from_outside(returncode: int) -> bool:
    """Whether the process died of a signal that none of its limits sends (SIGSEGV, SIGBUS, or a SIGKILL
    before its time: the kernel's out-of-memory killer): the grader regrades such a problem once."""
    signum = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else 0
    return signum in (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)


def stop_reason(returncode: int, stderr: str) -> str:
    """Why the grading process ended without finishing ("" when it exited 0): its signal or exit status, with
    the last line it wrote (a traceback's, or faulthandler's for a crash)."""
    if returncode == 0:
        return ""
    signum = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else 0
    how = f"killed by {signal.Signals(signum).name}" if signum in signal.valid_signals() else f"exit status {returncode}"
    if signum == signal.SIGXCPU:
        how += " (its CPU-time limit)"
    elif signum == signal.SIGKILL:
        how += " (its CPU-time limit, or the out-of-memory killer)"
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    lines = [ln for ln in lines if ln.startswith("Fatal Python error")] or lines   # a crash: faulthandler's headline
    return how + (f": {lines[-1][:160]}" if lines else ", no output")


def grade(path: str, fixtures: str, verbose: bool = False, only=None, for_credit: bool = False) -> dict:
    """Grade a copy (folder) or a submission (.tar.gz) on held-out fixtures, each problem in its own sealed
    process (`grade_problem`) over the regular files the grader read (`submission_folder`). On a machine that
    cannot seal (`seal.missing`) it grades unsealed, or, with `for_credit`, refuses (ValueError). Returns
    {problem: {passed, cases, error, points, max, sealed, notes}}."""
    import torch

    index_path = os.path.join(fixtures, "index.json")
    if not os.path.isfile(index_path):
        raise ValueError(f"--fixtures {fixtures}: no index.json (write fixtures with --fixtures DIR --seed N)")
    with open(index_path, encoding="utf-8") as f:
        index = json.load(f)
    names = [n for n in index["problems"] if only is None or n in only]
    needed = {fn.split(":")[0] for n in names for fn in BY_NAME[n].functions}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = submission_folder(path, tmp, needed)   # before anything runs: a refused file is one line
        missing = seal.missing()
        if missing and for_credit:
            raise ValueError(f"--for-credit: this machine cannot seal the grading processes: {missing}; grade "
                             f"where it can (Linux 5.13+ with Landlock and seccomp, util-linux's unshare, user "
                             f"namespaces)")
        for name in names:
            data = torch.load(os.path.join(fixtures, f"{name}.pt"), weights_only=False)
            r = grade_problem(folder, name, data, index["tokenizer"], verbose=verbose,
                              hidden=[os.path.abspath(path), fixtures], sealed=not missing)
            r["max"] = BY_NAME[name].points
            r["points"] = r["max"] if r["passed"] == r["cases"] and not r["error"] else 0
            results[name] = r
    return results


def grade_report(results: dict, verbose: bool = False) -> str:
    rows = [f"{'#':>2}  {'problem':<18} {'points':>9}  cases   note"]
    for name, r in results.items():
        n = EXERCISES.index(BY_NAME[name]) + 1
        rows.append(f"{n:>2}  {name:<18} {r['points']:>4} / {r['max']:<3} {r['passed']:>2}/{r['cases']:<3}  {r['error']}")
        if verbose:
            rows += [f"      {note}" for note in r["notes"][1:]]
    got, full = sum(r["points"] for r in results.values()), sum(r["max"] for r in results.values())
    rows.append(f"    {'total':<18} {got:>4} / {full:<3}")
    if all(r["sealed"] for r in results.values()):
        rows += [seal.identity_note()] if seal.identity_note() else []
    else:
        why = seal.missing() or "a grading process could not seal itself (its row says so)"
        rows.append(f"warning: not sealed ({why}): each problem's process could "
                    f"read your files, use the network and reach the others; not a grade for credit "
                    f"(--for-credit refuses to grade here)")
    return "\n".join(rows)

