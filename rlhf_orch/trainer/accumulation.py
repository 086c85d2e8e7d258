"""Gradient accumulation over an optimizer step's micro-batches, and the step's gradient norms."""

from __future__ import annotations

import torch

from rlhf_orch.liveness import WorkCount
from rlhf_orch.trainer.token_weighting import OptimizerStepPlan


class Accumulation:
    """One train() call's backward passes on a DeepSpeed `engine`: each micro-batch's loss times
    its weight, the optimizer stepping at each step's last micro-batch; it keeps the gradient norm
    of every optimizer step DeepSpeed computed one for."""

    def __init__(self, engine, work_done: WorkCount):
        self.engine = engine
        self.work_done = work_done
        self.grad_norms: list[float] = []  # per optimizer step of this train() call

    def backward(self, plan: OptimizerStepPlan, position: int, loss: torch.Tensor, weight: float) -> float:
        """Backward of one micro-batch's loss times its `weight` (`plan.weight`: its share of the
        step's normaliser over all ranks); the optimizer steps at the step's last micro-batch.

        So the update is the step's loss aggregated over all its sequences however they were cut
        into micro-batches -- count-based or token-budget, fixed or varying counts. Returns the
        micro-batch's weighted loss (the step's loss is their sum over positions and ranks / ranks).
        """
        self.engine.set_gradient_accumulation_boundary(plan.is_boundary(position))
        with self.work_done.collective():  # (DeepSpeed reduces the gradients over the ranks in these)
            self.engine.backward(loss * weight, scale_wrt_gas=False)
            self.engine.step()
        if plan.is_boundary(position):
            norm = self.engine.get_global_grad_norm()  # None when DeepSpeed did not compute one
            if norm is not None:
                self.grad_norms.append(float(norm))
        return float(loss.detach()) * weight

    def with_grad_norm(self, stats: dict[str, float]) -> dict[str, float]:
        """`stats` plus the largest gradient norm of this train() call, when DeepSpeed computed one
        (torch's max keeps a NaN, which the driver's guard then reports; Python's may not)."""
        if self.grad_norms:
            stats["grad_norm"] = float(torch.tensor(self.grad_norms).max())
        return stats
