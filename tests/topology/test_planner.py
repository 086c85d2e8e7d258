"""The pure placement planner: layouts, multi-node filling, and the errors' wording."""

from __future__ import annotations

from pathlib import Path

import hydra
import pytest
from hydra import compose, initialize_config_dir

from rlhf_orch.config.schema import register_configs
from rlhf_orch.topology.placement import ColocatedPlacement, CpuLocalPlacement, SplitPlacement
from rlhf_orch.topology.plan import PlacementError, PlacementPlan, RoleSlot
from rlhf_orch.topology.planners import plan_colocated, plan_cpu_local, plan_split, split_gpu_counts

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def cpu_local(**overrides) -> PlacementPlan:
    args = dict(
        actor_ranks=1,
        critic_ranks=1,
        reference_ranks=1,
        engines=1,
        engine_tp=1,
        reward="function",
        nodes=1,
        gpus_per_node=0,
    )
    return plan_cpu_local(**{**args, **overrides})


def colocated(**overrides) -> PlacementPlan:
    args = dict(
        actor_ranks=4,
        critic_ranks=4,
        reference_ranks=4,
        engines=4,
        engine_tp=1,
        reward="function",
        nodes=1,
        gpus_per_node=4,
        actor_fraction=0.25,
        critic_fraction=0.25,
        reference_fraction=0.15,
        engine_fraction=0.35,
    )
    return plan_colocated(**{**args, **overrides})


