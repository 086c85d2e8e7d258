"""The policy's Ray actor: one data-parallel rank of the trained policy (DeepSpeed). A thin shell:
its experience is `experience.make_experience`, its update `policy_update.train_policy`, its
weights' views `policy_weights.PolicyWeights`, its export `checkpointing.export_hf`, the reference
it may host `frozen_models` -- each a plain part tested without Ray."""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from rlhf_orch.algo.estimators import Algorithm
from rlhf_orch.liveness import resolved
from rlhf_orch.trainer import checkpointing
from rlhf_orch.trainer.experience import make_experience
from rlhf_orch.trainer.forward import enable_gradient_checkpointing, load_policy, shares_prompts
from rlhf_orch.trainer.frozen_models import frozen_logprobs, frozen_models
from rlhf_orch.trainer.lora import apply_lora, frozen_base
from rlhf_orch.trainer.phase_memory import ends_a_phase
from rlhf_orch.trainer.policy_update import train_policy
from rlhf_orch.trainer.policy_weights import PolicyWeights
from rlhf_orch.trainer.spec import TrainerSpec, respecced
from rlhf_orch.trainer.trained_sequences import trained_sequences
from rlhf_orch.trainer.training_engine import training_engine
from rlhf_orch.trainer.weight_source import on_cpu
from rlhf_orch.trainer.worker import TrainerWorker
from rlhf_orch.transfer.inbox import staged_micro_batches


