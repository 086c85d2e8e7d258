"""Running model-written Python, which is hostile by default, in a separate process.

`run_python(code, limits)` writes the code to `main.py` in a fresh temporary directory and runs
`sys.executable -I -B sandbox_child.py CONFIG` there: that file, run as a script, is the bootstrap. It
sets up the boundaries as root, drops to an unprivileged uid, installs an audit hook and runs
`main.py`. Nothing happens between fork and exec (no `preexec_fn`): `preexec_fn` is not safe in a
threaded parent such as a Ray actor, and the bootstrap is a fresh, single-threaded process.

The boundaries, with what was measured on the development machine (a Firecracker VM, Linux 6.18,
Python 3.11.7, running as root with every capability; `sandbox_support()` probes them once per
process and falls back to what works elsewhere):

* network: `unshare(CLONE_NEWNET)` works as root (also CLONE_NEWUSER|CLONE_NEWNET as uid 65534):
  the code gets a namespace with only a loopback that is down, `connect` to 127.0.0.1 fails with
  ENETUNREACH. Python 3.11 has no `os.unshare`; it is called through ctypes.
* processes: RLIMIT_NPROC counts the processes *and threads* of a real uid and does not apply to
  root, so the code runs as its own uid, a random one in [2_000_000_000, 2_000_000_000 + 2**24)
  (not 65534: sandboxes running at once would share its count, and other `nobody` processes count
  too). Measured: as that uid with RLIMIT_NPROC=2, the second `os.fork()` and `libc.fork()` fail
  with EAGAIN, and a thread cannot start. Running as another uid needs the interpreter to be
  reachable: here it lives under /root (mode 0700), so that needs the private filesystem below.
* files: `unshare(CLONE_NEWNS)` works as root. In the private mount namespace every mount is
  remounted read-only, nosuid and nodev; /tmp and /var/tmp are replaced by empty read-only tmpfs
  (they hold other programs' files and unix sockets, which a network namespace does not isolate;
  /dev/shm goes with /dev, below); /proc is a new instance with hidepid=2 (no other process's command line). What the
  code can read is a minimal tree (`read_only_tree`): the system directories and the interpreter's
  own paths; every other directory on the way to those (a checkout with its datasets and run dirs,
  /root, a temp dir holding a CI clone) is replaced by a read-only tmpfs holding only the entries on
  that way, and so is this project's checkout, the working directory and the home directory wherever
  they are (/usr/src/app); every other top-level directory (/home, /run, /mnt, /opt, ...) and every
  directory mounted under /etc or /var (a Kubernetes token) by an empty one; /dev by the harmless
  nodes alone (null, zero, full, random, urandom and the fd/std* links). If the tree cannot be
  worked out, the private filesystem counts as unavailable (fail closed). The working directory is a
  tmpfs of 8 x max_file_bytes + the code, owned by the sandbox uid, the only writable place.
  With the mount namespace comes an IPC namespace (CLONE_NEWIPC): the host's SysV shared memory,
  semaphores and message queues and its POSIX message queues, which no mount hides, are not the
  code's (a segment or queue anyone may read, made by the caller, is not there).
* the whole tree dies: the code runs in a new session; afterwards (exit, timeout or too much
  output) its process group is killed, then every process of the sandbox uid (found in /proc:
  a grandchild that left the group with `setsid` is killed too).
* rlimits, set as root before dropping privileges so the code cannot raise them: RLIMIT_CPU
  (soft: SIGXCPU, hard +1 s: SIGKILL), RLIMIT_AS, RLIMIT_FSIZE (Python ignores SIGXFSZ: a write
  fails with EFBIG), RLIMIT_NPROC = 1 + max_processes, RLIMIT_CORE = 0; PR_SET_NO_NEW_PRIVS.
* the audit hook (`sys.addaudithook`, defence in depth only: ctypes, `_posixsubprocess` or
  `os.open(..., dir_fd=)` get around it) refuses sockets, starting processes, writing or renaming
  outside the working directory, signalling other processes, and ctypes look-ups of libc calls
  that would do the same.

Not root (a Slurm or Kubernetes job that allows unprivileged user namespaces): the same boundaries
come from a user namespace of the code's own (`SandboxSupport.user_namespace`; the mode bubblewrap
uses). The bootstrap unshares user, mount, network, pid and IPC namespaces, maps its uid to the
namespace's 0 and forks pid 1 of the new pid namespace, which builds the same private read-only tree
and forks the code's process (pid 2: a namespace's init ignores signals it has no handler for,
SIGXCPU included); that process leaves the caller's session and drops every capability (bounding
set included) before the code runs. pid 1 reports the code's wait status and exits when the code's
process ends, which kills everything left in the namespace; the bootstrap ends as the code did.
The pid namespace stands in for the separate uid: the code sees, signals and traces no process of
the host (no /proc/<pid>/environ of the caller), RLIMIT_NPROC counts the namespace's processes
alone on Linux >= 5.14 (per user namespace; older kernels count every process of the caller's
uid, the engine's threads included, so the code could start none: measured here on 6.18 only) --
the bootstrap, pid 1 and the code count: 3 + max_processes -- and every process it starts
dies with it. Measured as uid 65534 here via `setpriv` (tests/env/test_sandbox_hostile_corpus.py: the
same 29 hostile programs as root, all held); a container whose seccomp profile refuses `unshare` or
the new /proc falls back to what works. Where unprivileged user namespaces are off (a default Docker
container) the code runs with a network namespace at most, no private filesystem, and only the
audit hook in the way of writes -- `env=python_tool` is then refused unless env.allow_weak_sandbox=true.
As root, though, the code never runs as root (which no hidepid, read-only mount or rlimit stops: it
reads /proc/<any pid>/environ, the caller's secrets included): where no separate uid works, as root,
`run_python` refuses to run it. A probe run that fails is retried (_PROBE_ATTEMPTS) before a boundary
is given up: on a loaded machine one run can time out, and that must not cost the uid. A result a
timed-out run weakened is probed again after _REPROBE_S, so one bad moment does not weaken a process
for good.

`-I` makes the child ignore PYTHON* variables: -B does what PYTHONDONTWRITEBYTECODE asks, but
PYTHONHASHSEED=0 reaches only what the code would start (str hashing in the code is randomised).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from rlhf_orch.env.sandbox_child import (
    CODE_FILE,
    SETUP_FAILED,
    SETUP_FAILED_EXIT,
    mount_points,
)
from rlhf_orch.env.sandbox_view import hidden_dirs, interpreter_paths, merged_plans, private_locations, read_only_tree

logger = logging.getLogger(__name__)

# The bootstrap the child runs as a script (rlhf_orch/env/sandbox_child.py).
_BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
_SANDBOX_UID_BASE = 2_000_000_000
_SANDBOX_UID_SPAN = 2**24
_MIN_OUTPUT_CAP = 64 * 1024  # read at least this much before stopping a chatty program
_PROBE_ATTEMPTS = 3  # runs of one probe before its boundary is given up
_REPROBE_S = 60.0  # a degraded result is probed again after this long
SANDBOX_UNAVAILABLE = "sandbox unavailable: "


# ---------------------------------------------------------------------------------------------
# Limits and results
# ---------------------------------------------------------------------------------------------


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    valid = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        raise ValueError(f"SandboxLimits.{name}={value!r}: must be an integer {valid}")


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. max_processes counts threads too (RLIMIT_NPROC does)."""

    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 5
    memory_mb: int = 512  # address space
    max_processes: int = 1  # beyond the program itself
    max_output_bytes: int = 10_000  # what the model sees
    max_file_bytes: int = 1_000_000  # per file

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"SandboxLimits.timeout_s={t!r}: must be a finite number of seconds > 0")
        _check_int("cpu_s", self.cpu_s, 1)
        _check_int("memory_mb", self.memory_mb, 16)
        _check_int("max_processes", self.max_processes, 0, 1024)
        _check_int("max_output_bytes", self.max_output_bytes, 1)
        _check_int("max_file_bytes", self.max_file_bytes, 0)