def split(**overrides) -> PlacementPlan:
    args = dict(
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
    return plan_split(**{**args, **overrides})


def claimed_per_bundle(plan: PlacementPlan) -> dict[tuple[int, int], float]:
    totals: dict[tuple[int, int], float] = {}
    for slot in plan.slots:
        for bundle in slot.bundles:
            totals[(slot.node, bundle)] = totals.get((slot.node, bundle), 0.0) + slot.num_gpus
    return totals


def assert_consistent(plan: PlacementPlan) -> None:
    """Invariants every plan keeps: claims fit their bundles, CPUs cover the processes."""
    for (node, bundle), gpus in claimed_per_bundle(plan).items():
        assert gpus <= plan.nodes[node][bundle].get("GPU", 0) + 1e-9
    for node, bundles in enumerate(plan.nodes):
        for index, resources in enumerate(bundles):
            processes = len(plan.claims_on(node, index))
            assert processes >= 1, f"bundle {node}/{index} reserved but unused"
            assert resources["CPU"] == pytest.approx(processes * 1.0)
    for slot in plan.slots_for("engine"):
        assert len(slot.bundles) == plan.engine_tp


# --------------------------------------------------------------------------- data structures
def test_slots_for_is_sorted_by_rank_and_roles_are_canonical() -> None:
    plan = colocated()
    assert [slot.rank for slot in plan.slots_for("actor")] == [0, 1, 2, 3]
    assert plan.roles == ("actor", "critic", "reference", "engine")
    assert plan.slots_for("reward") == []


def test_plan_refuses_a_slot_outside_its_node() -> None:
    with pytest.raises(ValueError, match="bundle 3"):
        PlacementPlan("cpu_local", (({"CPU": 1},),), (RoleSlot("actor", 0, 0, (3,), 0.0, 1.0),), 1)
    with pytest.raises(ValueError, match="unknown role"):
        RoleSlot("trainer", 0, 0, (0,), 0.0, 1.0)


def test_describe_lists_roles_bundles_and_fractions() -> None:
    text = split(nodes=2, gpus_per_node=4, actor_gpus=2, critic_gpus=2, vllm_gpus=4, engine_tp=2).describe()
    assert isinstance(text, str)
    for expected in (
        "placement: split",
        "planned nodes=2",
        "GPUs=8",
        "engine_tp=2",
        "actor",
        "critic",
        "reference",
        "engine",
        "0,1",
        "1 x2",
        "CPU=2 GPU=1",
        "engine0/tp1(1)",
        "actor0(0.75) reference0(0.25)",
        "GPUs per role:",
    ):
        assert expected in text, expected
    assert str(split()) == split().describe()


# --------------------------------------------------------------------------- cpu_local
def test_cpu_local_one_cpu_bundle_per_process_on_node_zero() -> None:
    plan = cpu_local(actor_ranks=2, critic_ranks=1, reference_ranks=1, engines=2)
    assert plan.layout == "cpu_local"
    assert len(plan.nodes) == 1
    assert all(bundle == {"CPU": 1.0} for bundle in plan.nodes[0])
    assert len(plan.nodes[0]) == len(plan.slots) == 6
    assert plan.total_gpus == 0
    assert all(slot.node == 0 and slot.num_gpus == 0 for slot in plan.slots)
    used = [bundle for slot in plan.slots for bundle in slot.bundles]
    assert sorted(used) == list(range(6))  # no bundle shared


def test_cpu_local_engine_tp_gets_one_bundle_per_worker() -> None:
    plan = cpu_local(engines=2, engine_tp=2)
    assert [len(slot.bundles) for slot in plan.slots_for("engine")] == [2, 2]
    assert len(plan.nodes[0]) == 3 + 4


def test_cpu_local_reward_model_gets_its_own_bundle() -> None:
    plan = cpu_local(reward="model")
    (reward,) = plan.slots_for("reward")
    others = {bundle for slot in plan.slots if slot.role != "reward" for bundle in slot.bundles}
    assert reward.bundles[0] not in others
    assert cpu_local(reward="function").slots_for("reward") == []


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"nodes": 2}, "placement.nodes=2"),
        ({"gpus_per_node": 8}, "placement.gpus_per_node=8 but placement=cpu_local uses no GPUs"),
        ({"actor_ranks": 0}, "placement.actor_ranks=0 must be >= 1"),
        ({"engines": 0}, "placement.engines=0 must be >= 1"),
        ({"engine_tp": 0}, "placement.engine_tp=0 must be >= 1"),
        ({"reward": "rm"}, "placement.reward='rm' is not one of 'function', 'model'"),
    ],
)
def test_cpu_local_errors(overrides: dict, fragment: str) -> None:
    with pytest.raises(PlacementError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        cpu_local(**overrides)


# --------------------------------------------------------------------------- colocated
def test_colocated_every_role_shares_every_gpu() -> None:
    plan = colocated()
    assert plan.layout == "colocated"
    assert plan.total_gpus == 4
    assert plan.nodes == (tuple({"CPU": 4.0, "GPU": 1} for _ in range(4)),)
    for rank in range(4):
        bundles = {plan.slots_for(role)[rank].bundles for role in ("actor", "critic", "reference", "engine")}
        assert bundles == {(rank,)}
    assert plan.slots_for("actor")[0].num_gpus == 0.25
    assert plan.slots_for("engine")[0].num_gpus == 0.35
    assert plan.gpus_per_role() == {"actor": 1.0, "critic": 1.0, "reference": 0.6, "engine": 1.4}
    assert_consistent(plan)


def test_colocated_engine_tp_bundles_stay_on_one_node() -> None:
    plan = colocated(nodes=2, gpus_per_node=4, actor_ranks=8, critic_ranks=8, reference_ranks=8, engines=4, engine_tp=2)
    assert len(plan.nodes) == 2
    engines = plan.slots_for("engine")
    assert [(slot.node, slot.bundles) for slot in engines] == [(0, (0, 1)), (0, (2, 3)), (1, (0, 1)), (1, (2, 3))]
    # TP workers claim the engine's share on every bundle of the engine.
    assert claimed_per_bundle(plan)[(1, 3)] == pytest.approx(1.0)
    assert plan.gpus_per_role()["engine"] == pytest.approx(8 * 0.35)
    assert_consistent(plan)


def test_colocated_fills_node_zero_first() -> None:
    plan = colocated(nodes=2, gpus_per_node=4, actor_ranks=6, critic_ranks=2, reference_ranks=2, engines=2)
    assert [(slot.node, slot.bundles[0]) for slot in plan.slots_for("actor")] == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
        (1, 1),
    ]
    assert [slot.node for slot in plan.slots_for("critic")] == [0, 0]
    assert len(plan.nodes[1]) == 2  # only the GPUs in use are reserved
    assert_consistent(plan)


def test_colocated_fewer_ranks_than_gpus_reserves_only_used_gpus() -> None:
    plan = colocated(nodes=1, gpus_per_node=8, actor_ranks=2, critic_ranks=2, reference_ranks=2, engines=2)
    assert plan.total_gpus == 2


def test_colocated_fractions_over_one_are_refused_with_the_keys() -> None:
    with pytest.raises(PlacementError) as error:
        colocated(engine_fraction=0.5)
    message = str(error.value)
    assert "node 0 bundle 0 sum to 1.15 > 1" in message
    assert "engine0:engine_fraction=0.5" in message
    assert "lower placement.actor_fraction, placement.critic_fraction, placement.engine_fraction" in message


