"""The seal around one graded process: what the student's code may touch while a problem is graded.

Why a relay scores nothing: a graded process holds no secret. Its folder has the student's modules, the engine
and the runners, never a reference solution or an expected output; the functions its problem depends on answer
from the grader's reference process over plain-data pipes (`wire.py`), which refuses another problem's held-out
inputs; no graded process runs beside one of a problem it depends on; and each grading draws its own inputs
(`grade.draw_for`). So whatever one grading sends out, through any channel (the page cache, a socket, timing),
is the student's own code and one grading's inputs, worth nothing to the next. The seal below is defence in
depth and keeps the rest of the machine, the teacher's files and the grader out of the student's reach.

The graded process CAN: (1) read the Python installation, the system's libraries and its own folder;
(2) write its own folder; (3) use /dev/null and /dev/urandom; (4) use at most MEMORY bytes of address space,
PROCESSES processes and threads, files of FILE_BYTES and as many CPU seconds as its time limit (a root grader
also totals a grading: one cgroup of GRADING_MEMORY and GRADING_TASKS, each folder a tmpfs of DISK).
It CANNOT: (5) read the teacher's repository, the fixtures, the submission or anything else (Landlock);
(6) write outside its folder (Landlock); (7) own or change a file of the teacher's: it runs as uid/gid
IDENTITY, which owns nothing, when the grader is root (otherwise it keeps the teacher's uid and 8 stops it);
(8) set or read extended attributes, change a file's mode, owner or times, use the kernel's keyrings or
io_uring (seccomp: EPERM); (9) see, signal or outlive another process: its own PID namespace, whose
processes all die with it; (10) reach a network (its own network namespace, Landlock's TCP rules) or any
unix or other socket: seccomp answers EPERM to socket() of every family but AF_INET and AF_INET6 (AF_UNIX,
AF_VSOCK, AF_NETLINK, ...) and to socketpair(); Landlock scopes abstract sockets;
(11) read the teacher's environment (ENV_KEPT only); (12) reach the grader's terminal or session: stdin is
/dev/null, it leads a session of its own with no controlling terminal, holds no descriptor of the grader's
but its status pipe and its dependencies' pipes, and the seccomp filter denies the ioctls that type into a
terminal (TIOCSTI, TIOCLINUX); (13) leave a trace a later grading reads: a root grader shows it the system and
the Python installation through read-only, noatime mounts of its own (`as_identity`), so reading sets no access
time; (14) set or test pages of the page cache: fadvise64, readahead, cachestat and preadv2 with RWF_NOWAIT
answer EPERM (timing a read still tells a cached page: the first paragraph is why that carries nothing);
(15) flood the grader: it keeps the last OUTPUT_BYTES of each of its stdout and stderr (`bounded_run`).
"""
import contextlib
import ctypes
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import types

IDENTITY = 65534                         # the kernel's overflow uid and gid ("nobody"): owns no file of the teacher's
MEMORY = 6 << 30                         # RLIMIT_AS, bytes
FILE_BYTES = 256 << 20                   # RLIMIT_FSIZE: the largest file it may write, bytes
PROCESSES = 256                          # RLIMIT_NPROC: processes and threads of IDENTITY
GRADING_MEMORY = 8 << 30                 # a grading's processes together, bytes of memory (their tmpfs included)
GRADING_TASKS = 1024                     # ... and processes and threads
DISK = 512 << 20                         # the size of the tmpfs a graded process's folder is (a root grader)
OUTPUT_BYTES = 64 << 10                  # the most of a process's stdout, and of its stderr, the grader keeps (the end)
GRACE = 15                               # seconds between a process's alarm and its kill
FAILED = 3                               # the worker's exit status when it could not seal itself
SEALED, NOT_SEALED = b"1", b"0"          # the one byte the worker writes to its status pipe before any student code
# user, PID, network, IPC and mount namespaces (util-linux's unshare); no uid map, so inside it the process is
# the unmapped uid; PID 1 of its namespace, so every process it forks dies with it; unshare's child gets SIGKILL
# when unshare ends, and unshare when the grader ends (PR_SET_PDEATHSIG)
NAMESPACES = ("unshare", "--user", "--pid", "--net", "--ipc", "--mount", "--mount-proc", "--fork",
              "--kill-child=SIGKILL")
