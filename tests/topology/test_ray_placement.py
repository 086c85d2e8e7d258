"""Plans realised on a real Ray: logical GPUs on one node, and a real multi-node `Cluster`.

Probe actors are placed with `RayPlacement.options_for(slot)` and report where Ray put them; the
driver checks that against the plan (placement group, bundle accounting, GPU ids, node ids).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import hydra
import pytest
import ray
import torch
from hydra import compose, initialize_config_dir
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from launchers.cluster import ClusterRayLauncher
from launchers.local import LocalRayLauncher
from launchers.submit_ray_job import build_entrypoint, parse_args
from rlhf_orch.config.schema import register_configs
from rlhf_orch.topology.plan import PlacementPlan, RoleSlot
from rlhf_orch.topology.planners import plan_colocated, plan_split
from rlhf_orch.topology.ray_placement import PlacementUnavailableError, RayPlacement

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


@ray.remote
class Probe:
    """Reports where Ray placed this actor."""

    def report(self, expected_bundle: int) -> dict:
        context = ray.get_runtime_context()
        current = ray.util.get_current_placement_group()
        return {
            "placement_group_id": context.get_placement_group_id(),
            "current_group_id": current.id.hex() if current else None,
            "bundle_spec": current.bundle_specs[expected_bundle] if current else None,
            "gpu_ids": [int(gpu) for gpu in ray.get_gpu_ids()],
            "node_id": context.get_node_id(),
        }


def start_probes(placement: RayPlacement) -> dict[RoleSlot, dict]:
    """One probe per slot; returns each slot's report."""
    probes = {slot: Probe.options(**placement.options_for(slot)).remote() for slot in placement.plan.slots}
    reports = ray.get([probe.report.remote(slot.bundles[0]) for slot, probe in probes.items()], timeout=120)
    return dict(zip(probes, reports))


def wait_for_bundle_usage(placement: RayPlacement, timeout_s: float = 20.0) -> None:
    """Each bundle's used GPU/CPU equals what the plan's slots claim on it (their first bundle).

    Ray names a bundle's resources `GPU_group_<index>_<group id>`: their use proves which bundle
    index each probe landed in. Ray's resource view syncs asynchronously, hence the polling.
    """
    expected: dict[str, float] = {}
    for slot in placement.plan.slots:
        group_id = placement.placement_group_for(slot).id.hex()
        for kind, amount in (("GPU", slot.num_gpus), ("CPU", slot.num_cpus)):
            key = f"{kind}_group_{slot.bundles[0]}_{group_id}"
            expected[key] = expected.get(key, 0.0) + amount
    deadline = time.monotonic() + timeout_s
    while True:
        total, available = ray.cluster_resources(), ray.available_resources()
        used = {key: total.get(key, 0.0) - available.get(key, 0.0) for key in expected}
        if all(abs(used[key] - amount) < 1e-6 for key, amount in expected.items()):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"bundle usage {used} != planned {expected}")
        time.sleep(0.25)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for: {what}")
        time.sleep(0.25)


def gpu_of(report: dict) -> tuple[str, int]:
    (gpu,) = report["gpu_ids"]  # a fractional or whole claim on one bundle is one GPU
    return report["node_id"], gpu


def assert_probes_in_their_groups(placement: RayPlacement, reports: dict[RoleSlot, dict]) -> None:
    for slot, report in reports.items():
        group = placement.placement_group_for(slot)
        assert report["placement_group_id"] == group.id.hex(), slot
        assert report["current_group_id"] == group.id.hex(), slot
        assert report["bundle_spec"] == {
            k: float(v) for k, v in placement.plan.nodes[slot.node][slot.bundles[0]].items()
        }
        assert report["node_id"] == placement.real_node_ids[slot.node], slot


