"""What every launcher shares: its config fields, a Ray session context, and placement creation.

A launcher only owns the Ray connection. `session()` connects (local: starts) Ray and always
disconnects on the way out, exceptions included, so Hydra multirun jobs in one process each get a
clean Ray. With `reuse_session` a run instead joins the Ray session its process already has (a
notebook, the test suite, several runs from one script: Ray starts once) and leaves it up; the run
still removes everything it started (actors, placement groups). Subclasses say how to connect
(`_init_kwargs`, or `_connect` when `ray.init` alone is not enough) and how many GPUs there are
(`gpus_present`).
"""

from __future__ import annotations

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
    ) -> None:
        if logical_gpus < 0:
            raise ValueError(f"launcher.logical_gpus={logical_gpus} must be >= 0")
        if num_cpus is not None and num_cpus < 1:
            raise ValueError(f"launcher.num_cpus={num_cpus} must be >= 1 (or null for the default)")
        self.dry_run = dry_run
        self.logical_gpus = logical_gpus
        self.num_cpus = num_cpus
        self.address = address
        self.startup_timeout_s = startup_timeout_s
        self.reuse_session = reuse_session
        self.memory_check = memory_check  # read by the app's memory check (rlhf_orch.memory.check)
        self._output = LibraryOutput(None)  # replaced by each session()

    @abstractmethod
    def _init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `ray.init`."""

    @abstractmethod
    def gpus_present(self) -> int:
        """GPUs Ray can schedule (real or logical)."""

    def _connect(self) -> None:
        """Start or join Ray; `session()` disconnects it again (also when this raises after `ray.init`)."""
        ray.init(**self._init_kwargs(), **self._output.init_kwargs())

    @contextmanager
    def session(self, log_dir: Optional[Path] = None, verbose: bool = False) -> Iterator["RayLauncher"]:
        """Connect to Ray for the body and disconnect afterwards, whatever happens.

        Unless `verbose`, what Ray, vLLM and DeepSpeed print stays off the console: it goes to
        <log_dir>/ray_workers.log (`LibraryOutput`; without a log_dir, to Ray's session logs only).
        """
        joined = ray.is_initialized()
        if joined and not self.reuse_session:
            raise RuntimeError(
                "Ray is already initialised in this process; a launcher session must own its connection "
                "(call ray.shutdown() first, or set launcher.reuse_session=true to run inside it)"
            )
        self._output = LibraryOutput(log_dir, verbose)
        self._output.start()
        try:
            if joined:
                self._check_joined()
            else:
                self._connect()
            self._output.connected()
            yield self
        finally:
            if not self.reuse_session:
                ray.shutdown()
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