ENV_KEPT = ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH")   # what the environment holds of the teacher's
SYSTEM = ["/usr", "/lib", "/lib64", "/bin", "/proc", "/sys", "/etc/ld.so.cache", "/etc/localtime"]

# Landlock (Linux >= 5.13)
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15   # ABI 2, 3 and 5
_LL_READ = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
_LL_FILE = _LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV   # the rights a file can take
_LL_NET_TCP = (1 << 0) | (1 << 1)                   # ABI 4: bind and connect TCP
_LL_SCOPES = (1 << 0) | (1 << 1)                    # ABI 6: abstract unix sockets and signals of other domains
DEVICES = {"/dev/null": _LL_READ_FILE | _LL_WRITE_FILE | _LL_TRUNCATE, "/dev/urandom": _LL_READ_FILE}

# seccomp: the system calls that answer EPERM, per architecture (the kernel's numbers)
_XATTR_AT = (463, 464, 465, 466)                    # setxattrat, getxattrat, listxattrat, removexattrat
_IO_URING = (425, 426, 427)                         # io_uring_setup, _enter, _register: they bypass seccomp
_CACHESTAT = 451                                    # cachestat: which pages of a file are in the page cache
DENIED = {
    "x86_64": (0xC000003E, 317, tuple(range(188, 200)) + _XATTR_AT + (248, 249, 250) + _IO_URING
               + (90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280) + (53, 221, 187, _CACHESTAT)),
    "aarch64": (0xC00000B7, 277, tuple(range(5, 17)) + _XATTR_AT + (217, 218, 219) + _IO_URING
                + (52, 53, 452, 54, 55, 88) + (199, 223, 213, _CACHESTAT)),
}   # (audit arch, seccomp's own number, denied: the 12 xattr calls, the *xattrat, add_key, request_key, keyctl,
#      io_uring, chmod/fchmod/fchmodat/fchmodat2, chown/fchown/lchown/fchownat, utime/utimes/futimesat/utimensat,
#      socketpair, fadvise64, readahead, cachestat)
_X32 = 0x40000000                                   # x86_64's x32 numbers are the same calls + this bit: denied all
# calls denied for some arguments only: (ioctl's number, socket's number, preadv2's number) per architecture
BY_ARGUMENT = {"x86_64": (16, 41, 327), "aarch64": (29, 198, 286)}
TIOCSTI, TIOCLINUX = 0x5412, 0x541C                 # ioctl(2) requests that type into a terminal or a console
AF_INET, AF_INET6 = 2, 10                           # the socket families allowed (its network is loopback only)
RWF_NOWAIT = 0x08                                   # preadv2's flag that answers EAGAIN for an uncached page

_CHECKED = {}
_LIBC = ctypes.CDLL(None, use_errno=True)   # loaded once: a preexec_fn runs after fork, where dlopen may deadlock


def _syscall():
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    return fn


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    try:
        syscall = _syscall()
    except (OSError, AttributeError):
        return 0
    return max(0, syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))   # landlock_create_ruleset


def landlock(readable: list, writable: list, devices: dict = DEVICES) -> int:
    """Restrict this thread (and what it starts) to reading `readable`, writing `writable` and the `devices`
    with their rights; where the kernel has them (ABI 4, 6), also no TCP, no connecting to an abstract unix
    socket and no signal outside its own domain. Returns the ABI used; 0 when the kernel has no Landlock."""
    abi = landlock_abi()
    if abi < 1:
        return 0
    syscall = _syscall()

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    fs_all = ((1 << 13) - 1) | (_LL_REFER if abi >= 2 else 0) | (_LL_TRUNCATE if abi >= 3 else 0) | (
        _LL_IOCTL_DEV if abi >= 5 else 0)
    attr = [fs_all] + ([_LL_NET_TCP] if abi >= 4 else []) + ([_LL_SCOPES] if abi >= 6 else [])
    handled = (ctypes.c_uint64 * len(attr))(*attr)
    ruleset = syscall(444, ctypes.byref(handled), ctypes.c_size_t(ctypes.sizeof(handled)), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    rules = [(p, _LL_READ) for p in readable] + [(p, fs_all) for p in writable] + list(devices.items())
    for p, rights in rules:
        if not os.path.exists(p):
            continue
        fd = os.open(p, os.O_PATH | os.O_CLOEXEC)
        allowed = (rights if os.path.isdir(p) else rights & _LL_FILE) & fs_all
        ok = syscall(445, ruleset, 1, ctypes.byref(PathBeneath(allowed, fd)), 0)
        os.close(fd)
        if ok != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {p}")
    if _no_new_privileges() != 0 or syscall(446, ruleset, 0) != 0:   # landlock_restrict_self
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)
    return abi


