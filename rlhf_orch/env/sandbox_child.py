"""The child side of the sandbox: `python -I -B sandbox_child.py CONFIG`, run by
`rlhf_orch.env.sandbox.run_python` in the code's working directory. It sets up the boundaries
(namespaces, private filesystem, rlimits) as root and drops to the sandbox uid, or, not root, in a
user namespace of its own and then drops every capability; installs the audit hook and runs
`main.py`. It is started in isolated mode, so it imports nothing of the project: everything it
needs is in this file (the parent imports the constants below from it).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import sys

CODE_FILE = "main.py"
MASKED_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# Top-level directories the code may read (the system's programs, libraries, configuration); every
# other one -- home directories, checkouts, datasets, run dirs, /run, /mnt, /opt ... -- is hidden
# behind an empty read-only tmpfs but for the entries on the way to the interpreter's own paths.
SYSTEM_DIRS = frozenset(
    {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "sys", "var", "tmp", "dev"}
)
# The device nodes the code keeps: /dev is replaced by these alone (no GPU, disk or /dev/kvm node).
KEPT_DEVICES = ("null", "zero", "full", "random", "urandom", "fd", "stdin", "stdout", "stderr")
SETUP_FAILED_EXIT = 125
SETUP_FAILED = "sandbox setup failed: "
_BOOTSTRAP = os.path.abspath(__file__)

# ---------------------------------------------------------------------------------------------
# The child side: `python -I -B sandbox_child.py CONFIG` sets up the boundaries, then runs main.py
# ---------------------------------------------------------------------------------------------

_CLONE_NEWNS = 0x00020000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_KEPT = {"nodev": _MS_NODEV, "noexec": _MS_NOEXEC, "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21}
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_CAPABILITY_VERSION_3 = 0x20080522


class _SetupError(Exception):
    pass


class _Libc:
    """The few system calls Python 3.11 does not wrap (os.unshare is 3.12)."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def _check(self, result: int, what: str, allowed: tuple[int, ...] = ()) -> int:
        if result != 0:
            err = self._ctypes.get_errno()
            if err not in allowed:
                raise _SetupError(f"{what}: {os.strerror(err)}")
            return err
        return 0

    def unshare(self, flags: int) -> None:
        self._check(self._libc.unshare(flags), f"unshare({flags:#x})")

    def mount(
        self,
        source: str | None,
        target: str,
        fstype: str | None,
        flags: int,
        data: str | None = None,
        allowed: tuple[int, ...] = (),
    ) -> int:
        def c(s: str | None) -> bytes | None:
            return None if s is None else os.fsencode(s)

        return self._check(
            self._libc.mount(c(source), c(target), c(fstype), flags, c(data)), f"mount {target}", allowed
        )

    def prctl(self, option: int, value: int) -> None:
        self._check(self._libc.prctl(option, value, 0, 0, 0), f"prctl({option})")

    def drop_capabilities(self) -> None:
        """No capability left, none to regain: the bounding set emptied (an exec, even as the
        namespace's uid 0, gets none back), then the effective, permitted and inheritable sets."""
        ctypes = self._ctypes
        cap = 0
        while self._libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
            cap += 1
        if cap == 0:
            raise _SetupError(f"prctl(PR_CAPBSET_DROP): {os.strerror(ctypes.get_errno())}")

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [
                ("effective", ctypes.c_uint32),
                ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32),
            ]

        self._check(self._libc.capset(ctypes.byref(Header(_CAPABILITY_VERSION_3, 0)), (Data * 2)()), "capset")
        with open("/proc/self/status") as f:
            held = [line.split()[1] for line in f if line.startswith(("CapEff:", "CapPrm:", "CapBnd:", "CapAmb:"))]
        if len(held) != 4 or any(int(mask, 16) for mask in held):
            raise _SetupError(f"capabilities still held: {held}")