_SIGNAL_REASONS = {
    signal.SIGKILL: "memory or CPU limit",
    signal.SIGXCPU: "CPU time limit",
    signal.SIGXFSZ: "file size limit",
}


@dataclass
class ToolResult:
    """One run. exit_code: the program's status, -N if signal N killed it, None if we stopped it."""

    output: str  # stdout and stderr interleaved, cut to max_output_bytes with a marker line
    exit_code: int | None
    timed_out: bool
    truncated: bool
    error: bool  # non-zero exit, a signal, a timeout, or stopped for too much output
    seconds: float
    timeout_s: float = 0.0  # for the observation's "[timed out after ...]"
    stopped_for_output: bool = False

    def status_line(self) -> str | None:
        if self.timed_out:
            return f"[timed out after {self.timeout_s:g}s]"
        if self.stopped_for_output:
            return "[stopped: too much output]"
        if self.exit_code is not None and self.exit_code < 0:
            try:
                name = signal.Signals(-self.exit_code).name
            except ValueError:
                name = str(-self.exit_code)
            reason = _SIGNAL_REASONS.get(-self.exit_code)
            return f"[killed by signal {name}: {reason}]" if reason else f"[killed by signal {name}]"
        if self.exit_code:
            return f"[exit code {self.exit_code}]"
        return None

    def observation(self) -> str:
        """Exactly the text the model gets: the output, then one status line if something went wrong."""
        status = self.status_line()
        if status is None:
            return self.output
        separator = "\n" if self.output and not self.output.endswith("\n") else ""
        return f"{self.output}{separator}{status}"


