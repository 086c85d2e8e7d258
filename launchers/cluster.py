"""Join a running Ray cluster (`ray start --head` / Slurm template / Ray Job); never stop it."""

from __future__ import annotations

from typing import Any, Optional

import ray

from launchers.base import RayLauncher


class ClusterRayLauncher(RayLauncher):
    """Connects with `ray.init(address=...)`; leaving the session only disconnects this driver.

    The cluster's resources are fixed by `ray start`, so `logical_gpus` and `num_cpus` are refused
    here rather than silently ignored. `gpus_present()` reads the cluster: inside `session()` it uses
    that connection, outside it connects just long enough to ask (config checks run before the session).
    """

    def __init__(
        self,
        dry_run: bool = False,
        logical_gpus: int = 0,
        num_cpus: Optional[int] = None,
        address: Optional[str] = "auto",
        startup_timeout_s: float = 600.0,
    ) -> None:
        if logical_gpus:
            raise ValueError(
                f"launcher.logical_gpus={logical_gpus} cannot be applied to a running cluster: "
                "give `ray start --num-gpus=N` on each node instead, or use launcher=local"
            )
        if num_cpus is not None:
            raise ValueError(
                f"launcher.num_cpus={num_cpus} cannot be applied to a running cluster: "
                "give `ray start --num-cpus=N` on each node instead, or use launcher=local"
            )
        super().__init__(dry_run, logical_gpus, num_cpus, address or "auto", startup_timeout_s)

    def gpus_present(self) -> int:
        if ray.is_initialized():
            return int(ray.cluster_resources().get("GPU", 0))
        with self.session():
            return int(ray.cluster_resources().get("GPU", 0))

    def _init_kwargs(self) -> dict[str, Any]:
        return {"address": self.address}