# --------------------------------------------------------------------------- one node, logical GPUs
@pytest.fixture(scope="class")
def single_node_ray() -> Iterator[None]:
    ray.init(address="local", num_gpus=4, num_cpus=8, include_dashboard=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.usefixtures("single_node_ray")
class TestSingleNode:
    def test_colocated_roles_on_one_bundle_share_its_gpu(self) -> None:
        plan = plan_colocated(
            actor_ranks=2,
            critic_ranks=2,
            reference_ranks=2,
            engines=1,
            engine_tp=2,
            reward="function",
            nodes=1,
            gpus_per_node=2,
            actor_fraction=0.25,
            critic_fraction=0.25,
            reference_fraction=0.15,
            engine_fraction=0.35,
        )
        with RayPlacement(plan, ready_timeout_s=60) as placement:
            assert len(placement.placement_groups) == 1
            reports = start_probes(placement)
            assert_probes_in_their_groups(placement, reports)
            wait_for_bundle_usage(placement)
            gpu_by_bundle: dict[int, set] = {}
            for slot, report in reports.items():
                gpu_by_bundle.setdefault(slot.bundles[0], set()).add(gpu_of(report))
            # Same bundle -> same GPU for every role on it; different bundles -> different GPUs.
            assert all(len(gpus) == 1 for gpus in gpu_by_bundle.values()), gpu_by_bundle
            assert len({next(iter(gpus)) for gpus in gpu_by_bundle.values()}) == 2
        # Groups are removed on exit (Ray frees their resources asynchronously).
        wait_until(lambda: ray.available_resources().get("GPU") == 4, "GPUs freed after remove()")

    def test_split_trainer_and_engine_gpus_are_disjoint(self) -> None:
        plan = plan_split(
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
        with RayPlacement(plan, ready_timeout_s=60) as placement:
            reports = start_probes(placement)
            assert_probes_in_their_groups(placement, reports)
            wait_for_bundle_usage(placement)
            gpus = {role: {gpu_of(reports[s]) for s in plan.slots_for(role)} for role in plan.roles}
            trainer = gpus["actor"] | gpus["critic"] | gpus["reference"]
            assert not trainer & gpus["engine"]
            assert len(gpus["engine"]) == 2
            assert gpus["actor"] == gpus["reference"]  # the reference rides on the actor's GPU
            assert not gpus["actor"] & gpus["critic"]

    def test_plan_larger_than_any_node_fails_fast_naming_ray_resources(self) -> None:
        plan = plan_split(
            nodes=1,
            gpus_per_node=8,
            engine_tp=1,
            reward="function",
            ratio=None,
            actor_gpus=4,
            critic_gpus=2,
            vllm_gpus=2,
            reference_fraction=0.25,
        )
        started = time.monotonic()
        with pytest.raises(PlacementUnavailableError) as error:
            RayPlacement(plan, ready_timeout_s=60).create()
        assert time.monotonic() - started < 10
        message = str(error.value)
        assert "planned node 0 of the split plan needs {CPU: 12, GPU: 8}" in message
        assert "ray.cluster_resources(): {CPU: 8, GPU: 4}" in message

    def test_timeout_names_what_was_asked_and_removes_groups(self) -> None:
        blocker = placement_group([{"GPU": 1}] * 4, strategy="STRICT_PACK")
        ray.get(blocker.ready(), timeout=30)
        try:
            plan = plan_split(
                nodes=1,
                gpus_per_node=4,
                engine_tp=1,
                reward="function",
                ratio=None,
                actor_gpus=1,
                critic_gpus=1,
                vllm_gpus=1,
                reference_fraction=0.25,
            )
            placement = RayPlacement(plan, ready_timeout_s=2)
            with pytest.raises(PlacementUnavailableError) as error:
                placement.create()
            message = str(error.value)
            assert "planned node 0 of the split plan was not placed within 2 s" in message
            assert "ray.available_resources(): {CPU: 8, GPU: 0}" in message
            assert placement.placement_groups == ()
        finally:
            remove_placement_group(blocker)

    def test_lookups_before_create_are_refused(self) -> None:
        plan = plan_split(
            nodes=1,
            gpus_per_node=4,
            engine_tp=1,
            reward="function",
            ratio=None,
            actor_gpus=1,
            critic_gpus=1,
            vllm_gpus=1,
            reference_fraction=0.25,
        )
        with pytest.raises(RuntimeError, match="create"):
            RayPlacement(plan).options_for(plan.slots[0])


# --------------------------------------------------------------------------- several real nodes
@pytest.fixture(scope="class")
def two_gpu_nodes() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 2, "num_gpus": 0})
    try:
        cluster.add_node(num_cpus=4, num_gpus=4)
        cluster.add_node(num_cpus=4, num_gpus=4)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def on_cluster(two_gpu_nodes: Cluster) -> Iterator[ClusterRayLauncher]:
    launcher = ClusterRayLauncher(address=two_gpu_nodes.address, startup_timeout_s=60)
    with launcher.session():
        yield launcher


