"""runs.py — run folders that never lose work: naming, no clobbering, a lock, a checkpoint swap without a
gap, recovery on resume, and JSONL logs that survive a kill.

Not part of the paper: this is the bookkeeping a real run (hours on a GPU) needs so that an ordinary
mistake or a kill -9 costs at most the steps since the last checkpoint. The rules, each tested in
tests/test_runs.py:

 1. A new run never writes into a folder that holds another run (a config.json, metrics.jsonl,
    traces.jsonl or checkpoint): it stops with one line naming the folder and the three ways out
    (`--resume`, another `--run-name`, `--overwrite`). Exit code 2, before any model loads.
 2. A lock file `runs/<name>/lock` ("pid host") makes a second process on the same folder stop at once.
    A lock left by a process that no longer runs on this host is stale and taken over (said in one line).
 3. Checkpoint swap: write `checkpoint.tmp/` (state.pt last, itself written to a .part file then renamed),
    rename `checkpoint/` to `checkpoint.old/`, rename `checkpoint.tmp/` to `checkpoint/`, delete the old one.
    At every instant at least one complete checkpoint exists under one of the three names.
 4. Resume takes the newest complete checkpoint among the three names (complete = state.pt present) and
    makes it `checkpoint/`; nothing is deleted before that choice is made. A folder without any
    checkpoint is resumed (from step 1, its logs replaced) only with `--overwrite`.
 5. Logs: a torn last line of metrics.jsonl / traces.jsonl (a kill mid-write) is dropped with a warning;
    lines logged after the checkpoint's step are dropped on resume; a broken line elsewhere stops the
    resume with one line naming the file and line.
 6. The record: `config.json` holds the flags the run was started with, and under "environment" what it ran
    with (`environment`: package versions, CPU, threads, commit); a resume never rewrites it.
    A flag typed on `--resume` that differs from the run's settings is appended to `changes.jsonl`
    ({"step": first step trained with it, "changes": {flag: [old, new]}}); the run's settings at any point
    are config.json with those records applied in order (`run_settings`).
"""
import contextlib
import contextvars
import json
import os
import random
import shlex
import shutil
import socket
import sys
import tempfile

import numpy as np

CONFIG_RECORDS = ("environment",)   # config.json keys that record how the run ran; not flags, never compared
RUN_FILES = ("config.json", "changes.jsonl", "metrics.jsonl", "traces.jsonl", "checkpoint", "checkpoint.tmp",
             "checkpoint.old", "rollouts.jsonl", "model", "model.tmp", "curves.png", "summary.txt")


class Refused(ValueError):
    """A refusal raised to a Python caller instead of a one-line exit (inside `refusals_raised`): `str()` is the
    message as that caller spells its settings (scope.main's dict keys: run_name=...), `flags` the command line's."""

    def __init__(self, message: str, spelled: str | None = None):
        super().__init__(message if spelled is None else spelled)
        self.flags = message


class Done(SystemExit):
    """The end of a run that did not train (a dry run, a finished run): exit 0 on the command line; a Python
    caller (config.library_call) gets `result`, a dict."""

    def __init__(self, result: dict):
        super().__init__(0)
        self.result = result


_RAISE = contextvars.ContextVar("refusals_raised", default=None)   # None: the command line's one-line exit


def stop(message: str, code: int = 2):
    """One line on stderr and exit (code 2: the command line asked for something this run refuses); inside
    `refusals_raised` a `Refused` exception instead."""
    spell = _RAISE.get()
    if spell is not None:
        raise Refused(message, spell(message))
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)


@contextlib.contextmanager
def refusals_raised(spell=str):
    """Inside the block `stop` raises `Refused(message)`, whose str() is `spell(message)` (scope.main called from
    Python: the dict's keys; eval.py: the message as it is), rather than printing and exiting."""
    token = _RAISE.set(spell)
    try:
        yield
    finally:
        _RAISE.reset(token)


# ---------------------------------------------------------------------------------------------------------- folder
def holds_run(run_dir: str) -> bool:
    """True when run_dir holds (part of) a run: its config, logs or a checkpoint."""
    return any(os.path.exists(os.path.join(run_dir, name)) for name in RUN_FILES)


RUN_MODELS = ("checkpoint", "checkpoint.tmp", "checkpoint.old", "model")   # the model folders a run folder holds


