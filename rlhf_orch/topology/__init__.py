"""Where every role runs: pure placement plans (`plan`, built by `planners`), their config classes (`placement`) and the
Ray placement groups that realise them (`ray_placement`, imported on demand so planning needs no Ray)."""

from rlhf_orch.topology.plan import ROLES, BundleClaim, PlacementError, PlacementPlan, RoleSlot
from rlhf_orch.topology.planners import SplitGpuCounts, plan_colocated, plan_cpu_local, plan_split, split_gpu_counts

__all__ = [
    "ROLES",
    "BundleClaim",
    "PlacementError",
    "PlacementPlan",
    "RoleSlot",
    "SplitGpuCounts",
    "plan_colocated",
    "plan_cpu_local",
    "plan_split",
    "split_gpu_counts",
]
