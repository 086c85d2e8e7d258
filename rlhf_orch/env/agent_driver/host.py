"""The process the agent functions run in, out of the engine's (`env=agent`), run as a script.

`AgentRunner` (rlhf_orch.env.agent_driver.runner) starts `python -I -B host.py` once per engine and
talks to it over its stdin and a second pipe (its stdout at start; what the functions print goes to
stderr, the engine's log). The host imports `openai` and the function once, then forks one process
per trajectory: an agent that calls `os._exit`, crashes natively (a segfault in a C extension) or
hangs takes down or holds only its own process, which scores 0; the engine and the other
trajectories go on. The host itself is single-threaded, so forking it is safe (forking the engine,
with vLLM's threads, is not).

Each trajectory's process runs in a process group of its own, which is killed when the process
exits (seen on a pidfd, not on its result pipe, which a process it started may hold open), when its
deadline (env.timeout_s, counted from the process's start) passes, or when the host ends; it also
dies with the host (PR_SET_PDEATHSIG). What it started out of its group (`setsid`) is reparented to
the host, a subreaper, which kills it. The host dies with the thread of the engine that started it
(PR_SET_PDEATHSIG: the engine's long-lived rollout thread). At most `concurrency` run at once; the
rest wait in the host, their deadlines not yet started.

Messages both ways are length-prefixed pickles (`write_message`, `read_message`):
  to the host:   ("init", sys_path, pickled function, concurrency, timeout_s), then per batch
                 ("run", batch, [(index, row, secret length), ...]) followed by one frame of the
                 batch's secrets (`write_secrets`): each trajectory's base URL and key, concatenated
  from the host: ("ready",) or ("init_failed", text), then ("done", outcome fields with the batch) per trajectory
The function travels as a cloudpickle (a function defined in a user's file or inside a test is
pickled by value); the rows are plain data.

Each trajectory's process holds its own base URL and key and no other trajectory's (tested by an
agent that reads its whole process memory): the host reads a batch's secrets straight into memory
mapped MADV_DONTFORK (`_read_secrets`), which no fork inherits, and hands each process its own
through a pipe written before the fork. Nothing else of them is in the host's memory: a process
forked while others' trajectories are queued or running has every page of the host but that one.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # Run as a script: this directory is sys.path[0], where its modules (runner.py, record.py, ...)
    # would shadow the standard library's and the user's; the caller's path comes with "init".
    sys.path.pop(0)

import gc
import inspect
import math
import mmap
import pickle
import selectors
import signal
import struct
import time
from typing import Any, BinaryIO, Callable, Mapping

CLIENT_KEYWORDS = ("client", "base_url", "api_key")
_HEADER = struct.Struct("!I")
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def reward_of(result: Any) -> tuple[float, dict[str, float]]:
    """The function's return value as (reward, extra metrics); TypeError when it is neither."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"an agent's dict result needs a 'score' key, got keys {sorted(result)}")
        extra = {
            str(k): float(v)
            for k, v in result.items()
            if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        return _finite(result["score"]), extra
    return _finite(result), {}


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"an agent must return its reward as a number or a dict with 'score', got {type(value).__name__}"
        )
    if not math.isfinite(float(value)):
        raise TypeError(f"an agent returned a non-finite reward {value}")
    return float(value)


def accepted_keywords(fn: Callable) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return CLIENT_KEYWORDS
    names = {
        p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }
    return tuple(k for k in CLIENT_KEYWORDS if k in names)