def run_config(path: str) -> dict | None:
    """The config.json of a run folder (a run's flags); None where `path` has none, or a model's (which names its
    "model_type")."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and "model_type" not in config else None


def run_folder(path: str) -> bool:
    """True for a scope.py run folder (runs/NAME), known by what it holds: a checkpoint, model/, its logs, its lock,
    or a run's config.json (which records the "environment"); a folder whose config.json is a model's is a model."""
    if not os.path.isdir(path) or (os.path.isfile(os.path.join(path, "config.json")) and run_config(path) is None):
        return False
    return "environment" in (run_config(path) or {}) or any(
        os.path.exists(os.path.join(path, name)) for name in (*RUN_MODELS, "metrics.jsonl", "traces.jsonl", "lock"))


def run_of(path: str) -> str | None:
    """The run folder whose checkpoint/ (or model/) `path` is: runs/NAME for runs/NAME/checkpoint, else None."""
    folder = os.path.normpath(path)
    parent = os.path.dirname(folder) or "."
    return parent if os.path.basename(folder) in RUN_MODELS and run_config(parent) is not None else None


def clear_run(run_dir: str) -> None:
    """Remove a previous run's files (only called with --overwrite, while holding the lock)."""
    for name in RUN_FILES:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def unwritable(run_dir: str) -> str | None:
    """What stops `run_dir` from being created or written: its nearest existing ancestor, when that is a file
    or a folder this process may not write; else None."""
    folder = os.path.abspath(run_dir)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)):
        return folder
    try:   # root passes os.access everywhere, also on /sys and /proc: a folder made and removed settles it
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=folder))
    except OSError:
        return folder
    return None


