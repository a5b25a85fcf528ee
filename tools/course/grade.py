"""Grading: the handed-in files read as regular files (a tarball in a limited child), this grading's own inputs
and the reference's outputs drawn here (`held_out`), a folder per problem holding no reference solution, one
sealed process per problem (`seal.py`, `worker.py`) whose dependencies a reference process of the grader's
answers (`wire.py`); the parent compares the answers and writes the report."""
import ast
import concurrent.futures
import contextlib
import hashlib
import io
import json
import os
import reprlib
import resource
import secrets
import shutil
import signal
import stat
import sys
import tarfile
import tempfile
import time
import tokenize

from . import seal
from .fixtures import matches
from .problems import BY_NAME, EXERCISES, MODULES, ROOT, SUBMITTED, reached_exercises
from .student_copy import stub_source


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


TAR_SECONDS = 20              # the longest a tarball's reading may take (CPU and wall clock)
TAR_MEMORY = 256 << 20        # the address space of the process that reads it (Python and tarfile: about 40 MB)


def tar_members(f, label: str, needed: set) -> dict:
    """{name: bytes} of the `needed` members of the tarball open as `f`, read by `read_tar` in a child process
    limited to TAR_SECONDS of CPU and wall clock, TAR_MEMORY of address space and HAND_IN_BYTES per file it writes:
    a header that makes `tarfile` loop (a pax record of millions of digits) or hold a gigabyte (a GNU long name)
    ends that child, and the grader refuses the tarball with one line."""
    with tempfile.TemporaryDirectory(prefix="tarball-") as out:
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from tools.course.grade import read_tar; "
                "sys.exit(read_tar(sys.argv[2], sys.argv[3:]))")

        def limited():
            resource.setrlimit(resource.RLIMIT_AS, (TAR_MEMORY, TAR_MEMORY))
            resource.setrlimit(resource.RLIMIT_CPU, (TAR_SECONDS, TAR_SECONDS + 1))
            resource.setrlimit(resource.RLIMIT_FSIZE, (HAND_IN_BYTES + 1, HAND_IN_BYTES + 1))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        proc = seal.bounded_run([sys.executable, "-I", "-c", code, ROOT, out, *sorted(needed)], TAR_SECONDS,
                                stdin=f.fileno(), preexec_fn=limited, env={"PATH": os.environ.get("PATH", "")})
        if proc is None or proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):   # wall clock or CPU time
            raise ValueError(f"--grade {label}: reading the tarball took over {TAR_SECONDS} s: hand in what "
                             f"submit.sh packs")
        if proc.returncode != 0:
            why = (proc.stdout.strip().splitlines() or [""])[-1][:200] if proc.returncode == 2 else ""
            raise ValueError(f"--grade {label}: " + (why or f"a tarball the grader cannot read (its reader "
                                                            f"{seal.ended(proc.returncode)}): hand in what "
                                                            f"submit.sh packs"))
        files = {}
        for name in sorted(needed):
            with open(os.path.join(out, name.replace("/", "%")), "rb") as g:
                files[name] = g.read(HAND_IN_BYTES + 1)
    return files


def read_tar(out: str, needed: list) -> int:
    """The child of `tar_members`: the tarball on stdin, each needed member written to `out` (its name with "/" as
    "%"); exit 0, or 2 with the reason on stdout. Each member one regular file of at most HAND_IN_BYTES (a link, a
    device, a folder or a second member under a needed name is refused), read through at most TAR_MEMBERS members
    and TAR_BYTES bytes."""
    needed, found = set(needed), set()
    try:
        tar = tarfile.open(fileobj=sys.stdin.buffer, mode="r|*")
    except (tarfile.TarError, OSError, EOFError):
        print("neither a folder nor a .tar.gz from submit.sh")
        return 2
    with tar:
        for k in range(TAR_MEMBERS + 1):
            try:
                m = tar.next()
            except (tarfile.TarError, OSError, EOFError) as err:
                print(f"a broken tarball ({type(err).__name__})")
                return 2
            if m is None:
                break
            if k == TAR_MEMBERS or tar.offset > TAR_BYTES:
                print(f"over {TAR_MEMBERS} members or {TAR_BYTES} bytes: hand in what submit.sh packs")
                return 2
            name = os.path.normpath(m.name).lstrip("/")
            if name not in needed:
                continue
            if not m.isfile() or name in found:
                print(f"{name} is refused (not one regular file in the tarball)")
                return 2
            if m.size > HAND_IN_BYTES:
                print(f"{name} is refused ({m.size} bytes, over {HAND_IN_BYTES})")
                return 2
            with open(os.path.join(out, name.replace("/", "%")), "wb") as f:
                f.write(tar.extractfile(m).read(HAND_IN_BYTES + 1))
            found.add(name)
    missing = sorted(needed - found)
    if missing:
        print(f"the submission lacks {', '.join(missing)}")
        return 2
    return 0


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
        python_source(data, f"--grade {path}: {name}")
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
    return tmp


