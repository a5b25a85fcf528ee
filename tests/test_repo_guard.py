"""The suite's guard against tests that leave files in the repository (conftest.RepoGuard): it names what the test
made, never a folder a person makes in the repository while the suite runs (a run of their own), which it once
blamed on whichever test was running (four teardown errors in the slow tier, each test passing alone)."""
import os
import socket
import subprocess
import sys

from conftest import RepoGuard, repo_listing


def person_makes(folder, lock=""):
    """A run folder (with `lock` in its lock file, if any) made by a process this test neither starts in the
    repository nor names it to: as a person's run is made."""
    code = ("import os, sys; folder, lock = sys.stdin.read().split('|'); os.makedirs(folder)\n"
            "if lock: open(os.path.join(folder, 'lock'), 'w').write(lock)")
    subprocess.run([sys.executable, "-c", code], input=f"{folder}|{lock}", text=True, check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(folder))))


def watching(root):
    guard = RepoGuard(str(root))
    RepoGuard.active.append(guard)
    return guard


def test_the_guard_names_what_the_test_made_and_not_a_persons_folder(tmp_path):
    root = tmp_path / "repo"
    (root / "runs" / "old").mkdir(parents=True)
    guard = watching(root)
    try:
        os.makedirs(root / "runs" / "mine" / "checkpoint")   # this process: a folder, then a file beside
        with open(root / "notes.txt", "w") as f:
            f.write("x")
        with open(root / "runs" / "old" / "more.txt", "w") as f:   # inside an entry that was there: not new
            f.write("x")
        person_makes(root / "runs" / "theirs")
    finally:
        RepoGuard.active.remove(guard)
    assert sorted(repo_listing(str(root)) - guard.before) == ["notes.txt", "runs/mine", "runs/theirs"]
    assert guard.left() == ["notes.txt", "runs/mine"] and not guard.child


def test_a_child_in_the_repository_makes_every_new_entry_the_tests_but_a_live_run_of_another_process(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        guard = watching(root)
        try:
            subprocess.run([sys.executable, "-c", "import os; os.makedirs('runs/child')"], cwd=root, check=True)
            person_makes(root / "runs" / "live", f"{sleeper.pid} {socket.gethostname()}")
            person_makes(root / "runs" / "done")
        finally:
            RepoGuard.active.remove(guard)
        # a person's run in progress (its lock names a live process) is not the test's; a finished one cannot be
        # told from the child's and is named
        assert guard.child and guard.left() == ["runs", "runs/child", "runs/done"]
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not RepoGuard(str(root)).writes_in_repo(str(tmp_path), [sys.executable, str(tmp_path / "x")])
    assert RepoGuard(str(root)).writes_in_repo(str(tmp_path), ["python", f"--out={root / 'runs' / 'new'}"])
