"""The seal around a graded process (tools/course/seal.py): one test per line of its docstring's list, run in a
real sealed process; the terminal cheat on a pseudo-terminal; the hand-in resolved once and read as regular
files only; the xattr and keyring relays; a forged report and 1,500 nested folders that change nothing.

A probe script, sealed exactly as the grader seals a problem's process (`seal.run` then `seal.apply`), tries each
thing the docstring names and reports what happened; each test below reads its line of the report.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools.course import grade, problems, seal, student_copy  # noqa: E402

PROBE = r'''
import ctypes, errno, json, os, resource, socket, sys
here = os.getcwd()
sys.path.insert(0, here)
from _course import seal
hidden = json.loads(sys.argv[1])
seal.apply(here, hidden["hidden"])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
out = {}

def attempt(key, fn):
    try:
        fn()
        out[key] = "ok"
    except OSError as err:
        out[key] = errno.errorcode.get(err.errno, str(err.errno))
    except MemoryError:
        out[key] = "MemoryError"

def call(key, *args):
    r = libc.syscall(*args)
    out[key] = "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")

attempt("read_python", lambda: open(os.__file__).read())
attempt("read_own", lambda: open("probe.py").read())
attempt("write_own", lambda: open("written.txt", "w").write("x"))
attempt("dev_null", lambda: open("/dev/null", "w").write("x"))
attempt("dev_urandom", lambda: open("/dev/urandom", "rb").read(8))
attempt("dev_zero", lambda: open("/dev/zero", "rb").read(8))
out["limits"] = [resource.getrlimit(r)[0] for r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC, resource.RLIMIT_CPU)]
attempt("allocate_past_the_limit", lambda: bytearray(hidden["too_much"]))
for i, p in enumerate(hidden["hidden"]):
    attempt(f"read_hidden_{i}", lambda: os.listdir(p))
attempt("read_shadow", lambda: open("/etc/shadow").read())
attempt("write_tmp", lambda: open("/tmp/scope-seal-probe", "w").write("x"))
attempt("write_target", lambda: open(hidden["target"], "a").write("x"))
out["uid"] = [os.getuid(), os.getgid(), os.getgroups()]
attempt("setxattr_own", lambda: os.setxattr("written.txt", "user.relay", b"1"))
attempt("setxattr_target", lambda: os.setxattr(hidden["target"], "user.relay", b"1"))
attempt("getxattr_target", lambda: os.getxattr(hidden["target"], "user.relay"))
attempt("chmod_own", lambda: os.chmod("written.txt", 0o600))
attempt("chmod_target", lambda: os.chmod(hidden["target"], 0o600))
attempt("utime_target", lambda: os.utime(hidden["target"], (1, 1)))
attempt("chown_own", lambda: os.chown("written.txt", os.getuid(), os.getgid()))
call("add_key", 248 if os.uname().machine == "x86_64" else 217, b"user", b"scope-seal-probe", b"x",
     ctypes.c_size_t(1), ctypes.c_int(-4))
call("keyctl", 250 if os.uname().machine == "x86_64" else 219, 0, ctypes.c_int(-4), 0)   # KEYCTL_GET_KEYRING_ID
call("io_uring_setup", 425, 4, ctypes.create_string_buffer(120))
out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
attempt("signal_the_grader", lambda: os.kill(hidden["grader"], 0))
if os.fork() == 0:   # a daemon of its own session: it must die with the graded process
    os.setsid()
    if os.fork() == 0:
        libc.prctl(15, b"scope-seal-orph", 0, 0, 0)
        import time
        time.sleep(600)
    os._exit(0)
os.wait()
def connect():
    s = socket.create_connection(("127.0.0.1", hidden["port"]), timeout=2)
    s.close()
attempt("connect_localhost", connect)
def connect_unix():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(hidden["unix"])
    s.close()
attempt("connect_unix", connect_unix)
attempt("socketpair", lambda: [s.close() for s in socket.socketpair()])
attempt("socketpair_dgram", lambda: [s.close() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)])
attempt("vsock", lambda: socket.socket(40, socket.SOCK_STREAM).close())        # AF_VSOCK: the host of a VM
attempt("netlink", lambda: socket.socket(16, socket.SOCK_RAW).close())        # AF_NETLINK
attempt("inet_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
big = os.open(os.__file__, os.O_RDONLY)
call("fadvise64", 221 if os.uname().machine == "x86_64" else 223, big, 0, 4096, 4)     # POSIX_FADV_DONTNEED
call("readahead", 187 if os.uname().machine == "x86_64" else 213, big, 0, 4096)
page = ctypes.create_string_buffer(4096)
iov = (ctypes.c_void_p * 2)(ctypes.cast(page, ctypes.c_void_p), 4096)
call("preadv2_nowait", 327 if os.uname().machine == "x86_64" else 286, big, iov, 1, 0, 0, 8)   # RWF_NOWAIT
call("preadv2", 327 if os.uname().machine == "x86_64" else 286, big, iov, 1, 0, 0, 0)
call("cachestat", 451, big, 0, 0, 0)
os.close(big)
out["fds"] = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
out["ttys"] = [os.isatty(fd) for fd in (0, 1, 2)]
out["stdin"] = sys.stdin.read()
out["environ"] = sorted(os.environ)
st = os.statvfs(".")
out["disk"] = st.f_blocks * st.f_frsize
out["cgroup"] = open("/proc/self/cgroup").read()
print(json.dumps(out))
'''


def named(name):
    """PIDs of the live processes called `name` (read from /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat.split("(", 1)[1].rsplit(")", 1)[0] == name and stat.rsplit(")", 1)[1].split()[0] != "Z":
            found.append(int(pid))
    return found


TERMINAL_CHEAT = r'''
import errno, fcntl, json, os, sys, termios
sys.path.insert(0, os.getcwd())
from _course import seal
seal.apply(os.getcwd(), [])
out = {"ttys": [os.isatty(fd) for fd in (0, 1, 2)]}
for fd in (0, 1, 2):
    try:
        for ch in b"id > /tmp/scope-typed\n":
            fcntl.ioctl(fd, termios.TIOCSTI, bytes([ch]))
        out[str(fd)] = "ok"
    except OSError as err:
        out[str(fd)] = errno.errorcode.get(err.errno, str(err.errno))
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def probe():
    """What a sealed process could and could not do, and the facts around it (the grader's view)."""
    import socket

    assert seal.missing() == "", seal.missing()
    base = open_folder()
    here, secret = base / "here", base / "secret"
    here.mkdir()
    secret.mkdir()
    disk, totals = seal.own_disk(str(here)), seal.grading_limits()   # as grade_problem and grade set them up
    disk.__enter__()
    totals.__enter__()
    target = base / "target.txt"   # a file of the teacher's, readable by all
    target.write_text("teacher")
    os.chmod(base, 0o755)
    os.chmod(target, 0o644)
    shutil.copytree(os.path.join(ROOT, "tools", "course"), here / "_course",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (here / "probe.py").write_text(PROBE)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)   # a pathname socket anyone may connect to
    unix.bind(str(base / "relay.sock"))
    os.chmod(base / "relay.sock", 0o777)
    unix.listen(1)
    facts = {"hidden": [ROOT, str(secret)], "target": str(target), "too_much": seal.MEMORY + (1 << 30),
             "grader": os.getpid(), "port": listener.getsockname()[1], "unix": str(base / "relay.sock")}
    read = os.path.realpath(os.__file__)   # the probe reads it: an access time older than its change time
    was = os.stat(read)
    os.utime(read, ns=(was.st_mtime_ns - 10**9, was.st_mtime_ns))
    os.environ["SCOPE_TEACHER_SECRET"] = "1"
    try:
        proc = seal.run([sys.executable, "probe.py", json.dumps(facts)], str(here), 60)
    finally:
        del os.environ["SCOPE_TEACHER_SECRET"]
        listener.close()
        unix.close()
        atime = os.stat(read).st_atime_ns
        os.utime(read, ns=(was.st_atime_ns, was.st_mtime_ns))
    assert proc is not None and proc.returncode == 0, proc and proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    report["written_owner"] = os.stat(here / "written.txt").st_uid if os.path.exists(here / "written.txt") else None
    report["target_after"] = (target.read_text(), os.stat(target).st_mode & 0o777, os.listxattr(target))
    report["orphans"] = named("scope-seal-orph")
    report["atime_moved"] = atime != was.st_mtime_ns - 10**9
    totals.__exit__(None, None, None)
    disk.__exit__(None, None, None)
    yield report
    shutil.rmtree(base)


def open_folder():
    """A new folder in the system's temp folder that every user may enter (pytest's own are the teacher's
    only): what the grader's folders are, so a graded process running as IDENTITY reaches it."""
    import pathlib
    import tempfile

    base = pathlib.Path(tempfile.mkdtemp(prefix="scope-seal-test-"))
    os.chmod(base, 0o755)
    return base


def test_1_it_reads_the_python_installation_and_its_own_folder(probe):
    assert probe["read_python"] == "ok" and probe["read_own"] == "ok"


def test_2_it_writes_its_own_folder(probe):
    assert probe["write_own"] == "ok"


def test_3_of_the_devices_only_null_and_urandom(probe):
    assert probe["dev_null"] == "ok" and probe["dev_urandom"] == "ok" and probe["dev_zero"] == "EACCES"


def test_4_memory_processes_and_cpu_are_limited(probe):
    memory, nproc, cpu = probe["limits"]
    assert memory == seal.MEMORY and cpu == 60 and 0 < nproc < 100_000
    assert probe["allocate_past_the_limit"] == "MemoryError"


def test_5_it_reads_nothing_of_the_teachers(probe):
    assert probe["read_hidden_0"] == "EACCES" and probe["read_hidden_1"] == "EACCES"
    assert probe["read_shadow"] == "EACCES"


def test_6_it_writes_nothing_outside_its_folder(probe):
    assert probe["write_tmp"] == "EACCES" and probe["write_target"] == "EACCES"
    assert not os.path.exists("/tmp/scope-seal-probe")


def test_7_it_runs_as_an_identity_that_owns_nothing(probe):
    if os.geteuid() != 0:
        pytest.skip("a grader that is not root cannot change the graded process's uid (line 8 stands in)")
    assert probe["uid"][:2] == [seal.IDENTITY, seal.IDENTITY] and set(probe["uid"][2]) <= {seal.IDENTITY}
    assert probe["written_owner"] == seal.IDENTITY   # as the grader sees it: the kernel's uid, not a mapped one


def test_8_attributes_modes_times_keyrings_and_io_uring_answer_eperm(probe):
    for key in ("setxattr_own", "setxattr_target", "getxattr_target", "chmod_own", "chmod_target", "utime_target",
                "chown_own", "add_key", "keyctl", "io_uring_setup"):
        assert probe[key] == "EPERM", (key, probe[key])
    assert probe["target_after"] == ("teacher", 0o644, [])


def test_9_it_sees_only_its_own_processes_and_its_orphans_die_with_it(probe):
    assert probe["pids"][0] == 1 and len(probe["pids"]) <= 4, probe["pids"]
    assert probe["signal_the_grader"] != "ok"
    assert probe["orphans"] == []


def test_10_no_network_and_no_unix_socket(probe):
    assert probe["connect_localhost"] in ("ENETUNREACH", "EACCES", "ECONNREFUSED", "EPERM")
    assert probe["connect_localhost"] != "ok"
    assert probe["connect_unix"] == "EPERM"   # a pathname socket of anyone's: socket(AF_UNIX) is denied
    # socketpair(AF_UNIX)'s end can sendto() any pathname datagram socket; AF_VSOCK reaches a VM's host
    assert probe["socketpair"] == probe["socketpair_dgram"] == "EPERM"
    assert probe["vsock"] == probe["netlink"] == "EPERM" and probe["inet_socket"] == "ok"   # loopback IP only


def test_14_no_page_cache_probe(probe):
    """fadvise64 (to evict a page), readahead (to load one) and preadv2 with RWF_NOWAIT (EAGAIN when a page is not
    cached) answer EPERM, as does cachestat; a plain preadv2 runs."""
    for key in ("fadvise64", "readahead", "preadv2_nowait"):
        assert probe[key] == "EPERM", (key, probe[key])
    assert probe["cachestat"] in ("EPERM", "ENOSYS") and probe["preadv2"] == "ok"


def test_12_no_terminal_and_no_descriptor_of_the_graders(probe):
    assert probe["ttys"] == [False, False, False] and probe["stdin"] == ""
    assert probe["fds"] == [0, 1, 2, 3], probe["fds"]   # 3: the listing's own


def test_13_reading_leaves_no_access_time(probe):
    if os.geteuid() != 0:
        pytest.skip("a grader that is not root cannot mount the noatime view (the access-time relay stays open)")
    assert probe["read_python"] == "ok" and not probe["atime_moved"]


def test_the_terminal_cheat_types_nothing_on_the_graders_terminal(tmp_path):
    """A grader whose stdin is its controlling terminal (a pseudo-terminal here): the graded code tries
    ioctl(TIOCSTI) on each of its standard descriptors. Nothing reaches the terminal: no echo on the master's
    side, nothing queued on the slave's; the graded process has no terminal at all."""
    import fcntl
    import termios

    base = open_folder()
    here = base / "here"
    here.mkdir()
    shutil.copytree(os.path.join(ROOT, "tools", "course"), here / "_course",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (here / "cheat.py").write_text(TERMINAL_CHEAT)
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[3] &= ~termios.ICANON   # what is typed is readable at once, no line needed
    attrs[6][termios.VMIN], attrs[6][termios.VTIME] = 0, 0
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    grader = ("import fcntl, os, sys, termios\n"
              "fcntl.ioctl(0, termios.TIOCSCTTY, 0)\n"   # the terminal becomes the grader's controlling one
              f"sys.path.insert(0, {ROOT!r})\n"
              "from tools.course import seal\n"
              "proc = seal.run([sys.executable, 'cheat.py'], sys.argv[1], 60)\n"
              "print(proc.stdout.strip().splitlines()[-1] if proc and proc.returncode == 0 else proc and proc.stderr)\n")
    try:
        proc = subprocess.run([sys.executable, "-c", grader, str(here)], stdin=slave, capture_output=True, text=True,
                              start_new_session=True, timeout=120)
        typed = b""
        for fd in (master, slave):
            os.set_blocking(fd, False)
            try:
                typed += os.read(fd, 1024)
            except (BlockingIOError, OSError):
                pass
    finally:
        os.close(master)
        os.close(slave)
        shutil.rmtree(base)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert typed == b"", typed
    assert report["ttys"] == [False, False, False], report
    assert all(report[k] != "ok" for k in ("0", "1", "2")), report


def test_4_a_root_grader_totals_a_gradings_memory_processes_and_disk(probe):
    """Its folder is a tmpfs of seal.DISK bytes, and it runs in the grading's cgroups (memory and pids), so the
    grading's processes together have a bound, not only each one."""
    if os.geteuid() != 0 or not seal._cgroup_dirs():
        pytest.skip("the totals need a root grader and cgroup controllers: the per-process limits hold alone")
    assert probe["disk"] == seal.DISK
    assert probe["cgroup"].count(f"scope-grading-{os.getpid()}-") == len(seal._cgroup_dirs()), probe["cgroup"]


def test_11_its_environment_is_the_allow_list(probe):
    assert "SCOPE_TEACHER_SECRET" not in probe["environ"]
    assert set(probe["environ"]) <= set(seal.ENV_KEPT) | set(seal.environment("/x")) | {"LC_CTYPE"}


def test_the_seccomp_program_denies_exactly_its_table():
    """The BPF program, run by hand: each denied number answers EPERM, another number runs, another
    architecture is killed, and on x86_64 every x32 number answers EPERM."""
    import struct

    for arch, (audit, _, denied) in seal.DENIED.items():
        code = seal.seccomp_program(arch)
        prog = [struct.unpack("HBBI", code[i:i + 8]) for i in range(0, len(code), 8)]

        def run(nr, arch_word=audit, args=(0, 0, 0, 0, 0, 0)):
            args = tuple(args) + (0,) * (6 - len(args))
            pc, acc = 0, 0
            while True:
                op, jt, jf, k = prog[pc]
                if op == 0x20:
                    acc = {4: arch_word, 0: nr, **{16 + 8 * i: a & 0xFFFFFFFF for i, a in enumerate(args)}}[k]
                elif op == 0x06:
                    return k
                elif op in (0x15, 0x35, 0x45):
                    pc += jt if {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op] else jf
                pc += 1

        assert all(run(nr) == 0x00050001 for nr in denied)
        assert run(0) == run(1) == 0x7FFF0000 and run(denied[0], arch_word=0x40000003) == 0x80000000
        if arch == "x86_64":
            assert run(0x40000000 + 2) == 0x00050001
        ioctl, socket, preadv2 = seal.BY_ARGUMENT[arch]
        assert run(ioctl, args=(0, seal.TIOCSTI)) == run(ioctl, args=(1, seal.TIOCLINUX)) == 0x00050001
        assert run(ioctl, args=(0, seal.TIOCSTI | 1 << 32)) == 0x00050001   # the kernel reads the request as 32 bits
        assert run(ioctl, args=(0, 0x5401)) == 0x7FFF0000                    # TCGETS runs
        assert all(run(socket, args=(family, 1)) == 0x00050001 for family in (1, 16, 17, 40))   # unix netlink packet vsock
        assert run(socket, args=(2, 1)) == run(socket, args=(10, 2)) == 0x7FFF0000
        assert run(preadv2, args=(3, 0, 1, 0, 0, seal.RWF_NOWAIT | 1)) == 0x00050001
        assert run(preadv2, args=(3, 0, 1, 0, 0, 0)) == 0x7FFF0000


# ---------------------------------------------------------------------------------------------------
# the handed-in files: regular files only, never through a link
# ---------------------------------------------------------------------------------------------------
def test_links_and_other_non_regular_files_are_refused_with_one_line(tmp_path):
    """A folder whose grpo.py is a symbolic link (to /proc/self/cwd/grpo.py: from the grader's own folder, the
    reference) or a FIFO, or sits in a linked folder, and a tarball whose grpo.py is a link, are refused
    with one line naming the file; regular files are read."""
    needed = {"grpo.py", "prm.py"}
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "prm.py").write_text("x = 1\n")
    os.symlink("/proc/self/cwd/grpo.py", sub / "grpo.py")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=r"^--grade .*: grpo\.py is refused \(a symbolic link\)"):
        grade.submission_folder(str(sub), str(out), needed)
    os.remove(sub / "grpo.py")
    os.mkfifo(sub / "grpo.py")
    with pytest.raises(ValueError, match=r"grpo\.py is refused \(not a regular file\)"):
        grade.submission_folder(str(sub), str(out), needed)
    os.remove(sub / "grpo.py")
    (sub / "grpo.py").write_text("y = 2\n")
    assert grade.submission_folder(str(sub), str(out), needed) == str(out)
    assert (out / "grpo.py").read_text() == "y = 2\n" and not os.path.islink(out / "grpo.py")
    (sub / "big.py").write_bytes(b"#" * (grade.HAND_IN_BYTES + 1))
    with pytest.raises(ValueError, match=r"big\.py is refused \(\d+ bytes, over \d+\)"):
        grade.submission_folder(str(sub), str(out), needed | {"big.py"})
    (sub / "latin1.py").write_bytes(b"x = '\xe9'\n")   # Latin-1 without its declaration: Python refuses it too
    with pytest.raises(ValueError, match=r"latin1\.py is not Python source text \(SyntaxError"):
        grade.submission_folder(str(sub), str(out), needed | {"latin1.py"})
    (sub / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\nx = '\xe9'\n")   # read as Python reads them
    (sub / "bom.py").write_bytes(b"\xef\xbb\xbfx = '\xc3\xa9'\n")
    assert grade.submission_folder(str(sub), str(out), needed | {"latin1.py", "bom.py"}) == str(out)
    assert (out / "latin1.py").read_bytes() == (sub / "latin1.py").read_bytes()   # byte for byte
    for linked, to in (("linked", sub), ("cwd", "/proc/self/cwd")):   # the folder itself a link: refused too
        os.symlink(to, tmp_path / linked)
        with pytest.raises(ValueError, match=rf"^--grade .*: {tmp_path / linked} is refused \(a symbolic link\)"):
            grade.submission_folder(str(tmp_path / linked), str(out), needed)
    os.symlink(tmp_path, tmp_path / "up")   # or a folder on the way
    with pytest.raises(ValueError, match=rf"{tmp_path / 'up'} is refused \(a symbolic link\)"):
        grade.submission_folder(str(tmp_path / "up" / "sub"), str(out), needed)
    with pytest.raises(ValueError, match=r"a hand-in is never read from /proc"):
        grade.submission_folder("/proc/self/cwd", str(out), needed)
    tar_path = tmp_path / "submission.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(sub / "prm.py", "prm.py")
        info = tarfile.TarInfo("grpo.py")
        info.type, info.linkname = tarfile.SYMTYPE, "/proc/self/cwd/grpo.py"
        tar.addfile(info)
    with pytest.raises(ValueError, match=r"grpo\.py is refused \(not one regular file in the tarball\)"):
        grade.submission_folder(str(tar_path), str(out), needed)
    os.symlink(tar_path, tmp_path / "linked.tar.gz")
    with pytest.raises(ValueError, match=r"linked\.tar\.gz is refused \(a symbolic link\)"):
        grade.submission_folder(str(tmp_path / "linked.tar.gz"), str(out), needed)


@pytest.mark.slow
def test_a_blank_copy_of_links_to_the_graders_folder_is_refused(tmp_path):
    """The submission whose four files link to /proc/self/cwd/<file> (the grader's folder when it runs from the
    repository root), and a hand-in folder that is itself a link to /proc/self/cwd: the grade is refused with one
    line, from the repository root, before any problem runs."""
    sub, fx = tmp_path / "links", tmp_path / "fx"
    sub.mkdir()
    fx.mkdir()
    (fx / "index.json").write_text(json.dumps({"seed": 0, "tokenizer": "", "problems": {"split_steps": 12}}))
    for f in problems.SUBMITTED:
        os.symlink(f"/proc/self/cwd/{f}", sub / f)
    os.symlink("/proc/self/cwd", tmp_path / "cwd")   # the hand-in folder itself a link to the grader's folder
    for hand_in in (sub, tmp_path / "cwd"):
        proc = subprocess.run([sys.executable, "-m", "tools.exercises", "--grade", str(hand_in), "--fixtures",
                               str(fx)], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout
        assert "is refused (a symbolic link)" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------------
# relays through state the namespaces and Landlock do not cover
# ---------------------------------------------------------------------------------------------------
# Module-level code appended to each file a blank copy hands in: it stores every reference function its
# grading folder holds, in extended attributes of a file of the teacher's and in a key of the kernel's user
# keyring, and takes back the ones its own file lacks (the next problem's grading, or the next grading).
RELAY = r'''


def _xattr_keyring_relay():
    import ast, ctypes, json, os
    target, stub = TARGET, "raise NotImplementedError('exercise"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    x86 = os.uname().machine == "x86_64"
    mine = {}
    for name in ("prm.py", "grpo.py", "refine.py", "scope.py"):
        try:
            text = open(name, encoding="utf-8").read()
        except OSError:
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef):
                src = ast.get_source_segment(text, node)
                if stub not in src and "_relay" not in src:
                    mine[node.name] = src
    store = {}
    for name, src in mine.items():
        data = src.encode()
        try:
            os.setxattr(target, "user.relay." + name, data)
        except OSError:
            pass
        libc.syscall(248 if x86 else 217, b"user", ("scope-relay-" + name).encode(), data,
                     ctypes.c_size_t(len(data)), ctypes.c_int(-4))
    try:
        for attr in os.listxattr(target):
            if attr.startswith("user.relay."):
                store[attr[len("user.relay."):]] = os.getxattr(target, attr).decode()
    except OSError:
        pass
    for name in list(globals()):
        key = libc.syscall(250 if x86 else 219, 10, ctypes.c_int(-4), b"user", ("scope-relay-" + name).encode(), 0)
        if key >= 0:   # KEYCTL_SEARCH found it: KEYCTL_READ
            buf = ctypes.create_string_buffer(1 << 16)
            n = libc.syscall(250 if x86 else 219, 11, ctypes.c_long(key), buf, ctypes.c_size_t(1 << 16))
            if n > 0:
                store[name] = buf.raw[:n].decode()
    for name, src in store.items():   # my stubs, replaced by the reference functions another grading held
        fn = globals().get(name)
        if callable(fn) and getattr(fn, "__module__", None) == __name__:
            try:
                if stub in open(fn.__code__.co_filename, encoding="utf-8").read().split("def " + name + "(")[1][:4000]:
                    exec(src, globals())
            except (OSError, IndexError):
                pass


    import socket   # a datagram to a pathname socket anyone may write to, from a socketpair's end
    try:
        end, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        end.sendto(json.dumps(sorted(mine)).encode()[:4000], LISTENER)
        end.close()
        other.close()
    except OSError:
        pass
    try:   # the page cache: a page read is a 1, a page evicted (fadvise DONTNEED) a 0, read back with RWF_NOWAIT
        big = os.open(os.__file__, os.O_RDONLY)
        bits = "".join(f"{b:08b}" for b in json.dumps(sorted(mine)).encode()[:2])
        for i, bit in enumerate(bits):
            if bit == "1":
                os.pread(big, 1, i * 4096)
            else:
                os.posix_fadvise(big, i * 4096, 4096, os.POSIX_FADV_DONTNEED)
        for i in range(len(bits)):
            try:
                os.preadv(big, [bytearray(1)], i * 4096, os.RWF_NOWAIT)
            except BlockingIOError:
                pass
        os.close(big)
        open("page-cache-relay-ran", "w").close()
    except OSError:
        pass