def _no_new_privileges() -> int:
    return ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)   # PR_SET_NO_NEW_PRIVS


def seccomp_program(arch: str) -> bytes:
    """The classic-BPF filter: another architecture is killed; a DENIED call (and, on x86_64, any x32 call),
    ioctl(fd, TIOCSTI or TIOCLINUX), socket() of any family but AF_INET and AF_INET6 (AF_UNIX, AF_NETLINK,
    AF_VSOCK, ...) and preadv2(..., RWF_NOWAIT) answer EPERM; everything else runs. An argument is read as its low
    32 bits (the kernel reads these as 32-bit ints too)."""
    audit, _, denied = DENIED[arch]
    ioctl, socket, preadv2 = BY_ARGUMENT[arch]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06   # BPF_LD|W|ABS, BPF_JMP|JEQ|K, |JGE|K, |JSET|K, BPF_RET|K
    allow, eperm, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000   # SECCOMP_RET_ALLOW, _ERRNO|EPERM, _KILL_PROCESS
    nr, arg0, arg1, arg5 = 0, 16, 24, 56                # offsets in struct seccomp_data (little-endian low halves)
    # (op, jump if true, jump if false, k), a jump being a label's name (below it) or 0 (the next instruction)
    prog = [(ld, 0, 0, 4), (jeq, 0, "kill", audit), (ld, 0, 0, nr)]   # the architecture, then the call's number
    if arch == "x86_64":
        prog.append((jge, "eperm", 0, _X32))
    prog += [(jeq, "eperm", 0, n) for n in denied]
    prog += [(jeq, "ioctl", 0, ioctl), (jeq, "socket", 0, socket), (jeq, "preadv2", 0, preadv2), (ret, 0, 0, allow),
             "ioctl", (ld, 0, 0, arg1), (jeq, "eperm", 0, TIOCSTI), (jeq, "eperm", 0, TIOCLINUX), (ret, 0, 0, allow),
             "socket", (ld, 0, 0, arg0), (jeq, "allow", 0, AF_INET), (jeq, "allow", "eperm", AF_INET6),
             "preadv2", (ld, 0, 0, arg5), (jset, "eperm", 0, RWF_NOWAIT), "allow", (ret, 0, 0, allow),
             "kill", (ret, 0, 0, kill), "eperm", (ret, 0, 0, eperm)]   # every jump goes forward
    at, code = {}, []
    for item in prog:
        if isinstance(item, str):
            at[item] = len(code)
        else:
            code.append(item)
    out = []
    for pc, (op, jt, jf, k) in enumerate(code):
        jt, jf = (at[j] - pc - 1 if isinstance(j, str) else j for j in (jt, jf))
        assert 0 <= jt < 256 and 0 <= jf < 256, "a seccomp jump longer than 255 instructions"
        out.append(struct.pack("HBBI", op, jt, jf, k))
    return b"".join(out)


