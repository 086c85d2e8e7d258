"""The memory check `python run.py` runs after the config check and before Ray starts: plan, and
for a plan that does not fit, the fixes (each re-planned through the same checks as the run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlhf_orch.config.problems import ConfigError
from rlhf_orch.config.ranges import range_problems
from rlhf_orch.config.schema import RootConfig
from rlhf_orch.config.validate import Hardware, validate
from rlhf_orch.memory.fixes import Fix, fix_chain, suggest_fixes
from rlhf_orch.memory.plan import MemoryPlan, gpu_memory, host_memory, plan_memory
from rlhf_orch.memory.report import describe, refusal
from rlhf_orch.memory.shapes import shape_of
from rlhf_orch.topology.plan import PlacementError, PlacementPlan

# Re-planned candidates are checked against a cluster this large: "more GPUs" is a fix to name
# even where this cluster has none to give.
_ANY_GPUS = 1 << 20


@dataclass
class MemoryVerdict:
    plan: Optional[MemoryPlan]
    skipped: str = ""  # why there is no plan (the model's shape is unknown here)
    fixes: tuple[Fix, ...] = ()
    chain: tuple[Fix, ...] = ()  # the first fix of each re-plan, until it fits

    @property
    def fits(self) -> bool:
        return self.plan is None or self.plan.fits

    def table(self) -> str:
        return describe(self.plan) if self.plan else f"memory plan: skipped ({self.skipped})"

    def refusal(self) -> str:
        return refusal(self.plan, list(self.fixes), list(self.chain)) if self.plan else ""

    def summary_line(self) -> str:
        if self.plan is None:
            return f"memory: not planned ({self.skipped})"
        worst = self.plan.worst()
        return (
            f"memory: {worst.device.name} needs {worst.need / 1e9:.1f} GB of {worst.device.capacity / 1e9:.1f} GB "
            f"(headroom {worst.headroom / 1e9:.1f} GB; launcher.dry_run=true prints the plan)"
        )


def check_memory(typed: RootConfig, plan: PlacementPlan, on_gpu: bool, reward_model: bool) -> MemoryVerdict:
    """The run's memory plan; `on_gpu`: its processes get CUDA devices (a dry run of a GPU layout
    plans GPUs even on a machine without one)."""
    shape, source = shape_of(typed.model)
    if shape is None:
        return MemoryVerdict(None, skipped=source)
    teacher = None
    if typed.teacher is not None and typed.algo.uses_teacher:
        teacher, teacher_source = shape_of(typed.teacher)
        if teacher is None:
            return MemoryVerdict(None, skipped=f"the teacher's shape: {teacher_source}")
        source += f"; teacher from {teacher_source}"
    gpu = gpu_memory(typed) if on_gpu else (0, "")
    host = host_memory()
    memory = plan_memory(typed, plan, shape, source, on_gpu, gpu, host, teacher)
    if memory.fits:
        return MemoryVerdict(memory)

    def replan(changed: RootConfig) -> Optional[MemoryPlan]:
        if range_problems(changed):
            return None
        try:
            placement = instantiate(OmegaConf.structured(changed.placement)).plan(
                reward_model=reward_model,
                critic=changed.algo.needs_critic,
                reference=changed.algo.needs_reference_ranks,
            )
            validate(changed, placement, Hardware(gpus=_ANY_GPUS, cuda=on_gpu))
        except (ConfigError, PlacementError, ValueError):
            return None
        return plan_memory(
            changed, placement, shape, source, on_gpu, gpu_memory(changed) if on_gpu else gpu, host, teacher
        )

    fixes = suggest_fixes(typed, memory, replan)
    chain = fix_chain(typed, memory, replan) if fixes and not any(fix.plan.fits for fix in fixes) else []
    return MemoryVerdict(memory, fixes=tuple(fixes), chain=tuple(chain))