_xattr_keyring_relay()
'''


def relay_keys():
    """The relay's live keys (descriptions starting scope-relay-, not invalidated: flag i), from /proc/keys."""
    try:
        with open("/proc/keys") as f:
            return [line for line in f if "scope-relay-" in line and not line.split()[1].endswith("i")]
    except OSError:
        return []


def clear_relay(target):
    import ctypes

    for attr in os.listxattr(target):
        if attr.startswith("user.relay."):
            os.removexattr(target, attr)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    x86 = os.uname().machine == "x86_64"
    for line in relay_keys():
        libc.syscall(250 if x86 else 219, 21, ctypes.c_long(int(line.split()[0], 16)))   # KEYCTL_INVALIDATE


@pytest.mark.slow
def test_relays_score_nothing_twice_and_leave_nothing(tmp_path):
    """A blank copy whose modules, at import, send every function they hold that is not a stub out through
    extended attributes of a file of the teacher's, the kernel's user keyring, a socketpair's datagram to a
    pathname socket (the test listens on one) and the page cache (fadvise to evict, RWF_NOWAIT to test), and
    take back what they find. Unsealed, each channel carries. Graded twice for credit, sealed, on problems 3
    and 6 (6 depends on 1-5, whose functions answer from the grader's reference process: no process holds a
    reference solution to send), it scores at most 8 points each time (0 here), no datagram arrives, and no xattr
    or key of it is left."""
    import socket

    from tools.course import fixtures

    assert seal.missing() == "", seal.missing()
    base = open_folder()
    target, listener_path = base / "teachers_file.txt", str(base / "listener.sock")
    target.write_text("the teacher's")
    os.chmod(target, 0o644)
    clear_relay(target)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(listener_path)
    os.chmod(listener_path, 0o777)
    listener.setblocking(False)

    def datagrams():
        n = 0
        while True:
            try:
                listener.recv(1 << 16)
                n += 1
            except BlockingIOError:
                return n

    out = tmp_path / "blank"
    student_copy.generate(str(out))
    for f in problems.SUBMITTED:
        with open(out / f, "a", encoding="utf-8") as fh:
            fh.write(RELAY.replace("TARGET", repr(str(target))).replace("LISTENER", repr(listener_path)))
    try:   # the channels are real: unsealed, one import sends through each
        proc = subprocess.run([sys.executable, "-c", "import prm"], cwd=out, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(out)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert os.listxattr(target) and relay_keys() and datagrams() == 1 and (out / "page-cache-relay-ran").exists()
    finally:
        clear_relay(target)
        (out / "page-cache-relay-ran").unlink(missing_ok=True)
    assert not os.listxattr(target) and not relay_keys()
    fx = tmp_path / "fx"
    fixtures.write_fixtures(str(fx), seed=5, only=["first_error", "scope_step"])
    try:
        for attempt in (1, 2):
            results = grade.grade(str(out), str(fx), for_credit=True)
            assert all(r["sealed"] for r in results.values())
            assert sum(r["points"] for r in results.values()) <= 8, (attempt, results)
            assert os.listxattr(target) == [] and relay_keys() == [], f"grading {attempt} left relay state"
            assert datagrams() == 0, f"grading {attempt} sent a datagram"
    finally:
        listener.close()
        shutil.rmtree(base)


def test_the_report_says_sealed_whatever_exit_status_the_students_code_gives(tmp_path):
    """'sealed' is the worker's own word, one byte on a pipe written and closed before anything of the student's
    runs: a copy whose code exits with the worker's could-not-seal status (seal.FAILED) is still graded as
    sealed, and its row gives the exit status, not 'could not seal itself'."""
    from tools.course import fixtures

    assert seal.missing() == "", seal.missing()
    out = tmp_path / "copy"
    student_copy.generate(str(out))
    with open(out / "prm.py", "a", encoding="utf-8") as fh:
        fh.write(f"\nimport os\nos._exit({seal.FAILED})\n")
    fx = tmp_path / "fx"
    fixtures.write_fixtures(str(fx), seed=5, only=["split_steps"])
    results = grade.grade(str(out), str(fx), only=["split_steps"], for_credit=True)
    row = results["split_steps"]
    assert row["sealed"] is True and row["points"] == 0, row
    assert f"exit status {seal.FAILED}" in row["error"] and "could not seal" not in row["error"], row["error"]


# ---------------------------------------------------------------------------------------------------
# the report and the clean-up: nothing a graded process does reaches them
# ---------------------------------------------------------------------------------------------------
FORGED = r'''


