"""Trainer-side Ray actors: policy (DeepSpeed), critic (DeepSpeed), reference (forward only).

They are thin: the math is in `rlhf_orch.algo`, the forward passes in `forward.py`, the
DeepSpeed config in `deepspeed_config.py`. What lives here is process set-up, holding the
experience this rank was handed, and calling those functions in order.
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from rlhf_orch.algo.estimators import Algorithm, TargetRows
from rlhf_orch.algo.losses import (
    aggregate_loss,
    clipped_policy_loss,
    clipped_value_loss,
    decoupled_is_weights,
    kl_divergence,
    loss_denominator,
    truncated_is_weights,
)
from rlhf_orch.algo.ppo_math import LOGPROB_DIFF_THRESHOLD, masked_mean
from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.liveness import MONITOR, WorkCount, resolved
from rlhf_orch.rng import rng_state, set_rng_state
from rlhf_orch.trainer.deepspeed_config import deepspeed_config, frozen_model_config
from rlhf_orch.trainer.deepspeed_startup import skip_muon_import, skip_shm_comm_op
from rlhf_orch.trainer.forward import (
    VARLEN_SDPA,
    enable_gradient_checkpointing,
    load_critic,
    load_policy,
    load_reward_model,
    packed_attention_impl,
    sequence_logprobs,
    sequence_logprobs_and_entropy,
    sequence_scores,
    sequence_values,
)
from rlhf_orch.trainer.token_weighting import (
    OptimizerStepPlan,
    all_reduce_sum,
    padded_rows,
    plan_optimizer_steps,
    rows_for_targets,
    targets_in_layout,
)
from rlhf_orch.trainer.phase_memory import ends_a_phase
from rlhf_orch.trainer.progress import count_layers, counting_saved_tensors
from rlhf_orch.trainer.lora import ADAPTER_DIR, AdapterWeights, MergedLoraWeights, apply_lora, export_adapter, frozen_base
from rlhf_orch.trainer.weight_source import ModuleWeightSource
from rlhf_orch.transfer.batch import ENGINE_LOGPROBS, TURN_REWARDS, PackedBatch, PaddedBatch, model_turn_spans
from rlhf_orch.transfer.inbox import ExperienceInbox


@dataclass(frozen=True)
class TrainerSpec:
    """What every trainer-side process needs; built on the driver from the config."""

    model_path: str
    dtype: str
    zero_stage: int
    micro_batch_size: int
    train_batch_size: int
    data_parallel_size: int
    pad_id: int
    temperature: float
    lr: float
    weight_decay: float
    grad_clip: float
    clip_eps: float
    ppo_epochs: int
    seed: int
    torch_threads: int = 1
    optimizer: str = "adamw"  # trainer.optimizer: "adamw" or "sgd" (plain, no momentum)
    offload_optimizer: bool = False  # trainer.offload_optimizer (ZeRO-Offload; GPU layouts)
    gradient_checkpointing: bool = False  # trainer.gradient_checkpointing
    host_reference: bool = False  # the policy rank also holds the reference (plan.reference_in_actor)
    reference_memory: str = "full"  # trainer.reference_memory: full, sharded (ZeRO-3) or offloaded
    share_prompts: bool = False  # trainer.share_prompts: packed micro-batches run a repeated prompt once
    # model.lora (its sync resolved to adapter or merged): the policy trains adapters on a frozen
    # base (rlhf_orch.trainer.lora); None: every weight trains.
    lora: LoraSettings | None = None
    # The process shares its GPU with others of the run (`PlacementPlan.shares_gpu`): it gives its
    # cached CUDA memory back as each phase ends (rlhf_orch/trainer/phase_memory.py).
    free_cache_between_phases: bool = False


class _Worker(ExperienceInbox):
    """Process set-up shared by all trainer roles; receiving experience comes from `ExperienceInbox`."""

    role = "worker"

    @property
    def share_prompts(self) -> bool:
        """trainer.share_prompts where it can hold: the shared-prompt row needs this project's
        attention (varlen_sdpa); flash-attention's varlen kernels, where a CUDA machine has them,
        take whole sequences only."""
        return self.spec.share_prompts and packed_attention_impl(self.device) == VARLEN_SDPA

    def __init__(self, spec: TrainerSpec, rank: int, world_size: int):
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        # What this rank got done (`progress`); kept over `reset`, so it only grows while the process lives.
        self.work_done = self.__dict__.get("work_done") or WorkCount()
        torch.set_num_threads(spec.torch_threads)
        torch.manual_seed(spec.seed + rank)
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Experience this rank holds, by shard index: list of micro-batches (padded or packed,
        # as the transfer strategy delivered them; the forward takes both).
        self._staged: dict[int, list[PaddedBatch | PackedBatch]] = {}
        self.pad_id = spec.pad_id
        self._grad_norms: list[float] = []  # per optimizer step of the current train() call
        # Per optimizer step of the last train() call: the sample indices this rank trained on in it.
        self.last_step_members: list[tuple[int, ...]] = []

    def reset(self, spec: TrainerSpec) -> None:
        """What a new actor of this role and rank starts as, for the next run of this process
        (`rlhf_orch.orchestration.warm_actors`; `build` follows as for a new one): every attribute
        of the last run dropped (model, DeepSpeed engine, staged experience, weight-sync group) and
        set up again, the RNG seeded again. The torch.distributed group of the role's ranks stays:
        the same plan gives the same ranks."""
        self._respec(spec)  # refuses another data-parallel size
        rank, world_size, work_done = self.rank, self.world_size, self.work_done
        self.__dict__.clear()
        self.work_done = work_done
        gc.collect()  # the last run's model, optimizer state and weight-sync group before the next is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what a colocated engine sees free is what a new process would leave
        _Worker.__init__(self, spec, rank, world_size)

    # ---------------------------------------------------------------- placement introspection
    def placement(self) -> dict[str, Any]:
        from rlhf_orch.topology.introspect import where_am_i

        return where_am_i(self.role, self.rank)

    # ---------------------------------------------------------------- distributed set-up
    def ping(self) -> int:
        """Answers while the process is alive and not busy (the run's check after a failure)."""
        return self.rank

    @ray.method(concurrency_group=MONITOR)
    def progress(self) -> int:
        """Micro-batches, decoder layers, saved tensors and collectives this rank went through so
        far (rlhf_orch.trainer.progress). Answered on a thread of its own while a phase runs (the
        driver's liveness check, rlhf_orch.liveness): a count that moves means the
        phase moves; one that stands, or no answer, means a hung rank."""
        return self.work_done.count

    def rendezvous_address(self) -> tuple[str, int]:
        from rlhf_orch.sync.group import free_port, rendezvous_ip

        host = rendezvous_ip()  # Ray's node IP (127.0.0.1 under launcher=local), as every weight group
        return host, free_port(host)

    def init_distributed(self, host: str, port: int) -> None:
        import deepspeed
        import torch.distributed as dist
        from deepspeed.constants import default_pg_timeout

        from rlhf_orch.sync.group import bind_interfaces_towards, tcp_store

        if dist.is_initialized():  # a kept (warm) process keeps its world (`reset` refuses another size)
            return
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        os.environ.update(
            {
                "MASTER_ADDR": host,
                "MASTER_PORT": str(port),
                "RANK": str(self.rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": "0",
            }
        )
        # gloo (and NCCL's bootstrap) bind this interface: loopback locally, the cluster NIC on multi-node.
        bind_interfaces_towards(host)
        # torch's own tcp:// store would listen on every interface; this one listens on `host` only.
        store = tcp_store(host, port, self.world_size, self.rank == 0, default_pg_timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=default_pg_timeout)
        if self.device.type == "cpu":
            skip_shm_comm_op()
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)  # reuses the initialised group

    # ---------------------------------------------------------------- experience hand-over
    def _receive(self, mb: PaddedBatch | PackedBatch) -> PaddedBatch | PackedBatch:
        return mb.to(self.device)

    def _micro_batches(self, shard: int) -> list[PaddedBatch | PackedBatch]:
        mbs = self._staged[shard]
        if any(mb is None for mb in mbs):
            raise RuntimeError(f"shard {shard}: {sum(mb is None for mb in mbs)} streamed micro-batches never arrived")
        return mbs

    def _accumulate(self, plan: OptimizerStepPlan, position: int, loss: torch.Tensor, weight: float) -> float:
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
                self._grad_norms.append(float(norm))
        return float(loss.detach()) * weight

    def _with_grad_norm(self, stats: dict[str, float]) -> dict[str, float]:
        """`stats` plus the largest gradient norm of this train() call, when DeepSpeed computed one
        (torch's max keeps a NaN, which the driver's guard then reports; Python's may not)."""
        if self._grad_norms:
            stats["grad_norm"] = float(torch.tensor(self._grad_norms).max())
        return stats

    def _logprobs_of(self, model: torch.nn.Module, shard: int) -> list[torch.Tensor]:
        """A frozen model's log-probs of the shard's sequences, on CPU (the reference's, hosted or not).
        A sharded model's forwards are collective: the ranks first agree on how many they run, so a
        rank short of micro-batches fails every rank at once instead of leaving the others waiting."""
        if self.spec.reference_memory != "full" and self.world_size > 1:
            import torch.distributed as dist

            try:
                mbs, failure = self._micro_batches(shard), None
            except Exception as e:  # told to every rank below, then raised here
                mbs, failure = [], e
            counts = [None] * self.world_size
            with self.work_done.collective():
                dist.all_gather_object(counts, -1 if failure else len(mbs))
            if failure is not None:
                raise failure
            if len(set(counts)) > 1:
                raise RuntimeError(f"shard {shard}: the sharded reference's ranks hold {counts} micro-batches (-1: failed); "
                                   "its forwards are collective and need as many on every rank")
        else:
            mbs = self._micro_batches(shard)
        return [sequence_logprobs(model, mb, self.spec.temperature, self.share_prompts).float().cpu() for mb in self.work_done.each(mbs)]

    def _load_frozen(self, loader) -> int:
        """A forward-only model (reference, reward model): eval mode, no gradients; returns its size."""
        self.model = count_layers(_frozen(loader(self.spec.model_path, self.spec.dtype, self.device).to(self.device)), self.work_done)
        return sum(p.numel() for p in self.model.parameters())

    def _reference_model(self) -> torch.nn.Module:
        """The frozen initial policy as `trainer.reference_memory` says to hold it: whole on this
        rank, or sharded by ZeRO-3 over this process's torch.distributed world (the reference
        ranks, or the policy ranks hosting it), its shards in host memory when offloaded. A sharded
        forward is collective: every rank of the world runs the same micro-batches' forwards (the
        transfers give each rank as many, empty stand-ins included)."""
        if self.spec.reference_memory == "full":
            return count_layers(_frozen(load_policy(self.spec.model_path, self.spec.dtype, self.device).to(self.device)), self.work_done)
        import deepspeed

        # Loaded whole in host memory (each rank's, once, at start), then partitioned parameter by
        # parameter by zero.Init onto this rank's device -- or its host memory when offloaded -- so a
        # GPU never holds the whole model (deepspeed.initialize alone would move it there first).
        model = count_layers(_frozen(load_policy(self.spec.model_path, self.spec.dtype, self.device)), self.work_done)  # (the device picks the attention kernel)
        skip_muon_import()
        offload = self.spec.reference_memory == "offloaded"
        config = frozen_model_config(dtype=self.spec.dtype, data_parallel_size=self.world_size, offload_params=offload)
        deepspeed.zero.Init(module=model, config_dict_or_path=config, remote_device="cpu" if offload else None, pin_memory=offload,
                            mem_efficient_linear=False)
        for buffer in model.buffers():  # (zero.Init moves parameters only; initialize no longer moves the model)
            buffer.data = buffer.data.to(self.device)
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine

    def _respec(self, spec: TrainerSpec | None) -> None:
        if spec is None:
            return
        if spec.data_parallel_size != self.world_size:
            raise ValueError(f"a {self.role} group of {self.world_size} ranks cannot take data_parallel_size={spec.data_parallel_size}")
        self.spec = spec

    def step_members(self) -> list[tuple[int, ...]]:
        """Per optimizer step of the last train() call (all epochs), the sample indices this rank
        trained on in it: which sequences shared a step (the rest of the update is their math)."""
        return list(self.last_step_members)

    @torch.no_grad()
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Every weight of the role's model, on CPU: rank 0 returns them, other ranks None (every
        rank calls: under ZeRO-3 the gather is collective)."""
        return self._on_cpu(self.checkpoint_weights)

    @torch.no_grad()
    def adapter_weights(self) -> dict[str, torch.Tensor] | None:
        """The policy's LoRA adapters (model.lora) on CPU under PEFT's names: rank 0 returns them,
        other ranks None (every rank calls: under ZeRO-3 the gather is collective)."""
        return self._on_cpu(self.adapter)

    def _on_cpu(self, source) -> dict[str, torch.Tensor] | None:
        """Every tensor of a weight view, copied to CPU on rank 0 (None on the others, which gather too)."""
        with self.work_done.collective(), source.gathered([m.name for m in source.metas()]) as tensors:
            return {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()} if self.rank == 0 else None

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str) -> None:
        """DeepSpeed's checkpoint of this role (every rank calls: ZeRO partitions are per rank) and
        this rank's RNG state (DeepSpeed keeps `client_state` from rank 0 only)."""
        # Under model.lora only the adapters (and their optimizer states) are saved: the frozen
        # base is the model's own checkpoint, loaded again by `build`.
        with self.work_done.collective():
            self.engine.save_checkpoint(directory, tag="state", save_latest=False, exclude_frozen_parameters=self.spec.lora is not None)
        torch.save(rng_state(), os.path.join(directory, f"rng_rank{self.rank}.pt"))

    def load_checkpoint(self, directory: str) -> None:
        with self.work_done.collective():
            path, _ = self.engine.load_checkpoint(
                directory, tag="state", load_optimizer_states=True, load_lr_scheduler_states=True,
                # (the adapters' checkpoint has no base weights; a checkpoint of another model.lora is
                # refused before any actor starts: `model` keys are breaking, orchestration/checkpoint.py)
                load_module_strict=self.spec.lora is None,
            )
        if path is None:
            raise RuntimeError(f"no DeepSpeed checkpoint of the {self.role} in {directory}")
        set_rng_state(torch.load(os.path.join(directory, f"rng_rank{self.rank}.pt"), weights_only=True))

    def _ds_engine(self, model: torch.nn.Module, lr: float):
        import deepspeed

        skip_muon_import()

        spec = self.spec
        params = [p for p in model.parameters() if p.requires_grad]
        if spec.optimizer == "sgd":  # plain SGD: an update proportional to the gradient (scale errors show)
            optimizer = torch.optim.SGD(params, lr=lr, weight_decay=spec.weight_decay)
        else:
            optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
        config = deepspeed_config(
            zero_stage=spec.zero_stage,
            micro_batch_size=spec.micro_batch_size,
            train_batch_size=spec.train_batch_size,
            data_parallel_size=spec.data_parallel_size,
            grad_clip=spec.grad_clip,
            dtype=spec.dtype,
            offload_optimizer=spec.offload_optimizer,
        )
        engine, *_ = deepspeed.initialize(model=count_layers(model, self.work_done), optimizer=optimizer, config=config)
        return engine