def python_source(data: bytes, label: str) -> str:
    """`data` read as Python reads a module (a UTF-8 BOM, a PEP 263 coding line: tokenize.detect_encoding) and
    parsed; ValueError naming `label` and the line when Python would not import it."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        text = data.decode(encoding)
        if text.startswith("\ufeff"):
            text = text[1:]
    except (SyntaxError, LookupError, UnicodeDecodeError) as err:
        raise ValueError(f"{label} is not Python source text ({type(err).__name__}: {str(err)[:80]})") from None
    try:
        ast.parse(data)
    except SyntaxError as err:
        raise ValueError(f"{label}:{err.lineno}: the submitted file is not valid Python ({err.msg})") from None
    except (ValueError, RecursionError, MemoryError) as err:
        raise ValueError(f"{label}: the submitted file is not valid Python ({type(err).__name__})") from None
    return text


def hand_in_digest(folder: str, names) -> str:
    """SHA-256 over the handed-in files as the grader read them (name, length, bytes): what each grading's inputs
    are drawn from, with the teacher's seed and a fresh nonce (`draw_for`)."""
    h = hashlib.sha256()
    for name in sorted(names):
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        h.update(f"{name}\0{len(data)}\0".encode() + data)
    return h.hexdigest()


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


def function_spans(text: str) -> dict:
    """{name: (first line, last line)} (1-based, decorators included) of the top-level functions in `text`."""
    spans = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans[node.name] = (start, node.end_lineno)
    return spans


# what a problem's runner calls beyond the problem's own functions: problem 6's runner goes on from the pick to
# the repair (refine.rectify, which splices) and the advantages over the merged groups, as scope.main does
RUNNER_CALLS = {"scope_step": ("refine.py::rectify", "grpo.py::group_advantages")}


def runner_reaches(problem: str, root: str = ROOT) -> set:
    """The other exercises whose functions the code of `problem`'s functions and its runner call (statically,
    through the reference's files and harness/): the only reference solutions its grading process holds."""
    calls = [f.replace(":", "::") for f in BY_NAME[problem].functions] + list(RUNNER_CALLS.get(problem, ()))
    return reached_exercises(calls, root) - {problem}


def depends_on(problem: str) -> list:
    """The functions ("prm.first_error") the grader's reference process answers for `problem`'s graded process:
    those of the problems its functions and runner reach (`runner_reaches`)."""
    return sorted(f.split(".py:")[0] + "." + f.split(":")[1] for e in runner_reaches(problem)
                  for f in BY_NAME[e].functions)


def graded_modules(problem: str, depends: list) -> list:
    """The student's modules the worker imports before it puts the stand-ins in place: those of `problem`'s
    functions, of its dependencies and of what its runner calls (the rest it imports when first used)."""
    files = [f.split(":")[0] for f in BY_NAME[problem].functions] + [c.split("::")[0] for c in
                                                                    RUNNER_CALLS.get(problem, ())]
    return sorted({f[:-3] for f in files} | {d.split(".")[0] for d in depends})