@contextlib.contextmanager
def removed_on_failure(run_dir: str, new: bool):
    """A new run's folder is removed again if what runs inside fails (a model that does not load, Ctrl-C while
    loading): nothing was trained in it, and a folder left behind would refuse the corrected command. Its server
    logs (*.log, which the error names) stay: a folder holding only them is no run (holds_run) and counts as new."""
    try:
        yield
    except BaseException:
        if new and os.path.isdir(run_dir):
            for name in os.listdir(run_dir):
                path = os.path.join(run_dir, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                elif not name.endswith(".log"):
                    with contextlib.suppress(OSError):
                        os.remove(path)
            with contextlib.suppress(OSError):   # not empty: the logs stay in it
                os.rmdir(run_dir)
        raise


def only_logs(run_dir: str) -> bool:
    """True when run_dir does not exist or holds nothing but the *.log files of a start that failed."""
    return not os.path.isdir(run_dir) or all(name.endswith(".log") and os.path.isfile(os.path.join(run_dir, name))
                                             for name in os.listdir(run_dir))


# ---------------------------------------------------------------------------------------------------------- lock
def _lock_owner(path: str) -> tuple[int, str] | None:
    """(pid, host) written in a lock file; None when it cannot be read."""
    try:
        with open(path) as f:
            pid, host = f.read().split()
        return int(pid), host
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists, owned by someone else
        return True
    return True


def lock_holder(run_dir: str) -> str | None:
    """A description of the live process holding run_dir's lock, or None (no lock, or a stale one)."""
    owner = _lock_owner(os.path.join(run_dir, "lock"))
    if owner is None:
        return None
    pid, host = owner
    if host == socket.gethostname() and not pid_alive(pid):
        return None
    return f"pid {pid} on {host}"


def acquire_lock(run_dir: str) -> str:
    """Create run_dir/lock holding "pid host" (atomically); stop if a live process holds it. Returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "lock")
    me = f"{os.getpid()} {socket.gethostname()}"
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            holder = lock_holder(run_dir)
            if holder is not None:
                stop(f"{run_dir} is in use by another run ({holder}); wait for it, or delete {path} "
                     f"if that process is gone")
            print(f"note: taking over the stale lock of {run_dir} (its process is gone)", file=sys.stderr)
            stale = f"{path}.stale.{os.getpid()}"
            try:
                os.replace(path, stale)   # only one taker wins the rename; the others retry the O_EXCL create
                os.remove(stale)
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me)
        return path
    stop(f"could not take the lock of {run_dir}: another process keeps taking it")


def release_lock(path: str) -> None:
    """Remove the lock if it is still ours."""
    if _lock_owner(path) == (os.getpid(), socket.gethostname()):
        os.remove(path)


# ---------------------------------------------------------------------------------------------------------- checkpoint
def checkpoint_step(path: str) -> int | None:
    """The step of a complete checkpoint folder (state.pt is written last), else None."""
    import torch   # here, not at the top: eval.py refuses bad input before torch loads
    state = os.path.join(path, "state.pt")
    if not os.path.isfile(state):
        return None
    try:
        return int(torch.load(state, weights_only=False)["step"])
    except Exception:   # a torn state.pt (older layouts wrote it in place): not a complete checkpoint
        return None


def find_checkpoint(run_dir: str) -> tuple[str, int] | None:
    """(path, step) of the newest complete checkpoint among checkpoint/, checkpoint.tmp/, checkpoint.old/.
    Reads only; on equal steps the canonical name wins."""
    found = []
    for rank, name in enumerate(("checkpoint", "checkpoint.tmp", "checkpoint.old")):
        step = checkpoint_step(os.path.join(run_dir, name))
        if step is not None:
            found.append((step, -rank, os.path.join(run_dir, name)))
    if not found:
        return None
    step, _, path = max(found)
    return path, step


def recover_checkpoint(run_dir: str) -> tuple[str, int] | None:
    """Make the newest complete checkpoint `checkpoint/` (a kill mid-swap leaves it as .tmp or .old) and
    remove the leftovers; (path, step) or None. The chosen one exists complete at every instant."""
    found = find_checkpoint(run_dir)
    if found is None:
        return None
    best, step = found
    final = os.path.join(run_dir, "checkpoint")
    if best != final:
        print(f"note: recovered the checkpoint of step {step} from {best} (a kill interrupted a save)",
              file=sys.stderr)
        shutil.rmtree(final, ignore_errors=True)   # incomplete or older than `best`
        os.replace(best, final)
    for name in ("checkpoint.tmp", "checkpoint.old"):
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    return final, step


def save_checkpoint(run_dir: str, step: int, model, tokenizer, optimizer, cuda_rng: list | None = None,
                    describe=None) -> None:
    """runs/<name>/checkpoint: model + tokenizer (save_pretrained), optimizer, RNG states, step; swapped in
    without a moment in which no complete checkpoint exists (rule 3 above). cuda_rng: each torchrun rank's CUDA
    RNG state of its own GPU, in rank order (None: this process's, when CUDA is there). describe(folder), if given,
    writes what says what the folder is (export.describe_checkpoint: its README.md) before the swap."""
    import torch   # here, not at the top: eval.py refuses bad input before torch loads
    from transformers.utils import logging as hf_logging

    final, tmp, old = (os.path.join(run_dir, n) for n in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)   # a half-written one from a killed save (resume recovered any whole one)
    hf_logging.disable_progress_bar()   # keep the per-step lines readable
    model.save_pretrained(tmp)
    hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    if describe is not None:
        describe(tmp)
    torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    if cuda_rng is None and torch.cuda.is_available():
        cuda_rng = [torch.cuda.get_rng_state()]   # the current device's: one process, one GPU
    torch.save({"step": step, "python": random.getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state(), "cuda_by_rank": cuda_rng},
               os.path.join(tmp, "state.pt.part"))
    os.replace(os.path.join(tmp, "state.pt.part"), os.path.join(tmp, "state.pt"))   # now tmp is complete
    swap_in(run_dir)


def swap_in(run_dir: str) -> None:
    """checkpoint → checkpoint.old, checkpoint.tmp → checkpoint, delete checkpoint.old."""
    final, tmp, old = (os.path.join(run_dir, n) for n in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def restore_rng(state: dict, rank: int = 0) -> None:
    """The RNG states of a checkpoint's state.pt; the CUDA one is this rank's own (saved by that rank's GPU), so
    no rank takes over rank 0's stream. A rank the checkpoint has no state for (a larger world) keeps its seed.
    A state.pt holding `cuda` (every device's state, as one process saw them) restores them all."""
    import torch   # here, not at the top: eval.py refuses bad input before torch loads
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if not torch.cuda.is_available():
        return
    if state.get("cuda_by_rank") is not None:
        if rank < len(state["cuda_by_rank"]):
            torch.cuda.set_rng_state(state["cuda_by_rank"][rank])
    elif state.get("cuda") is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------------------- logs
def read_log(path: str) -> list[dict]:
    """The records of a JSONL log; a torn last line is dropped with a warning, a broken line elsewhere stops."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if lineno == len(lines):
                print(f"warning: {path}: dropped a torn last line {lineno} ({len(line)} characters; "
                      f"a kill mid-write leaves one)", file=sys.stderr)
                break
            stop(f"{path}: line {lineno} is not valid JSON (not a torn last line; was the folder written by "
                 f"two processes at once?)")
    return records


def truncate_jsonl(path: str, last_step: int) -> None:
    """Keep the lines up to last_step (the checkpoint we resume from), dropping a torn last line."""
    if os.path.exists(path):
        records = [r for r in read_log(path) if r.get("step", 0) <= last_step]
        with open(path + ".part", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        os.replace(path + ".part", path)


# ---------------------------------------------------------------------------------------------------------- record
def read_changes(run_dir: str) -> list[dict]:
    """The accepted changes of a run, oldest first: [{"step": first step trained with them, "changes": {flag:
    [old, new]}}] (flag names as in config.json)."""
    return read_log(os.path.join(run_dir, "changes.jsonl"))


def run_settings(config: dict, changes: list[dict]) -> dict:
    """The run's settings now: config.json with every accepted change applied in order."""
    settings = dict(config)
    for record in changes:
        settings.update({name: new for name, (_, new) in record["changes"].items()})
    return settings


def append_change(run_dir: str, step: int, changes: dict) -> None:
    """Record flags changed on a resume ({flag: (old, new)}) as taking effect at `step`."""
    with open(os.path.join(run_dir, "changes.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "changes": {k: list(v) for k, v in changes.items()}}) + "\n")


def format_changes(changes: list[dict]) -> list[str]:
    """One line per accepted change: "from step 11: --lr 0.0001 -> 0.001, --steps 30 -> 60"."""
    return [f"from step {r['step']}: " + ", ".join(f"--{k.replace('_', '-')} {old} -> {new}"
                                                    for k, (old, new) in r["changes"].items()) for r in changes]


def launch_command(argv: list[str]) -> str:
    """The command line of this run as a person types it: `python scope.py ARGS`, or torchrun's launch."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launcher = f"torchrun --nproc_per_node {world} scope.py" if world > 1 else "python scope.py"
    return " ".join([launcher, *map(shlex.quote, argv)])


def resume_hint(run_dir: str, argv: list[str] | None, first_save: int) -> str:
    """Where a stopped run stands and the command that goes on from there (for an interrupt). After a checkpoint:
    its step and the --resume command. Before the first one (`first_save`: the step that writes it): that nothing
    was saved, and the typed command that starts the run again from step 1 (with --overwrite when the folder
    already holds this run's logs, said in words: that restart replaces them). `argv` None: scope.main called from
    Python, whose call is spelled instead (main({"resume": "runs/NAME"}))."""
    found = find_checkpoint(run_dir)
    if found is not None:
        again = f'main({{"resume": "{run_dir}"}})' if argv is None else launch_command(['--resume', run_dir])
        return f"the last complete checkpoint is step {found[1]} ({found[0]}); continue with: {again}"
    if argv is None:
        replace = f' with "overwrite": True added (it replaces the logs in {run_dir})' if holds_run(run_dir) else ""
        return (f"nothing was saved yet (the first checkpoint comes after step {first_save}); start the run again "
                f"with the same main(...) call{replace}")
    if not holds_run(run_dir):
        return f"nothing was written; start the run again with: {launch_command(argv)}"
    again = launch_command(argv if "--overwrite" in argv else [*argv, "--overwrite"])
    return (f"nothing was saved yet (the first checkpoint comes after step {first_save}); start the run again "
            f"from step 1, replacing the logs in {run_dir}, with: {again}")


def environment() -> dict:
    """What a record needs to be reproduced: package versions, Python, CPU (with the capability torch dispatches
    to and the CPU flags that change numerics), threads, and the commit it ran on ("dirty": true when tracked files
    differ from it, "changed" those files' content hashes). Stored in every config.json and study record."""
    import torch   # here, not at the top: eval.py refuses bad input before torch loads
    import importlib.metadata
    import platform
    import subprocess

    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*words):
        try:
            out = subprocess.run(["git", *words], cwd=os.path.dirname(os.path.abspath(__file__)),
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    status = git("status", "--porcelain", "--untracked-files=no")
    root = git("rev-parse", "--show-toplevel")
    changed = {}   # a dirty tree: each changed tracked file and the git hash of its contents here (None: deleted)
    for path in (git("diff", "--name-only", "HEAD") or "").splitlines() if status else ():
        full = os.path.join(root or "", path)
        changed[path] = git("hash-object", full) if os.path.isfile(full) else None
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": version("transformers"),
            "numpy": np.__version__, "scipy": version("scipy"), "platform": platform.platform(), "cpu": cpu,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),   # the kernels torch dispatches to
            "cpu_flags": cpu_flags(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(),
            "thread_env": {k: os.environ[k] for k in NUMERICS_ENV if k in os.environ},
            "commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status),
            "changed": changed}


# CPU features and variables that change which kernels run, and so the last bits of a result
NUMERICS_FLAGS = ("sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512dq", "avx512bw",
                  "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
NUMERICS_ENV = ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_CBWR", "OPENBLAS_NUM_THREADS",
                "TORCH_NUM_THREADS")


def cpu_flags() -> list[str] | None:
    """Which of NUMERICS_FLAGS /proc/cpuinfo lists (None where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            have = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if have is None else [x for x in NUMERICS_FLAGS if x in have]