class PolicyWorker(_Worker):
    """One data-parallel rank of the policy: old logprobs, advantages, PPO updates, weight sends."""

    role = "actor"

    def build(self, spec: TrainerSpec | None = None) -> int:
        """(Re)build the DeepSpeed engine from the checkpoint; `spec` replaces this role's settings."""
        self._respec(spec)
        if spec is not None:
            self.reference = None  # another spec may name another model: loaded again below
        model = load_policy(self.spec.model_path, self.spec.dtype, self.device).to(self.device)
        model.config.use_cache = False
        if self.spec.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        lora = self.spec.lora
        if lora is not None:
            model = apply_lora(model, lora, self.spec.seed)
        self.engine = self._ds_engine(model, self.spec.lr)
        # `checkpoint_weights`: every weight under the checkpoint's names (export, tests); `weights`:
        # what a sync sends -- the same, or the adapter tensors alone (model.lora.sync=adapter).
        if lora is None:
            self.checkpoint_weights = self.weights = ModuleWeightSource(self.engine.module, self.spec.zero_stage)
        else:
            self.checkpoint_weights = MergedLoraWeights(self.engine.module, self.spec.zero_stage)
            self.adapter = AdapterWeights(self.engine.module, self.spec.zero_stage)
            self._lora_views = {"adapter": self.adapter, "merged": self.checkpoint_weights}
            # (auto: merged until the engines say what they take, `use_lora_sync`)
            self.weights = self._lora_views.get(lora.sync, self.checkpoint_weights)
            self.reference = None  # the frozen base under the adapters is the reference (`frozen_base`)
        if lora is None and self.spec.host_reference and getattr(self, "reference", None) is None:
            # The frozen initial policy, as a ReferenceWorker would load it (a rebuild keeps it:
            # it never changes), sharded over the policy ranks under trainer.reference_memory.
            self.reference = self._reference_model()
        return sum(p.numel() for p in model.parameters())

    def use_lora_sync(self, mode: str) -> None:
        """What each weight sync sends under model.lora, as the engines take it (`VLLMEngine.lora_sync_mode`):
        "adapter" the adapter tensors only, "merged" every weight with the adapters merged in."""
        if mode not in self._lora_views:
            raise ValueError(f"lora sync mode {mode!r}: one of {sorted(self._lora_views)}")
        self.weights = self._lora_views[mode]

    def lora_summary(self) -> dict[str, Any]:
        """What model.lora trains and what a sync moves (the start-up line)."""
        lora = self.spec.lora
        params = list(self.engine.module.parameters())
        numel = lambda p: int(getattr(p, "ds_numel", p.numel()))  # noqa: E731 (ZeRO-3 keeps the full count here)
        return {
            "rank": lora.rank, "alpha": lora.alpha, "sync": lora.sync, "layers": len(self.adapter.metas()) // 2,
            "trainable": sum(numel(p) for p in params if p.requires_grad), "total": sum(numel(p) for p in params),
            "adapter_bytes": sum(m.nbytes for m in self.adapter.metas()),
            "full_bytes": sum(m.nbytes for m in self.checkpoint_weights.metas()),
        }

    # ---------------------------------------------------------------- the hosted reference
    @torch.no_grad()
    def reference_logprobs(self, shard: int) -> list[torch.Tensor]:
        """What `ReferenceWorker.logprobs` returns, from the reference this rank holds
        (`host_reference`); the shard stays staged for this rank's experience and update. Under
        model.lora the reference is the policy's own base with the adapters switched off."""
        if self.spec.lora is not None:
            self.engine.eval()
            with frozen_base(self.engine.module) as base:
                return self._logprobs_of(base, shard)
        return self._logprobs_of(self.reference, shard)

    def reference_placement(self) -> dict[str, Any]:
        from rlhf_orch.topology.introspect import where_am_i

        return where_am_i("reference", self.rank)

    @ends_a_phase
    @torch.no_grad()
    def make_experience(
        self,
        shard: int,
        ref_logprobs: list[torch.Tensor] | None,
        values: list[torch.Tensor] | None,
        algo: Algorithm,
        sample_values: dict[int, float],
    ) -> tuple[dict[str, float], list[torch.Tensor]]:
        """Old logprobs, then the algorithm's token targets. Returns stats and the critic's returns.

        `sample_values` (sample index -> value) is what the algorithm computed on the driver from
        the final scores: the score itself (PPO, REINFORCE++), a group-centred score, or the
        advantage (GRPO, RLOO, DAPO). `ref_logprobs` / `values` are None when the algorithm has no
        reference / critic (either may come `Deferred`: fetched here). Batch-wide normalisation is
        over all policy ranks (they all call this).
        """
        ref_logprobs, values = resolved(ref_logprobs), resolved(values)
        self.engine.eval()
        mbs = self._micro_batches(shard)
        old = [sequence_logprobs(self.engine, mb, self.spec.temperature, self.share_prompts).float() for mb in self.work_done.each(mbs)]
        ref = [r.to(self.device) for r in ref_logprobs] if ref_logprobs is not None else None
        vals = [v.to(self.device) for v in values] if values is not None else None
        # Targets run along each sequence: on [b, L-1] rows (packed micro-batches are unpacked
        # here, in this process, for this math only); results go back to the mb's layout.
        rows = rows_for_targets(mbs, old, ref or old, vals or old, self.spec.pad_id)
        target_rows = [
            TargetRows(
                mask=r.action_mask,
                sample_values=torch.tensor([sample_values.get(int(i), 0.0) for i in r.indices], dtype=torch.float32),
                old_logprobs=r.fields["old"],
                ref_logprobs=r.fields["ref"] if ref is not None else None,
                values=r.fields["values"] if vals is not None else None,
                turn_rewards=r.fields.get(TURN_REWARDS),
            )
            for r in rows
        ]
        world = self.world_size

        def summed_over_ranks(t: torch.Tensor) -> torch.Tensor:
            with self.work_done.collective():
                return torch.tensor(all_reduce_sum(t.tolist(), world), dtype=t.dtype)

        targets = algo.token_targets(target_rows, summed_over_ranks)
        returns = []
        for k, (mb, lp, r, t) in enumerate(zip(mbs, old, rows, targets)):
            wanted = {"advantages": t.advantages}
            if t.returns is not None:
                wanted["returns"] = t.returns
            in_layout = targets_in_layout(mb, r, wanted)
            mb.fields["old_logprobs"] = lp
            mb.fields["advantages"] = in_layout["advantages"]
            if algo.kl_in_loss:
                mb.fields["ref_logprobs"] = ref[k]
            if t.returns is not None:
                returns.append(in_layout["returns"].cpu())
        tokens = sum(float(r.action_mask.sum()) for r in rows)
        # How far the engine's sampling log-probs are from the trainer's recomputation of the same
        # tokens (train/inference mismatch; token in / token out keeps it at float noise).
        diffs = [
            (lp - mb.fields[ENGINE_LOGPROBS].to(lp.device)).abs()[mb.action_mask.bool()]
            for mb, lp in zip(mbs, old)
            if ENGINE_LOGPROBS in mb.fields
        ]
        diffs = [d for d in diffs if d.numel()]
        every_diff = torch.cat(diffs) if diffs else torch.zeros(0)  # concatenated once for the four statistics
        # The largest |advantage| (torch's max keeps a NaN, which the driver's guard then reports).
        row_max = [t.advantages[r.mask.bool()].abs().max() for r, t in zip(target_rows, targets) if r.mask.any()]
        adv_abs_max = float(torch.stack(row_max).max()) if row_max else 0.0
        # Sums, not means: the driver divides by the tokens of all ranks (`trainer.metrics`).
        stats = {
            "advantages_abs_max": adv_abs_max,
            "kl_sum": sum(float(torch.where(r.mask.bool(), t.kl, 0).sum()) for r, t in zip(target_rows, targets)),
            "response_tokens": tokens,
            "logprob_diff_max": float(every_diff.max()) if diffs else 0.0,
            "logprob_diff_sum": float(every_diff.sum()),
            "logprob_diff_tokens": float(every_diff.numel()),
            "logprob_diff_over": float((every_diff > LOGPROB_DIFF_THRESHOLD).sum()),
            "values_sum": (
                sum(float(torch.where(r.mask.bool(), r.values, 0).sum()) for r in target_rows) if vals is not None else 0.0
            ),
        }
        return stats, returns

    def sequences(self, shard: int, indices: list[int]) -> list[dict]:
        """The sequences `indices` of `shard` as this rank trained them: token ids, which positions
        are model tokens (`action`), the mean advantage over them and over each model turn, each
        turn's placed reward (env.reward=per_turn), the weights that drew them (the rollout dump,
        logger.rollouts; after make_experience, which set the advantages)."""
        wanted = set(indices)
        out = []
        for mb in self.work_done.each(self._micro_batches(shard)):
            if not wanted & set(mb.indices.tolist()):
                continue
            carried = {name: mb.fields[name] for name in ("advantages", TURN_REWARDS) if name in mb.fields}
            rows = padded_rows(mb, carried, self.spec.pad_id)
            for r, index in enumerate(rows.indices.tolist()):
                if index not in wanted:
                    continue
                length = int(rows.attention_mask[r].sum())
                action = rows.action_mask[r, : length - 1].bool()
                advantages = rows.fields["advantages"][r, : length - 1]
                turns = model_turn_spans(action.tolist())
                seq = {
                    "index": index,
                    "ids": rows.input_ids[r, :length].tolist(),
                    "action": [0] + action.int().tolist(),  # position t: token t is the model's
                    "advantage": float(advantages[action].float().mean()) if action.any() else 0.0,
                    "turn_advantages": [float(advantages[a:b].float().mean()) for a, b in turns],
                    "weight_version": int(rows.weight_versions[r]),
                }
                if TURN_REWARDS in rows.fields:
                    placed = rows.fields[TURN_REWARDS][r, : length - 1]
                    seq["turn_rewards"] = [round(float(placed[a:b].sum()), 6) for a, b in turns]
                out.append(seq)
        return out

    @ends_a_phase
    def train(self, shard: int, algo: Algorithm, norm_len: int) -> dict[str, float]:
        """`ppo_epochs` passes of the policy loss (clipped surrogate + KL in the loss - entropy).

        The loss is aggregated as `algo.loss_agg` says, normalised over each optimizer step's
        whole batch (all micro-batches, all ranks: `plan_optimizer_steps`), so the update does not
        depend on how the batch was cut. Micro-batches are reshuffled between epochs (the same
        permutation on every rank, a new one every step). `rlhf_orch.algo.oracle` is this update
        written without micro-batches or ranks; `tests/algo/test_oracle_matrix.py` holds the two equal.
        """
        self.engine.train()
        self._grad_norms = []
        self.last_step_members = []
        mbs = self._micro_batches(shard)
        totals: dict[str, float] = {}
        steps = 0

        def denominator(mb: PaddedBatch | PackedBatch) -> float:
            """The micro-batch's share of its step's loss normaliser (`algo.losses.loss_denominator`)."""
            return float(loss_denominator(mb.action_mask, algo.loss_agg, norm_len, mb.sequence_ids))

        for epoch in range(algo.ppo_epochs):
            order = list(range(len(mbs)))
            if epoch:  # the same permutation on every rank: only the count per step must agree
                seed = (self.spec.seed * 1_000_003 + int(self.engine.global_steps)) * 101 + epoch
                order = torch.randperm(len(mbs), generator=torch.Generator().manual_seed(seed)).tolist()
            epoch_mbs = [mbs[i] for i in order]
            plan = plan_optimizer_steps(
                epoch_mbs,
                self.spec.train_batch_size,
                self.world_size,
                denominator,
            )
            steps += plan.num_steps
            self.last_step_members += plan.members
            for position, mb in enumerate(self.work_done.each(epoch_mbs)):
                with counting_saved_tensors(self.work_done):  # (its backward moves the count too)
                    loss_mat, stats = self._policy_token_loss(mb, algo)
                local = denominator(mb)
                loss = aggregate_loss(loss_mat, mb.action_mask, algo.loss_agg, denominator=local, sequence_ids=mb.sequence_ids)
                totals["policy_loss"] = totals.get("policy_loss", 0.0) + self._accumulate(plan, position, loss, plan.weight(position, local))
                # Token means over the step's action tokens, whatever the loss aggregation and the cut.
                token_weight = plan.token_weight(position, float(mb.action_mask.sum()))
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + float(value) * token_weight
        self.drop_staged()
        # Per optimizer step (normalised as the loss), averaged over steps and epochs.
        return self._with_grad_norm({k: v / max(steps, 1) for k, v in totals.items()})

    def _policy_token_loss(self, mb: PaddedBatch | PackedBatch, algo: Algorithm) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token policy loss of one micro-batch and its token-mean statistics."""
        logprobs, entropy = sequence_logprobs_and_entropy(
            self.engine, mb, self.spec.temperature, entropy=algo.entropy_coef > 0, share_prompts=self.share_prompts
        )
        mask = mb.action_mask
        old_logprobs = mb.fields["old_logprobs"]
        # The engine's log-probs are the behaviour policy (stale under one_step_off); old_logprobs
        # the proximal one the clip is against. At most one correction is set (validate refuses both).
        is_weights = None
        if algo.tis_cap is not None:
            is_weights = truncated_is_weights(old_logprobs, mb.fields[ENGINE_LOGPROBS], mask, algo.tis_cap)
        elif algo.decoupled_is_cap is not None:
            is_weights = decoupled_is_weights(old_logprobs, mb.fields[ENGINE_LOGPROBS], mask, algo.decoupled_is_cap)
        loss_mat, stats = clipped_policy_loss(
            logprobs, old_logprobs, mb.fields["advantages"], mask, algo.clip_low, algo.clip_high, algo.loss_agg, is_weights, algo.clip_ratio_c
        )
        stats = {k: stats[k] for k in ("clipfrac", "approx_kl", "clipfrac_dual") if k in stats}
        if algo.tis_cap is not None:
            stats["tis_weight"] = masked_mean(is_weights, mask)
            stats["tis_capped"] = masked_mean((is_weights >= algo.tis_cap * (1 - 1e-6)).to(is_weights.dtype), mask)
        elif algo.decoupled_is_cap is not None:
            stats["decoupled_weight"] = masked_mean(is_weights, mask)  # dropped tokens count as 0
            # Dropped: the weight exceeds the cap (tested as decoupled_is_weights does, on the log-ratio).
            above_cap = (old_logprobs - mb.fields[ENGINE_LOGPROBS]) > math.log(algo.decoupled_is_cap)
            stats["decoupled_dropped"] = masked_mean(above_cap.to(is_weights.dtype), mask)
        if algo.kl_in_loss:
            kl = kl_divergence(logprobs, mb.fields["ref_logprobs"], algo.kl_estimator, mask=mask)
            loss_mat = loss_mat + algo.kl_coef * kl
            stats["kl_loss"] = masked_mean(kl.detach(), mask)
        if entropy is not None:
            loss_mat = loss_mat - algo.entropy_coef * entropy
            stats["entropy"] = masked_mean(entropy.detach(), mask)
        return loss_mat, stats

    # ---------------------------------------------------------------- weight sync
    def join_weight_group(self, address, rank: int) -> int:
        from rlhf_orch.sync.group import BroadcastGroup

        self.weight_group = BroadcastGroup(address, rank)
        return rank

    def weight_group_address(self, world_size: int, backend: str, timeout_s: float, name: str = "rlhf_orch_weights"):
        from rlhf_orch.sync.group import free_port_address

        return free_port_address(world_size, backend, timeout_s, name)

    def send_raw_broadcast(self, nbytes: int) -> float:
        """The sync's hardware limit: one broadcast of a pre-filled `nbytes` buffer (no packing, RPC, load).

        The buffer is allocated and filled once and kept, so repetitions time the wire alone.
        """
        buf = getattr(self, "_raw_broadcast_buffer", None)
        if buf is None or buf.numel() != nbytes:
            buf = torch.ones(nbytes, dtype=torch.uint8, device=self.weight_group.device)
            self._raw_broadcast_buffer = buf
        t0 = time.perf_counter()
        self.weight_group.broadcast(buf, 0).wait()
        return time.perf_counter() - t0

    def drop_raw_broadcast_buffer(self) -> None:
        self._raw_broadcast_buffer = None

    def run_weight_sync(self, strategy, engines: list, version: int) -> dict[str, float]:
        """Every policy rank calls this (ZeRO-3 gathers are collective); senders also send."""
        t0 = time.perf_counter()
        with self.work_done.collective():  # (its gathers and sends)
            stats = strategy.run_send(self.weights, getattr(self, "weight_group", None), engines, version, self.rank)
        stats["seconds"] = time.perf_counter() - t0
        return stats

    @torch.no_grad()
    def export_hf(self, directory: str) -> None:
        """The policy in Hugging Face format (safetensors + config + tokenizer), loadable as is by
        vLLM and transformers. Every rank calls (ZeRO-3 gathers are collective); rank 0 writes."""
        names = [m.name for m in self.checkpoint_weights.metas()]
        with self.work_done.collective(), self.checkpoint_weights.gathered(names) as full:
            if self.rank == 0:
                state = {n: t.detach().to("cpu", copy=True).contiguous() for n, t in full.items()}
                base = self.engine.module if self.spec.lora is None else self.engine.module.get_base_model()
                base.save_pretrained(directory, state_dict=state, safe_serialization=True)
        if self.spec.lora is not None:
            export_adapter(self.adapter, self.engine.module, os.path.join(directory, ADAPTER_DIR), self.rank == 0)
        if self.rank == 0:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(self.spec.model_path).save_pretrained(directory)

    @torch.no_grad()
    def logprobs_of(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of every token after the first, one sequence at a time (no padding at all)."""
        self.engine.eval()
        out = []
        for seq in sequences:
            ids = torch.tensor([seq], device=self.device)
            mb = PaddedBatch.from_samples([_single(seq)], self.spec.pad_id).to(self.device)
            lp = sequence_logprobs(self.engine, mb, 1.0)[0]
            out.append(lp[: ids.shape[1] - 1].tolist())
        return out

    @torch.no_grad()
    def perturb_weights(self, scale: float, seed: int) -> None:
        """Add seeded noise to every weight (tests: a sync must then change the engine)."""
        gen = torch.Generator().manual_seed(seed)
        # Same seed on every rank: replicated weights (ZeRO-0/1/2) stay identical; under ZeRO-3
        # the full parameters are gathered and rank 0's change is what gets re-partitioned.
        # (Under model.lora: the adapters, the only weights that change.)
        source = self.weights if self.spec.lora is None else self.adapter
        names = [m.name for m in source.metas()]
        with source.gathered(names, modifier_rank=0) as full:
            for p in full.values():
                p.add_(torch.randn(p.shape, generator=gen).to(p) * scale)


