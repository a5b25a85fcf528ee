"""Grading: the handed-in files read as regular files, a folder per problem, one sealed process per problem
(`seal.py`, `worker.py`); the parent compares the answers and writes the report."""
import ast
import contextlib
import io
import json
import os
import reprlib
import shutil
import signal
import stat
import sys
import tarfile
import tempfile
import time

from . import seal
from .fixtures import matches
from .problems import BY_NAME, EXERCISES, MODULES, ROOT, SUBMITTED, reached_exercises
from .student_copy import stub_source
from .worker import OWN_GRPO


HAND_IN_BYTES = 4 << 20       # the largest file the grader reads from a hand-in (a method file is under 40 KB)
TAR_MEMBERS = 10_000          # the most members it reads through in a tarball
TAR_BYTES = 64 << 20          # and the most bytes it reads through in one, uncompressed
SYSTEM_TREES = ("/proc", "/sys", "/dev")   # a hand-in is never read from these


def open_hand_in(path: str) -> int:
    """A descriptor of the hand-in `path` (a folder or a tarball), resolved once: every component from / opened
    with O_NOFOLLOW, so the path is refused if it or any folder on the way is a symbolic link (the folder itself
    a link to /proc/self/cwd would be the grader's own folder), and refused under /proc, /sys or /dev. ValueError
    naming the culprit otherwise."""
    absolute = os.path.abspath(path)
    tree = next((t for t in SYSTEM_TREES if absolute == t or absolute.startswith(t + "/")), None)
    if tree:
        raise ValueError(f"--grade {path}: a hand-in is never read from {tree}: name the folder or tarball itself")
    parts = [p for p in absolute.split("/") if p]
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            on_the_way = "/" + "/".join(parts[:i + 1])
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                              | (0 if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError as err:
                why = "a symbolic link" if os.path.islink(on_the_way) else err.strerror
                raise ValueError(f"--grade {path}: {on_the_way} is refused ({why}): name the folder or tarball "
                                 f"itself, by a path without links") from None
            os.close(fd)
            fd = nxt
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise ValueError(f"--grade {path}: neither a folder nor a .tar.gz from submit.sh")
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_regular(folder_fd: int, rel: str, label: str) -> bytes:
    """The bytes of the regular file `rel` inside the folder open as `folder_fd`, opened without following a link
    anywhere on the way (each folder with O_NOFOLLOW | O_DIRECTORY, the file with O_NOFOLLOW, then fstat: a
    regular file of at most HAND_IN_BYTES only). ValueError naming the file (`label` is the hand-in) otherwise."""
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"--grade {label}: {rel} is not a plain path inside the submission")
    fd = os.dup(folder_fd)
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                              | (0 if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError as err:
                try:
                    kind = "a symbolic link" if stat.S_ISLNK(os.lstat(part, dir_fd=fd).st_mode) else err.strerror
                except OSError:
                    kind = err.strerror
                raise ValueError(f"--grade {label}: {'/'.join(parts[:i + 1])} is refused ({kind}): hand in "
                                 f"the file itself") from None
            os.close(fd)
            fd = nxt
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--grade {label}: {rel} is refused (not a regular file): hand in the file itself")
        if st.st_size > HAND_IN_BYTES:
            raise ValueError(f"--grade {label}: {rel} is refused ({st.st_size} bytes, over {HAND_IN_BYTES})")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(HAND_IN_BYTES + 1)
        if len(data) > HAND_IN_BYTES:
            raise ValueError(f"--grade {label}: {rel} is refused (over {HAND_IN_BYTES} bytes)")
        return data
    finally:
        os.close(fd)


def tar_members(f, label: str, needed: set) -> dict:
    """{name: bytes} of the `needed` members of the tarball open as `f`: each one regular file of at most
    HAND_IN_BYTES (a link, a device, a folder or a second member under a needed name is refused), read through
    at most TAR_MEMBERS members and TAR_BYTES bytes."""
    try:
        tar = tarfile.open(fileobj=f, mode="r:*")
    except (tarfile.TarError, OSError, EOFError):
        raise ValueError(f"--grade {label}: neither a folder nor a .tar.gz from submit.sh") from None
    files = {}
    with tar:
        for k in range(TAR_MEMBERS + 1):
            try:
                m = tar.next()
            except (tarfile.TarError, OSError, EOFError) as err:
                raise ValueError(f"--grade {label}: a broken tarball ({type(err).__name__})") from None
            if m is None:
                break
            if k == TAR_MEMBERS or tar.offset > TAR_BYTES:
                raise ValueError(f"--grade {label}: over {TAR_MEMBERS} members or {TAR_BYTES} bytes: hand in what "
                                 f"submit.sh packs")
            name = os.path.normpath(m.name).lstrip("/")
            if name not in needed:
                continue
            if not m.isfile() or name in files:
                raise ValueError(f"--grade {label}: {name} is refused (not one regular file in the tarball)")
            if m.size > HAND_IN_BYTES:
                raise ValueError(f"--grade {label}: {name} is refused ({m.size} bytes, over {HAND_IN_BYTES})")
            files[name] = tar.extractfile(m).read(HAND_IN_BYTES + 1)
    missing = sorted(needed - set(files))
    if missing:
        raise ValueError(f"--grade {label}: the submission lacks {', '.join(missing)}")
    return files


def submission_folder(path: str, tmp: str, needed: set) -> str:
    """`tmp` (a fresh folder of the grader's), holding copies of the submission's `needed` files as the grader
    read them, and nothing else: the hand-in resolved once (`open_hand_in`); from a folder, regular files only,
    never through a link (`read_regular`); from a submit.sh tarball, its regular members only (`tar_members`);
    each UTF-8 text of at most HAND_IN_BYTES. The modules a submission lacks are the reference's
    (`grading_folder`)."""
    fd = open_hand_in(path)
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            missing = []
            for name in sorted(needed):
                try:
                    os.lstat(name, dir_fd=fd)
                except FileNotFoundError:
                    missing.append(name)
            if missing:
                raise ValueError(f"--grade {path}: missing {', '.join(missing)}")
            files = {name: read_regular(fd, name, path) for name in sorted(needed)}
        else:
            with os.fdopen(os.dup(fd), "rb") as f:
                files = tar_members(f, path, needed)
    finally:
        os.close(fd)
    for name, data in files.items():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"--grade {path}: {name} is not UTF-8 text (byte {err.start})") from None
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
    bounded = reprlib.Repr()   # what a graded process returned: bounded in depth and length, whatever it is
    bounded.maxlevel, bounded.maxstring, bounded.maxother = 4, 60, 60
    try:
        text = bounded.repr(x)
    except Exception:
        text = f"a {type(x).__name__}"
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
        if got.dtype != want.dtype:
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


