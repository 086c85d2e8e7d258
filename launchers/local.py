"""Start Ray inside this process (`ray.init`) and stop it when the session ends."""

from __future__ import annotations

import os
from typing import Any, Optional

from launchers.base import RayLauncher

# Ray schedules actors by logical CPUs; on a 2-core box a run has more processes than cores, so the
# default declares at least this many (they are bookkeeping, not pinned cores).
MIN_LOGICAL_CPUS = 16


class LocalRayLauncher(RayLauncher):
    """A private single-node Ray for this run; `logical_gpus` lets CPU machines test GPU layouts."""

    def __init__(
        self,
        dry_run: bool = False,
        logical_gpus: int = 0,
        num_cpus: Optional[int] = None,
        address: Optional[str] = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        if address not in (None, "local"):
            raise ValueError(
                f"launcher.address={address!r} joins an existing cluster, which launcher=local never does: "
                "use launcher=cluster launcher.address=... or leave address null"
            )
        super().__init__(dry_run, logical_gpus, num_cpus, address, startup_timeout_s)

    def gpus_present(self) -> int:
        cuda_gpus = _cuda_device_count()
        if cuda_gpus == 0 and self.logical_gpus > 0:
            return self.logical_gpus
        return cuda_gpus

    def logical_cpus(self) -> int:
        if self.num_cpus is not None:
            return self.num_cpus
        return max(os.cpu_count() or 1, MIN_LOGICAL_CPUS)

    def _init_kwargs(self) -> dict[str, Any]:
        # address="local" always starts a new instance, never joins one found via RAY_ADDRESS or
        # a `ray start` on this machine (num_cpus/num_gpus are only accepted for a new instance).
        return {
            "address": "local",
            "num_cpus": self.logical_cpus(),
            "num_gpus": self.gpus_present(),
            "include_dashboard": False,
        }


def _cuda_device_count() -> int:
    import torch  # imported here: torch is slow to import and not needed to build the launcher

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