def grading_folder(folder: str, problem: str, dest: str) -> None:
    """Fill `dest` with what the process that grades `problem` may see: the student's modules byte for byte as the
    grader read them (where the grader read none, the reference's with every exercise a stub), the
    reference's harness/ (the engine, no exercise) and the runners (this package's worker, seal, wire, problems
    and fixtures, as `_course`). No function of the reference's method files and no expected output is in it:
    the functions `problem` depends on are answered from outside (`depends_on`, `wire.Dependencies`)."""
    for n in MODULES:
        rel = n + ".py"
        src = os.path.join(folder, rel)
        if rel in SUBMITTED and os.path.isfile(src):   # grade() has checked that every file a problem needs is there
            shutil.copyfile(src, os.path.join(dest, rel))
        else:   # a module no graded problem needs: the reference's, every exercise in it a stub
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                text, _ = stub_source(f.read(), set(BY_NAME), rel)
            with open(os.path.join(dest, rel), "w", encoding="utf-8") as f:
                f.write(text)
    shutil.copytree(os.path.join(ROOT, "harness"), os.path.join(dest, "harness"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    here = os.path.dirname(os.path.abspath(__file__))
    os.mkdir(os.path.join(dest, "_course"))
    for f in RUNNER_FILES:
        shutil.copyfile(os.path.join(here, f), os.path.join(dest, "_course", f))


RUNNER_FILES = ("__init__.py", "worker.py", "seal.py", "wire.py", "problems.py", "fixtures.py")


# ---------------------------------------------------------------------------------------------------
# each grading's own inputs and the reference's answers, in the grader's process
# ---------------------------------------------------------------------------------------------------
def draw_for(seed: int, digest: str, nonce: int) -> int:
    """The number a grading's inputs are drawn from: the teacher's seed, the hand-in's digest and a fresh nonce
    (so no two gradings see the same inputs); the report records it, and `--draw` re-grades on it exactly."""
    return int(hashlib.sha256(f"{seed}:{digest}:{nonce}".encode()).hexdigest()[:15], 16)


def held_out(draw: int, names, spec: str, root: str = ROOT) -> tuple[dict, dict]:
    """({problem: {"cases", "outputs"}}, {problem: (own, used)}) for the grading drawn from `draw`: each problem's
    inputs made from `draw` (as `write_fixtures` makes them from the teacher's seed) with the teacher's tokenizer
    `spec`, the reference's outputs on them, and the fingerprints (`wire.fingerprint`) of the calls the reference
    made on them to the problem's own functions and to other problems' (`refused_for`). ValueError when the draw
    does not reject a constant answer (`grade` draws again)."""
    from .fixtures import drawn

    if "torch._dynamo" not in sys.modules:   # its import makes a cache folder in the temp folder (torch 2.x):
        with fresh_folder("torch-cache-") as scratch:   # here, one of the grader's, removed after
            was = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch
            try:
                import torch._dynamo  # noqa: F401
            finally:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR") if was is None else os.environ.update(
                    TORCHINDUCTOR_CACHE_DIR=was)
    data, prints = {}, {}
    watched = {}

    @contextlib.contextmanager
    def watch(ref, name, tok):   # the fingerprints of the calls the reference makes on this problem's cases
        own, used = watched[name] = set(), set()
        with _recorded(ref, name, own, used, tok):
            yield

    for name, cases, outputs in drawn(draw, names, spec, root, label="draw", watch=watch):
        data[name], prints[name] = {"cases": cases, "outputs": outputs}, watched[name]
    return data, prints


@contextlib.contextmanager
def _recorded(ref, problem: str, own: set, used: set, tok):
    """Within the block, each call of an exercise's function in the reference set `ref` adds its fingerprint to
    `own` (a function of `problem`) or `used` (another problem's, which `problem`'s code asks of its
    dependencies)."""
    from . import wire

    put = []
    for e in EXERCISES:
        for f in e.functions:
            module, fn = getattr(ref, f.split(".py:")[0]), f.split(":")[1]
            original, dotted = getattr(module, fn), f.split(".py:")[0] + "." + fn
            seen = own if e.name == problem else used

            def recording(*args, _original=original, _dotted=dotted, _seen=seen, **kwargs):
                try:
                    _seen.add(wire.fingerprint(_original, _dotted, args, kwargs, tok))
                except (TypeError, wire.NotPlain):
                    pass
                return _original(*args, **kwargs)
            put.append((module, fn, original))
            setattr(module, fn, recording)
    try:
        yield
    finally:
        for module, fn, original in reversed(put):
            setattr(module, fn, original)


def serve_main(job_path: str, ask: int, hear: int) -> int:
    """The grader's reference process for one graded process (`start_reference`): the reference's modules it needs,
    imported from the repository (its only folder on sys.path), the functions job.json names, answered until the
    graded process closes its pipe."""
    import importlib
    import inspect

    from .fixtures import _attached_surrogate, wrap_tokenizer
    from . import wire

    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    functions = {d: getattr(importlib.import_module(d.split(".")[0]), d.split(".")[1]) for d in job["depends"]}
    swaps = {"attached": (sys.modules["grpo"], "clipped_surrogate", _attached_surrogate)} if "grpo" in sys.modules \
        else {}
    takes = any("tokenizer" in inspect.signature(fn).parameters for fn in functions.values())
    tokenizer = wrap_tokenizer(job["tokenizer"]) if takes else None   # transformers only where a function needs it
    wire.serve(ask, hear, functions, tokenizer, set(job["refused"]), swaps)
    return 0


def start_reference(here: str, depends: list, tokenizer: str, refused: set, seconds: int):
    """The reference process that answers `depends` for one graded process, started in the grader's own folder
    `here` (not the graded one) under the graded process's limits: (process, ask_w, hear_r) for the graded end of
    its two pipes, the other ends held by the reference process only."""
    job = os.path.join(here, "reference.json")
    with open(job, "w", encoding="utf-8") as f:
        json.dump({"depends": depends, "tokenizer": tokenizer, "refused": sorted(refused)}, f)
    ask_r, ask_w = os.pipe()
    hear_r, hear_w = os.pipe()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tools.course.grade import serve_main; "
            "sys.exit(serve_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))")
    try:
        proc = seal.start([sys.executable, "-c", code, ROOT, job, str(ask_r), str(hear_w)], here,
                          preexec_fn=lambda: seal.limits(seconds), pass_fds=(ask_r, hear_w),
                          env={**seal.environment(here), "PYTHONPATH": ROOT})
    finally:
        os.close(ask_r)
        os.close(hear_w)
    return proc, ask_w, hear_r


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
                  hidden=(), sealed: bool = True, refused=frozenset()):
    """Run problem `name` of the submission in `folder` in its own process on the inputs `data["cases"]` and
    compare its answers with `data["outputs"]` here. The functions it depends on are answered by a reference
    process of the grader's (`start_reference`), which refuses the calls in `refused`. `sealed`: inside
    `seal.NAMESPACES`, as `seal.IDENTITY` (a root grader), under `seal.limits`, and the worker seals itself before
    it runs anything of the student's (the caller has checked that the machine can: `seal.missing`). The process
    gets `seconds` from its start (its alarm; start-up included) and seal.GRACE more before it is killed. Returns
    {passed, cases, error, sealed, notes}; `sealed` is what the grader set up, false only when unsealed or when
    the worker could not seal itself (then nothing ran)."""
    from . import wire

    notes, first, depends = [], "", depends_on(name)
    cases = wire.pack(data["cases"])
    for attempt in (1, 2):   # a process killed by a signal it did not earn is graded once more, in a new folder
        t0 = time.monotonic()
        with fresh_folder("grade-") as here, seal.own_disk(here), fresh_folder("reference-") as mine:
            grading_folder(folder, name, here)
            with open(os.path.join(here, "cases.safetensors"), "wb") as f:
                f.write(cases)
            ref, ends = None, ()
            if depends:
                ref, ask_w, hear_r = start_reference(mine, depends, tokenizer, refused, seconds)
                ends = (ask_w, hear_r)
            status_r, status_w = os.pipe()   # the worker's one byte: sealed or not, before any student code
            with open(os.path.join(here, "job.json"), "w", encoding="utf-8") as f:
                json.dump({"problem": name, "tokenizer": tokenizer, "seconds": seconds, "status_fd": status_w,
                           "depends": depends, "modules": graded_modules(name, depends),
                           "ask_fd": ends[0] if ends else None,
                           "hear_fd": ends[1] if ends else None, "hidden": [ROOT, folder] + list(hidden)}, f)
            try:
                proc = seal.run([sys.executable, "-m", "_course.worker", here], here, seconds, sealed,
                                pass_fds=(status_w, *ends))
            finally:
                for fd in ends:
                    os.close(fd)
                if ref is not None:
                    seal.stop(ref)
            status = read_status(status_r, status_w)
            answers, stopped = [], (f"it ran past its time limit ({seconds + seal.GRACE} s) and was killed" if proc is None
                                    else "it could not seal itself, so nothing was graded" if status == seal.NOT_SEALED
                                    else stop_reason(proc.returncode, proc.stderr))
            try:   # what the process wrote is untrusted: a regular file of at most wire.LIMIT bytes, plain data
                answers = read_answers(here)
            except FileNotFoundError:
                pass
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
        if "output" in answer and agrees(answer["output"], want):
            passed += 1
            continue
        why = answer.get("error") or difference(name, answer.get("output"), want)
        why = why if isinstance(why, str) else "an error that is not text"
        error = error or (f"case {k}: {why}" if verbose else f"case {k} differs from the reference"
                          if "error" not in answer else f"case {k}: {answer['error']}")
        notes.append(f"case {k}: {why}")
    return {"passed": passed, "cases": len(data["outputs"]), "error": shown(error), "sealed": sealed,
            "notes": [shown(n) for n in notes[:MAX_NOTES]]}


