"""The graded process of one problem: `python -m _course.worker FOLDER` inside the folder `grade.grading_folder`
fills (this package is copied there as `_course`). It seals itself (`seal.apply`) before it imports anything,
then runs the problem's runner on each held-out input and writes the answers; it never sees the expected
outputs. Whether it sealed itself goes to the grader as one byte on the status pipe (job.json's "status_fd"),
written and closed before anything of the student's runs, so no exit status or file of theirs can forge it;
when it could not seal itself it exits with seal.FAILED and nothing of the student's has run.
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
OWN_GRPO = "_own_grpo"   # problem 12's grading: the student's grpo.py as written, for its clipped_surrogate


class _TimeLimit(BaseException):
    """The problem ran past its time limit. A BaseException, so the per-case `except Exception` cannot swallow
    it: the alarm fires once, and the remaining cases must stop with it."""


def _alarm(signum, frame):
    raise _TimeLimit("the problem ran past its time limit")


def _first_line(err: BaseException) -> str:
    first = (str(err).splitlines() or [""])[0]
    return f"{type(err).__name__[:80]}: {first[:80]}" + ("…" if len(first) > 80 else "")   # the grader escapes it


def worker(here: str) -> int:
    """Seal, read job.json and cases.pt in `here`, write answers.pt there."""
    with open(os.path.join(here, "job.json"), encoding="utf-8") as f:
        job = json.load(f)
    try:
        seal.apply(here, job["hidden"])
    except OSError as err:
        print(f"seal failed: {err}", file=sys.stderr)
        report_seal(job, seal.NOT_SEALED)
        return seal.FAILED
    report_seal(job, seal.SEALED)   # before anything of the student's is imported
    import torch

    from . import fixtures

    cases = torch.load(os.path.join(here, "cases.pt"), weights_only=False)
    name = job["problem"]
    sys.path.insert(0, here)
    for n in MODULES:
        sys.modules.pop(n, None)
    ctx = {"tokenizer": fixtures.wrap_tokenizer(job["tokenizer"])}
    if os.path.isfile(os.path.join(here, OWN_GRPO + ".py")):   # problem 12: the student's own grpo.py as well
        ctx["own_grpo"] = importlib.import_module(OWN_GRPO)
    answers = []
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(max(1, job["seconds"] - int(time.monotonic() - STARTED)))   # its start-up counts
    try:
        mods = types.SimpleNamespace(**{n: importlib.import_module(n) for n in MODULES})
        if "own_grpo" not in ctx and name == "update":
            ctx["own_grpo"] = mods.grpo
        run = getattr(fixtures, f"run_{name}")
        for case in cases:
            try:
                answers.append({"output": run(mods, ctx, case)})
            except Exception as err:   # a student's code may raise anything: this case scores nothing
                answers.append({"error": _first_line(err)})
    except BaseException as err:   # an import error or the time limit: the remaining cases are missing
        answers.append({"error": _first_line(err)})
    finally:
        signal.alarm(0)
    torch.save({"answers": answers}, os.path.join(here, "answers.pt"))
    return 0


def report_seal(job: dict, status: bytes) -> None:
    """Write the seal's status to the grader's pipe and close it: the student's code, which runs after, cannot."""
    fd = job.get("status_fd")
    if fd is not None:
        os.write(fd, status)
        os.close(fd)


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1]))