class CriticWorker(_Worker):
    """One data-parallel rank of the value model."""

    role = "critic"

    def build(self, spec: TrainerSpec | None = None) -> int:
        self._respec(spec)
        model = load_critic(self.spec.model_path, self.spec.dtype, self.device).to(self.device)
        if self.spec.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.engine = self._ds_engine(model, self.spec.lr)
        self.checkpoint_weights = ModuleWeightSource(self.engine.module, self.spec.zero_stage)
        self._old_values: dict[int, list[torch.Tensor]] = {}
        return sum(p.numel() for p in model.parameters())

    @ends_a_phase
    @torch.no_grad()
    def values(self, shard: int) -> list[torch.Tensor]:
        self.engine.eval()
        vals = [sequence_values(self.engine, mb, self.share_prompts).float() for mb in self.work_done.each(self._micro_batches(shard))]
        self._old_values[shard] = vals
        return [v.cpu() for v in vals]

    @ends_a_phase
    def train(self, returns_by_shard: dict[int, list[torch.Tensor]]) -> dict[str, float]:
        """`ppo_epochs` passes of the clipped value loss, a token mean over each optimizer step."""
        import ray

        self.engine.train()
        # Refs nested in a dict are not resolved by Ray: fetch them here, worker to worker.
        returns_by_shard = {s: ray.get(r) if isinstance(r, ray.ObjectRef) else r for s, r in returns_by_shard.items()}
        work = [
            (mb, old_v, ret)
            for shard, returns in sorted(returns_by_shard.items())
            for mb, old_v, ret in zip(self._micro_batches(shard), self._old_values[shard], returns)
        ]
        plan = plan_optimizer_steps([mb for mb, _, _ in work], self.spec.train_batch_size, self.world_size)
        self._grad_norms = []
        self.last_step_members = list(plan.members) * self.spec.ppo_epochs
        total, clip = 0.0, 0.0
        for _ in range(self.spec.ppo_epochs):
            for position, (mb, old_v, ret) in enumerate(self.work_done.each(work)):
                with counting_saved_tensors(self.work_done):  # (its backward moves the count too)
                    values = sequence_values(self.engine, mb, self.share_prompts)
                loss_mat, stats = clipped_value_loss(values, old_v, ret.to(self.device), mb.action_mask, self.spec.clip_eps)
                tokens = float(mb.action_mask.sum())
                loss = aggregate_loss(loss_mat, mb.action_mask, "token-mean")
                weight = plan.weight(position, tokens)
                total += self._accumulate(plan, position, loss, weight)
                clip += float(stats["vf_clipfrac"]) * weight
        self.drop_staged()
        self._old_values.clear()
        steps = plan.num_steps * self.spec.ppo_epochs
        return self._with_grad_norm({"value_loss": total / steps, "vf_clipfrac": clip / steps})