def read_answers(here: str) -> list:
    """The answers the graded process wrote in `here`: answers.safetensors, a regular file (not a link) of at most
    wire.LIMIT bytes, read as plain data."""
    from . import wire

    fd = os.open(os.path.join(here, "answers.safetensors"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size > wire.LIMIT:
            raise ValueError("not a regular file of at most wire.LIMIT bytes")
        answers = wire.unpack(f.read(wire.LIMIT + 1))["answers"]
    return list(answers) if isinstance(answers, list) else []


def agrees(got, want) -> bool:
    """`matches`, with an answer it cannot compare (an int past float's range, a non-finite value where the
    reference has a number, anything that raises) a wrong case, never the grader's error."""
    try:
        return bool(matches(got, want)) and finite_where(got, want)
    except Exception:
        return False


def finite_where(got, want) -> bool:
    """Whether `got` is non-finite only where `want` is (the reference's NaN and ±inf are its answer there)."""
    import math
    import torch

    if isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and want.is_floating_point():
        return bool((torch.isfinite(got) | ~torch.isfinite(want)).all())
    if isinstance(want, float) and isinstance(got, (int, float)):
        return math.isfinite(float(got)) or not math.isfinite(want)
    if isinstance(want, dict) and isinstance(got, dict):
        return all(finite_where(got[k], want[k]) for k in want if k in got)
    if isinstance(want, (list, tuple)) and isinstance(got, (list, tuple)):
        return all(finite_where(a, b) for a, b in zip(got, want))
    return True


def difference(name: str, got, want) -> str:
    """`describe_difference`, or what the answer is when that cannot say."""
    try:
        return describe_difference(name, got, want) or "differs from the reference"
    except Exception as err:
        return f"an answer the grader cannot compare with the reference ({type(err).__name__})"


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


DRAWS = 5   # the most draws a grading tries for inputs that reject a constant answer


def grade(path: str, fixtures: str, verbose: bool = False, only=None, for_credit: bool = False,
          draw: int | None = None) -> dict:
    """Grade a copy (folder) or a submission (.tar.gz) on inputs drawn for this grading (`draw_for`: the seed in
    `fixtures`/index.json, the hand-in's digest and a fresh nonce; or `draw`, a report's, to re-grade exactly),
    each problem in its own sealed process (`grade_problem`) over the regular files the grader read
    (`submission_folder`), PARALLEL at a time and never beside a problem it depends on (`stages`). On a machine
    that cannot seal (`seal.missing`) it grades unsealed, or, with `for_credit`, refuses (ValueError). Returns
    {problem: {passed, cases, error, points, max, sealed, notes, draw}}."""
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
        if not names:
            return results
        digest = hand_in_digest(folder, needed)
        for attempt in range(1 if draw is not None else DRAWS):
            this = draw if draw is not None else draw_for(index.get("seed", 0), digest, secrets.randbits(64))
            try:
                data, prints = held_out(this, names, index["tokenizer"])
                break
            except ValueError:
                if draw is not None or attempt == DRAWS - 1:
                    raise
        hidden = [os.path.abspath(path), fixtures]

        def one(name):
            refused = refused_for(name, prints)
            r = grade_problem(folder, name, data[name], index["tokenizer"], verbose=verbose, hidden=hidden,
                              sealed=not missing, refused=refused)
            r["max"] = BY_NAME[name].points
            r["points"] = r["max"] if r["passed"] == r["cases"] and not r["error"] else 0
            r["draw"] = this
            return name, r

        with seal.grading_limits():
            done = {}
            for stage in stages(names):
                with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL) as pool:
                    done.update(pool.map(one, stage))
        results = {n: done[n] for n in names}
    return results


def refused_for(problem: str, prints: dict) -> set:
    """The calls `problem`'s dependencies refuse: every other problem's held-out calls to its own functions, but
    those the reference itself makes on `problem`'s own inputs (a small call such as keep_ratio(2, 5) may be both)."""
    others = set().union(*[own for n, (own, _) in prints.items() if n != problem])
    return others - prints[problem][1]


PARALLEL = 2   # graded processes at once (each imports torch: about 0.5 GB and one core while it starts)


def stages(names: list) -> list:
    """`names` in stages run one after another: a problem's stage comes after every stage holding a problem it
    depends on (`runner_reaches`), so no graded process runs beside one whose functions it may call."""
    reaches = {n: [d for d in runner_reaches(n) if d in names] for n in names}
    level = {}

    def depth(n):
        if n not in level:
            level[n] = 1 + max((depth(d) for d in reaches[n]), default=-1)
        return level[n]
    for n in names:
        depth(n)
    return [[n for n in names if level[n] == k] for k in sorted(set(level.values()))]


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
    draws = {r.get("draw") for r in results.values()} - {None}
    if draws:
        rows.append(f"inputs drawn for this grading: --draw {draws.pop()} grades on them again")
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
            "draw": next((r["draw"] for r in results.values() if "draw" in r), None),
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