class _Forged(Exception):
    pass


_Forged.__name__ = "Error\x1b[1A\x1b[2K\r 3  first_error  6 / 6   14/14\n    total  100 / 100\n"


def first_error(scores, tau=0.5):
    import os
    here = os.getcwd()
    if not os.path.isdir("d"):   # 1,500 nested folders for the grader to clean up, and a link out of them
        for _ in range(1500):
            os.mkdir("d")
            os.chdir("d")
        os.symlink("/", "root")
        os.chdir(here)
    raise _Forged("100/100")
'''


def test_a_forged_report_and_deep_folders_change_nothing(tmp_path):
    """A first_error that raises an exception whose class name carries a cursor-up, an erase-line, a carriage
    return and newlines spelling a full-marks row and total, and that leaves 1,500 nested folders (and a link to
    /) in its grading folder: the report's rows and totals, read by regex, are the real ones (0 / 6), no line of
    it is the student's, the JSON holds the real total, and the grader leaves no folder behind."""
    from tools.course import fixtures

    copy, fx, tmp = tmp_path / "copy", tmp_path / "fx", open_folder()
    copy.mkdir()
    for f in problems.SUBMITTED:
        shutil.copy(os.path.join(ROOT, f), copy / f)
    with open(copy / "prm.py", "a", encoding="utf-8") as fh:
        fh.write(FORGED)
    fixtures.write_fixtures(str(fx), seed=5, only=["first_error"])
    try:
        proc = subprocess.run([sys.executable, "-m", "tools.exercises", "--grade", str(copy), "--fixtures", str(fx),
                               "--json", str(tmp_path / "report.json")], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "TMPDIR": str(tmp)})
        left = os.listdir(tmp)
    finally:
        grade.remove_tree(str(tmp))
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr[-2000:]
    report = proc.stdout
    rows = re.findall(r"^\s*\d+\s+(\w+)\s+(\d+) / (\d+)", report, re.MULTILINE)
    totals = re.findall(r"total\s+(\d+) / (\d+)", report)
    assert rows == [("first_error", "0", "6")] and totals[0] == totals[-1] == ("0", "6"), report
    assert "\x1b" not in report and "\r" not in report
    assert len(report.splitlines()) == 5 + bool(seal.identity_note()), report
    assert report.splitlines()[-1].startswith("inputs drawn for this grading: --draw ")
    assert "Error\\x1b[1A" in report and "\\n    total" in report   # shown, escaped, on its row
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["total"] == 0 and data["max"] == 6 and data["problems"]["first_error"]["points"] == 0
    assert f"--draw {data['draw']} " in report
    assert "\n" not in data["problems"]["first_error"]["error"]
    assert left == [], left


# ---------------------------------------------------------------------------------------------------
# the grader cannot be taken down: bounded output, any answer compared, tarballs read in a limited child
# ---------------------------------------------------------------------------------------------------
def test_a_process_that_floods_stdout_costs_the_grader_no_memory():
    """A process that writes 256 MiB to stdout and 16 MiB to stderr: the grader keeps the last seal.OUTPUT_BYTES of
    each, and its own peak memory grows by far less than what was written."""
    code = ("import os, resource, sys; sys.path.insert(0, sys.argv[1]); from tools.course import seal\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "w = 'import os\\nfor _ in range(256): os.write(1, b\"x\" * (1 << 20))\\n"
            "for _ in range(16): os.write(2, b\"y\" * (1 << 20))\\nos.write(1, b\"end\")'\n"
            "r = seal.bounded_run([sys.executable, '-c', w], 120)\n"
            "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "print(r.returncode, len(r.stdout), len(r.stderr), r.stdout.endswith('end'), (after - before) // 1024)")
    proc = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True, timeout=300)
    rc, out, err, ends, grew_mib = proc.stdout.split()
    assert (int(rc), int(out), int(err), ends) == (0, seal.OUTPUT_BYTES, seal.OUTPUT_BYTES, "True"), proc.stdout
    assert int(grew_mib) < 32, f"the grader grew by {grew_mib} MiB reading 272 MiB of output"


def test_an_answer_the_grader_cannot_compare_is_a_wrong_case():
    """10**400 where a float is expected raises OverflowError in `matches`; inf or NaN where the reference has a
    number; a tensor with inf: each is a wrong case with a reason, never the grader's exception."""
    import torch

    from tools.course import fixtures

    with pytest.raises(OverflowError):
        fixtures.matches(10**400, 0.5)
    for got, want in ((10**400, 0.5), (float("inf"), 1e308), (float("nan"), 0.5), ([10**400], [0.5]),
                      (torch.tensor([float("inf")], dtype=torch.float64), torch.tensor([1e308], dtype=torch.float64))):
        assert grade.agrees(got, want) is False, (got, want)
        assert isinstance(grade.difference("group_advantages", got, want), str)
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    assert grade.agrees(nan.clone(), nan) and grade.agrees(float("inf"), float("inf"))   # the reference's own


def pax_bomb(digits: int) -> bytes:
    """A .tar.gz whose first member is a pax header of `digits` digits and no record: tarfile's pax parser on
    Python 3.11.7 backtracks over it for hours at 4,000,000 digits (CVE-2024-6232)."""
    import gzip
    import io

    data = b"1" * digits
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, len(data)
    raw = info.tobuf(format=tarfile.USTAR_FORMAT) + data + b"\0" * (-len(data) % 512) + b"\0" * 1024
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", compresslevel=9) as f:
        f.write(raw)
    return out.getvalue()


def long_name_bomb(path, size: int) -> None:
    """A .tar.gz whose first member is a GNU long name of `size` bytes (zeros: a megabyte packed per gigabyte):
    tarfile reads it whole into memory."""
    import gzip

    info = tarfile.TarInfo("././@LongLink")
    info.type, info.size = tarfile.GNUTYPE_LONGNAME, size
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(info.tobuf(format=tarfile.GNU_FORMAT))
        chunk = b"\0" * (16 << 20)
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.write(b"\0" * (size % len(chunk) + 1024))


def test_tarball_bombs_are_refused_with_one_line_in_bounded_time(tmp_path, monkeypatch):
    """A pax header of 400,000 digits and a GNU long name of 512 MiB (a tenth and a half of the full-size bombs;
    the reader's time limit lowered to match, 3 s): each is refused with one line naming the hand-in, within
    seconds, the tarball read in a limited child (grade.TAR_MEMORY) so the grader holds none of it."""
    import time

    monkeypatch.setattr(grade, "TAR_SECONDS", 3)
    (tmp_path / "pax.tar.gz").write_bytes(pax_bomb(400_000))
    long_name_bomb(tmp_path / "long.tar.gz", 512 << 20)
    out = tmp_path / "out"
    out.mkdir()
    for name, why in (("pax.tar.gz", "took over 3 s"), ("long.tar.gz", "a tarball the grader cannot read")):
        t0 = time.monotonic()
        with pytest.raises(ValueError, match=rf"^--grade \S*{name}: .*{why}") as err:
            grade.submission_folder(str(tmp_path / name), str(out), {"grpo.py"})
        assert "\n" not in str(err.value) and time.monotonic() - t0 < 60, (name, str(err.value))
    assert os.listdir(out) == []


# ---------------------------------------------------------------------------------------------------
# what crosses between a graded process and the grader (tools/course/wire.py)
# ---------------------------------------------------------------------------------------------------
def test_plain_data_crosses_and_nothing_else_does():
    """Containers, tuples, non-string keys, ±inf and NaN, empty and bool tensors round-trip; a function, a class
    or a module is refused before anything is sent; a message past the limit is refused before it is read."""
    import math
    import torch

    from tools.course import wire

    obj = {"a": (1, 2.5, float("inf")), "b": [None, "x", torch.zeros(0, 3), torch.tensor([True, False])], 3: True,
           (1, 2): [float("nan"), 10**40]}
    back = wire.unpack(wire.pack(obj))
    assert back["a"] == (1, 2.5, float("inf")) and back[3] is True and back[(1, 2)][1] == 10**40
    assert math.isnan(back[(1, 2)][0]) and back["b"][2].shape == (0, 3) and back["b"][3].dtype == torch.bool
    for bad in (print, type, os, {"f": lambda: 0}):
        with pytest.raises(wire.NotPlain):
            wire.pack(bad)
    r, w = os.pipe()
    os.write(w, (wire.LIMIT + 1).to_bytes(8, "little"))
    with pytest.raises(ValueError, match="over"):
        wire.receive(r)
    os.close(r)
    os.close(w)


def test_a_dependency_answers_values_and_gradients_and_refuses_held_out_inputs():
    """A stand-in for the reference's policy_loss, served over two pipes (by a thread here, by a process of the
    grader's when grading): the loss, its terms and d loss / d logp and d loss / d entropy equal the reference's
    in place; a call with inputs in the refused set is refused; a function it does not serve is refused."""
    import threading
    import torch

    import grpo
    from tools.course import wire

    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g, dtype=torch.float64) - 0.1
    old = logp + 0.3 * torch.rand(3, 5, generator=g, dtype=torch.float64)
    adv, resp = torch.randn(3, generator=g, dtype=torch.float64), torch.ones(3, 5, dtype=torch.long)
    off, ent = torch.zeros(3, 5, dtype=torch.long), torch.rand(3, 5, generator=g, dtype=torch.float64)
    off[0, 2:] = 1
    kw = {"clip_eps": 0.2, "entropy_coef": 0.01, "max_new_tokens": 6}
    refused = {wire.fingerprint(grpo.clipped_surrogate, "grpo.clipped_surrogate", (logp, old, adv, resp, 0.3), {})}
    ask_r, ask_w = os.pipe()
    hear_r, hear_w = os.pipe()
    server = threading.Thread(target=wire.serve, daemon=True,
                              args=(ask_r, hear_w, {"grpo.policy_loss": grpo.policy_loss,
                                                    "grpo.clipped_surrogate": grpo.clipped_surrogate}, None,
                                    refused, {}))
    server.start()
    deps = wire.Dependencies(ask_w, hear_r, {})
    results = []
    for fn in (deps.function("grpo.policy_loss"), grpo.policy_loss):
        lp, en = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
        loss, terms = fn(lp, old, adv, resp, off, entropy=en, **kw)
        loss.backward()
        results.append((loss.detach(), lp.grad, en.grad, {k: v for k, v in terms.items()}))
    (a, ga, ea, ta), (b, gb, eb, tb) = results
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(ga, gb)
    torch.testing.assert_close(ea, eb)
    assert set(ta) == set(tb) and bool(ga.abs().sum() > 0)
    surrogate = deps.function("grpo.clipped_surrogate")
    with pytest.raises(RuntimeError, match="held-out inputs of another problem"):
        surrogate(logp, old, adv, resp, clip_eps=0.3)
    surrogate(logp, old, adv, resp, 0.2)   # the same tensors, another ε: answered
    with pytest.raises(RuntimeError, match="not a function this problem depends on"):
        deps.function("grpo.update")(None, None, {})
    for fd in (ask_w, hear_r):
        os.close(fd)
    server.join(timeout=30)
    for fd in (ask_r, hear_w):
        os.close(fd)