def mount_points() -> list[tuple[str, set[str]]]:
    """(mount point, its per-mount options) for every mount this process sees."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            path = fields[4]
            for escaped, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                path = path.replace(escaped, char)
            points.append((path, set(fields[5].split(","))))
    return points


def _private_filesystem(libc: _Libc, config: dict, source: bytes) -> None:
    """A mount namespace where only the work dir is writable and the host's temp dirs are hidden, and
    an IPC namespace: SysV shared memory, semaphores and message queues and POSIX message queues are
    the host's otherwise (no mount hides them; /dev/shm, POSIX shared memory, goes with /dev)."""
    workdir, uid = config["workdir"], config["uid"]
    libc.unshare(_CLONE_NEWNS | _CLONE_NEWIPC)
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing we mount reaches the host
    # Open what the hidden directories must still show before a tmpfs covers them.
    exposed = []  # (directory, name, a symlink's target or an O_PATH descriptor of the entry)
    for directory, names in config["hidden_dirs"]:
        for name in names:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                exposed.append((directory, name, os.readlink(path)))
            elif os.path.lexists(path):
                exposed.append((directory, name, os.open(path, os.O_PATH)))
    for path, options in mount_points():
        # Every mount read-only, no set-uid, no device nodes (the kept ones are bound below).
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        for option, flag in _MS_KEPT.items():
            if option in options:
                flags |= flag
        # ENOENT/EINVAL: a mount under another mount, which nothing here can reach.
        libc.mount(None, path, None, flags, allowed=(errno.ENOENT, errno.EINVAL))
    new_mounts = []
    for directory in MASKED_DIRS:
        if os.path.isdir(directory):
            libc.mount("tmpfs", directory, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k,nr_inodes=256")
            new_mounts.append(directory)
    # Shallowest first, each directory emptied and then given back its exposed entries, so that a
    # deeper hidden directory (an exposed entry of this one) exists when its turn comes.
    for directory in dict.fromkeys(d for d, _ in config["hidden_dirs"]):
        if not os.path.isdir(directory):
            continue  # (its entries' descriptors are closed below: none reaches the code)
        libc.mount("tmpfs", directory, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=64k,nr_inodes=256")
        new_mounts.append(directory)
        for name, entry in [(n, e) for d, n, e in exposed if d == directory]:
            target = os.path.join(directory, name)
            if isinstance(entry, str):
                os.symlink(entry, target)
                continue
            original = f"/proc/self/fd/{entry}"
            if os.path.isdir(original):
                os.mkdir(target)
            else:
                open(target, "wb").close()
            libc.mount(original, target, None, _MS_BIND | _MS_REC)
            # (a kept device node stays usable: its bind mount alone lacks nodev)
            device = directory == "/dev"
            libc.mount(
                None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | (0 if device else _MS_NODEV)
            )
    for _, _, entry in exposed:  # every O_PATH descriptor of the originals, bound or not: the code runs in this process
        if not isinstance(entry, str):
            os.close(entry)
    os.makedirs(workdir, exist_ok=True)  # inside a masked /tmp it is gone
    size = config["workdir_bytes"]
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    libc.mount("tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode=0700,size={size},nr_inodes=1024{owner}")
    for directory in new_mounts:  # (ENOENT: a masked dir under a hidden one, /dev/shm under /dev: gone)
        libc.mount(
            None,
            directory,
            None,
            _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV,
            allowed=(errno.ENOENT, errno.EINVAL),
        )
    # A new /proc that shows other users' processes to no one: their command lines may hold secrets.
    libc.mount("proc", "/proc", "proc", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, "hidepid=2")
    code_file = os.path.join(workdir, CODE_FILE)
    with open(code_file, "wb") as f:
        f.write(source)
    if uid is not None:
        os.chown(code_file, uid, uid)


def _enter_user_namespace(libc: _Libc) -> int:
    """Not root: a user namespace of the code's own (its uid 0 is the caller's uid, with
    capabilities only over what the namespace owns), with mount, network, pid and IPC namespaces. Returns
    in a forked child, pid 1 of the new pid namespace (`_reap_for_the_code` then forks the code as
    pid 2), with the pipe on which it reports the code's wait status: the code sees no process of
    the host (no /proc/<pid>/environ, nothing to signal or trace), and every process it starts dies
    with pid 1. This process waits and ends as the code did (`_exit_as`)."""
    uid, gid = os.geteuid(), os.getegid()
    libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID | _CLONE_NEWIPC)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        return write_fd
    os.close(write_fd)
    _, status = os.waitpid(pid, 0)
    reported = os.read(read_fd, 32)  # pid 1 has exited: the whole report, or nothing (it failed first)
    _exit_as(int(reported) if reported else status)


def _reap_for_the_code(status_fd: int) -> None:
    """pid 1 of the code's pid namespace: fork the code's process (pid 2) and return in it. pid 1
    reaps what the code leaves behind until the code's own process ends, reports its wait status and
    exits, which kills every process left in the namespace. The code does not run as pid 1: a
    namespace's init ignores every signal it has no handler for (RLIMIT_CPU's SIGXCPU included) and
    its exit would not say which signal ended it."""
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        os.setsid()  # out of the caller's process group: kill(0, ...) reaches nothing of the host
        return
    # A namespace's init gets only the signals it handles: with Python's SIGINT handler gone, the
    # code cannot end pid 1 early (and with it fake its own exit status).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        if done == pid:
            os.write(status_fd, str(status).encode())
            os._exit(0)


def _exit_as(status: int) -> None:
    """End this process as one with wait status `status` ended: with its exit code, or killed by
    its signal (raised again here, without a core)."""
    try:
        sys.stdout.flush()
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if number not in (signal.SIGKILL, signal.SIGSTOP):  # (their handlers cannot be set)
                signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            os._exit(128 + number)  # (a signal whose default is not to end a process)
    finally:
        os._exit(os.waitstatus_to_exitcode(status))


def _limit_resources(limits: dict, processes_before: int = 1) -> None:
    """`processes_before`: the processes RLIMIT_NPROC already counts when the code starts."""

    def limit(which: int, soft: int, hard: int | None = None) -> None:
        resource.setrlimit(which, (soft, soft if hard is None else hard))

    limit(resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1)  # SIGXCPU first, SIGKILL a second later
    limit(resource.RLIMIT_AS, limits["memory_mb"] * 1024 * 1024)
    limit(resource.RLIMIT_FSIZE, limits["max_file_bytes"])
    limit(resource.RLIMIT_NPROC, processes_before + limits["max_processes"])
    limit(resource.RLIMIT_CORE, 0)


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (uid, uid, uid):
        raise _SetupError("the uid did not change")
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:
        raise _SetupError("root could be regained")


def _child_main(config_json: str) -> None:
    config = json.loads(config_json)
    workdir = config["workdir"]
    try:
        with open(os.path.join(workdir, CODE_FILE), "rb") as f:
            source = f.read()
        libc = _Libc()
        user_namespace = config["user_namespace"]
        if user_namespace:
            status_fd = _enter_user_namespace(libc)  # (with the network namespace)
        elif config["network_namespace"]:
            libc.unshare(_CLONE_NEWNET if os.geteuid() == 0 else _CLONE_NEWUSER | _CLONE_NEWNET)
        if config["private_filesystem"]:
            _private_filesystem(libc, config, source)
        if user_namespace:
            _reap_for_the_code(status_fd)  # returns in the code's own process, pid 2
        os.chdir(workdir)  # the tmpfs now mounted there, not the directory under it
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1)
        # (in a user namespace RLIMIT_NPROC also counts the bootstrap waiting outside and pid 1)
        _limit_resources(config["limits"], processes_before=3 if user_namespace else 1)
        if config["uid"] is not None:
            _drop_privileges(config["uid"])
        if user_namespace:
            libc.drop_capabilities()
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        del libc
    except Exception as e:  # fail closed: the code never runs with a boundary half set up
        sys.stderr.write(f"{SETUP_FAILED}{type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED_EXIT)
    sys.stdout.reconfigure(line_buffering=True)  # what was printed before a kill still comes back
    sys.argv = [CODE_FILE]
    if config["audit_hook"]:
        sys.addaudithook(_make_audit_hook(os.path.realpath(workdir)))
    _run_code(source)


def _run_code(source: bytes) -> None:
    """Run main.py as `python main.py` would, its traceback without the bootstrap's frames."""
    import builtins
    import traceback
    import types

    try:
        code = compile(source, CODE_FILE, "exec", dont_inherit=True)  # not this file's __future__
    except (SyntaxError, ValueError) as e:
        sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
        sys.exit(1)
    module = types.ModuleType("__main__")
    module.__file__ = CODE_FILE
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as e:
        _hide_bootstrap_frames(e)
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)