def test_colocated_default_fractions_sum_to_exactly_one() -> None:
    plan = colocated(actor_fraction=0.25, critic_fraction=0.25, reference_fraction=0.15, engine_fraction=0.35)
    assert claimed_per_bundle(plan)[(0, 0)] == pytest.approx(1.0)


def test_colocated_reward_model_shares_the_critic_bundles() -> None:
    plan = colocated(engine_fraction=0.2, reward="model")
    rewards = plan.slots_for("reward")
    assert [(s.node, s.bundles) for s in rewards] == [(s.node, s.bundles) for s in plan.slots_for("critic")]
    assert rewards[0].num_gpus == 0.15  # reference_fraction unless reward_fraction is given
    assert (
        plan_colocated(**{**_colocated_args(), "reward": "model", "engine_fraction": 0.2, "reward_fraction": 0.1})
        .slots_for("reward")[0]
        .num_gpus
        == 0.1
    )
    assert_consistent(plan)


def test_colocated_reward_model_over_budget_names_reward() -> None:
    with pytest.raises(PlacementError, match=r"reward0:reference_fraction=0.15"):
        colocated(reward="model")


def _colocated_args() -> dict:
    return dict(
        actor_ranks=4,
        critic_ranks=4,
        reference_ranks=4,
        engines=4,
        engine_tp=1,
        reward="function",
        nodes=1,
        gpus_per_node=4,
        actor_fraction=0.25,
        critic_fraction=0.25,
        reference_fraction=0.15,
        engine_fraction=0.35,
    )


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            {"actor_ranks": 5},
            "placement.actor_ranks=5 needs more GPUs than the 4 of placement.nodes=1 x "
            "placement.gpus_per_node=4: set actor_ranks <= 4",
        ),
        ({"engines": 3, "engine_tp": 2}, "placement.engines=3 x placement.engine_tp=2 = 6 GPUs exceed the 4"),
        ({"engine_tp": 3, "engines": 1}, "placement.gpus_per_node=4 is not a multiple of placement.engine_tp=3"),
        ({"gpus_per_node": 0}, "placement.gpus_per_node=0 must be >= 1"),
        ({"nodes": 0}, "placement.nodes=0 must be >= 1"),
        ({"actor_fraction": 0.0}, "placement.actor_fraction=0.0 must be a GPU fraction in (0, 1]"),
        ({"engine_fraction": 1.5}, "placement.engine_fraction=1.5 must be a GPU fraction"),
        ({"reference_ranks": 0}, "placement.reference_ranks=0 must be >= 1"),
    ],
)
def test_colocated_errors(overrides: dict, fragment: str) -> None:
    with pytest.raises(PlacementError) as error:
        colocated(**overrides)
    assert fragment in str(error.value)


# --------------------------------------------------------------------------- split
def test_split_explicit_gpus_are_disjoint_between_trainer_and_vllm() -> None:
    plan = split()
    assert plan.layout == "split"
    assert plan.total_gpus == 8
    trainer = {
        (s.node, b) for role in ("actor", "critic", "reference") for s in plan.slots_for(role) for b in s.bundles
    }
    vllm = {(s.node, b) for s in plan.slots_for("engine") for b in s.bundles}
    assert not trainer & vllm
    assert len(trainer) == 6 and len(vllm) == 2
    assert_consistent(plan)


def test_split_ranks_are_derived_from_gpus() -> None:
    plan = split(actor_gpus=3, critic_gpus=1, vllm_gpus=4, engine_tp=2)
    assert plan.num_ranks("actor") == 3
    assert plan.num_ranks("reference") == 3
    assert plan.num_ranks("critic") == 1
    assert plan.num_ranks("engine") == 2


def test_split_reference_shares_actor_gpu_with_its_fraction() -> None:
    plan = split(reference_fraction=0.2)
    for actor, reference in zip(plan.slots_for("actor"), plan.slots_for("reference")):
        assert (actor.node, actor.bundles) == (reference.node, reference.bundles)
        assert actor.num_gpus == pytest.approx(0.8)
        assert reference.num_gpus == pytest.approx(0.2)
    assert all(slot.num_gpus == 1.0 for slot in plan.slots_for("critic"))
    assert plan.gpus_per_role() == {"actor": 3.2, "critic": 2.0, "reference": 0.8, "engine": 2.0}