class PolicyWorker(TrainerWorker):
    """One data-parallel rank of the policy: old logprobs, advantages, PPO updates, weight sends."""

    role = "actor"

    def build(self, spec: TrainerSpec | None = None) -> int:
        """(Re)build the DeepSpeed engine from the checkpoint; `spec` replaces this role's settings."""
        self.spec = respecced(self.spec, spec, self.role, self.world_size)
        if spec is not None:
            self.frozen = None  # another spec may name other models: loaded again below
        model = load_policy(self.spec.model_path, self.spec.dtype, self.device).to(self.device)
        model.config.use_cache = False
        if self.spec.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        lora = self.spec.lora
        if lora is not None:
            model = apply_lora(model, lora, self.spec.seed)
        self.engine = training_engine(model, self.spec, self.work_done)
        # `checkpoint_weights`: every weight under the checkpoint's names (export, tests); `weights`:
        # what a sync sends -- the same, or the adapter tensors alone (model.lora.sync=adapter).
        self.weight_views = PolicyWeights(self.engine.module, self.spec.zero_stage, lora)
        self.checkpoint_weights, self.weights = self.weight_views.full, self.weight_views.for_sync()
        if self.spec.host_reference and getattr(self, "frozen", None) is None:
            # The frozen models, as a ReferenceWorker would load them (a rebuild keeps them: they
            # never change), sharded over the policy ranks under trainer.reference_memory. Under
            # model.lora the frozen base under the adapters is the reference (`frozen_base`).
            self.frozen = frozen_models(self.spec, self.device, self.world_size, self.work_done, reference=lora is None)
        return sum(p.numel() for p in model.parameters())

    def use_lora_sync(self, mode: str) -> None:
        """What each weight sync sends under model.lora, as the engines take it (`VLLMEngine.lora_sync_mode`):
        "adapter" the adapter tensors only, "merged" every weight with the adapters merged in."""
        self.weights = self.weight_views.for_sync(mode)

    def lora_summary(self) -> dict[str, Any]:
        """What model.lora trains and what a sync moves (the start-up line)."""
        return self.weight_views.lora_summary()

    @torch.no_grad()
    def adapter_weights(self) -> dict[str, torch.Tensor] | None:
        """The policy's LoRA adapters (model.lora) on CPU under PEFT's names: rank 0 returns them,
        other ranks None (every rank calls: under ZeRO-3 the gather is collective)."""
        return on_cpu(self.weight_views.adapter, self.rank, self.work_done)

    # ---------------------------------------------------------------- the hosted reference
    @torch.no_grad()
    def reference_logprobs(self, shard: int) -> dict[str, list[torch.Tensor]]:
        """What `ReferenceWorker.logprobs` returns, from the frozen models this rank holds
        (`host_reference`); the shard stays staged for this rank's experience and update. Under
        model.lora the reference is the policy's own base with the adapters switched off."""
        share = shares_prompts(self.spec.share_prompts, self.device)

        def logprobs(model: torch.nn.Module) -> list[torch.Tensor]:
            return frozen_logprobs(
                model,
                lambda: staged_micro_batches(self._staged, shard),
                shard,
                self.spec,
                self.world_size,
                share,
                self.work_done,
            )

        out = {name: logprobs(model) for name, model in self.frozen.items()}
        if self.spec.lora is not None and self.spec.holds_reference:
            self.engine.eval()
            with frozen_base(self.engine.module) as base:
                out["ref"] = logprobs(base)
        return out

    def reference_placement(self) -> dict[str, Any]:
        from rlhf_orch.topology.introspect import where_am_i

        return where_am_i("reference", self.rank)

    # ---------------------------------------------------------------- experience and update
    @ends_a_phase
    @torch.no_grad()
    def make_experience(
        self,
        shard: int,
        frozen: dict[str, list[torch.Tensor]] | None,
        values: list[torch.Tensor] | None,
        algo: Algorithm,
        sample_values: dict[int, float],
    ) -> tuple[dict[str, float], list[torch.Tensor]]:
        """Old logprobs, then the algorithm's token targets (`experience.make_experience`). Returns
        stats and the critic's returns. `frozen` (the reference ranks' log-probs, "ref" / "teacher")
        and `values` may come `Deferred`: fetched here.
        Whether the update's forward is to give the old log-probs is kept for `train`, with the shard."""
        frozen, values = resolved(frozen), resolved(values)
        stats, returns, from_update = make_experience(
            self.engine,
            staged_micro_batches(self._staged, shard),
            frozen,
            values,
            algo,
            sample_values,
            self.spec,
            self.device,
            self.world_size,
            shares_prompts(self.spec.share_prompts, self.device),
            self.work_done,
        )
        self._old_from_update[shard] = from_update  # (train() takes it: the update is held to it)
        return stats, returns

    def dumped_sequences(self) -> list[dict]:
        """The sequences the last `train` was asked to keep for the rollout dump (logger.rollouts),
        as this rank trained them (`trained_sequences`); handed over once."""
        dumped, self._dumped = self._dumped, []
        return dumped

    @ends_a_phase
    def train(self, shard: int, algo: Algorithm, norm_len: int, dump: Sequence[int] = ()) -> dict[str, float]:
        """`ppo_epochs` passes of the policy loss over the shard (`policy_update.train_policy`); the
        staged experience is dropped after, but for the sequences `dump` (the rollout dump's, read
        after the update: its forward may be where the trainer's log-probs come from), which
        `dumped_sequences` hands over."""
        self.last_step_members = []
        if shard not in self._old_from_update:
            raise RuntimeError(f"shard {shard}: the policy's update ran without its experience (make_experience)")
        from_update = self._old_from_update.pop(shard)
        stats, self.last_step_members = train_policy(
            self.engine,
            staged_micro_batches(self._staged, shard),
            algo,
            norm_len,
            self.spec,
            self.world_size,
            shares_prompts(self.spec.share_prompts, self.device),
            self.work_done,
            from_update,
        )
        self._dumped = (
            trained_sequences(staged_micro_batches(self._staged, shard), list(dump), self.spec.pad_id) if dump else []
        )
        self.drop_staged()
        return stats

    # ---------------------------------------------------------------- weight sync
    def join_weight_group(self, address, rank: int) -> int:
        from rlhf_orch.sync.group import BroadcastGroup

        self.weight_group = BroadcastGroup(address, rank)
        return rank

    def weight_group_address(self, world_size: int, backend: str, timeout_s: float, name: str = "rlhf_orch_weights"):
        from rlhf_orch.sync.group import free_port_address

        return free_port_address(world_size, backend, timeout_s, name)

    def run_weight_sync(self, strategy, engines: list, version: int) -> dict[str, float]:
        """Every policy rank calls this (ZeRO-3 gathers are collective); senders also send."""
        t0 = time.perf_counter()
        with self.work_done.collective():  # (its gathers and sends)
            stats = strategy.run_send(self.weights, getattr(self, "weight_group", None), engines, version, self.rank)
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def export_hf(self, directory: str) -> None:
        """The policy in Hugging Face format (`checkpointing.export_hf`). Every rank calls (ZeRO-3
        gathers are collective); rank 0 writes."""
        checkpointing.export_hf(
            self.engine, self.weight_views, directory, self.rank, self.spec.model_path, self.work_done
        )
