"""The GPU path, checked without GPUs: CUDA IPC feeds, TP engines in their bundles, rendezvous
address, engine memory, sleep/wake and the vLLM interface check.

Pure planner tests (free), one Ray logical-GPU test that starts engine actors exactly as the run
does and then creates their TP workers the way vLLM's Ray executor does (from the environment the
engine was given), and small unit tests. The real TP=2 engine is tests/engines/test_engine_tp.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from rlhf_orch.engines.launch import (
    SLEEP_WHERE_AVAILABLE,
    cpu_thread_binding,
    engine_launch,
    memory_utilization,
    sleep_level,
)
from rlhf_orch.sync.handover import WorkerPayloads, _engine_payload
from rlhf_orch.sync.receive import CloseSession, OpenSession
from rlhf_orch.topology.plan import PlacementError, describe_feeds, feed_table, ipc_feeds
from rlhf_orch.topology.planners import plan_colocated, plan_split

ROOT = Path(__file__).resolve().parents[2]


def _colocated(engines: int, engine_tp: int, nodes: int, gpus_per_node: int, actor_ranks: int | None = None):
    gpus = nodes * gpus_per_node
    return plan_colocated(
        actor_ranks=actor_ranks or gpus,
        critic_ranks=gpus,
        reference_ranks=gpus,
        engines=engines,
        engine_tp=engine_tp,
        reward="function",
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        actor_fraction=0.25,
        critic_fraction=0.25,
        reference_fraction=0.15,
        engine_fraction=0.35,
    )


# ----------------------------------------------------------------------------- defect 1: CUDA IPC feeds
@pytest.mark.parametrize("engines", [1, 2, 8])
@pytest.mark.parametrize("engine_tp", [1, 2])
@pytest.mark.parametrize("nodes", [1, 2])
def test_every_engine_worker_is_fed_by_the_policy_rank_on_its_gpu(engines, engine_tp, nodes):
    gpus_per_node = max(2, engines * engine_tp // nodes)
    plan = _colocated(engines, engine_tp, nodes, gpus_per_node)
    feeds = ipc_feeds(plan)
    assert len(feeds) == engines * engine_tp
    actor_gpu = {s.rank: (s.node, s.bundles[0]) for s in plan.slots_for("actor")}
    for f in feeds:
        assert f.policy_rank is not None
        assert actor_gpu[f.policy_rank] == (f.node, f.bundle)  # same node, same GPU
    table = feed_table(feeds)
    # Engine e's TP worker w sits on global GPU e*tp + w, where policy rank e*tp + w sits:
    # rank 0 feeding everything (the defect) fails here as soon as there are two engine GPUs.
    assert table == {(e, w): e * engine_tp + w for e in range(engines) for w in range(engine_tp)}


def test_layout_with_an_engine_gpu_without_policy_rank_is_refused():
    plan = _colocated(4, 1, 1, 4, actor_ranks=2)
    feeds = ipc_feeds(plan)
    assert [f.engine for f in feeds if f.policy_rank is None] == [2, 3]
    with pytest.raises(PlacementError, match="engine2/tp0 on node 0 GPU 2"):
        feed_table(feeds)
    assert "NONE" in describe_feeds(feeds)


def test_tp_engine_gets_one_payload_per_worker_from_its_feeders():
    feeds = {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3}
    by_rank = ["p0", "p1", "p2", "p3"]
    payload = _engine_payload(by_rank, feeds, 1, 2)
    assert isinstance(payload, WorkerPayloads)
    assert [payload.for_worker(w) for w in (0, 1)] == ["p2", "p3"]
    assert _engine_payload(["only"], {(0, 0): 0, (0, 1): 0}, 0, 2) == "only"  # one feeder: the same payload


def test_dry_run_prints_which_rank_feeds_which_engine():
    out = subprocess.run(
        [
            sys.executable,
            "run.py",
            "placement=colocated",
            "placement.gpus_per_node=4",
            "launcher.logical_gpus=4",
            "sync=cuda_ipc",
            "launcher.dry_run=true",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "CUDA IPC feeds" in out.stdout
    for rank in range(4):
        assert f"{rank}       0        0     {rank}    policy rank {rank}" in out.stdout


# ----------------------------------------------------------------------------- defect 2: TP workers in their bundles
def test_tp_engine_launch_names_its_bundles_and_claims_no_gpu_itself():
    plan = _colocated(2, 2, 1, 4)
    first, second = plan.slots_for("engine")
    launch = engine_launch(second, gpu_layout=True)
    assert launch.actor_num_gpus == 0 and launch.executor == "ray"
    assert launch.env == {"VLLM_RAY_BUNDLE_INDICES": "2,3", "VLLM_RAY_PER_WORKER_GPUS": "0.35"}
    assert (
        engine_launch(
            plan_split(
                nodes=1,
                gpus_per_node=4,
                engine_tp=1,
                reward="function",
                ratio=None,
                actor_gpus=1,
                critic_gpus=1,
                vllm_gpus=2,
                reference_fraction=0.25,
            ).slots_for("engine")[0],
            gpu_layout=True,
        ).actor_num_gpus
        == 1.0
    )
    assert engine_launch(first, gpu_layout=False).executor == "mp"


@ray.remote
class _EngineStub:
    """Stands where VLLMEngine stands; `start_workers` does what vLLM's Ray executor does with the
    environment the engine was started with (vllm/v1/executor/ray_executor.py: _init_workers_ray)."""

    def start_workers(self) -> list[list[int]]:
        import os

        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = ray.util.get_current_placement_group()
        indices = [int(i) for i in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        per_worker = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
        self.workers = [
            _Worker.options(
                num_cpus=0,
                num_gpus=per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=i, placement_group_capture_child_tasks=True
                ),
            ).remote()
            for i in indices
        ]
        return ray.get([w.gpus.remote() for w in self.workers], timeout=60)

    def gpus(self) -> list[int]:
        return [int(g) for g in ray.get_gpu_ids()]


@ray.remote
class _Worker:
    def gpus(self) -> list[int]:
        return [int(g) for g in ray.get_gpu_ids()]


@pytest.mark.extended
@pytest.mark.integration
def test_tp_workers_land_on_the_engines_planned_gpus_with_every_role_placed():
    """Colocated, 4 logical GPUs, 2 engines x TP 2, every role started: each TP worker gets the GPU
    its planned bundle holds (the one its policy rank has). Had the engine actor claimed its share
    on bundle 0 as well (the defect), bundle 0 would be over-claimed and its worker never start."""
    from rlhf_orch.engines.vllm_engine import EngineSpec
    from rlhf_orch.orchestration.actors import engine_options
    from rlhf_orch.topology.ray_placement import RayPlacement

    plan = _colocated(2, 2, 1, 4)
    ray.init(address="local", num_cpus=16, num_gpus=4, include_dashboard=False)
    try:
        with RayPlacement(plan, ready_timeout_s=60) as placement:
            others = {
                slot: _Worker.options(**placement.options_for(slot)).remote()
                for slot in plan.slots
                if slot.role != "engine"
            }
            actor_gpus = {s.rank: ray.get(a.gpus.remote(), timeout=60) for s, a in others.items() if s.role == "actor"}
            spec = EngineSpec(model_path="unused", dtype="float32", max_model_len=8, tensor_parallel_size=2)
            for slot in plan.slots_for("engine"):
                options, engine_spec = engine_options(placement, slot, spec, {}, gpu_layout=True)
                assert engine_spec.distributed_executor_backend == "ray"
                engine = _EngineStub.options(**options).remote()
                assert ray.get(engine.gpus.remote(), timeout=60) == []  # the actor itself holds no GPU
                worker_gpus = ray.get(engine.start_workers.remote(), timeout=90)
                feeds = feed_table(ipc_feeds(plan))
                for tp_rank, gpus in enumerate(worker_gpus):
                    assert gpus == actor_gpus[feeds[(slot.rank, tp_rank)]]
    finally:
        ray.shutdown()


def test_cpu_tp_workers_get_their_own_cores():
    assert cpu_thread_binding([0, 1], 2) == "0|1"
    assert cpu_thread_binding(list(range(8)), 2) == "0-3|4-7"
    with pytest.raises(RuntimeError, match="one core per worker"):
        cpu_thread_binding([0], 2)


# ----------------------------------------------------------------------------- defect 3: rendezvous address
def test_every_rendezvous_uses_rays_node_ip_not_the_hostname(monkeypatch):
    import socket

    from rlhf_orch.sync import group
    from rlhf_orch.trainer.policy import PolicyWorker

    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # the usual /etc/hosts trap
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.9.8.7")
    monkeypatch.setattr(group, "free_port", lambda host: 4242)
    for backend in ("nccl", "gloo"):
        assert group.free_port_address(3, backend, 10.0).host == "10.9.8.7"
    assert PolicyWorker.rendezvous_address(None) == ("10.9.8.7", 4242)  # the trainers' DeepSpeed world too


# ----------------------------------------------------------------------------- memory: utilisation and sleep
def test_engine_memory_defaults_follow_the_plan():
    colocated = _colocated(1, 1, 1, 1)
    split = plan_split(
        nodes=1,
        gpus_per_node=4,
        engine_tp=1,
        reward="function",
        ratio=None,
        actor_gpus=1,
        critic_gpus=1,
        vllm_gpus=2,
        reference_fraction=0.25,
    )
    assert memory_utilization(None, colocated) == 0.35 and memory_utilization(None, split) == 0.9
    assert memory_utilization(0.2, colocated) == 0.2
    assert (
        sleep_level(None, colocated) == SLEEP_WHERE_AVAILABLE
        and sleep_level(None, split) == 0
        and sleep_level(2, split) == 2
    )


def test_validation_checks_memory_against_the_planned_share():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from rlhf_orch.app import check
    from rlhf_orch.config.schema import register_configs
    from rlhf_orch.config.validate import ConfigError

    register_configs()
    base = ["placement=colocated", "placement.gpus_per_node=4", "launcher.dry_run=true"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):

        def run(extra):
            cfg = compose(config_name="config", overrides=base + extra)
            return check(cfg, instantiate(cfg.launcher))

        run(["sync=cuda_ipc"])  # defaults: utilisation = engine_fraction, one rank per GPU
        with pytest.raises(ConfigError, match="engine_fraction=0.35"):
            run(["engine.gpu_memory_utilization=0.5"])  # the old default
        with pytest.raises(ConfigError, match="no policy rank sits on engine2/tp0"):
            run(["sync=cuda_ipc", "placement.actor_ranks=2"])
        with pytest.raises(ConfigError, match="engine.sleep_level"):
            compose_cpu = compose(config_name="config", overrides=["engine.sleep_level=1"])
            check(compose_cpu, instantiate(compose_cpu.launcher))


class _FakeLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up",))

    def collective_rpc(self, name, args=()):
        self.calls.append((name, type(args[0]).__name__) if name == "rlhf_receive" else (name,))
        return [0]


def _engine(sleep_level: int):
    from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    llm = _FakeLLM()
    llm.reset_prefix_cache = lambda reset_running_requests=False: None
    llm.llm_engine = type("Labels", (), {"set_weight_version": lambda self, version: None})()
    engine._assemble(
        llm, EngineSpec(model_path="x", dtype="float32", max_model_len=8, sleep_level=sleep_level), 0, False
    )
    return engine


def test_engine_sleeps_when_told_and_wakes_before_weights_arrive():
    engine = _engine(sleep_level=1)
    engine.sleep()
    engine.sleep()  # once asleep, not again
    engine.receive_weights(OpenSession())
    assert engine.llm.calls == [("sleep", 1), ("wake_up",), ("rlhf_receive", "OpenSession")]
    off = _engine(sleep_level=0)
    off.sleep()
    assert off.llm.calls == []  # sleep_level 0: never


def test_sleep_level_2_generates_only_after_a_sync_has_loaded_the_weights_again():
    """Level 2 discards the weights: generating or scoring before a sync would use garbage."""
    engine = _engine(sleep_level=2)
    engine.sleep()
    with pytest.raises(RuntimeError, match="dropped its weights .* the driver must sync before it generates"):
        engine.prompt_logprobs([[1, 2, 3]])
    engine.receive_weights(OpenSession())
    engine.receive_weights(CloseSession(3))  # a whole sync: every weight loaded
    engine.power.weights_present()  # no error now
    level_one = _engine(sleep_level=1)
    level_one.sleep()
    level_one.power.weights_present()  # level 1 keeps the weights in CPU memory


def test_idle_engines_sleep_after_the_rollout_is_handed_over_not_between_generations():
    """The sync pipeline puts the engines to sleep once the rollout is on the trainers (dynamic
    sampling's rounds and evaluations come before that, or after the sync); one_step_off only when
    the rollout it generates ahead is done."""
    from types import SimpleNamespace

    from rlhf_orch.orchestration.pipeline import OneStepOffPipeline, SyncPipeline

    calls = []
    loop = SimpleNamespace(
        sleep_engines=lambda: calls.append("sleep"), generate=lambda step: calls.append(f"generate {step}") or step
    )
    SyncPipeline().engines_idle(loop)
    assert calls == ["sleep"]
    calls.clear()
    pipeline = OneStepOffPipeline()
    pipeline.engines_idle(loop)
    assert calls == []
    pipeline._start(loop, 2)
    pipeline._next.result()
    assert calls == ["generate 2", "sleep"]
    pipeline.close(None)


# ----------------------------------------------------------------------------- defect 4: vLLM interfaces
def test_vllm_interface_check_names_the_supported_range(monkeypatch):
    import vllm

    from rlhf_orch.engines.llm_start import SUPPORTED_VLLM, VLLMInterfaceError, check_vllm_interfaces

    assert check_vllm_interfaces() == vllm.__version__  # the installed vLLM has everything
    monkeypatch.delattr(vllm.LLM, "enqueue")
    with pytest.raises(VLLMInterfaceError, match=rf"LLM.enqueue.*vllm{SUPPORTED_VLLM}"):
        check_vllm_interfaces()


def test_gpu_extra_pins_the_supported_vllm():
    import tomllib

    from rlhf_orch.engines.llm_start import SUPPORTED_VLLM

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = {e.split(">")[0].split("=")[0].split("<")[0]: e for e in extras}
    assert pins["vllm"] == f"vllm{SUPPORTED_VLLM}"
    assert all("<" in pins[p] for p in ("torch", "vllm", "transformers"))  # a tested upper bound each


def test_the_kv_cache_is_the_configured_size_or_on_cpu_what_the_engine_holds_at_once():
    """engine.kv_cache_gb: vLLM's kv_cache_memory_bytes (per GPU, per CPU worker); null: vLLM sizes
    it from gpu_memory_utilization on GPUs, and on CPU it is every sequence of the training rollouts
    an engine generates at once at full length (its share, rollouts generated together) with
    headroom; a held-out evaluation of more runs in waves."""
    from vllm.engine.arg_utils import EngineArgs

    from rlhf_orch.engines.launch import (
        CPU_KV_CACHE_MIN_BYTES,
        cpu_kv_cache_bytes,
        kv_cache_args,
        kv_sequences_per_engine,
    )

    assert kv_cache_args(int(6.5 * 2**30)) == {"kv_cache_memory_bytes": int(6.5 * 2**30)} and kv_cache_args(None) == {}
    assert set(kv_cache_args(1)) <= set(EngineArgs.__dataclass_fields__)  # a vLLM argument, by that name
    assert kv_sequences_per_engine(128, 1, 1) == 128 and kv_sequences_per_engine(128, 2, 2) == 128
    assert kv_sequences_per_engine(512, 1, 1) == 256  # vLLM's max_num_seqs on CPU
    # SmolLM2 (30 layers x 3 KV heads x 64 x 2 x 4 bytes = 46080 B a token), 32 sequences of 208 -> 224 tokens
    assert cpu_kv_cache_bytes(32, 208, 46080, 1, 32) == int(32 * 224 * 46080 * 1.25)
    assert cpu_kv_cache_bytes(32, 208, 46080, 2, 32) == int(32 * 224 * 46080 * 1.25) // 2
    assert cpu_kv_cache_bytes(4, 16, 64, 1, 32) == CPU_KV_CACHE_MIN_BYTES


def test_an_eager_cpu_engine_runs_vllms_compiled_helpers_eagerly_and_its_tp_workers_too():
    """CPU + engine.enforce_eager: no torch.compile in the engine (~5 s per engine start); the env
    var the engine hands its TP worker processes is the one torch reads."""
    from rlhf_orch.engines.launch import TORCH_COMPILE_OFF_ENV, skips_torch_compile

    assert skips_torch_compile(is_cpu=True, enforce_eager=True)
    assert not skips_torch_compile(is_cpu=True, enforce_eager=False)  # the user asked for compilation
    assert not skips_torch_compile(is_cpu=False, enforce_eager=True)  # GPUs keep vLLM's compiled kernels
    probe = "import torch._dynamo.config as c; print(c.disable)"
    out = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, **TORCH_COMPILE_OFF_ENV}, capture_output=True, text=True
    )
    assert out.stdout.strip() == "True", out.stderr[-2000:]


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (
            [
                "placement=colocated",
                "launcher.logical_gpus=8",
                "engine.kv_cache_gb=4",
                "engine.gpu_memory_utilization=0.3",
            ],
            "engine.gpu_memory_utilization=0.3",
            "leave one of the two null",
        ),
        (
            ["engine.gpu_memory_utilization=0.5"],
            "engine.gpu_memory_utilization=0.5",
            "leave it null with placement=cpu_local",
        ),
    ],
)
def test_kv_cache_and_memory_fraction_that_would_do_nothing_are_refused(overrides, key, words):
    from hydra.utils import instantiate

    from rlhf_orch.app import check
    from rlhf_orch.config.validate import ConfigError
    from tests.conftest import compose_config

    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as err:
        check(cfg, instantiate(cfg.launcher))
    assert key in str(err.value) and words in str(err.value)


def test_trainers_on_gpus_use_expandable_segments_unless_the_sync_hands_over_their_cuda_memory(monkeypatch):
    from rlhf_orch.orchestration.actors import _ACTOR_ENV, trainer_process_env
    from rlhf_orch.sync.bucketed import BucketedBroadcastSync
    from rlhf_orch.sync.cuda_ipc import CudaIpcSync

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert trainer_process_env(_ACTOR_ENV, gpu_layout=True)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in trainer_process_env(_ACTOR_ENV, gpu_layout=False)  # CPU: no CUDA allocator
    # CUDA IPC senders keep the default allocator (an expandable segment's handle needs pidfd_getfd)
    assert CudaIpcSync.shares_cuda_memory and not BucketedBroadcastSync.shares_cuda_memory
    assert "PYTORCH_CUDA_ALLOC_CONF" not in trainer_process_env(_ACTOR_ENV, True, CudaIpcSync.shares_cuda_memory)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in trainer_process_env(_ACTOR_ENV, gpu_layout=True)  # the user's own wins
    assert "PYTORCH_CUDA_ALLOC_CONF" not in _ACTOR_ENV  # engines get the shared env only: vLLM's sleep pool


def test_a_cuda_ipc_handle_opens_only_on_the_gpu_it_came_from():
    from rlhf_orch.sync.cuda_ipc_handles import local_index_of

    assert local_index_of("GPU-b", ["GPU-a", "GPU-b"]) == 1  # indices differ between processes, UUIDs do not
    with pytest.raises(RuntimeError, match="cannot see that GPU"):
        local_index_of("GPU-c", ["GPU-a", "GPU-b"])


def test_the_kv_block_size_is_the_configured_one_or_32_on_cpu_and_vllms_on_gpus():
    from rlhf_orch.engines.launch import kv_block_size

    assert kv_block_size(None, is_cpu=True) == 32
    assert kv_block_size(None, is_cpu=False) is None  # vLLM's own default (16 on CUDA)
    assert kv_block_size(64, is_cpu=True) == 64 and kv_block_size(16, is_cpu=False) == 16


def test_the_engine_is_given_the_checkpoint_s_own_chat_template(tmp_path):
    """vLLM's start-up warms its chat rendering up; given no template it loads the checkpoint's
    processor -- a second tokenizer -- to look for one first. The engine hands it the checkpoint's
    own: chat_template.jinja, else tokenizer_config.json's string; none (or named templates, or no
    checkpoint here): vLLM's own lookup."""
    from rlhf_orch.engines.llm_start import checkpoint_chat_template

    (tmp_path / "config.json").write_text("{}")
    assert checkpoint_chat_template(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": [{"name": "default", "template": "{{ x }}"}]}')
    assert checkpoint_chat_template(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ bos_token }}"}')
    assert checkpoint_chat_template(str(tmp_path)) == "{{ bos_token }}"
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}")
    assert checkpoint_chat_template(str(tmp_path)) == str(tmp_path / "chat_template.jinja")
    assert checkpoint_chat_template(str(tmp_path / "elsewhere")) is None