def test_split_reward_model_shares_critic_gpus() -> None:
    plan = split(reward="model")
    critics, rewards = plan.slots_for("critic"), plan.slots_for("reward")
    assert [(s.node, s.bundles) for s in rewards] == [(s.node, s.bundles) for s in critics]
    assert critics[0].num_gpus == pytest.approx(0.75) and rewards[0].num_gpus == pytest.approx(0.25)
    assert plan.total_gpus == 8
    assert_consistent(plan)


@pytest.mark.parametrize(
    "ratio, actor, critic, vllm",
    [("1:1", 3, 1, 4), ("3:1", 4, 2, 2), ("6:2", 4, 2, 2), ("7:1", 5, 2, 1), ("5:3", 3, 2, 3)],
)
def test_split_ratio_splits_all_gpus(ratio: str, actor: int, critic: int, vllm: int) -> None:
    counts = split_gpu_counts(nodes=1, gpus_per_node=8, ratio=ratio, actor_gpus=4, critic_gpus=2, vllm_gpus=99)
    assert (counts.actor, counts.critic, counts.vllm) == (actor, critic, vllm)
    plan = split(ratio=ratio)
    assert plan.total_gpus == 8
    assert plan.num_ranks("actor") == actor and plan.num_ranks("engine") == vllm


def test_split_ratio_multi_node_with_tp() -> None:
    plan = split(nodes=2, gpus_per_node=8, ratio="3:1", engine_tp=2, actor_gpus=1, critic_gpus=1)
    assert plan.total_gpus == 16
    assert plan.num_ranks("actor") == 6 and plan.num_ranks("critic") == 6 and plan.num_ranks("engine") == 2
    assert_consistent(plan)


def test_split_multi_node_fills_node_zero_first_and_keeps_tp_on_one_node() -> None:
    plan = split(nodes=2, gpus_per_node=4, actor_gpus=2, critic_gpus=2, vllm_gpus=4, engine_tp=2)
    assert [len(node) for node in plan.nodes] == [4, 4]
    assert [(s.node, s.bundles) for s in plan.slots_for("engine")] == [(0, (0, 1)), (0, (2, 3))]
    assert [(s.node, s.bundles) for s in plan.slots_for("actor")] == [(1, (0,)), (1, (1,))]
    assert [(s.node, s.bundles) for s in plan.slots_for("critic")] == [(1, (2,)), (1, (3,))]
    assert_consistent(plan)


def test_split_odd_trainer_count_still_aligns_engines() -> None:
    # Engines take the first GPUs, so a TP group never starts mid-pair whatever the trainer count.
    plan = split(nodes=2, gpus_per_node=4, actor_gpus=2, critic_gpus=1, vllm_gpus=4, engine_tp=2)
    for slot in plan.slots_for("engine"):
        assert slot.bundles[0] % 2 == 0
    assert [len(node) for node in plan.nodes] == [4, 3]
    assert_consistent(plan)


def test_split_trainer_ranks_may_span_nodes() -> None:
    plan = split(nodes=2, gpus_per_node=4, actor_gpus=5, critic_gpus=1, vllm_gpus=2)
    assert [s.node for s in plan.slots_for("actor")] == [0, 0, 1, 1, 1]


def test_split_uses_only_the_gpus_asked_for() -> None:
    plan = split(actor_gpus=1, critic_gpus=1, vllm_gpus=1)
    assert plan.total_gpus == 3
    assert len(plan.nodes) == 1 and len(plan.nodes[0]) == 3


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            {"vllm_gpus": 3, "engine_tp": 2, "actor_gpus": 2},
            "placement.vllm_gpus=3 is not divisible by placement.engine_tp=2: set vllm_gpus to a multiple of engine_tp",
        ),
        (
            {"actor_gpus": 4, "critic_gpus": 2, "vllm_gpus": 4},
            "placement.actor_gpus=4 + placement.critic_gpus=2 + placement.vllm_gpus=4 = 10 GPUs exceed the 8 of "
            "placement.nodes=1 x placement.gpus_per_node=8",
        ),
        (
            {"gpus_per_node": 6, "engine_tp": 4, "actor_gpus": 1, "critic_gpus": 1, "vllm_gpus": 4},
            "placement.gpus_per_node=6 is not a multiple of placement.engine_tp=4",
        ),
        ({"ratio": "1:2"}, "placement.ratio='1:2' cannot split the 8 GPUs"),
        ({"ratio": "3-1"}, "placement.ratio='3-1' is not 'trainer:vllm' with two positive integers"),
        ({"ratio": "0:1"}, "placement.ratio='0:1' is not 'trainer:vllm'"),
        ({"ratio": "1:1:1"}, "placement.ratio='1:1:1' is not 'trainer:vllm'"),
        ({"ratio": "1:7"}, "placement.ratio='1:7' leaves 1 trainer GPU(s) of 8"),
        (
            {"ratio": "1:1", "engine_tp": 8},
            "placement.ratio='1:1' gives vLLM 4 GPUs, not divisible by placement.engine_tp=8",
        ),
        ({"critic_gpus": 0}, "placement.critic_gpus=0 must be >= 1"),
        ({"vllm_gpus": 0}, "placement.vllm_gpus=0 must be >= 1"),
        ({"reference_fraction": 1.0}, "placement.reference_fraction=1.0 must be a GPU fraction in (0, 1)"),
        ({"gpus_per_node": 0}, "placement.gpus_per_node=0 must be >= 1"),
        ({"reward": "learned"}, "placement.reward='learned' is not one of"),
    ],
)
def test_split_errors(overrides: dict, fragment: str) -> None:
    with pytest.raises(PlacementError) as error:
        split(**overrides)
    assert fragment in str(error.value)