def write_message(stream: BinaryIO, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def read_message(stream: BinaryIO) -> Any:
    """The next message; EOFError when the other side has gone. `stream` may be unbuffered (the
    host's: a buffered reader would hold messages its selector cannot see), so reads may come short."""
    (size,) = _HEADER.unpack(_read_exactly(stream, _HEADER.size))
    return pickle.loads(_read_exactly(stream, size))


def write_secrets(stream: BinaryIO, secrets: list[bytes]) -> None:
    """The frame of a batch's secrets, after its "run" message (their lengths are in the message)."""
    blob = b"".join(secrets)
    stream.write(_HEADER.pack(len(blob)) + blob)
    stream.flush()


def trajectory_secret(base_url: str, api_key: str) -> bytes:
    return f"{base_url}\n{api_key}".encode()


def _secret_fields(secret: bytes) -> tuple[str, str]:
    base_url, _, api_key = secret.decode().partition("\n")
    return base_url, api_key


def _unforked_memory(size: int) -> mmap.mmap:
    """Anonymous memory no child of this process inherits (MADV_DONTFORK: absent from a fork)."""
    memory = mmap.mmap(-1, max(1, size))
    memory.madvise(mmap.MADV_DONTFORK)
    return memory


def _read_secrets(stream: BinaryIO) -> mmap.mmap:
    """A batch's secrets frame, read from the unbuffered `stream` directly into memory no fork
    inherits (never through a bytes object of the host's heap, which every fork copies)."""
    (size,) = _HEADER.unpack(_read_exactly(stream, _HEADER.size))
    memory = _unforked_memory(size)
    view = memoryview(memory)
    got = 0
    while got < size:
        n = stream.readinto(view[got:size])
        if not n:
            raise EOFError
        got += n
    view.release()
    return memory


class _Secret:
    """Where one trajectory's base URL and key lie in its batch's unforked memory."""

    def __init__(self, memory: mmap.mmap, offset: int, length: int):
        self.memory, self.offset, self.length = memory, offset, length

    def into_pipe(self) -> int:
        """A pipe's read end holding the secret (written from the unforked memory: no copy of it
        in the host's heap); the child that inherits it reads it."""
        read_fd, write_fd = os.pipe()
        try:
            with memoryview(self.memory) as view:
                os.write(write_fd, view[self.offset : self.offset + self.length])  # (far below a pipe's capacity)
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return read_fd


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _prctl(option: int, value: int) -> None:
    """prctl(2) on Linux; a no-op elsewhere. Used for PR_SET_PDEATHSIG (the kernel kills this
    process when its parent ends) and PR_SET_CHILD_SUBREAPER (what a process under this one leaves
    behind is reparented here, to be killed: `Host._kill_orphans`)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)
    except (OSError, AttributeError):
        return


def exit_text(status: int) -> str:
    """What ended a process without an outcome, from its wait status."""
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = str(number)
        return f"AgentProcessDied: the agent's process was killed by {name}"
    return (
        f"AgentProcessDied: the agent's process exited with code {os.waitstatus_to_exitcode(status)} before returning"
    )


class _Trajectory:
    def __init__(self, batch: int, index: int, pid: int, result_fd: int, exit_fd: int, timeout_s: float):
        self.batch, self.index, self.pid = batch, index, pid
        self.result_fd, self.exit_fd = result_fd, exit_fd  # its outcome's pipe; a pidfd, readable once it exits
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.data = bytearray()
        self.timed_out = False


class Host:
    def __init__(self, commands: BinaryIO, replies: BinaryIO):
        self.commands, self.replies = commands, replies
        self.fn: Any = None
        self.concurrency, self.timeout_s = 1, 1.0
        self.queued: list[tuple[int, int, Any, _Secret]] = []  # (batch, index, row, where its URL and key lie)
        self.running: dict[int, _Trajectory] = {}  # by pid
        self.dying: set[int] = set()  # orphans killed, not yet reaped
        self.selector = selectors.DefaultSelector()

    # ------------------------------------------------------------------ the host's loop
    def serve(self) -> None:
        if not self._init(read_message(self.commands)):
            return
        self.selector.register(self.commands.fileno(), selectors.EVENT_READ, None)
        try:
            while True:
                self._start_queued()
                for key, _ in self.selector.select(self._wait_s()):
                    if key.data is None:
                        try:
                            _, batch, items = read_message(self.commands)
                            memory = _read_secrets(self.commands)
                        except EOFError:
                            return  # the engine is gone or closed the runner
                        offset = 0
                        for index, row, length in items:
                            self.queued.append((batch, index, row, _Secret(memory, offset, length)))
                            offset += length
                        del memory  # (unmapped once the last of its trajectories has started)
                    elif self.running.get(key.data.pid) is not key.data:
                        continue  # finished by an earlier event of this round: its descriptors are closed
                    elif key.fd == key.data.exit_fd:
                        self._finish(key.data)
                    else:
                        self._read_result(key.data)
                self._stop_overdue()
                self._kill_orphans()
        finally:
            for t in list(self.running.values()):
                self._kill(t)
                try:
                    os.waitpid(t.pid, 0)
                except ChildProcessError:
                    pass
            self._kill_orphans()

    def _init(self, message: Any) -> bool:
        try:
            _, sys_path, pickled, concurrency, timeout_s = message
            sys.path[:] = sys_path
            # imported once here, not in every trajectory's process
            import asyncio  # noqa: F401
            import ssl

            import cloudpickle  # noqa: F401 - what unpickles a function pickled by value
            import httpx  # noqa: F401
            import openai  # noqa: F401

            self.fn = pickle.loads(pickled)
            self.keywords = accepted_keywords(self.fn)
            self.is_async = inspect.iscoroutinefunction(self.fn)
            self.concurrency, self.timeout_s = int(concurrency), float(timeout_s)
            # built once, inherited by every fork: a client otherwise loads the CA bundle (~40 ms)
            self.ssl_context = ssl.create_default_context()
            _warm_up(self.ssl_context)
            _unforked_memory(1).close()  # (where MADV_DONTFORK is missing, no batch's secrets are taken)
            # What exists now is shared with every fork: keep the collector from touching (and so
            # copying) its pages in each trajectory's process.
            gc.freeze()
        except BaseException as e:  # reported to the engine, which raises it there
            write_message(self.replies, ("init_failed", f"{type(e).__name__}: {e}"))
            return False
        write_message(self.replies, ("ready",))
        return True

    def _wait_s(self) -> float | None:
        if self.dying:
            return 0.05  # (to reap them soon, not at the next command)
        if not self.running:
            return None
        return max(0.0, min(t.deadline for t in self.running.values()) - time.monotonic())

    def _start_queued(self) -> None:
        while self.queued and len(self.running) < self.concurrency:
            batch, index, row, secret = self.queued.pop(0)
            sys.stdout.flush()  # (nothing buffered here is printed again by the child)
            sys.stderr.flush()
            try:
                secret_fd = secret.into_pipe()
            except OSError as e:
                self._could_not_start(batch, index, e)
                continue
            try:
                read_fd, write_fd = os.pipe()
            except OSError as e:
                os.close(secret_fd)
                self._could_not_start(batch, index, e)
                continue
            try:
                pid = os.fork()
            except OSError as e:  # (out of processes or memory: this trajectory fails, not the host)
                for fd in (read_fd, write_fd, secret_fd):
                    os.close(fd)
                self._could_not_start(batch, index, e)
                continue
            if pid == 0:  # the trajectory's process: never returns
                os.close(read_fd)
                _run_trajectory(self, write_fd, row, secret_fd, secret.length)
            os.close(secret_fd)
            os.close(write_fd)
            try:
                os.setpgid(pid, pid)  # (the child does it too: a kill must find the group whichever runs first)
            except OSError:
                pass
            os.set_blocking(read_fd, False)
            t = _Trajectory(batch, index, pid, read_fd, os.pidfd_open(pid), self.timeout_s)
            self.running[pid] = t
            self.selector.register(read_fd, selectors.EVENT_READ, t)
            self.selector.register(t.exit_fd, selectors.EVENT_READ, t)

    def _could_not_start(self, batch: int, index: int, error: OSError) -> None:
        outcome = {
            "batch": batch,
            "index": index,
            "seconds": 0.0,
            "error": f"AgentProcessDied: could not start: {error}",
        }
        write_message(self.replies, ("done", outcome))

    def _read_result(self, t: _Trajectory) -> None:
        """Read what the outcome's pipe holds. Its end is not the trajectory's end: a process the
        agent started may hold the pipe open after the agent returned (the pidfd says when it exits)."""
        while True:
            try:
                chunk = os.read(t.result_fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                self.selector.unregister(t.result_fd)
                return
            t.data += chunk

    def _stop_overdue(self) -> None:
        now = time.monotonic()
        for t in list(self.running.values()):
            if now >= t.deadline:
                t.timed_out = True
                self._finish(t)

    def _kill(self, t: _Trajectory) -> None:
        try:
            os.killpg(t.pid, signal.SIGKILL)  # the function's own children too
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(t.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _kill_orphans(self) -> None:
        """Kill and reap every child of the host that is no trajectory: what an agent started and
        left behind, out of its process group (`setsid`), reparented here (a subreaper)."""
        try:
            with open(f"/proc/self/task/{os.getpid()}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            return
        for pid in children:
            if pid in self.running:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # (gone, or no longer ours to signal)
                pass
            self.dying.add(pid)
        for pid in list(self.dying):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done == pid:
                self.dying.discard(pid)

    def _finish(self, t: _Trajectory) -> None:
        """The trajectory's process has exited (returned, or died) or is overdue: its group is
        killed and reaped, and its outcome goes to the engine."""
        self._kill(t)
        _, status = os.waitpid(t.pid, 0)
        if t.result_fd in self.selector.get_map():
            self._read_result(t)  # (what it wrote before exiting; unregisters the pipe at its end)
        if t.result_fd in self.selector.get_map():
            self.selector.unregister(t.result_fd)
        self.selector.unregister(t.exit_fd)
        os.close(t.result_fd)
        os.close(t.exit_fd)
        del self.running[t.pid]
        seconds = time.monotonic() - t.started
        outcome: dict[str, Any] = {"batch": t.batch, "index": t.index, "seconds": seconds}
        if t.timed_out:
            outcome["timed_out"] = True
        else:
            try:
                outcome.update(pickle.loads(bytes(t.data)))
            except Exception:  # nothing, or half a result: the process died first
                outcome["error"] = exit_text(status)
        write_message(self.replies, ("done", outcome))


def _run_trajectory(host: Host, result_fd: int, row: Any, secret_fd: int, secret_length: int) -> None:
    """In the forked process: take its own base URL and key from `secret_fd`, run the function
    once, write its outcome, exit without cleanup."""
    code = 0
    try:
        os.setpgid(0, 0)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        # What the agent starts and leaves stays under this process while it runs (the host's
        # subreaping is not inherited) and reaches the host, to be killed, when it ends.
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host decides when this process ends
        host.selector.close()
        fds = [host.commands.fileno(), host.replies.fileno()]
        for t in host.running.values():
            fds += [t.result_fd, t.exit_fd]
        for fd in fds:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        with os.fdopen(secret_fd, "rb") as pipe:
            base_url, api_key = _secret_fields(_read_exactly(pipe, secret_length))
        bypass_proxies_for(base_url)
        outcome = _call(host, row, base_url, api_key)
        sys.stdout.flush()  # before the outcome: the host kills this process's group once it is in
        sys.stderr.flush()
        with os.fdopen(result_fd, "wb") as out:
            out.write(pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL))
    except BaseException:  # the host reports a process that wrote no outcome
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def keep_traces_home() -> None:
    """The OpenAI Agents SDK uploads a trace of every run to api.openai.com by default (with the
    environment's OPENAI_API_KEY, or the key of the client an agent hands it: the trajectory's):
    off in every agent's process unless the job's environment says otherwise, so an agent written
    as the SDK's docs show sends nothing off the machine. (LangSmith traces only when asked.)"""
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")


def bypass_proxies_for(base_url: str) -> None:
    """The endpoint's host added to NO_PROXY / no_proxy in this process's environment: a proxy a
    job's environment names (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY) would not reach the engine's
    loopback (nor, often, its node's address), and clients an agent builds itself from `base_url`
    (httpx, requests, urllib, aiohttp with trust_env) read these variables."""
    from urllib.parse import urlsplit

    host = urlsplit(base_url).hostname
    if not host:
        return
    for name in ("no_proxy", "NO_PROXY"):
        kept = [h for h in os.environ.get(name, "").split(",") if h.strip()]
        if "*" not in kept and host not in kept:
            os.environ[name] = ",".join([*kept, host])


def _client(is_async: bool, base_url: str, api_key: str, timeout_s: float, ssl_context: Any) -> Any:
    import httpx
    import openai

    # No retries: a refused call is the agent's to handle, and a retry would be a second call.
    # trust_env=False: no proxy from the environment between the agent and its engine's endpoint.
    if is_async:
        return openai.AsyncOpenAI(
            base_url=base_url,
            api_key=api_key,
            max_retries=0,
            timeout=timeout_s,
            http_client=httpx.AsyncClient(verify=ssl_context, timeout=timeout_s, trust_env=False),
        )
    return openai.OpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=0,
        timeout=timeout_s,
        http_client=httpx.Client(verify=ssl_context, timeout=timeout_s, trust_env=False),
    )