def seccomp() -> None:
    """Install `seccomp_program` on every thread of this process (SECCOMP_FILTER_FLAG_TSYNC)."""
    arch = platform.machine()
    if arch not in DENIED:
        raise OSError(f"no seccomp table for {arch}")
    code = seccomp_program(arch)

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = Prog(len(code) // 8, code)
    if _no_new_privileges() != 0 or _syscall()(DENIED[arch][1], 1, 1, ctypes.byref(prog)) != 0:   # SET_MODE_FILTER
        raise OSError(ctypes.get_errno(), "seccomp")


def apply(here: str, hidden: list) -> None:
    """The graded process seals itself, before it imports anything of the student's: Landlock (read the
    system and the Python installation minus `hidden`, write `here`), then the seccomp filter. Raises OSError
    when it cannot; the worker then exits with FAILED and runs nothing."""
    readable = SYSTEM + [p for p in sys.path if p and os.path.isdir(p)] + [sys.prefix, sys.base_prefix]
    hidden = [os.path.realpath(h) for h in hidden]

    def covers(p):
        p = os.path.realpath(p)
        return any(h == p or h.startswith(p.rstrip(os.sep) + os.sep) for h in hidden)

    if landlock([p for p in readable if not covers(p)], [here]) < 1:
        raise OSError("the kernel has no Landlock")
    seccomp()


def missing() -> str:
    """What this machine lacks to seal a grading process (namespaces, Landlock, seccomp), in a few words; ""
    when it has everything. Probed once per process."""
    if "missing" not in _CHECKED:
        why = ""
        if not sys.platform.startswith("linux"):
            why = f"{sys.platform} is not Linux (no namespaces, no Landlock)"
        elif landlock_abi() < 1:
            why = "the kernel has no Landlock (Linux 5.13 or later, enabled in the LSM list)"
        elif platform.machine() not in DENIED:
            why = f"no seccomp table for {platform.machine()}"
        elif not shutil.which(NAMESPACES[0]):
            why = "no unshare command (Debian's util-linux package)"
        else:
            with tempfile.TemporaryDirectory(prefix="seal-probe-") as here:
                proc = run([sys.executable, "-c", "import torch"], here, 60)
            if proc is None or proc.returncode != 0:
                why = ("a sealed process cannot start here (" + ("it ran past 70 s" if proc is None else
                       (proc.stderr.strip().splitlines() or ["no message"])[-1]) + ")")
        _CHECKED["missing"] = why
    return _CHECKED["missing"]


def as_identity(here: str) -> list:
    """The command prefix that runs the rest as IDENTITY (a root grader only; [] otherwise): in a mount
    namespace of its own, each folder on the way to the Python installation that IDENTITY may not enter (a
    pyenv under /root) is covered by an empty tmpfs holding only the installation's own folders, bound back;
    then the system and the Python installation are bound read-only and noatime over themselves (`views`:
    reading them leaves no access time, a channel to a later grading), and setpriv drops to IDENTITY, with no
    supplementary groups."""
    if os.geteuid() != 0:
        return []
    needed = {os.path.realpath(p) for p in [sys.executable, sys.prefix, sys.base_prefix] + sys.path
              if p and os.path.exists(p)}
    covers = {}   # {a folder IDENTITY may not enter: the entries of it on the way to a needed path}
    for path in sorted(needed):
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            folder = "/" + "/".join(parts[:i])
            if not os.stat(folder).st_mode & 0o001:   # others may not search it
                covers.setdefault(folder, set()).add(folder + "/" + parts[i])
                break
    script = ["set -e"]
    for k, (folder, entries) in enumerate(sorted(covers.items())):
        staged = []
        for j, entry in enumerate(sorted(entries)):
            stage = os.path.join(here, f".view{k}-{j}")
            script += [f"mkdir {shlex.quote(stage)}", f"mount --rbind {shlex.quote(entry)} {shlex.quote(stage)}"]
            staged.append((stage, entry))
        script.append(f"mount -t tmpfs -o mode=755,size=1m tmpfs {shlex.quote(folder)}")
        for stage, entry in staged:
            script += [f"mkdir -p {shlex.quote(entry)}", f"mount --move {shlex.quote(stage)} {shlex.quote(entry)}"]
    tops, below = views(needed)
    for view in tops:
        q = shlex.quote(view)
        script += [f"mount --rbind {q} {q}", f"mount -o remount,bind,ro,noatime,nosuid,nodev {q}"]
    script += [f"mount -o remount,bind,ro,noatime,nosuid,nodev {shlex.quote(m)} || true" for m in below]
    script.append(f'exec setpriv --reuid={IDENTITY} --regid={IDENTITY} --clear-groups --pdeathsig=KILL "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(script), "sh"]


def views(needed) -> tuple[list, list]:
    """The paths `as_identity` binds read-only and noatime over themselves: the system's (SYSTEM but /proc, which
    the PID namespace mounts afresh) and `needed`, none inside another; and the mounts below them, which the
    recursive bind copies and each need their own remount (outermost first)."""
    paths = sorted({os.path.realpath(p) for p in [*SYSTEM, *needed] if p != "/proc" and os.path.exists(p)})
    tops = [p for p in paths if not any(p.startswith(q.rstrip("/") + "/") for q in paths if q != p)]
    below = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if any(point.startswith(t.rstrip("/") + "/") for t in tops) and point not in below:
                below.append(point)
    return tops, sorted(below, key=lambda p: p.count("/"))


def identity_note() -> str:
    """One line for the report when the graded processes keep the teacher's uid ("" when they run as IDENTITY)."""
    if os.geteuid() == 0:
        return ""
    return ("note: graded under your own uid (the grader is not root, so it cannot change it); the seccomp "
            "filter, not the uid, keeps the graded code from changing your files' attributes")


def give_folder(here: str) -> None:
    """Hand the graded process its folder: owned by IDENTITY when it runs as that."""
    if os.geteuid() == 0:
        for d, dirs, files in os.walk(here):
            for p in [d] + [os.path.join(d, n) for n in dirs + files]:
                os.lchown(p, IDENTITY, IDENTITY)


def limits(seconds: int) -> None:
    """Popen's preexec_fn: memory, process and CPU limits; the child (unshare) gets SIGKILL when the grader's
    process ends, however it ends."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    nproc = PROCESSES if os.geteuid() == 0 else PROCESSES + _own_tasks()   # root drops to IDENTITY
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + GRACE))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    _LIBC.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG


def _own_tasks() -> int:
    """Processes and threads of this uid now (RLIMIT_NPROC counts them all): the limit is set above them."""
    n, uid = 0, os.getuid()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return n


def run(argv: list, here: str, seconds: int, sealed: bool = True, pass_fds=()):
    """Run `argv` in `here` as a graded process: inside NAMESPACES as IDENTITY (`as_identity`; when `sealed`), under
    `limits` and the grading's cgroup (`grading_limits`), with `environment`, killed `seconds` + GRACE after it
    starts; `pass_fds` stay open in it (the status pipe, the dependencies' pipes) and no other descriptor of the
    grader's; stdin is /dev/null and it starts a session of its own (no controlling terminal). Returns what
    `bounded_run` does. The process seals the rest itself (`apply`) before it runs anything untrusted."""
    if sealed:
        give_folder(here)
    prefix = [*as_identity(here), *NAMESPACES] if sealed else []

    def limited():
        join_grading()
        limits(seconds)
    return bounded_run([*prefix, *argv], seconds + GRACE, cwd=here, env=environment(here), preexec_fn=limited,
                       pass_fds=pass_fds)


class _Tail(threading.Thread):
    """Reads a pipe to its end, keeping its last OUTPUT_BYTES only."""

    def __init__(self, pipe):
        super().__init__(daemon=True)
        self.pipe, self.kept = pipe, bytearray()

    def run(self):
        try:
            while chunk := os.read(self.pipe.fileno(), 1 << 16):
                self.kept += chunk
                if len(self.kept) > OUTPUT_BYTES:
                    del self.kept[:-OUTPUT_BYTES]
        except (OSError, ValueError):
            pass


def bounded_run(argv: list, seconds: float, cwd=None, env=None, preexec_fn=None, pass_fds=(),
                stdin=subprocess.DEVNULL):
    """Run `argv` in a session of its own, its stdout and stderr each read to the end and kept to their last
    OUTPUT_BYTES (a process that writes a gigabyte costs the grader no memory), killed with its process group after
    `seconds`. Returns (returncode, stdout, stderr) as a namespace, or None when it was killed for time."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=preexec_fn, pass_fds=pass_fds, start_new_session=True, close_fds=True)
    tails = [_Tail(proc.stdout), _Tail(proc.stderr)]
    for t in tails:
        t.start()
    try:
        returncode = proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        stop(proc)
        returncode = None
    for t in tails:
        t.join(timeout=10)   # an orphan of an unsealed process may hold the pipe: not waited for longer
    proc.stdout.close()
    proc.stderr.close()
    if returncode is None:
        return None
    out, err = (bytes(t.kept).decode("utf-8", "replace") for t in tails)
    return types.SimpleNamespace(returncode=returncode, stdout=out, stderr=err)


def start(argv: list, cwd: str, preexec_fn, pass_fds, env):
    """Start `argv` in a session of its own with no stdin, stdout or stderr (the grader's reference process)."""
    return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, preexec_fn=preexec_fn, pass_fds=pass_fds,
                            start_new_session=True, close_fds=True)


def stop(proc) -> None:
    """Kill `proc` and its process group, and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def ended(returncode: int) -> str:
    """How a process ended, in words ("killed by SIGXCPU", "exit status 1")."""
    signum = -returncode if returncode < 0 else 0
    return f"killed by {signal.Signals(signum).name}" if signum in signal.valid_signals() else \
        f"exit status {returncode}"


# ---------------------------------------------------------------------------------------------------
# a grading's totals: one cgroup for its processes, a tmpfs for each graded process's folder (a root grader)
# ---------------------------------------------------------------------------------------------------
_GRADING = {}   # {"procs": [cgroup.procs files the graded processes join]} while a grading runs


def _cgroup_dirs() -> list:
    """[(controller, folder of this process's cgroup)] for memory and pids: cgroup v2's unified tree when it has
    both controllers, else v1's own hierarchies; [] when there are none."""
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        lines = [ln.rstrip("\n").split(":", 2) for ln in f]
    unified = next((path for k, ctl, path in lines if k == "0" and ctl == ""), None)
    for base in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
        try:
            with open(os.path.join(base, "cgroup.controllers"), encoding="utf-8") as f:
                have = f.read().split()
        except OSError:
            continue
        if unified is not None and {"memory", "pids"} <= set(have):
            return [("v2", base + unified)]
    found = []
    for _, ctl, path in lines:
        for name in ("memory", "pids"):
            if name in ctl.split(",") and os.path.isdir(f"/sys/fs/cgroup/{name}"):
                found.append((name, f"/sys/fs/cgroup/{name}{path}"))
    return found if {c for c, _ in found} == {"memory", "pids"} else []


@contextlib.contextmanager
def grading_limits():
    """Within the block, every graded process joins one cgroup of this grading (a root grader on a machine with
    the memory and pids controllers): GRADING_MEMORY of memory and GRADING_TASKS processes and threads for all of
    them together, each process's rlimits still its own (elsewhere, the rlimits only)."""
    made = []
    if os.geteuid() == 0 and sys.platform.startswith("linux"):
        try:
            for controller, parent in _cgroup_dirs():
                path = os.path.join(parent, f"scope-grading-{os.getpid()}-{len(made)}")
                os.mkdir(path)
                made.append(path)
                settings = {"v2": {"memory.max": GRADING_MEMORY, "memory.swap.max": 0, "pids.max": GRADING_TASKS},
                            "memory": {"memory.limit_in_bytes": GRADING_MEMORY},
                            "pids": {"pids.max": GRADING_TASKS}}[controller]
                for key, value in settings.items():
                    with contextlib.suppress(FileNotFoundError):
                        with open(os.path.join(path, key), "w") as f:
                            f.write(str(value))
        except OSError:
            made = _remove_cgroups(made)
    _GRADING["procs"] = [os.path.join(p, "cgroup.procs") for p in made]
    try:
        yield
    finally:
        _GRADING.clear()
        _remove_cgroups(made)


def _remove_cgroups(paths: list) -> list:
    import time

    for path in paths:
        for _ in range(50):   # its last processes may still be exiting
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)
    return []


def join_grading() -> None:
    """Popen's preexec_fn: this process joins the grading's cgroups (`grading_limits`), if any."""
    for procs in _GRADING.get("procs", ()):
        fd = os.open(procs, os.O_WRONLY)
        os.write(fd, b"0")
        os.close(fd)


@contextlib.contextmanager
def own_disk(here: str):
    """Within the block, `here` is a tmpfs of DISK bytes (a root grader; as it is otherwise), unmounted after: a
    graded process's files together, not just each one (RLIMIT_FSIZE), have a bound, and its pages count in the
    grading's memory."""
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK},mode=0755,nosuid,nodev", "tmpfs", here],
        capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", here], capture_output=True)


def environment(here: str) -> dict:
    """The graded process's whole environment: ENV_KEPT of the teacher's, its folder as home and temp."""
    env = {k: os.environ[k] for k in ENV_KEPT if k in os.environ}
    env.update(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), TOKENIZERS_PARALLELISM="false",
               HOME=here, TMPDIR=here, PWD=here, PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1",
               PYTHONFAULTHANDLER="1")
    return env