def test_placement_error_is_a_value_error() -> None:
    assert issubclass(PlacementError, ValueError)


# --------------------------------------------------------------------------- config classes via Hydra
@pytest.fixture(scope="module")
def compose_config():
    register_configs()

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose("config", overrides=list(overrides))

    return _compose


@pytest.mark.parametrize(
    "overrides, cls, layout, gpus",
    [
        ((), CpuLocalPlacement, "cpu_local", 0),
        (("placement=colocated",), ColocatedPlacement, "colocated", 8),
        (("placement=split",), SplitPlacement, "split", 8),
        (("experiment=gpu_split_qwen",), SplitPlacement, "split", 8),
        (
            ("placement=split", "placement.ratio=3:1", "placement.nodes=2", "placement.engine_tp=2"),
            SplitPlacement,
            "split",
            16,
        ),
    ],
)
def test_instantiate_composed_placement(compose_config, overrides, cls, layout, gpus) -> None:
    cfg = compose_config(*overrides)
    placement = hydra.utils.instantiate(cfg.placement)
    assert isinstance(placement, cls)
    plan = placement.plan()
    assert plan.layout == layout
    assert plan.total_gpus == gpus


def test_split_placement_derives_ranks_and_refuses_them_given(compose_config) -> None:
    cfg = compose_config("placement=split")
    plan = hydra.utils.instantiate(cfg.placement).plan()
    assert plan.num_ranks("actor") == cfg.placement.actor_gpus == 4
    with pytest.raises(Exception, match=r"derives ranks and engines from the GPU counts: drop placement.actor_ranks=7"):
        hydra.utils.instantiate(compose_config("placement=split", "placement.actor_ranks=7").placement)


def test_instantiated_placement_surfaces_planner_errors(compose_config) -> None:
    cfg = compose_config("placement=split", "placement.vllm_gpus=3", "placement.engine_tp=2", "placement.actor_gpus=2")
    with pytest.raises(PlacementError, match="placement.vllm_gpus=3 is not divisible by placement.engine_tp=2"):
        hydra.utils.instantiate(cfg.placement).plan()


# --------------------------------------------------------------------------- critic-free, no reference
def test_cpu_local_critic_free_places_no_critic_and_reward_beside_actors() -> None:
    plan = cpu_local(actor_ranks=2, critic_ranks=2, critic=False, reward="model")
    assert plan.roles == ("actor", "reference", "reward", "engine")
    assert plan.num_ranks("critic") == 0 and plan.num_ranks("reward") == 2
    assert_consistent(plan)
    assert cpu_local(critic=False, reference=False).roles == ("actor", "engine")


def test_colocated_critic_free_claims_no_critic_fraction() -> None:
    plan = colocated(critic=False)
    assert plan.num_ranks("critic") == 0
    for (node, bundle), gpus in claimed_per_bundle(plan).items():
        assert gpus == pytest.approx(0.25 + 0.15 + 0.35)  # actor + reference + engine, no critic
    assert_consistent(plan)
    assert colocated(critic=False, reference=False, reward="model").roles == ("actor", "reward", "engine")


def test_split_critic_free_gives_critic_gpus_to_vllm_and_ratio_trainer_share_to_actor() -> None:
    plan = split(critic=False)  # explicit 4 actor + 2 critic + 2 vLLM of 8
    assert plan.num_ranks("critic") == 0
    assert plan.num_ranks("actor") == 4 and plan.num_ranks("engine") == 4 and plan.total_gpus == 8
    ratio = split(ratio="3:1", critic=False)
    assert ratio.num_ranks("actor") == 6 and ratio.num_ranks("engine") == 2 and ratio.num_ranks("critic") == 0
    assert_consistent(plan)
    assert_consistent(ratio)


