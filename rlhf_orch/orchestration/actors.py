"""Materialise a PlacementPlan into Ray actors: engines, policy, critic and reference ranks."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import ray

from rlhf_orch.engines.launch import engine_launch
from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngineActor
from rlhf_orch.liveness import ANSWER_S, actor_class, ask_progress, read_progress
from rlhf_orch.topology.plan import PlacementPlan
from rlhf_orch.topology.ray_placement import RayPlacement
from rlhf_orch.trainer.critic import CriticWorker
from rlhf_orch.trainer.policy import PolicyWorker
from rlhf_orch.trainer.reference import ReferenceWorker
from rlhf_orch.trainer.reward_model import RewardModelWorker
from rlhf_orch.trainer.spec import TrainerSpec

# Environment every actor of a run gets: tokenizers threads fight the trainer's on small boxes.
_ACTOR_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TRANSFORMERS_VERBOSITY": "error",
    # vLLM's CPU build imports a deprecated torch.distributed alias; the warning says nothing to users.
    "PYTHONWARNINGS": "ignore::FutureWarning",
}


@dataclass(frozen=True)
class HostedReference:
    """A reference rank that runs inside policy rank `policy`'s process (`plan.reference_in_actor`):
    called like a `ReferenceWorker` actor (`logprobs`, `placement`, `ping`), it is no process of its
    own -- nothing to start, stage experience on, reset or kill."""

    policy: Any

    @property
    def logprobs(self) -> Any:
        return self.policy.reference_logprobs

    @property
    def placement(self) -> Any:
        return self.policy.reference_placement

    @property
    def ping(self) -> Any:
        return self.policy.ping


class ActorStartError(RuntimeError):
    """An actor failed while starting (bad checkpoint, out of memory, ...)."""


class StartupStopped(Exception):
    """A stop signal arrived while the actors were starting: they were killed, no step ran."""


# How often a start-up wait looks at the stop request (a signal during start-up stops the run within
# about this long, instead of after every engine and trainer has finished starting).
_STOP_POLL_S = 0.5


def wait_starting(refs: list, timeout_s: float, stopped: Callable[[], bool] | None) -> list:
    """`ray.get(refs, timeout=timeout_s)`, given up (StartupStopped) once `stopped()` is true."""
    if stopped is None:
        return ray.get(refs, timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        if stopped():
            raise StartupStopped()
        left = deadline - time.monotonic()
        if left <= 0:
            return ray.get(refs, timeout=0)  # raises GetTimeoutError as ray.get would have
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(_STOP_POLL_S, left))
    return ray.get(refs)


class RunEnding(RuntimeError):
    """The run's actors were killed (its attempt ended): no engine is started for it any more."""