_STUB_REPLY = (
    b'{"id": "warm-up", "object": "chat.completion", "created": 0, "model": "warm-up", "choices": '
    b'[{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}'
)


def _warm_up(ssl_context: Any) -> None:
    """One call through each kind of client to a stub server in this process, before any fork:
    what `openai` and `httpx` import and build at first use (resources, response models, transports,
    the event loop's machinery) is then done once here, not in every trajectory's process
    (scripts/bench/bench_agent.py: 39 ms per call over direct without this, 11 with). The stub's thread
    ends before anything forks."""
    import asyncio
    import http.server
    import threading

    class Stub(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the handler's API
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(_STUB_REPLY)))
            self.end_headers()
            self.wfile.write(_STUB_REPLY)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serving.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        request = {"model": "warm-up", "messages": [{"role": "user", "content": "x"}]}
        _client(False, url, "warm-up", 10.0, ssl_context).chat.completions.create(**request)

        async def call() -> None:
            client = _client(True, url, "warm-up", 10.0, ssl_context)
            await client.chat.completions.create(**request)
            await client.close()

        asyncio.run(call())
    except Exception:  # only a cost: every trajectory then pays it itself
        pass
    finally:
        server.shutdown()
        server.server_close()
        serving.join()


def _call(host: Host, row: Any, base_url: str, api_key: str) -> dict[str, Any]:
    import asyncio

    fn, timeout_s, is_async = host.fn, host.timeout_s, host.is_async
    try:
        client = _client(is_async, base_url, api_key, timeout_s, host.ssl_context)
        given = {"client": client, "base_url": base_url, "api_key": api_key}
        kwargs = {k: given[k] for k in host.keywords}
        result = asyncio.run(fn(row, **kwargs)) if is_async else fn(row, **kwargs)
        reward, metrics = reward_of(result)
        return {"reward": reward, "metrics": metrics}
    except Exception as e:  # the agent's bug or its model's output: counted, scored 0
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    # The protocol's pipe is the stdout the host was started with; anything printed from here on
    # (the functions' own output) goes to stderr.
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the engine, which closes this
    keep_traces_home()
    Host(os.fdopen(0, "rb", buffering=0), replies).serve()


if __name__ == "__main__":
    main()