def test_split_without_reference_or_critic_gives_the_actor_whole_gpus_and_the_reward_model_a_share() -> None:
    plan = split(critic=False, reference=False)
    assert all(s.num_gpus == 1.0 for s in plan.slots_for("actor")) and plan.num_ranks("reference") == 0
    with_rm = split(critic=False, reward="model")
    for actor, ref, rm in zip(with_rm.slots_for("actor"), with_rm.slots_for("reference"), with_rm.slots_for("reward")):
        assert actor.bundles == ref.bundles == rm.bundles
        assert actor.num_gpus + ref.num_gpus + rm.num_gpus == pytest.approx(1.0)
    assert_consistent(with_rm)


def test_composed_critic_free_algorithm_plans_no_critic(compose_config) -> None:
    from rlhf_orch.app import check

    for algo in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dapo"):
        cfg = compose_config(f"algo={algo}", "placement=split", "launcher.logical_gpus=8", "launcher.dry_run=true")
        _, plan = check(cfg, hydra.utils.instantiate(cfg.launcher))
        assert "critic" not in plan.roles, algo
        assert ("reference" in plan.roles) == (algo != "dapo"), algo  # DAPO has no KL term
    cfg = compose_config("algo=ppo", "placement=split", "launcher.logical_gpus=8", "launcher.dry_run=true")
    assert "critic" in check(cfg, hydra.utils.instantiate(cfg.launcher))[1].roles


# --------------------------------------------------------------------------- the reference inside the policy's processes
def test_the_reference_runs_inside_the_policy_ranks_where_the_plan_allows_it() -> None:
    from rlhf_orch.topology.reference_hosting import with_reference_hosting

    # null (the default): wherever each reference rank has its policy rank's node (and GPU)
    assert with_reference_hosting(cpu_local(), None).reference_in_actor
    assert with_reference_hosting(split(), None).reference_in_actor  # a reference beside each actor rank
    assert with_reference_hosting(colocated(), None).reference_in_actor  # rank r of each role on GPU r
    hosted = with_reference_hosting(cpu_local(), None)
    assert hosted.slots == cpu_local().slots  # the same slots and bundles: only no process of its own
    assert "reference ranks run inside the actor ranks' processes" in hosted.describe()
    assert "reference0[in actor0]" in hosted.describe() and "[in actor" not in cpu_local().describe()
    assert "inside" not in cpu_local().describe()
    # not where the ranks differ (one reference process serving two policy ranks stays that)
    assert not with_reference_hosting(cpu_local(actor_ranks=2), None).reference_in_actor
    assert not with_reference_hosting(colocated(reference_ranks=2), None).reference_in_actor
    # false: a process per reference rank
    assert not with_reference_hosting(cpu_local(), False).reference_in_actor


@pytest.mark.parametrize(
    "plan,setting,fragment",
    [
        (
            dict(actor_ranks=2),
            True,
            r"placement.reference_in_actor=true but 1 reference ranks for 2 policy ranks .* "
            r"set placement.reference_in_actor=false .* or null",
        ),
        (
            dict(reference=False),
            True,
            r"placement.reference_in_actor=true does nothing: the algorithm has no reference",
        ),
        (dict(reference=False), False, r"placement.reference_in_actor=false does nothing: .* drop the key"),
    ],
)
def test_a_reference_in_actor_setting_that_cannot_hold_or_does_nothing_is_refused(plan, setting, fragment) -> None:
    from rlhf_orch.topology.reference_hosting import with_reference_hosting

    with pytest.raises(PlacementError, match=fragment):
        with_reference_hosting(cpu_local(**plan), setting)


def test_the_composed_config_hosts_the_reference_and_its_key_reaches_the_plan(compose_config) -> None:
    from rlhf_orch.app import check

    def plan_of(*overrides: str) -> PlacementPlan:
        cfg = compose_config(*overrides)
        return check(cfg, hydra.utils.instantiate(cfg.launcher))[1]

    assert plan_of().reference_in_actor  # the default experiment: PPO with a KL reference, one rank each
    assert not plan_of("placement.reference_in_actor=false").reference_in_actor
    with pytest.raises(PlacementError, match="reference_in_actor=true does nothing"):
        plan_of("algo=dapo", "placement.reference_in_actor=true")  # DAPO has no KL term