def _hide_bootstrap_frames(error: BaseException) -> None:
    """Unlink this file's frames (the exec call, the audit hook) from the tracebacks of `error`
    and of the exceptions chained to it: the model should see its own code only."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == _BOOTSTRAP:
            tb = tb.tb_next
        error.__traceback__ = tb
        while tb is not None:
            while tb.tb_next is not None and tb.tb_next.tb_frame.f_code.co_filename == _BOOTSTRAP:
                tb.tb_next = tb.tb_next.tb_next
            tb = tb.tb_next
        error = error.__cause__ or error.__context__


# ---------------------------------------------------------------------------------------------
# The audit hook (defence in depth: the OS boundaries above are the real ones)
# ---------------------------------------------------------------------------------------------

_PROCESS_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.killpg",
        "pty.spawn",
    }
)
# event -> (index of a path argument, index of its dir_fd argument or None), for calls that change files
_PATH_EVENTS = {
    "os.mkdir": ((0, 2),),
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.utime": ((0, 3),),
    "os.truncate": ((0, None),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "os.chflags": ((0, None),),
    "shutil.rmtree": ((0, 1),),
}
_LIBC_DENIED = frozenset(
    {
        "fork",
        "vfork",
        "clone",
        "clone3",
        "execve",
        "execv",
        "execvp",
        "execvpe",
        "execl",
        "execlp",
        "execle",
        "fexecve",
        "system",
        "popen",
        "posix_spawn",
        "posix_spawnp",
        "socket",
        "socketpair",
        "connect",
        "bind",
        "sendto",
        "unshare",
        "setns",
        "mount",
        "umount",
        "umount2",
        "ptrace",
        "kill",
        "tgkill",
        "syscall",
        "prctl",
        "open",
        "open64",
        "openat",
        "openat64",
        "creat",
        "creat64",
        "fopen",
        "fopen64",
        "rename",
        "renameat",
        "unlink",
        "unlinkat",
        "symlink",
        "link",
        "chmod",
        "truncate",
    }
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _make_audit_hook(root: str):
    """A hook refusing what the code must not do. Everything it uses is bound as a default argument,
    so rebinding module globals from the code does not change it."""

    def inside(path, dir_fd=None, _root=root, _os=os) -> bool:
        if isinstance(path, int):
            return True  # an open file descriptor: opening it was checked
        path = _os.fsdecode(_os.fspath(path))
        if path == "/dev/null":
            return True
        base = _os.getcwd()
        if isinstance(dir_fd, int) and dir_fd >= 0 and not _os.path.isabs(path):  # -1: no dir_fd given
            base = _os.readlink(f"/proc/self/fd/{dir_fd}")
        full = _os.path.join(base, path)
        # Both the file and where its name lives: a symlink inside may point outside.
        for resolved in (
            _os.path.realpath(full),
            _os.path.join(_os.path.realpath(_os.path.dirname(full)), _os.path.basename(full)),
        ):
            if resolved != _root and not resolved.startswith(_root + "/"):
                return False
        return True

    def hook(
        event: str,
        args: tuple,
        _inside=inside,
        _process=_PROCESS_EVENTS,
        _paths=_PATH_EVENTS,
        _libc=_LIBC_DENIED,
        _write=_WRITE_FLAGS,
        _getpid=os.getpid,
    ) -> None:
        if event.startswith("socket."):
            raise PermissionError(f"sandbox: no network ({event})")
        if event in _process:
            raise PermissionError(f"sandbox: no other processes ({event})")
        if event == "open":
            path, mode, flags = args
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & _write)
            if writing and not _inside(path):
                raise PermissionError(f"sandbox: writing is allowed only in the working directory ({path!r})")
        elif event in _paths:
            for path_index, fd_index in _paths[event]:
                dir_fd = args[fd_index] if fd_index is not None and fd_index < len(args) else None
                if not _inside(args[path_index], dir_fd):
                    raise PermissionError(f"sandbox: changing files is allowed only in the working directory ({event})")
        elif event == "os.kill":
            if args[0] != _getpid():
                raise PermissionError("sandbox: no signals to other processes (os.kill)")
        elif event == "ctypes.dlsym":
            if isinstance(args[1], str) and args[1] in _libc:
                raise PermissionError(f"sandbox: ctypes may not call {args[1]}")
        elif event in ("gc.get_objects", "gc.get_referrers", "gc.get_referents"):
            raise PermissionError(f"sandbox: {event} is not allowed")  # the way to find this hook

    return hook


if __name__ == "__main__":
    _child_main(sys.argv[1])