def source_lines(text: str) -> list:
    """`text` split into lines as Python's tokenizer splits it (at \\n, \\r\\n and \\r only, ends kept), so line k
    here is line k of `ast`'s positions; str.splitlines also splits at form feeds, U+2028 and other characters
    that are not line ends in Python source."""
    return io.StringIO(text, newline="").readlines()


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
    except (ValueError, RecursionError, MemoryError) as err:
        raise ValueError(f"{path}: the submitted file is not valid Python ({type(err).__name__})") from None
    theirs = function_spans(reference)
    ref_lines, lines = source_lines(reference), source_lines(student)
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



@contextlib.contextmanager
def fresh_folder(prefix: str):
    """A new folder of the grader's (mkdtemp), removed with everything in it when the block ends, however it ends
    (`remove_tree`)."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        remove_tree(path)


def remove_tree(path: str) -> None:
    """Remove the folder `path` and everything below it, as deep and as many files as a graded process made:
    no recursion and never through a link. Each folder is emptied in turn, its subfolders moved up to `path`
    itself first (renameat), so depth costs no stack, no descriptors and no path length."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    top = os.open(path, flags)
    try:
        pending, moved = [None], 0   # folders directly in `path` still to empty (None: `path` itself)
        while pending:
            name = pending.pop()
            if name is not None and os.geteuid() != 0:   # a folder made with mode 0: the teacher's own uid's
                os.chmod(name, 0o700, dir_fd=top)
            fd = top if name is None else os.open(name, flags, dir_fd=top)
            try:
                if name is not None and os.geteuid() != 0:
                    os.chmod(fd, 0o700)
                with os.scandir(fd) as it:
                    entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                for entry, is_dir in entries:
                    if not is_dir:
                        os.unlink(entry, dir_fd=fd)
                    elif name is None:
                        pending.append(entry)
                    else:
                        while True:
                            moved += 1
                            up = f".removing-{moved}"
                            try:
                                os.lstat(up, dir_fd=top)
                            except FileNotFoundError:
                                break
                        os.rename(entry, up, src_dir_fd=fd, dst_dir_fd=top)
                        pending.append(up)
            finally:
                if fd != top:
                    os.close(fd)
            if name is not None:
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


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
        with fresh_folder("grade-") as here:
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
        why = why if isinstance(why, str) else "an error that is not text"
        error = error or (f"case {k}: {why}" if verbose else f"case {k} differs from the reference"
                          if "error" not in answer else f"case {k}: {answer['error']}")
        notes.append(f"case {k}: {why}")
    return {"passed": passed, "cases": len(data["outputs"]), "error": shown(error), "sealed": sealed,
            "notes": [shown(n) for n in notes[:MAX_NOTES]]}


