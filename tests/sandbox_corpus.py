"""A hostile corpus for the sandbox: programs a policy could write, each with what must hold after it.

`run_corpus(repo)` runs every snippet through `run_python` (hook off: the OS boundaries alone, or
on) and returns {snippet: what went wrong, or None}. It runs as whoever calls it: the tests call it
in-process as root, and run this file as a script as a non-root uid (`setpriv`), where it prints the
same mapping as JSON. It imports only the standard library and `rlhf_orch.env.sandbox`, so any
Python 3.11 the uid can run will do.

What is planted around each run: a secret file (world-readable) in a world-writable directory of
the checkout and in one of a top-level directory (/opt: where datasets and run dirs live on many
hosts), a helper process of the caller's uid with the secret in its environment (to be read through
/proc/<pid>/environ, signalled or traced), a TCP server on 127.0.0.1 and a unix socket in the
abstract namespace (each counts what reaches it). After each run: the secret is in no output,
nothing was written outside, nothing reached a server, the helper and the caller live, no
process of the sandbox is left, and the run ended within its time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

TIMEOUT_S = 3.0
MAX_PROCESSES = 4
_SAY_WORKDIR = "import os as _corpus_os\nprint('corpus workdir', _corpus_os.getcwd(), flush=True)\n"


@dataclass(frozen=True)
class Snippet:
    name: str
    code: str  # formatted with the planted things: {secret_files}, {write_dirs}, {helper_pid}, {port}, {unix_name}, {repo}
    expect_error: bool = False  # the run must end as an error (refused, killed or timed out)
    check: Callable[[Any], str | None] | None = None  # the ToolResult -> what is wrong with it


def _forks_within_the_limit(result: Any) -> str | None:
    found = re.search(r"^forked (\d+)$", result.output, re.M)
    if found is None:
        return "no fork count printed"
    return None if int(found.group(1)) <= MAX_PROCESSES else f"{found.group(1)} processes started (max_processes={MAX_PROCESSES})"


def _ended_by_its_signal(result: Any) -> str | None:
    return None if result.exit_code == -15 else f"exit code {result.exit_code}, not -15 (SIGTERM)"


def _ended_by_sigkill(result: Any) -> str | None:
    return None if result.exit_code == -9 else f"exit code {result.exit_code}, not -9 (SIGKILL): {result.output[-200:]!r}"


CORPUS = [
    Snippet("fork_bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", True),
    Snippet("busy_loop", "while True:\n    pass\n", True),
    Snippet("allocate_10_gb", "x = bytearray(10 * 1024 ** 3)\nprint(len(x))\n", True),
    Snippet("huge_output", "while True:\n    print('x' * 10000)\n", True),
    Snippet("fill_the_disk", "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 1_000_000)\n", True),
    Snippet("count_forks", "import os, time\nn = 0\nfor _ in range(50):\n    try:\n        if os.fork() == 0:\n"
                           "            time.sleep(5)\n            os._exit(0)\n    except OSError:\n        break\n    n += 1\n"
                           "print('forked', n, flush=True)\n", check=_forks_within_the_limit),
    Snippet("signal_itself", "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", True, check=_ended_by_its_signal),
    Snippet("sigkill_itself", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", True, check=_ended_by_sigkill),
    Snippet("interrupt_its_init", "import os, signal\nfor pid in (1, os.getppid()):\n    try:\n        os.kill(pid, signal.SIGINT)\n"
                                  "    except OSError as e:\n        print('refused', pid, e)\nimport time\ntime.sleep(0.5)\nprint('still here')\n",
            check=lambda result: None if "still here" in result.output and result.exit_code == 0 else
            f"ended early: exit {result.exit_code}, {result.output[-200:]!r}"),
    Snippet("escape_the_kill", "import ctypes, os, time\ntry:\n    os.setsid()\nexcept OSError as e:\n    print('setsid', e)\n"
                               "print('prctl', ctypes.CDLL(None).prctl(1, 0, 0, 0, 0))  # no parent-death signal\n"
                               "print('detached', flush=True)\ntime.sleep(60)\n", True),
    Snippet("threads", "import threading, time\nts = [threading.Thread(target=time.sleep, args=(30,)) for _ in range(200)]\n"
                       "[t.start() for t in ts]\n", True),
    Snippet("write_outside", "for d in {write_dirs!r}:\n    try:\n        open(d + '/written_by_code', 'w').write('x')\n"
                             "    except OSError as e:\n        print('refused', d, e)\n"),
    Snippet("write_temp_dirs", "for d in ('/tmp', '/var/tmp', '/dev/shm'):\n    try:\n"
                               "        open(d + '/{marker}', 'w').write('x')\n    except OSError as e:\n        print('refused', d, e)\n"),
    Snippet("read_secret_files", "for p in {secret_files!r}:\n    try:\n        print(open(p).read())\n"
                                 "    except OSError as e:\n        print('refused', p, e)\n"),
    Snippet("list_the_checkout", "import os\nfor d in ({repo!r}, '/opt', '/home', '/root', '/run', '/srv', '/mnt'):\n"
                                 "    try:\n        print(d, os.listdir(d))\n    except OSError as e:\n        print('refused', d, e)\n"),
    Snippet("read_environ_of_others", "import os\nfor pid in [{helper_pid}, os.getppid(), 1] + [p for p in os.listdir('/proc') if p.isdigit()]:\n"
                                      "    try:\n        print(pid, open(f'/proc/{{pid}}/environ', 'rb').read())\n"
                                      "    except OSError as e:\n        print('refused', pid, e)\n"),
    Snippet("posixsubprocess", "import _posixsubprocess, os\nargs = [b'/bin/sh', b'-c', b'for d in {write_dirs_sh}; do echo x > $d/by_shell; done; sleep 30 # {marker}']\n"
                               "r, w = os.pipe()\nfor extra in ((True,), ()):\n    try:\n"
                               "        pid = _posixsubprocess.fork_exec(args, [b'/bin/sh'], True, (), None, None, -1, -1, -1, -1, -1, -1, r, w,"
                               " True, True, -1, None, None, None, -1, None, *extra)\n        print('started', pid)\n        break\n"
                               "    except TypeError:\n        continue\n    except OSError as e:\n        print('refused', e)\n        break\n"
                               "import time\ntime.sleep(1)\n"),
    Snippet("ctypes_system", "import ctypes\nprint(ctypes.CDLL(None).system(b'for d in {write_dirs_sh}; do echo x > $d/by_system; done # {marker}'))\n"),
    Snippet("ctypes_open", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nfor d in {write_dirs!r}:\n"
                           "    fd = libc.open((d + '/by_ctypes').encode(), os.O_CREAT | os.O_WRONLY, 0o644)\n"
                           "    print(d, fd, ctypes.get_errno())\n"),
    Snippet("open_with_dir_fd", "import os\nfor d in {write_dirs!r}:\n    try:\n        fd = os.open(d, os.O_RDONLY)\n"
                                "        os.close(os.open('by_dir_fd', os.O_CREAT | os.O_WRONLY, dir_fd=fd))\n"
                                "    except OSError as e:\n        print('refused', d, e)\n"),
    Snippet("tcp_to_the_host", "import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hello')\n"
                               "except OSError as e:\n    print('refused', e)\n"),
    Snippet("abstract_unix_socket", "import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n"
                                    "    s.connect('\\0{unix_name}')\n    s.sendall(b'hello')\nexcept OSError as e:\n    print('refused', e)\n"),
    Snippet("signal_everyone", "import os, signal\nfor pid in ({helper_pid}, os.getppid(), -1):\n    try:\n"
                               "        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print('refused', pid, e)\n"),
    Snippet("ptrace_the_helper", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                                 "print(libc.ptrace(16, {helper_pid}, 0, 0), ctypes.get_errno())\n"),  # PTRACE_ATTACH
    Snippet("setsid_grandchild", "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                                 "        os.execv('/bin/sleep', ['/bin/sleep', '60', '{marker}'])\n    os._exit(0)\ntime.sleep(0.5)\n"),
    Snippet("device_nodes", "import os\nprint(sorted(os.listdir('/dev')))\nfor name in os.listdir('/dev'):\n    try:\n"
                            "        open('/dev/' + name, 'rb').close()\n    except OSError:\n        pass\ntry:\n"
                            "    os.mknod('null2', 0o20666, os.makedev(1, 3))\n    open('null2', 'wb').write(b'x')\n    print('made a device node')\n"
                            "except OSError as e:\n    print('refused', e)\n"),
    Snippet("undo_the_mounts", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                               "for attempt in ('as it is', 'in a user namespace of its own'):\n"
                               "    if attempt != 'as it is':\n"
                               "        print('unshare', libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())\n"
                               "    for d in ({repo!r}, '/opt', '/tmp', '/'):\n"
                               "        print('umount', d, libc.umount2(d.encode(), 2), ctypes.get_errno())\n"
                               "    for p in {secret_files!r}:\n        try:\n            print(open(p).read())\n"
                               "        except OSError as e:\n            print('refused', p, e)\n"),
]


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (real uid, command line) of every live process this caller can see."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            status = Path(f"/proc/{name}/status").read_text()
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "\nState:\tZ" in status:
            continue
        uid = int(status.split("\nUid:")[1].split()[0])
        found[int(name)] = (uid, cmdline)
    return found


class _Listeners:
    """A TCP server on 127.0.0.1 and an abstract unix socket, counting every connection."""

    def __init__(self) -> None:
        self.connections = 0
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.port = self.tcp.getsockname()[1]
        self.unix_name = f"rlhf_orch_corpus_{uuid.uuid4().hex}"
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix.bind("\0" + self.unix_name)
        self.unix.listen()
        for s in (self.tcp, self.unix):
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.tcp.close()
        self.unix.close()


def plant(repo: str) -> tuple[str, list[str]]:
    """(the secret, the directories holding it): one in the checkout, one under /opt. As root."""
    token = f"corpus_secret_{uuid.uuid4().hex}"
    planted = [Path(repo) / f".corpus_{uuid.uuid4().hex}", Path("/opt") / f"rlhf_orch_corpus_{uuid.uuid4().hex}"]
    for d in planted:
        d.mkdir(parents=True)
        d.chmod(0o777)  # writable by anyone: only the sandbox stands in the way
        (d / "secret.txt").write_text(token)
        (d / "secret.txt").chmod(0o644)
    return token, [str(d) for d in planted]


def remove(planted: list[str]) -> None:
    for d in planted:
        shutil.rmtree(d, ignore_errors=True)


def run_corpus(repo: str, token: str, planted_dirs: list[str], audit_hook: bool = False,
               names: list[str] | None = None) -> dict[str, str | None]:
    from rlhf_orch.env.sandbox import SandboxLimits, run_python, sandbox_support

    support = sandbox_support()
    if support.missing:
        return {s.name: f"not run: {support.describe()}" for s in CORPUS}
    planted = [Path(d) for d in planted_dirs]
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env={**os.environ, "CORPUS_SECRET": token})
    listeners = _Listeners()
    me = os.getuid()
    before = set(_processes())
    results: dict[str, str | None] = {}
    limits = SandboxLimits(timeout_s=TIMEOUT_S, cpu_s=2, memory_mb=256, max_processes=MAX_PROCESSES, max_output_bytes=4000,
                           max_file_bytes=1_000_000)
    try:
        deadline = time.monotonic() + 10
        while token.encode() not in Path(f"/proc/{helper.pid}/environ").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        for snippet in CORPUS:
            if names is not None and snippet.name not in names:
                continue
            marker = f"corpus_marker_{uuid.uuid4().hex}"
            write_dirs = [str(d) for d in planted]
            code = snippet.code.format(
                secret_files=[str(d / "secret.txt") for d in planted], write_dirs=write_dirs, write_dirs_sh=" ".join(write_dirs),
                helper_pid=helper.pid, port=listeners.port, unix_name=listeners.unix_name, repo=repo, marker=marker,
            )
            # Its working directory names its processes (a forked copy of the bootstrap shows it in its
            # command line; what it execs carries the marker): other sandboxes may run at once (xdist).
            result = run_python(_SAY_WORKDIR + code, limits, audit_hook=audit_hook)
            workdir = re.search(r"^corpus workdir (\S+)$", result.output, re.M)
            problems = []
            if token in result.output:
                problems.append("the secret is in the output")
            if result.seconds > TIMEOUT_S + 3:
                problems.append(f"took {result.seconds:.1f}s")
            if snippet.expect_error and not result.error:
                problems.append("ended without an error")
            if snippet.check is not None and (problem := snippet.check(result)):
                problems.append(problem)
            if result.output.startswith("sandbox unavailable") or result.exit_code == 125:
                problems.append("the sandbox did not start")
            written = sorted(str(p) for d in planted for p in d.iterdir() if p.name != "secret.txt")
            written += [d for d in ("/tmp", "/var/tmp", "/dev/shm") if os.path.exists(f"{d}/{marker}")]
            if written:
                problems.append(f"wrote {written}")
            if listeners.connections:
                problems.append(f"{listeners.connections} connection(s) reached the host's sockets")
            if helper.poll() is not None:
                problems.append("the helper process was killed")
            time.sleep(0.05)  # (a process killed a moment ago leaves /proc)
            ours = [marker] + ([workdir.group(1)] if workdir else [])
            left = {pid: cmd for pid, (uid, cmd) in _processes().items()
                    if pid not in before and (any(tag in cmd for tag in ours) or (uid == me and me != 0))}
            if left:
                problems.append(f"processes left: {left}")
            results[snippet.name] = "; ".join(problems) + f" (output: {result.output[-300:]!r})" if problems else None
            for d in planted:  # a failure above is reported once, not again by every later snippet
                for p in d.iterdir():
                    if p.name != "secret.txt":
                        p.unlink()
            listeners.connections = 0
    finally:
        helper.kill()
        helper.wait()
        listeners.close()
    return results


if __name__ == "__main__":
    # echo '{"repo": ..., "token": ..., "planted": [...], "audit_hook": false}' | python sandbox_corpus.py
    # as whoever runs it (the secret comes on stdin: a command line is readable by others); prints JSON
    request = json.loads(sys.stdin.read())
    sys.path.insert(0, request["repo"])
    os.chdir(tempfile.gettempdir())
    results = run_corpus(request["repo"], request["token"], request["planted"], request["audit_hook"])
    print(json.dumps({"uid": os.getuid(), "results": results}))