class _OutputBuffer:
    """Keeps the head and the tail of a stream, so a traceback after much output is still seen."""

    def __init__(self, max_bytes: int):
        self.head_limit = max_bytes - max_bytes // 2
        self.tail_limit = max_bytes // 2
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail_limit:
            self.tail += chunk
            if len(self.tail) > self.tail_limit:
                del self.tail[: len(self.tail) - self.tail_limit]

    def text(self) -> tuple[str, bool]:
        kept = len(self.head) + len(self.tail)
        if self.total == kept:
            return (self.head + self.tail).decode("utf-8", "replace"), False
        head_text = _whole_characters(bytes(self.head)).decode("utf-8", "replace")
        tail = bytes(self.tail)
        start = 0
        while start < min(3, len(tail)) and (tail[start] & 0xC0) == 0x80:  # the rest of a cut character
            start += 1
        tail_text = tail[start:].decode("utf-8", "replace")
        newline = "\n" if head_text and not head_text.endswith("\n") else ""
        marker = f"[output truncated: {self.total - kept} bytes cut]\n"
        return f"{head_text}{newline}{marker}{tail_text}", True


def _whole_characters(data: bytes) -> bytes:
    """`data` without a UTF-8 character cut at its end."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # the first byte of the last character
            need = 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4 if byte >> 3 == 0b11110 else 1
            return data if need <= back else data[:-back]
    return data


# ---------------------------------------------------------------------------------------------
# What this machine allows (probed once per process)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SandboxSupport:
    """Which OS boundaries work here; the audit hook and the rlimits are always there."""

    network_namespace: bool  # the code has no network (CLONE_NEWNET)
    private_filesystem: bool  # read-only mounts, masked /tmp, a tmpfs work dir (CLONE_NEWNS)
    separate_uid: bool  # the code runs as its own unprivileged uid: RLIMIT_NPROC holds
    # Not root: the three above come from a user namespace of the code's own, with a pid namespace
    # standing in for the separate uid (it sees, signals and traces no process of the host; every
    # process it starts dies with it; RLIMIT_NPROC counts the namespace's processes alone).
    user_namespace: bool = False

    @property
    def missing(self) -> list[str]:
        """The boundaries that do not work here."""
        names = {
            "network_namespace": "network namespace",
            "private_filesystem": "private read-only filesystem",
            "separate_uid": "separate uid",
        }
        return [name for field, name in names.items() if not getattr(self, field)]

    def describe(self) -> str:
        def word(ok: bool) -> str:
            return "yes" if ok else "no"

        how = " (a user and a pid namespace of its own, not root)" if self.user_namespace else ""
        return (
            f"sandbox: network namespace {word(self.network_namespace)}, private read-only filesystem "
            f"{word(self.private_filesystem)}, separate uid {word(self.separate_uid)}{how}"
        )


_support_lock = threading.Lock()
_support: SandboxSupport | None = None
_support_checked = 0.0  # time.monotonic() of the probe that gave _support
_probe_timed_out = False  # a run of that probe timed out: the result may be load, not the host
_hidden_dirs_plan: list[tuple[str, list[str]]] = []
# What the code sees of the filesystem beyond the system directories (`read_only_tree`): the
# entries on the way to the interpreter's paths, nothing else of checkouts, homes, temp dirs, /dev.
_read_only_plan: list[tuple[str, list[str]]] | None = []  # None: could not be made (no private filesystem)


def sandbox_support() -> SandboxSupport:
    """Probe (once per process, a few child runs) which OS boundaries work on this machine.

    A result that a timed-out probe run weakened is probed again after _REPROBE_S (a moment of load)."""
    global _support, _support_checked, _probe_timed_out
    with _support_lock:
        # Only a result that a timed-out probe run weakened is probed again (load passes; a host
        # without namespaces stays one, and probing it again would cost every call a lock wait).
        stale = _support is not None and _probe_timed_out and time.monotonic() - _support_checked > _REPROBE_S
        if _support is None or stale:
            _probe_timed_out = False
            _support = _probe_support()
            _support_checked = time.monotonic()
            if _support == _full_support():
                logger.info(_support.describe())
            else:
                logger.warning("%s (not every boundary works here)", _support.describe())
        return _support


def _note_timeout(timed_out: bool) -> None:
    global _probe_timed_out
    _probe_timed_out = _probe_timed_out or timed_out


def _full_support() -> SandboxSupport:
    return SandboxSupport(
        network_namespace=True, private_filesystem=True, separate_uid=True, user_namespace=os.geteuid() != 0
    )


def _probe_support() -> SandboxSupport:
    global _hidden_dirs_plan, _read_only_plan
    root = os.geteuid() == 0
    try:
        paths = interpreter_paths()
        if root:  # (the code's own uid must reach the interpreter; in a user namespace it is the caller's)
            _hidden_dirs_plan = hidden_dirs(paths + [tempfile.gettempdir()])
        _read_only_plan = read_only_tree(paths, private_locations(), mounts=[m for m, _ in mount_points()])
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        # Fail closed: without the tree the private filesystem would show everything.
        _read_only_plan = None
        logger.warning("sandbox: could not list the interpreter's paths (%s): no private filesystem", e)
    # Imports after the uid changed prove the interpreter is still reachable; "ok" proves setup worked.
    probe_code = "import decimal, fractions, json\nprint('ok')\n"

    def works(candidate: SandboxSupport) -> bool:
        # Retried: a run that times out on a loaded machine says nothing about the boundary.
        for attempt in range(1, _PROBE_ATTEMPTS + 1):
            result = _run(probe_code, SandboxLimits(timeout_s=20.0), candidate, audit_hook=True)
            if result.output == "ok\n" and result.exit_code == 0:
                return True
            _note_timeout(result.timed_out)
            logger.warning(
                "sandbox probe %s failed (attempt %d of %d, exit %s, timed out %s): %r",
                candidate,
                attempt,
                _PROBE_ATTEMPTS,
                result.exit_code,
                result.timed_out,
                result.output[-500:],
            )
        return False

    full = _full_support()
    if _read_only_plan is not None and works(full):
        return full
    network = works(SandboxSupport(True, False, False))
    filesystem = root and _read_only_plan is not None and works(SandboxSupport(network, True, False))
    uid = root and works(SandboxSupport(network, filesystem, True))
    return SandboxSupport(network, filesystem, uid)


# ---------------------------------------------------------------------------------------------
# The parent side: start the bootstrap, read its output, kill what is left, clean up
# ---------------------------------------------------------------------------------------------


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, audit_hook: bool = True) -> ToolResult:
    """Run `code` in the sandbox. Never raises for what the code does; returns within timeout_s + ~1 s.

    audit_hook=False leaves only the OS boundaries (the tests use it to check that they hold alone).
    """
    if not isinstance(limits, SandboxLimits):
        raise TypeError(f"limits must be a SandboxLimits, not {type(limits).__name__}")
    support = sandbox_support()
    if os.geteuid() == 0 and not support.separate_uid:
        # Fail closed: as root the code would read every process's /proc/<pid>/environ (hidepid does not
        # hide processes from root), write where the mounts allow, and undo the mounts themselves.
        message = f"{SANDBOX_UNAVAILABLE}the code would run as root ({support.describe()})"
        logger.error("%s", message)
        return ToolResult(
            output=message + "\n",
            exit_code=SETUP_FAILED_EXIT,
            timed_out=False,
            truncated=False,
            error=True,
            seconds=0.0,
            timeout_s=limits.timeout_s,
        )
    return _run(code, limits, support, audit_hook)


def _child_env(workdir: str) -> dict[str, str]:
    # Nothing inherited: the parent's environment holds tokens and cluster addresses.
    # The thread counts keep numpy's BLAS from starting threads that RLIMIT_NPROC would refuse.
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _run(code: str, limits: SandboxLimits, support: SandboxSupport, audit_hook: bool) -> ToolResult:
    source = code.encode("utf-8", "replace")
    own_uid = support.separate_uid and not support.user_namespace  # (in a user namespace: the caller's)
    uid = _SANDBOX_UID_BASE + secrets.randbelow(_SANDBOX_UID_SPAN) if own_uid else None
    workdir = os.path.realpath(tempfile.mkdtemp(prefix="rlhf_orch_sandbox_"))
    started = time.monotonic()
    try:
        with open(os.path.join(workdir, CODE_FILE), "wb") as f:
            f.write(source)
        if uid is not None:
            os.chown(workdir, uid, uid)
            os.chown(os.path.join(workdir, CODE_FILE), uid, uid)
        config = {
            "workdir": workdir,
            "uid": uid,
            "network_namespace": support.network_namespace,
            "user_namespace": support.user_namespace,
            "private_filesystem": support.private_filesystem,
            "hidden_dirs": merged_plans(
                _hidden_dirs_plan if uid is not None else [], _read_only_plan if support.private_filesystem else []
            ),
            "workdir_bytes": 8 * limits.max_file_bytes + len(source) + 64 * 1024,
            "limits": asdict(limits),
            "audit_hook": audit_hook,
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", _BOOTSTRAP, json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=_child_env(workdir),
            start_new_session=True,
            close_fds=True,
        )
        try:
            buffer = _OutputBuffer(limits.max_output_bytes)
            cap = max(4 * limits.max_output_bytes, _MIN_OUTPUT_CAP)
            ended = _collect(proc, buffer, cap, started + limits.timeout_s)
        finally:
            _kill_tree(proc, uid)
            proc.stdout.close()
        seconds = time.monotonic() - started
    finally:
        _remove_tree(workdir)
    output, truncated = buffer.text()
    timed_out = ended == "timeout"
    stopped = ended == "output"
    exit_code = None if timed_out or stopped else proc.returncode
    if exit_code == SETUP_FAILED_EXIT and output.startswith(SETUP_FAILED):
        logger.warning("%s", output.strip())
    return ToolResult(
        output=output,
        exit_code=exit_code,
        timed_out=timed_out,
        truncated=truncated,
        error=timed_out or stopped or exit_code != 0,
        seconds=seconds,
        timeout_s=limits.timeout_s,
        stopped_for_output=stopped,
    )


def _collect(proc: subprocess.Popen, buffer: _OutputBuffer, cap: int, deadline: float) -> str:
    """Read output until the program exits ("exit"), the deadline passes ("timeout") or it has
    written more than `cap` bytes ("output"). Exit is watched on a pidfd, not on the pipe's end:
    a grandchild may hold the pipe open long after the program itself is done."""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None  # old kernel: poll the process every 50 ms instead
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        if pidfd is not None:
            selector.register(pidfd, selectors.EVENT_READ)
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout"
                events = selector.select(remaining if pidfd is not None else min(remaining, 0.05))
                exited = False
                for key, _ in events:
                    if key.fd == fd:
                        if not _read_available(fd, buffer):
                            selector.unregister(fd)
                    else:
                        exited = True
                if buffer.total > cap:
                    return "output"
                if exited or (pidfd is None and proc.poll() is not None):
                    _read_available(fd, buffer, until=cap)
                    return "exit"
        finally:
            if pidfd is not None:
                os.close(pidfd)


def _read_available(fd: int, buffer: _OutputBuffer, until: int | None = None) -> bool:
    """Read what the pipe holds now; False at its end. Stops once buffer.total passes `until`."""
    while until is None or buffer.total <= until:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        buffer.add(chunk)
        if until is None:
            return True  # one read per wake-up keeps the loop checking the deadline and the cap
    return True


def _kill_tree(proc: subprocess.Popen, uid: int | None) -> None:
    """Kill the program's process group and, when it had its own uid, every process of that uid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the leader is not reaped yet, so the group id is ours
    except (ProcessLookupError, PermissionError):
        pass
    if uid is not None:
        _kill_uid(uid)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        logger.warning("sandbox: process %d did not die after SIGKILL", proc.pid)


def _kill_uid(uid: int) -> None:
    """SIGKILL every live process of `uid`, until a scan of /proc finds none."""
    for _ in range(100):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/status", "rb") as f:
                    status = f.read().decode("ascii", "replace")
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("State", "").strip().startswith("Z"):
                continue  # already dead, waiting for its parent
            if str(uid) in fields.get("Uid", "").split():
                found = True
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if not found:
            return
        time.sleep(0.001)
    logger.warning("sandbox: processes of uid %d survive SIGKILL", uid)


def _remove_tree(path: str) -> None:
    def make_writable_and_retry(function, failed_path, _exc_info) -> None:
        # The code may have taken its own permissions away (when it ran as our uid).
        try:
            os.chmod(os.path.dirname(failed_path), 0o700)
            os.chmod(failed_path, 0o700)
            function(failed_path)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable_and_retry)
