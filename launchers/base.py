"""What every launcher shares: its config fields, a Ray session context, and placement creation.

A launcher only owns the Ray connection. `session()` connects (local: starts) Ray and always
disconnects on the way out, exceptions included, so Hydra multirun jobs in one process each get a
clean Ray. With `reuse_session` a run instead joins the Ray session its process already has (a
notebook, the test suite, several runs from one script: Ray starts once) and leaves it up; the run
still removes everything it started (actors, placement groups). Subclasses say how to connect
(`_init_kwargs`, or `_connect` when `ray.init` alone is not enough) and how many GPUs there are
(`gpus_present`).

`connect_early()` starts the connection in a thread before the session: a local Ray takes ~4 s to
come up, mostly waiting on its own processes, while the driver spends ~3 s importing torch and
transformers and reading its inputs; the two overlap. `session()` then waits for that connection.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import ray

from rlhf_orch.logging.console import LibraryOutput
from rlhf_orch.topology.plan import PlacementPlan
from rlhf_orch.topology.ray_placement import RayPlacement


class RayLauncher(ABC):
    """Base of `LocalRayLauncher` and `ClusterRayLauncher` (fields = `LauncherConfig`)."""

    def __init__(
        self,
        dry_run: bool = False,
        logical_gpus: int = 0,
        num_cpus: Optional[int] = None,
        address: Optional[str] = None,
        startup_timeout_s: float = 600.0,
        reuse_session: bool = False,
        memory_check: str = "refuse",
        keep_actors: bool = False,
        memory_margin: float = 0.05,
    ) -> None:
        if logical_gpus < 0:
            raise ValueError(f"launcher.logical_gpus={logical_gpus} must be >= 0")
        if num_cpus is not None and num_cpus < 1:
            raise ValueError(f"launcher.num_cpus={num_cpus} must be >= 1 (or null for the default)")
        if keep_actors and not reuse_session:
            raise ValueError(
                "launcher.keep_actors=true keeps a run's actors for the next run in the same Ray session, "
                "which needs launcher.reuse_session=true (without it every run ends its Ray session)"
            )
        self.dry_run = dry_run
        self.logical_gpus = logical_gpus
        self.num_cpus = num_cpus
        self.address = address
        self.startup_timeout_s = startup_timeout_s
        self.reuse_session = reuse_session
        self.memory_check = memory_check  # read by the app's memory check (rlhf_orch.memory.check)
        self.memory_margin = memory_margin  # (the plan reads it from the config: launcher.memory_margin)
        self._output = LibraryOutput(None)  # replaced by each session()
        self._early: Optional[_EarlyConnection] = None  # connect_early() until session() takes it

    @abstractmethod
    def _init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `ray.init`."""

    @abstractmethod
    def gpus_present(self) -> int:
        """GPUs Ray can schedule (real or logical)."""

    def cuda_present(self) -> bool:
        """Real CUDA devices where the roles run (NCCL, CUDA IPC and the memory plan's GPU terms need
        them): this machine's, unless the launcher knows of others."""
        from rlhf_orch.cuda_probe import cuda_available

        return cuda_available()

    def _connect(self) -> None:
        """Start or join Ray; `session()` disconnects it again (also when this raises after `ray.init`)."""
        ray.init(**self._init_kwargs(), **self._output.init_kwargs())

    def connect_early(self, log_dir: Optional[Path] = None, verbose: bool = False) -> None:
        """Start connecting now, in a thread; the next `session()` (same log_dir) waits for it.

        Nothing happens when this process already has Ray (a session it joins). Whoever calls this
        calls `close_early()` on every path that may not reach `session()`.
        """
        if self._early is not None or ray.is_initialized():
            return
        self._output = LibraryOutput(log_dir, verbose)
        self._output.start()  # before ray.init: Ray's own driver messages go to the run's log
        self._early = _EarlyConnection(self._connect)

    def close_early(self) -> None:
        """Undo a `connect_early()` that no session took (the run stopped before its session)."""
        early, self._early = self._early, None
        if early is None:
            return
        early.done.wait()  # ray.init cannot be interrupted; shut down what it started
        ray.shutdown()
        early.release()
        self._output.finish()

    @contextmanager
    def session(self, log_dir: Optional[Path] = None, verbose: bool = False) -> Iterator["RayLauncher"]:
        """Connect to Ray for the body and disconnect afterwards, whatever happens.

        Unless `verbose`, what Ray, vLLM and DeepSpeed print stays off the console: it goes to
        <log_dir>/ray_workers.log (`LibraryOutput`; without a log_dir, to Ray's session logs only).
        """
        early, self._early = self._early, None
        joined = early is None and ray.is_initialized()
        if joined and not self.reuse_session:
            raise RuntimeError(
                "Ray is already initialised in this process; a launcher session must own its connection "
                "(call ray.shutdown() first, or set launcher.reuse_session=true to run inside it)"
            )
        if early is None:
            self._output = LibraryOutput(log_dir, verbose)
            self._output.start()
        try:
            if early is not None:
                early.wait()
            elif joined:
                self._check_joined()
            else:
                self._connect()
            self._output.connected()
            yield self
        finally:
            if not self.reuse_session:
                ray.shutdown()
                if early is not None:
                    early.release()
            self._output.finish()

    def _check_joined(self) -> None:
        """The session this run joins must offer the GPUs this launcher was configured with."""
        offered = int(ray.cluster_resources().get("GPU", 0))
        if offered < self.gpus_present():
            raise RuntimeError(
                f"launcher.reuse_session=true joins this process's Ray session, which offers {offered} GPUs, "
                f"fewer than the {self.gpus_present()} this run is configured for; start it with more "
                "(ray.init(num_gpus=...)) or leave launcher.reuse_session=false"
            )

    def placement(self, plan: PlacementPlan) -> RayPlacement:
        """Placement groups for `plan`, waited on for at most `startup_timeout_s` (use as `with`)."""
        return RayPlacement(plan, ready_timeout_s=self.startup_timeout_s)

    def check_gpus(self, plan: PlacementPlan) -> None:
        """Refuse a plan that asks for more GPUs than Ray has, naming both numbers."""
        present = self.gpus_present()
        if plan.total_gpus > present:
            raise RuntimeError(
                f"the {plan.layout} placement needs {plan.total_gpus} GPUs but Ray has {present}: "
                "lower placement.nodes/gpus_per_node or the per-role GPUs, or (CPU testing) set "
                f"launcher.logical_gpus={plan.total_gpus}"
            )


class _EarlyConnection:
    """`connect()` running in a daemon thread; `wait()` re-raises what it raised.

    The thread lives until `release()`, after `ray.shutdown()`: Ray starts its GCS and raylet with
    PR_SET_PDEATHSIG, which fires when the *thread* that started them exits (seen: the run's
    actors never answered, "Failed to connect to GCS within 60 seconds"). ray.init off the main
    thread installs no SIGTERM handler of its own (it logs that it did not): the run's handler
    stays the one in force.
    """

    def __init__(self, connect) -> None:
        self.done = threading.Event()
        self._released = threading.Event()
        self._error: Optional[BaseException] = None

        def run() -> None:
            try:
                connect()
            except BaseException as e:  # handed to the waiting session
                self._error = e
            finally:
                self.done.set()
            self._released.wait()

        threading.Thread(target=run, name="ray-connect", daemon=True).start()

    def release(self) -> None:
        self._released.set()

    def wait(self) -> None:
        self.done.wait()
        if self._error is not None:
            raise self._error
