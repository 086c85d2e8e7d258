"""Trainer-side Ray actors: policy (DeepSpeed), critic (DeepSpeed), reference (forward only).

They are thin: the math is in `rlhf_orch.algo`, the forward passes in `forward.py`, the
DeepSpeed config in `deepspeed_config.py`. What lives here is process set-up, holding the
experience this rank was handed, and calling those functions in order.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_orch.algo.experience import AdvantageSettings, compute_targets
from rlhf_orch.algo.ppo_math import policy_loss, value_loss
from rlhf_orch.trainer.deepspeed_config import deepspeed_config
from rlhf_orch.trainer.forward import load_critic, load_policy, sequence_logprobs, sequence_values
from rlhf_orch.trainer.token_weighting import OptimizerStepPlan, plan_optimizer_steps, rows_for_targets, targets_in_layout
from rlhf_orch.trainer.weight_source import ModuleWeightSource
from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _Worker(ExperienceInbox):
    """Process set-up shared by all trainer roles; receiving experience comes from `ExperienceInbox`."""

    role = "worker"

    def __init__(self, spec: TrainerSpec, rank: int, world_size: int):
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        torch.set_num_threads(spec.torch_threads)
        torch.manual_seed(spec.seed + rank)
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        # Experience this rank holds, by shard index: list of micro-batches (padded or packed,
        # as the transfer strategy delivered them; the forward takes both).
        self._staged: dict[int, list[PaddedBatch | PackedBatch]] = {}
        self.pad_id = spec.pad_id

    # ---------------------------------------------------------------- placement introspection
    def placement(self) -> dict[str, Any]:
        from rlhf_orch.topology.introspect import where_am_i

        return where_am_i(self.role, self.rank)

    # ---------------------------------------------------------------- distributed set-up
    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def init_distributed(self, host: str, port: int) -> None:
        import deepspeed

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
        deepspeed.init_distributed(
            dist_backend=backend,
            auto_mpi_discovery=False,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
        )

    # ---------------------------------------------------------------- experience hand-over
    def _receive(self, mb: PaddedBatch | PackedBatch) -> PaddedBatch | PackedBatch:
        return mb.to(self.device)

    def _micro_batches(self, shard: int) -> list[PaddedBatch | PackedBatch]:
        mbs = self._staged[shard]
        if any(mb is None for mb in mbs):
            raise RuntimeError(f"shard {shard}: {sum(mb is None for mb in mbs)} streamed micro-batches never arrived")
        return mbs

    def _step_plan(self, mbs: list[PaddedBatch | PackedBatch]) -> OptimizerStepPlan:
        """Optimizer steps over `mbs`, and each step's action tokens summed over data-parallel ranks."""
        return plan_optimizer_steps(mbs, self.spec.train_batch_size, self.world_size)

    def _accumulate(self, plan: OptimizerStepPlan, position: int, loss: torch.Tensor, tokens: int) -> float:
        """Backward of one micro-batch weighted by its share of the step's tokens; step at the boundary.

        The micro-batch loss is a token mean; times tokens / (step tokens over all ranks) x ranks it
        becomes this micro-batch's share of the step's token mean (DeepSpeed then averages over
        ranks). So the update is the token mean over the optimizer step's sequences however they
        were cut into micro-batches -- count-based or token-budget, fixed or varying counts.
        """
        weight = plan.weight(position, tokens)
        self.engine.set_gradient_accumulation_boundary(plan.is_boundary(position))
        self.engine.backward(loss * weight, scale_wrt_gas=False)
        self.engine.step()
        return float(loss.detach()) * weight

    def _ds_engine(self, model: torch.nn.Module, lr: float):
        import deepspeed

        spec = self.spec
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
        config = deepspeed_config(
            zero_stage=spec.zero_stage,
            micro_batch_size=spec.micro_batch_size,
            train_batch_size=spec.train_batch_size,
            data_parallel_size=spec.data_parallel_size,
            grad_clip=spec.grad_clip,
            dtype=spec.dtype,
        )
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        return engine