@dataclass
class RoleActors:
    engines: list[Any] = field(default_factory=list)
    policy: list[Any] = field(default_factory=list)
    critic: list[Any] = field(default_factory=list)
    reference: list[Any] = field(default_factory=list)
    reward: list[Any] = field(default_factory=list)  # reward model ranks (reward=model only)
    # start_engine(e) -> a new engine e in its own bundle (the replacement of one that died).
    start_engine: Callable[[int], Any] | None = None
    startup_timeout_s: float = field(kw_only=True)  # launcher.startup_timeout_s (required: the config declares it)
    # `kill` and `restart_engine` take turns: a rollout thread still replacing an engine when the
    # attempt ends (its Ray call blocked meanwhile) must not leave a new engine in a bundle the
    # next attempt needs. Every engine started here is killed with the others.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _killed: bool = False
    _started: dict[int, Any] = field(default_factory=dict, repr=False)  # per engine index, the last replacement started

    def restart_engine(self, e: int) -> Any:
        """Replace engine `e` (dead) by a fresh one in the same bundle; it holds the initial
        weights. RunEnding once the actors were killed (before or while it starts)."""
        with self._lock:
            if self._killed:
                raise RunEnding(f"the run's actors were removed: engine {e} is not replaced")
            try:
                ray.kill(self.engines[e])
            except Exception:  # already gone
                pass
            engine = self.start_engine(e)
            self._started[e] = engine
        try:
            ray.get(engine.ping.remote(), timeout=self.startup_timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise ActorStartError(
                f"the replacement of engine {e} did not start within {self.startup_timeout_s:g}s (launcher.startup_timeout_s): "
                "no node has room for its bundle (a node lost?) or it ran out of memory"
            ) from err
        except ray.exceptions.RayActorError as err:
            if self._killed:
                raise RunEnding(f"the run's actors were removed while engine {e}'s replacement started") from err
            raise ActorStartError(f"the replacement of engine {e} died while starting: {err}") from err
        with self._lock:
            if self._killed:  # (kill() took it down with the others)
                raise RunEnding(f"the run's actors were removed while engine {e}'s replacement started")
            self.engines[e] = engine
        return engine

    def all(self) -> list[Any]:
        """Every process of the run (a hosted reference is its policy rank's)."""
        return [*self.engines, *self.policy, *self.critic, *self.own_reference, *self.reward]

    @property
    def own_reference(self) -> list[Any]:
        """The reference ranks that are processes of their own (none when hosted by the policy)."""
        return [r for r in self.reference if not isinstance(r, HostedReference)]

    def close_endpoints(self) -> None:
        """Stop what the engines serve to agents (env=agent): nothing listens once the run has ended."""
        try:
            ray.get([e.close_chat_endpoint.remote() for e in self.engines], timeout=10)
        except Exception:  # a dead or hung engine: its process goes with ray.kill
            pass

    def kill(self) -> None:
        self.close_endpoints()  # first: ray.kill returns before the process is gone
        with self._lock:  # (no replacement starts after this, and one starting now goes too)
            self._killed = True
            actors = [*self.all(), *self._started.values()]
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:  # already gone is fine when tearing down
                pass


def ranks_named(actors: RoleActors, *roles: str) -> dict[str, Any]:
    """The trainer processes of `roles` (RoleActors fields: policy, critic, reference, reward) by the
    name a person reads ("policy rank 0"); a hosted reference is its policy rank's process."""
    names = {"policy": "policy", "critic": "critic", "reference": "reference", "reward": "reward-model"}
    return {
        f"{names[role]} rank {r}": actor
        for role in roles
        for r, actor in enumerate(getattr(actors, "own_reference" if role == "reference" else role, []))
    }


def not_answering(actors: Sequence[Any], timeout_s: float) -> list[int]:
    """Positions of the actors that are dead or do not answer `ping` within `timeout_s` (alive
    but stuck -- say, waiting in a broadcast that will never finish -- is as lost as dead). Strict:
    an engine busy in one long call does not answer either (see `lost_processes`)."""
    dead, stuck = dead_or_stuck(actors, timeout_s)
    return sorted(dead + stuck)


def dead_actors(actors: Sequence[Any], timeout_s: float) -> list[int]:
    """Positions of the engines or trainer ranks that are dead, asked on their monitor thread
    (`progress`, answered beside any long call): a busy one -- an agent session holding an engine's
    vLLM thread, a rank inside a broadcast -- answers at once instead of after its call, and one
    that does not answer within `timeout_s` is not taken for dead (the strict `dead_or_stuck`
    decides that for engines when a push fails)."""
    if not actors:
        return []
    refs = {k: actor.progress.remote() for k, actor in enumerate(actors)}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    dead = []
    for k, ref in refs.items():
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead.append(k)
        except ray.exceptions.GetTimeoutError:
            pass
    return dead


def dead_or_stuck(actors: Sequence[Any], timeout_s: float) -> tuple[list[int], list[int]]:
    """`not_answering`, told apart: positions of the dead actors, and of those alive but not
    answering `ping` within `timeout_s`."""
    refs = [actor.ping.remote() for actor in actors]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    dead, stuck = [], []
    for k, ref in enumerate(refs):
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            dead.append(k)
        except ray.exceptions.GetTimeoutError:
            stuck.append(k)
    return dead, stuck


# Seconds a liveness probe waits for an actor's answer before taking it for lost (not a config key:
# a probe asks a process that should answer at once).
PROBE_TIMEOUT_S = 10.0


def lost_processes(actors: Sequence[Any], timeout_s: float) -> list[int]:
    """Positions of the actors that are dead or hung, telling a busy process from a stuck one: `ping`
    runs on the thread that one long call holds without being stuck (an engine's whole agent
    session or unthreaded rollout; a trainer rank's long experience or update phase). Every actor
    with a count (`progress`, answered on a thread of its own: engines and trainer ranks,
    rlhf_orch.liveness) is asked for it as the `ping` wait starts; one that missed
    `ping` is asked again after it and counts as busy, not lost, if its count moved. Stuck in a
    broadcast, a collective or a hung call, its count stands; an actor without a count that misses
    `ping` is lost. At most `timeout_s` + `ANSWER_S`."""
    first_looks = ask_progress(dict(enumerate(actors)))
    silent = not_answering(actors, timeout_s)
    second_looks = ask_progress({k: actors[k] for k in silent if k in first_looks})
    if not second_looks:
        return silent
    # (one wait for both looks; a look not answered -- dead since, or not even its monitor thread
    # answers -- leaves the engine lost)
    first, second = "first", "second"
    counts = read_progress(
        {**{(k, first): first_looks[k] for k in second_looks}, **{(k, second): ref for k, ref in second_looks.items()}},
        ANSWER_S,
    )
    busy = {
        k
        for k in second_looks
        if None not in (counts[k, first], counts[k, second]) and counts[k, second] > counts[k, first]
    }
    return [k for k in silent if k not in busy]


def trainer_process_env(env: dict[str, str], gpu_layout: bool, shares_cuda_memory: bool = False) -> dict[str, str]:
    """The environment of trainer and forward-only processes. On GPUs torch's caching allocator uses
    expandable segments: one policy update on an H100 (scripts/bench/bench_gpu.py) reserved 2.3-11.7 GB
    above its peak with the default allocator and 0.05-4.0 GB with them. Not for engines: vLLM's
    sleep mode allocates from a memory pool that expandable segments break. Not when the sync hands
    engines CUDA IPC handles of the trainers' memory (`WeightSync.shares_cuda_memory`). A value the
    user set wins."""
    if not gpu_layout or shares_cuda_memory or "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return env
    return {**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def _remote(cls, placement: RayPlacement, slot, env: dict[str, str]):
    options = placement.options_for(slot)
    options["runtime_env"] = {"env_vars": env}
    return actor_class(cls).options(**options)  # (`progress` answers beside a running phase)


def engine_options(
    placement: RayPlacement, slot, spec: EngineSpec, env: dict[str, str], gpu_layout: bool
) -> tuple[dict[str, Any], EngineSpec]:
    """Ray options and spec of one engine: with engine_tp > 1 on GPUs the actor claims no GPU and
    vLLM's Ray executor puts one worker on each of the slot's bundles (`rlhf_orch.engines.launch`)."""
    launch = engine_launch(slot, gpu_layout)
    options = placement.options_for(slot)
    options["num_gpus"] = launch.actor_num_gpus
    # engine.torch_threads: vLLM's CPU backend binds its OpenMP threads at start, from this variable
    # (Ray sets it to the actor's CPUs otherwise).
    threads = {"OMP_NUM_THREADS": str(spec.torch_threads)}
    options["runtime_env"] = {"env_vars": {**env, **threads, **launch.env}}
    if spec.max_concurrency > 1:  # a threaded actor: several rollouts' calls at once (engines/shared_steps.py)
        options["max_concurrency"] = spec.max_concurrency + 2  # + a weight update and a hand-over
    return options, replace(spec, distributed_executor_backend=launch.executor)


def start_role_actors(
    plan: PlacementPlan,
    placement: RayPlacement,
    engine_spec: EngineSpec,
    policy_spec: TrainerSpec,
    critic_spec: TrainerSpec | None,
    reference_spec: TrainerSpec | None,
    timeout_s: float,
    reward_spec: TrainerSpec | None = None,
    warm: RoleActors | None = None,
    shares_cuda_memory: bool = False,
    stopped: Callable[[], bool] | None = None,
) -> RoleActors:
    """Every role's actors in their bundles, built and answering. `warm`: the actors of an earlier
    run on the same plan (`rlhf_orch.orchestration.warm_actors`), reset to what new ones start as
    and then built the same way; their torch.distributed groups, which the plan fixes, are kept.
    `stopped`: a stop request (a signal) -- once true, the actors are killed and StartupStopped raised."""
    env = dict(_ACTOR_ENV)
    engine_slots = plan.slots_for("engine")
    if plan.reference_in_actor:  # each policy rank loads the reference too; no reference process starts
        policy_spec, reference_spec = replace(policy_spec, host_reference=True), None

    def start_engine(e: int) -> Any:
        slot = engine_slots[e]
        options, spec = engine_options(placement, slot, engine_spec, env, plan.total_gpus > 0)
        return VLLMEngineActor.options(**options).remote(spec, slot.rank)

    roles = (  # (plan role, class, spec, RoleActors field)
        ("actor", PolicyWorker, policy_spec, "policy"),
        ("critic", CriticWorker, critic_spec, "critic"),
        ("reference", ReferenceWorker, reference_spec, "reference"),
        ("reward", RewardModelWorker, reward_spec, "reward"),
    )
    roles = tuple(
        r for r in roles if r[2] is not None
    )  # a role without a spec starts no process (none planned, or hosted)
    actors = RoleActors(start_engine=start_engine, startup_timeout_s=timeout_s)
    if warm is not None:
        try:
            gpu_layout = plan.total_gpus > 0
            resets = [
                e.reset.remote(engine_options(placement, slot, engine_spec, env, gpu_layout)[1])
                for e, slot in zip(warm.engines, engine_slots)
            ]
            # (the reward model's spec is the policy's: its ranks' count is its own)
            resets += [
                a.reset.remote(replace(spec, data_parallel_size=len(plan.slots_for(role))))
                for role, _, spec, name in roles
                for a in getattr(warm, name)
            ]
            ray.get(resets, timeout=timeout_s)
            actors.engines.extend(warm.engines)
            for _, _, _, name in roles:
                getattr(actors, name).extend(getattr(warm, name))
        except Exception as e:  # e.g. an engine with requests left in flight: start new ones
            print(f"actors: the kept actors could not be reset ({type(e).__name__}): starting new ones", flush=True)
            warm.kill()
            warm = None
    if warm is None:
        actors.engines.extend(start_engine(e) for e in range(len(engine_slots)))
        trainer_env = trainer_process_env(env, plan.total_gpus > 0, shares_cuda_memory)
        for role, cls, spec, name in roles:
            slots = plan.slots_for(role)
            for slot in slots:
                getattr(actors, name).append(
                    _remote(cls, placement, slot, trainer_env).remote(spec, slot.rank, len(slots))
                )

    try:
        # DeepSpeed needs each role's ranks in one torch.distributed world (rank 0 hosts it): the
        # trainers', and a reference sharded over its own ranks. Warm ranks keep theirs (a warm
        # reference that had none forms it now: `init_distributed` keeps a world it has).
        groups = [] if warm is not None else [actors.policy, actors.critic]
        if reference_spec is not None and reference_spec.reference_memory != "full":
            groups.append(actors.reference)
        inits = []
        for group in (g for g in groups if g):
            host, port = wait_starting([group[0].rendezvous_address.remote()], timeout_s, stopped)[0]
            inits += [a.init_distributed.remote(host, port) for a in group]
        wait_starting(inits, timeout_s, stopped)
        wait_starting(
            [a.build.remote() for a in (*actors.policy, *actors.critic, *actors.reference, *actors.reward)],
            timeout_s,
            stopped,
        )
        if plan.reference_in_actor:
            actors.reference = [HostedReference(p) for p in actors.policy]
        wait_starting([e.ping.remote() for e in actors.engines], timeout_s, stopped)
    except StartupStopped:
        actors.kill()
        raise
    except ray.exceptions.GetTimeoutError as e:
        actors.kill()
        raise ActorStartError(
            f"actors did not start within {timeout_s:.0f}s (launcher.startup_timeout_s); "
            "check that the cluster still has the planned resources (a node lost?), memory and the model path"
        ) from e
    except ray.exceptions.RayActorError as e:
        actors.kill()
        raise ActorStartError(f"an actor died while starting: {e}") from e
    return actors
