"""Run a user's agent function over many trajectories at once (`env=agent`; no engine here).

Each trajectory calls `fn(row, client=..., base_url=..., api_key=...)`: the data row, an `openai`
client bound to the trajectory's own base URL (`AsyncOpenAI` for an `async def`, `OpenAI` for a
plain function), that URL and the trajectory's own key (for code that makes its own client). Only the keywords
the function accepts are passed (all of them to `**kwargs`). At most `concurrency` trajectories run
at once; each has `timeout_s`, counted from its start. The function returns the reward: a number, or
a mapping with `score` (its other numeric entries are summed as metrics). An exception, a timeout or
a process that dies (`os._exit`, a segfault) scores 0 and is counted; the rollout still completes.

The functions run out of the caller's process, one process per trajectory forked from a host
process the runner starts once (rlhf_orch.env.agent_driver.host): what an agent does to its process cannot
stop the engine that answers its calls, and a trajectory past its deadline is killed, not waited for.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlhf_orch.env.agent_driver.host import (  # noqa: F401 - the runner's API too
    accepted_keywords,
    read_message,
    reward_of,
    trajectory_secret,
    write_message,
    write_secrets,
)


@dataclass
class AgentOutcome:
    index: int
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # "TypeError: ..." when the function raised
    timed_out: bool = False
    seconds: float = 0.0


class AgentHostError(RuntimeError):
    """The host process could not load the function (raised from `wait`)."""


class AgentRunner:
    """Start every trajectory's function; `wait` for them; `outcomes` once done; `close` at the end.
    One host process serves every `start` until `close` (one that died is started again). Each
    `start` is a batch of its own: an outcome of an earlier batch (a rollout given up) is dropped."""

    _HOST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host.py")

    def __init__(self, fn: Callable, concurrency: int, timeout_s: float):
        self.concurrency = max(1, int(concurrency))
        self.timeout_s = float(timeout_s)
        self.outcomes: dict[int, AgentOutcome] = {}
        self._pickled = pickled_function(fn)
        self._host: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._batch = 0
        self._batch_host: subprocess.Popen | None = None  # the host the current batch went to
        self._pending: set[int] = set()
        self._done = threading.Event()
        self._done.set()
        self._crash: BaseException | None = None

    def start(self, items: Sequence[tuple[int, Any, str, str]]) -> None:
        """items: (trajectory index, row, base_url, api_key): each trajectory's own URL and key."""
        items = list(items)
        with self._lock:
            self._batch += 1
            batch = self._batch
            self.outcomes = {}
            self._pending = {index for index, *_ in items}
            self._crash = None
            self._batch_host = None
            self._done.clear()
        if not items:
            self._done.set()
            return
        try:
            host = self._running_host()
            with self._lock:
                self._batch_host = host  # (before the message: a host dying at once fails this batch)
            # Each trajectory's URL and key apart from the rows: the host keeps them where its
            # forks do not see them, and hands each process its own (rlhf_orch.env.agent_driver.host).
            secrets = [trajectory_secret(base_url, api_key) for _, _, base_url, api_key in items]
            write_message(
                host.stdin, ("run", batch, [(index, row, len(s)) for (index, row, *_), s in zip(items, secrets)])
            )
            write_secrets(host.stdin, secrets)
        except (OSError, EOFError) as e:
            self._fail_pending(batch, None if isinstance(e, (BrokenPipeError, EOFError)) else e)
        except AgentHostError as e:
            self._fail_pending(batch, e)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        finished = self._done.wait(timeout)
        if finished and self._crash is not None:
            raise self._crash
        return finished

    def close(self) -> None:
        """Stop the host; trajectories still running are killed with it."""
        host, self._host = self._host, None
        if host is not None:
            try:
                host.stdin.close()  # the host kills its trajectories and exits
                host.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                host.kill()
                host.wait()
        self._fail_pending(self._batch, None)

    def __del__(self) -> None:
        host = getattr(self, "_host", None)
        if host is not None and host.poll() is None:
            host.kill()

    # ------------------------------------------------------------------ the host process
    def _running_host(self) -> subprocess.Popen:
        if self._host is not None and self._host.poll() is None:
            return self._host
        if self._host is not None:
            self._host.wait()
        # -I: no PYTHON* variables, no user site; the caller's sys.path comes with "init" instead
        host = subprocess.Popen([sys.executable, "-I", "-B", self._HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            write_message(host.stdin, ("init", list(sys.path), self._pickled, self.concurrency, self.timeout_s))
            reply = read_message(host.stdout)
        except (OSError, EOFError):
            reply = ("init_failed", f"the host process ended at start (exit code {host.wait()})")
        if reply[0] != "ready":
            host.kill()
            host.wait()
            raise AgentHostError(f"the agent function could not be loaded in its process: {reply[1]}")
        self._host = host
        # (a weak reference: a runner nobody closed is collected, and its __del__ ends the host)
        threading.Thread(
            target=_read_outcomes, args=(weakref.ref(self), host), name="agent-outcomes", daemon=True
        ).start()
        return host

    def _take(self, fields: dict[str, Any]) -> None:
        batch = fields.pop("batch")
        with self._lock:
            if batch == self._batch and fields["index"] in self._pending:
                self.outcomes[fields["index"]] = AgentOutcome(**fields)
                self._pending.discard(fields["index"])
                if not self._pending:
                    self._done.set()

    def _host_ended(self, host: subprocess.Popen, crash: BaseException | None) -> None:
        """The reader of `host` stopped: the host ended, or sent what could not be taken (it is then
        killed: nobody would read its outcomes again). Fails the batch it was running."""
        if crash is not None and host.poll() is None:
            host.kill()
            host.wait()
        with self._lock:
            if self._batch_host is not host:
                return  # (a host replaced before: the current batch is another's)
            batch = self._batch
        self._fail_pending(batch, crash)

    def _fail_pending(self, batch: int, crash: BaseException | None) -> None:
        with self._lock:
            if batch != self._batch:
                return
            for index in self._pending:
                self.outcomes[index] = AgentOutcome(index, error="AgentProcessDied: the agents' host process ended")
            self._pending = set()
            self._crash = crash
            self._done.set()


def _read_outcomes(runner_ref: weakref.ref, host: subprocess.Popen) -> None:
    """The reader thread of one host: every outcome to its runner, then the host's end."""
    crash: BaseException | None = None
    while True:
        try:
            _, fields = read_message(host.stdout)
        except (EOFError, OSError):
            break
        except BaseException as e:  # a message it cannot read: the rollout must not wait for ever
            crash = RuntimeError(f"the agents' host sent what could not be read: {type(e).__name__}: {e}")
            break
        runner = runner_ref()
        if runner is None:
            return
        try:
            runner._take(fields)
        except BaseException as e:
            crash = RuntimeError(f"an agent outcome could not be taken: {type(e).__name__}: {e}")
            break
        del runner
    runner = runner_ref()
    if runner is not None:
        runner._host_ended(host, crash)


def pickled_function(fn: Callable) -> bytes:
    """The function as the host can load it: with its module's code by value (a file loaded from
    env.path cannot be imported by name there; a test module could, at the cost of its imports)."""
    import cloudpickle

    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if module is not None and module.__name__ != "__main__":
        cloudpickle.register_pickle_by_value(module)
    return cloudpickle.dumps(fn)
