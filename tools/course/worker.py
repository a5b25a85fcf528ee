"""The graded process of one problem: `python -m _course.worker FOLDER` inside the folder `grade.grading_folder`
fills (the student's modules as handed in, the inputs, this package's runners as `_course`). It seals itself
(`seal.apply`) before it imports anything, then runs the problem's runner on each input and writes the answers;
it never holds an expected output or a line of the reference's code. The functions of the problems its problem
depends on are stand-ins (`wire.Dependencies`) that the grader's reference process answers over two pipes
(job.json's "ask_fd", "hear_fd"), put in place of the student's own in every module that holds them, so the
student's modules keep their own imports and helpers. Whether it sealed itself goes to the grader as one byte on
the status pipe (job.json's "status_fd"), written and closed before anything of the student's runs, so no exit
status or file of theirs can forge it; when it could not seal itself it exits with seal.FAILED and nothing of the
student's has run.
"""
import importlib
import json
import os
import signal
import sys
import time
import types

from . import seal
from .problems import MODULES

STARTED = time.monotonic()


class _TimeLimit(BaseException):
    """The problem ran past its time limit. A BaseException, so the per-case `except Exception` cannot swallow
    it: the alarm fires once, and the remaining cases must stop with it."""


def _alarm(signum, frame):
    raise _TimeLimit("the problem ran past its time limit")


def _first_line(err: BaseException) -> str:
    first = (str(err).splitlines() or [""])[0]
    return f"{type(err).__name__[:80]}: {first[:80]}" + ("…" if len(first) > 80 else "")   # the grader escapes it


def worker(here: str) -> int:
    """Seal, read job.json and cases.safetensors in `here`, write answers.safetensors there."""
    with open(os.path.join(here, "job.json"), encoding="utf-8") as f:
        job = json.load(f)
    try:
        seal.apply(here, job["hidden"])
    except OSError as err:
        print(f"seal failed: {err}", file=sys.stderr)
        report_seal(job, seal.NOT_SEALED)
        return seal.FAILED
    report_seal(job, seal.SEALED)   # before anything of the student's is imported
    from . import fixtures, wire

    with open(os.path.join(here, "cases.safetensors"), "rb") as f:
        cases = wire.unpack(f.read())
    name = job["problem"]
    sys.path.insert(0, here)
    for n in MODULES:
        sys.modules.pop(n, None)
    ctx = _Context(job["tokenizer"], fixtures)
    answers = []
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, job["seconds"] - int(time.monotonic() - STARTED)))   # its start-up counts
    try:
        mods = _Modules()
        for n in job["modules"]:
            getattr(mods, n)
        if name == "update":
            ctx["own_grpo"] = types.SimpleNamespace(clipped_surrogate=getattr(mods.grpo, "clipped_surrogate", None))
        if job["depends"]:
            stand_ins(here, mods, job["depends"], wire.Dependencies(job["ask_fd"], job["hear_fd"], ctx), fixtures)
        run = getattr(fixtures, f"run_{name}")
        for case in cases:
            try:
                out = run(mods, ctx, case)
                wire.encode(out, [])   # plain data, or this case's error
                answers.append({"output": out})
            except Exception as err:   # a student's code may raise anything: this case scores nothing
                answers.append({"error": _first_line(err)})
    except BaseException as err:   # an import error or the time limit: the remaining cases are missing
        answers.append({"error": _first_line(err)})
    finally:
        signal.alarm(0)
    blob = wire.pack({"answers": answers})
    with open(os.path.join(here, "answers.safetensors"), "wb") as f:
        f.write(blob)
    return 0


class _Modules:
    """The student's modules, each imported when first used (a problem that never reaches scope.py does not
    import it, nor transformers through it)."""

    def __getattr__(self, n):
        if n not in MODULES:
            raise AttributeError(n)
        setattr(self, n, importlib.import_module(n))
        return getattr(self, n)


class _Context(dict):
    """The runners' context: the grading's tokenizer (built from `spec` when a runner first asks for it)."""

    def __init__(self, spec: str, fixtures):
        super().__init__()
        self.spec, self.fixtures = spec, fixtures

    def __missing__(self, key):
        if key != "tokenizer":
            raise KeyError(key)
        self[key] = self.fixtures.wrap_tokenizer(self.spec)
        return self[key]


def stand_ins(here: str, mods, depends: list, deps, fixtures) -> None:
    """Put a stand-in (`deps.function`) for each of `depends` ("grpo.policy_loss") in place of the student's
    function of that name, in its module and wherever a module from `here` holds the same function object
    (`from prm import split_steps`). policy_loss's stand-in tells the reference which clipped_surrogate the
    runner put in place: the grading's `_attached_surrogate`, or one that lets a gradient reach π_old."""
    folder = os.path.realpath(here) + os.sep
    ours = [m for m in list(sys.modules.values())
            if os.path.realpath(getattr(m, "__file__", None) or "/").startswith(folder)]
    put = {}
    for dotted in depends:
        module, fn = dotted.split(".")
        mine = getattr(getattr(mods, module), fn, None)
        swaps = (lambda: surrogate_swaps(mods, put, fixtures)) if dotted == "grpo.policy_loss" else None
        put[dotted] = deps.function(dotted, swaps)
        setattr(getattr(mods, module), fn, put[dotted])
        for m in ours:
            for attr, value in list(vars(m).items()):
                if mine is not None and value is mine:
                    setattr(m, attr, put[dotted])


def surrogate_swaps(mods, put: dict, fixtures) -> list:
    current = mods.grpo.clipped_surrogate
    if current is put.get("grpo.clipped_surrogate"):
        return []
    if current is fixtures._attached_surrogate:
        return ["attached"]
    import torch

    try:   # the student's own surrogate (problem 12's first no-old_logp case): does π_old get a gradient?
        logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
        old = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
        loss = current(logp, old, torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2), 0.2)[0]
        loss.sum().backward()
        return ["attached"] if old.grad is not None and bool(old.grad.any()) else []
    except Exception:
        return []


def report_seal(job: dict, status: bytes) -> None:
    """Write the seal's status to the grader's pipe and close it: the student's code, which runs after, cannot."""
    fd = job.get("status_fd")
    if fd is not None:
        os.write(fd, status)
        os.close(fd)


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))