def split_two_nodes(gpus_per_node: int, **counts: int) -> PlacementPlan:
    return plan_split(
        nodes=2,
        gpus_per_node=gpus_per_node,
        engine_tp=2,
        reward="function",
        ratio=None,
        reference_fraction=0.25,
        cpus_per_process=0.5,
        **counts,
    )


class TestMultiNode:
    def test_split_over_two_nodes_follows_the_plan(self, on_cluster: ClusterRayLauncher) -> None:
        plan = split_two_nodes(4, actor_gpus=2, critic_gpus=2, vllm_gpus=4)
        assert on_cluster.gpus_present() == 8
        on_cluster.check_gpus(plan)
        with on_cluster.placement(plan) as placement:
            real_nodes = placement.real_node_ids
            assert len(set(real_nodes)) == 2  # planned nodes -> distinct real nodes
            reports = start_probes(placement)
            assert_probes_in_their_groups(placement, reports)
            wait_for_bundle_usage(placement)
            for slot in plan.slots_for("engine"):
                bundle_nodes = placement_group_table(placement.placement_group_for(slot))["bundles_to_node_id"]
                assert {bundle_nodes[b] for b in slot.bundles} == {real_nodes[slot.node]}
            for role in plan.roles:
                for slot in plan.slots_for(role):
                    assert reports[slot]["node_id"] == real_nodes[slot.node], (role, slot.rank)
            engine_gpus = {gpu_of(reports[s]) for s in plan.slots_for("engine")}
            trainer_gpus = {gpu_of(reports[s]) for r in ("actor", "critic", "reference") for s in plan.slots_for(r)}
            assert not engine_gpus & trainer_gpus

    def test_small_planned_nodes_still_get_distinct_real_nodes(self, on_cluster: ClusterRayLauncher) -> None:
        # Both planned nodes would fit on one 4-GPU node; they must not share one.
        plan = split_two_nodes(2, actor_gpus=1, critic_gpus=1, vllm_gpus=2)
        with on_cluster.placement(plan) as placement:
            assert len(set(placement.real_node_ids)) == 2
            for group, real_node in zip(placement.placement_groups, placement.real_node_ids):
                assert set(placement_group_table(group)["bundles_to_node_id"].values()) == {real_node}

    def test_more_planned_nodes_than_gpu_nodes_times_out_clearly(self, on_cluster: ClusterRayLauncher) -> None:
        plan = plan_split(
            nodes=3,
            gpus_per_node=2,
            engine_tp=2,
            reward="function",
            ratio=None,
            actor_gpus=2,
            critic_gpus=2,
            vllm_gpus=2,
            reference_fraction=0.25,
            cpus_per_process=0.5,
        )
        placement = RayPlacement(plan, ready_timeout_s=3)
        with pytest.raises(PlacementUnavailableError) as error:
            placement.create()
        message = str(error.value)
        assert "planned node 2 of the split plan was not placed within 3 s" in message
        assert "not used by planned nodes 0..1" in message
        assert "holds planned node 0" in message and "holds planned node 1" in message
        assert placement.placement_groups == ()

    def test_cluster_launcher_disconnects_without_stopping_the_cluster(
        self, two_gpu_nodes: Cluster, monkeypatch
    ) -> None:
        launcher = ClusterRayLauncher(address=two_gpu_nodes.address)
        connects = []
        init = ray.init
        monkeypatch.setattr(ray, "init", lambda *a, **k: connects.append(1) or init(*a, **k))
        assert launcher.gpus_present() == 8  # outside a session: connects just to ask
        assert not launcher.cuda_present()  # logical GPUs (untyped), and no CUDA here
        assert len(connects) == 1 and not ray.is_initialized()  # the checks' two questions: one connection
        monkeypatch.setattr(ray, "init", init)
        for _ in range(2):
            with launcher.session():
                assert sum(node["Alive"] for node in ray.nodes()) == 3
                assert launcher.gpus_present() == 8
            assert not ray.is_initialized()
        # A node whose GPUs Ray typed (as it does for real ones): the cluster's GPUs are real, whatever
        # this driver has (a CPU-only head node drives a GPU cluster).
        typed = two_gpu_nodes.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:H100": 1})
        try:
            two_gpu_nodes.wait_for_nodes()
            assert ClusterRayLauncher(address=two_gpu_nodes.address).cuda_present()
        finally:
            two_gpu_nodes.remove_node(typed)


