"""Where a running actor actually is: the facts tests compare against the PlacementPlan."""

from __future__ import annotations

import os
from typing import Any


def where_am_i(role: str, rank: int) -> dict[str, Any]:
    import ray

    ctx = ray.get_runtime_context()
    return {
        "role": role,
        "rank": rank,
        "node_id": ctx.get_node_id(),
        "placement_group_id": ctx.get_placement_group_id(),
        "gpu_ids": sorted(str(g) for g in ray.get_gpu_ids()),
        "pid": os.getpid(),
    }
