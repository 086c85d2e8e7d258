"""What every trainer-side Ray actor (policy, critic, reference, reward model) shares: process
set-up, the torch.distributed world of its role's ranks, liveness (`progress`), the experience it
was handed (`ExperienceInbox`) and, for a trained role, its weights and checkpoint.

The actors are thin shells: the math is in `rlhf_orch.algo`, the forward passes in `forward.py`,
each phase's work in a plain module of this package (`experience.py`, `policy_update.py`,
`frozen_models.py`, `checkpointing.py`, ...). What lives in the actors is holding what the rank
built and was handed, and calling those in order.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import ray
import torch

from rlhf_orch.liveness import MONITOR, WorkCount
from rlhf_orch.trainer import checkpointing
from rlhf_orch.trainer.deepspeed_startup import skip_shm_comm_op
from rlhf_orch.trainer.spec import TrainerSpec, respecced
from rlhf_orch.trainer.weight_source import on_cpu
from rlhf_orch.transfer.batch import PackedBatch, PaddedBatch
from rlhf_orch.transfer.inbox import ExperienceInbox


class TrainerWorker(ExperienceInbox):
    """Process set-up shared by all trainer roles; receiving experience comes from `ExperienceInbox`."""

    role = "worker"

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
        # By staged shard: whether the update's own forward gives its old log-probs (the policy's
        # make_experience decides, its train is held to it; a rank may stage several shards).
        self._old_from_update: dict[int, bool] = {}
        # The rollout dump's sequences the last policy update kept (`PolicyWorker.dumped_sequences`).
        self._dumped: list[dict] = []
        self.pad_id = spec.pad_id
        # Per optimizer step of the last train() call: the sample indices this rank trained on in it.
        self.last_step_members: list[tuple[int, ...]] = []

    def reset(self, spec: TrainerSpec) -> None:
        """What a new actor of this role and rank starts as, for the next run of this process
        (`rlhf_orch.orchestration.warm_actors`; `build` follows as for a new one): every attribute
        of the last run dropped (model, DeepSpeed engine, staged experience, weight-sync group) and
        set up again, the RNG seeded again. The torch.distributed group of the role's ranks stays:
        the same plan gives the same ranks."""
        respecced(self.spec, spec, self.role, self.world_size)  # refuses another data-parallel size
        rank, world_size, work_done = self.rank, self.world_size, self.work_done
        self.__dict__.clear()
        self.work_done = work_done
        gc.collect()  # the last run's model, optimizer state and weight-sync group before the next is built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what a colocated engine sees free is what a new process would leave
        TrainerWorker.__init__(self, spec, rank, world_size)

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
        dist.init_process_group(
            backend, store=store, rank=self.rank, world_size=self.world_size, timeout=default_pg_timeout
        )
        if self.device.type == "cpu":
            skip_shm_comm_op()
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)  # reuses the initialised group

    # ---------------------------------------------------------------- a trained role's update and weights
    def step_members(self) -> list[tuple[int, ...]]:
        """Per optimizer step of the last train() call (all epochs), the sample indices this rank
        trained on in it: which sequences shared a step (the rest of the update is their math)."""
        return list(self.last_step_members)

    @torch.no_grad()
    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Every weight of the role's model, on CPU: rank 0 returns them, other ranks None (every
        rank calls: under ZeRO-3 the gather is collective)."""
        return on_cpu(self.checkpoint_weights, self.rank, self.work_done)

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str) -> None:
        """DeepSpeed's checkpoint of this role and this rank's RNG state (`checkpointing.save_checkpoint`)."""
        checkpointing.save_checkpoint(self.engine, directory, self.rank, self.spec.lora is not None, self.work_done)

    def load_checkpoint(self, directory: str) -> None:
        checkpointing.load_checkpoint(
            self.engine, directory, self.rank, self.role, self.spec.lora is not None, self.work_done
        )