class ReferenceWorker(_Worker):
    """The frozen initial policy: reference logprobs for the KL penalty."""

    role = "reference"

    def build(self) -> int:
        self.model = self._reference_model()
        return sum(int(getattr(p, "ds_numel", p.numel())) for p in self.model.parameters())

    @ends_a_phase
    @torch.no_grad()
    def logprobs(self, shard: int) -> list[torch.Tensor]:
        out = self._logprobs_of(self.model, shard)
        self._staged.pop(shard, None)
        return out


class RewardModelWorker(_Worker):
    """A reward model rank: scores the sequences of the shards it is handed (forward only)."""

    role = "reward"

    def build(self) -> int:
        return self._load_frozen(load_reward_model)

    @ends_a_phase
    @torch.no_grad()
    def score(self, shard: int) -> tuple[list[int], list[float]]:
        """(sample indices, scores) of every sequence of the shard; the shard is then released."""
        indices: list[int] = []
        scores: list[float] = []
        for mb in self.work_done.each(self._micro_batches(shard)):
            values = sequence_scores(self.model, mb).cpu().tolist()
            for i, v in zip(mb.indices.tolist(), values):
                if i >= 0:  # -1: the stand-in of an empty planned micro-batch
                    indices.append(i)
                    scores.append(v)
        self._staged.pop(shard, None)
        return indices, scores

    @torch.no_grad()
    def scores_of(self, sequences: list[list[int]]) -> list[float]:
        """Scores of whole token sequences, one forward each (tests compare with a plain HF forward)."""
        out = []
        for seq in sequences:
            mb = PaddedBatch.from_samples([_single(seq)], self.spec.pad_id).to(self.device)
            out.append(float(sequence_scores(self.model, mb)[0]))
        return out


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    """`model` forward-only: eval mode, no gradients."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _single(seq: list[int]):
    from rlhf_orch.transfer.batch import Sample

    # The whole sequence as "response" after a 1-token prompt: every position is scored.
    return Sample(prompt_ids=seq[:1], response_ids=seq[1:], reward=0.0)