class PolicyWorker(_Worker):
    """One data-parallel rank of the policy: old logprobs, advantages, PPO updates, weight sends."""

    role = "actor"

    def build(self) -> int:
        model = load_policy(self.spec.model_path, self.spec.dtype, self.device).to(self.device)
        model.config.use_cache = False
        self.engine = self._ds_engine(model, self.spec.lr)
        self.weights = ModuleWeightSource(self.engine.module, self.spec.zero_stage)
        self._targets: dict[int, list[Any]] = {}
        return sum(p.numel() for p in model.parameters())

    @torch.no_grad()
    def make_experience(
        self, shard: int, ref_logprobs: list[torch.Tensor], values: list[torch.Tensor], settings: AdvantageSettings
    ) -> tuple[dict[str, float], list[torch.Tensor]]:
        """Old logprobs, then KL-shaped rewards and GAE. Returns stats and the critic's returns."""
        self.engine.eval()
        mbs = self._micro_batches(shard)
        ref_logprobs = [r.to(self.device) for r in ref_logprobs]
        values = [v.to(self.device) for v in values]
        old = [sequence_logprobs(self.engine, mb, self.spec.temperature).float() for mb in mbs]
        # GAE runs backwards along each sequence: on [b, L-1] rows (packed micro-batches are
        # unpacked here, in this process, for this math only), results go back to the mb's layout.
        rows = rows_for_targets(mbs, old, ref_logprobs, values, self.spec.pad_id)
        targets, stats = compute_targets(
            [r.action_mask for r in rows],
            [r.scores for r in rows],
            [r.fields["old"] for r in rows],
            [r.fields["ref"] for r in rows],
            [r.fields["values"] for r in rows],
            settings,
        )
        returns = []
        for mb, lp, r, t in zip(mbs, old, rows, targets):
            in_layout = targets_in_layout(mb, r, {"advantages": t.advantages, "returns": t.returns})
            mb.fields["old_logprobs"] = lp
            mb.fields["advantages"] = in_layout["advantages"]
            returns.append(in_layout["returns"].cpu())
        return stats, returns

    def train(self, shard: int) -> dict[str, float]:
        self.engine.train()
        mbs = self._micro_batches(shard)
        plan = self._step_plan(mbs)
        totals: dict[str, float] = {"policy_loss": 0.0, "clipfrac": 0.0, "approx_kl": 0.0}
        for _ in range(self.spec.ppo_epochs):
            for position, mb in enumerate(mbs):
                logprobs = sequence_logprobs(self.engine, mb, self.spec.temperature)
                loss, stats = policy_loss(
                    logprobs, mb.fields["old_logprobs"], mb.fields["advantages"], mb.action_mask, self.spec.clip_eps
                )
                tokens = int(mb.action_mask.sum())
                totals["policy_loss"] += self._accumulate(plan, position, loss, tokens)
                totals["clipfrac"] += float(stats["clipfrac"]) * plan.weight(position, tokens)
                totals["approx_kl"] += float(stats["approx_kl"]) * plan.weight(position, tokens)
        self.drop_staged()
        # Token means per optimizer step, averaged over steps and epochs.
        return {k: v / (plan.num_steps * self.spec.ppo_epochs) for k, v in totals.items()}

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
        stats = strategy.run_send(self.weights, getattr(self, "weight_group", None), engines, version, self.rank)
        stats["seconds"] = time.perf_counter() - t0
        return stats

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
        names = [m.name for m in self.weights.metas()]
        with self.weights.gathered(names, modifier_rank=0) as full:
            for p in full.values():
                p.add_(torch.randn(p.shape, generator=gen).to(p) * scale)


class CriticWorker(_Worker):
    """One data-parallel rank of the value model."""

    role = "critic"

    def build(self) -> int:
        model = load_critic(self.spec.model_path, self.spec.dtype, self.device).to(self.device)
        self.engine = self._ds_engine(model, self.spec.lr)
        self._old_values: dict[int, list[torch.Tensor]] = {}
        return sum(p.numel() for p in model.parameters())

    @torch.no_grad()
    def values(self, shard: int) -> list[torch.Tensor]:
        self.engine.eval()
        vals = [sequence_values(self.engine, mb).float() for mb in self._micro_batches(shard)]
        self._old_values[shard] = vals
        return [v.cpu() for v in vals]

    def train(self, returns_by_shard: dict[int, list[torch.Tensor]]) -> dict[str, float]:
        import ray

        self.engine.train()
        # Refs nested in a dict are not resolved by Ray: fetch them here, worker to worker.
        returns_by_shard = {s: ray.get(r) if isinstance(r, ray.ObjectRef) else r for s, r in returns_by_shard.items()}
        work = [
            (mb, old_v, ret)
            for shard, returns in sorted(returns_by_shard.items())
            for mb, old_v, ret in zip(self._micro_batches(shard), self._old_values[shard], returns)
        ]
        plan = self._step_plan([mb for mb, _, _ in work])
        total, clip = 0.0, 0.0
        for _ in range(self.spec.ppo_epochs):
            for position, (mb, old_v, ret) in enumerate(work):
                values = sequence_values(self.engine, mb)
                loss, stats = value_loss(values, old_v, ret.to(self.device), mb.action_mask, self.spec.clip_eps)
                tokens = int(mb.action_mask.sum())
                total += self._accumulate(plan, position, loss, tokens)
                clip += float(stats["vf_clipfrac"]) * plan.weight(position, tokens)
        self.drop_staged()
        self._old_values.clear()
        steps = plan.num_steps * self.spec.ppo_epochs
        return {"value_loss": total / steps, "vf_clipfrac": clip / steps}


class ReferenceWorker(_Worker):
    """The frozen initial policy: reference logprobs for the KL penalty."""

    role = "reference"

    def build(self) -> int:
        self.model = load_policy(self.spec.model_path, self.spec.dtype, self.device).to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        return sum(p.numel() for p in self.model.parameters())

    @torch.no_grad()
    def logprobs(self, shard: int) -> list[torch.Tensor]:
        out = [sequence_logprobs(self.model, mb, self.spec.temperature).float().cpu() for mb in self._micro_batches(shard)]
        self._staged.pop(shard, None)
        return out


def _single(seq: list[int]):
    from rlhf_orch.transfer.batch import Sample

    # The whole sequence as "response" after a 1-token prompt: every position is scored.
    return Sample(prompt_ids=seq[:1], response_ids=seq[1:], reward=0.0)
