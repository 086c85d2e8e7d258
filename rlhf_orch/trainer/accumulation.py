"""Gradient accumulation over an optimizer step's micro-batches, and the step's gradient norms."""

from __future__ import annotations

import torch

from rlhf_orch.liveness import WorkCount
from rlhf_orch.trainer.token_weighting import OptimizerStepPlan


class Accumulation:
    """One train() call's backward passes on a DeepSpeed `engine`: each micro-batch's loss times
    its weight, the optimizer stepping at each step's last micro-batch; it keeps the gradient norm
    of every optimizer step. DeepSpeed computes it under ZeRO and in its 16-bit optimizers; at stage
    0 in float32 (a role of one rank: `zero_stage_to_run`) it clips the gradients without keeping
    their norm, so there -- asked of the engine as DeepSpeed's own step decides it -- the norm is
    taken here, before the step clips them."""

    def __init__(self, engine, work_done: WorkCount):
        self.engine = engine
        self.work_done = work_done
        # (DeepSpeedEngine._take_model_step's own test for the plain float32 optimizer it steps)
        self.norm_before_step = not (engine.fp16_enabled() or engine.bfloat16_enabled() or engine.zero_optimization())
        self.grad_norms: list[float] = []  # per optimizer step of this train() call

    def backward(self, plan: OptimizerStepPlan, position: int, loss: torch.Tensor, weight: float) -> float:
        """Backward of one micro-batch's loss times its `weight` (`plan.weight`: its share of the
        step's normaliser over all ranks); the optimizer steps at the step's last micro-batch.

        So the update is the step's loss aggregated over all its sequences however they were cut
        into micro-batches -- count-based or token-budget, fixed or varying counts. Returns the
        micro-batch's weighted loss (the step's loss is their sum over positions and ranks / ranks).
        """
        boundary = plan.is_boundary(position)
        self.engine.set_gradient_accumulation_boundary(boundary)
        with self.work_done.collective():  # (DeepSpeed reduces the gradients over the ranks in these)
            self.engine.backward(loss * weight, scale_wrt_gas=False)
            own = self._gradient_norm() if boundary and self.norm_before_step else None
            self.engine.step()
        if boundary:
            norm = self.engine.get_global_grad_norm()  # None when DeepSpeed did not compute one
            norm = own if norm is None else norm
            if norm is not None:
                self.grad_norms.append(float(norm))
        return float(loss.detach()) * weight

    def _gradient_norm(self) -> float | None:
        """The 2-norm of every gradient at an optimizer step (at stage 0 already averaged over the
        ranks by `backward`), as DeepSpeed's ZeRO reports it: before clipping."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else None

    def with_grad_norm(self, stats: dict[str, float]) -> dict[str, float]:
        """`stats` plus the largest gradient norm of this train() call, when DeepSpeed computed one
        (torch's max keeps a NaN, which the driver's guard then reports; Python's may not)."""
        if self.grad_norms:
            stats["grad_norm"] = float(torch.tensor(self.grad_norms).max())
        return stats