SHOWN = 200       # the longest text of the graded process's (a name, a message) the report shows, characters
MAX_NOTES = 50    # the most notes a problem keeps


def shown(text: str, limit: int = SHOWN) -> str:
    """`text` as the report shows what a graded process wrote: every character that is not printable (line ends,
    carriage returns, escape sequences, U+2028, bidirectional controls) written as its escape, then cut to
    `limit` characters, so it stays on its own row and reads as what it is."""
    out = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text[:limit * 2])
    return out if len(out) <= limit else out[:limit - 1] + "…"


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
    with fresh_folder("hand-in-") as tmp:
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


def grade_report(results: dict, verbose: bool = False, json_path: str = "") -> str:
    """The text report: the total first and last, a row per problem between them (whatever a graded process wrote
    is `shown` escaped inside its row, so no line of the report is the student's), the seal's notes. A script
    reads the JSON (`grade_json`) instead."""
    got, full = sum(r["points"] for r in results.values()), sum(r["max"] for r in results.values())
    rows = [f"total {got} / {full}" + (f" (as JSON: {json_path})" if json_path else ""),
            f"{'#':>2}  {'problem':<18} {'points':>9}  cases   note"]
    for name, r in results.items():
        n = EXERCISES.index(BY_NAME[name]) + 1
        rows.append(f"{n:>2}  {name:<18} {r['points']:>4} / {r['max']:<3} {r['passed']:>2}/{r['cases']:<3}  {r['error']}")
        if verbose:
            rows += [f"      {note}" for note in r["notes"][1:]]
    rows.append(f"    {'total':<18} {got:>4} / {full:<3}")
    if all(r["sealed"] for r in results.values()):
        rows += [seal.identity_note()] if seal.identity_note() else []
    else:
        why = seal.missing() or "a grading process could not seal itself (its row says so)"
        rows.append(f"warning: not sealed ({why}): each problem's process could "
                    f"read your files, use the network and reach the others; not a grade for credit "
                    f"(--for-credit refuses to grade here)")
    return "\n".join(rows)


def grade_json(results: dict, hand_in: str, fixtures: str) -> dict:
    """The report as data, for a script: the total, whether every process was sealed, and per problem its
    points, cases passed, first error and notes (the same `shown` text as the report)."""
    return {"hand_in": os.path.abspath(hand_in), "fixtures": os.path.abspath(fixtures),
            "total": sum(r["points"] for r in results.values()), "max": sum(r["max"] for r in results.values()),
            "sealed": all(r["sealed"] for r in results.values()),
            "problems": {name: {k: r[k] for k in ("points", "max", "passed", "cases", "error", "sealed", "notes")}
                         for name, r in results.items()}}


def write_json(report: dict, path: str) -> None:
    """Write `report` to `path` whole or not at all (a temporary file beside it, then a rename)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".grade-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, ensure_ascii=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