# --------------------------------------------------------------------------- local launcher
class TestLocalLauncher:
    # One test, one launcher, two Ray sessions (each start is ~8 CPU-seconds): a session whose body
    # raises shuts Ray down; the next one of the same launcher starts cleanly with the asked
    # resources, refuses a nested session without touching its own, and shuts down at its end.
    def test_sessions_start_and_stop_in_one_process_even_when_the_body_raises_and_refuse_to_nest(self) -> None:
        launcher = LocalRayLauncher(logical_gpus=2, num_cpus=4)
        with pytest.raises(ZeroDivisionError):
            with launcher.session():
                assert ray.is_initialized()
                1 / 0
        assert not ray.is_initialized()
        with launcher.session() as session:  # a later session starts cleanly
            assert session is launcher
            resources = ray.cluster_resources()
            assert resources["CPU"] == 4
            assert resources.get("GPU", 0) == launcher.gpus_present()
            with pytest.raises(RuntimeError, match="already initialised"):
                with launcher.session():
                    pass
            assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 4  # the outer session is untouched
        assert not ray.is_initialized()  # ... and the refused nested call did not keep it from shutting down


# --------------------------------------------------------------------------- launcher construction
@pytest.fixture(scope="module")
def compose_launcher():
    register_configs()

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose("config", overrides=list(overrides)).launcher

    return _compose


class TestLauncherConfig:
    def test_instantiate_local_and_cluster(self, compose_launcher) -> None:
        local = hydra.utils.instantiate(compose_launcher("launcher.logical_gpus=2", "launcher.dry_run=true"))
        assert isinstance(local, LocalRayLauncher)
        assert local.dry_run and local.logical_gpus == 2 and local.startup_timeout_s == 600.0
        cluster = hydra.utils.instantiate(compose_launcher("launcher=cluster"))
        assert isinstance(cluster, ClusterRayLauncher)
        assert cluster.address == "auto"

    def test_local_gpus_and_cpus(self) -> None:
        launcher = LocalRayLauncher(logical_gpus=3)
        expected = torch.cuda.device_count() if torch.cuda.is_available() else 3
        assert launcher.gpus_present() == expected
        assert launcher.logical_cpus() == max(os.cpu_count() or 1, 16)
        assert LocalRayLauncher(num_cpus=5).logical_cpus() == 5

    def test_settings_that_cannot_apply_are_refused(self) -> None:
        with pytest.raises(ValueError, match="launcher.address='ray://head:10001'.*launcher=cluster"):
            LocalRayLauncher(address="ray://head:10001")
        with pytest.raises(ValueError, match="launcher.logical_gpus=2 cannot be applied to a running cluster"):
            ClusterRayLauncher(logical_gpus=2)
        with pytest.raises(ValueError, match="launcher.num_cpus=8 cannot be applied to a running cluster"):
            ClusterRayLauncher(num_cpus=8)
        with pytest.raises(ValueError, match="launcher.logical_gpus=-1 must be >= 0"):
            LocalRayLauncher(logical_gpus=-1)

    def test_submit_entrypoint_adds_cluster_launcher(self) -> None:
        assert build_entrypoint("python", "run.py", ["placement=split", "placement.ratio=3:1"]) == (
            "python run.py launcher=cluster placement=split placement.ratio=3:1"
        )
        assert build_entrypoint("python", "run.py", ["launcher=local"]) == "python run.py launcher=local"
        args = parse_args(["--address", "http://head:8265", "--follow", "algo.num_steps=2"])
        assert args.follow and args.address == "http://head:8265" and args.overrides == ["algo.num_steps=2"]
