"""Liveness by progress (rlhf_orch/liveness.py): a wait on actors whose counts move
goes on past any number of windows; one whose counts stand, or that do not answer, gives up
within two. Pure, on a fake clock: the results' readiness and the actors' counts are functions of
it. Then the real trainer class on Ray: its `progress` answers beside a busy phase, and a failure's
check tells its busy rank from a hung one (`lost_processes`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import pytest
import ray

from rlhf_orch.liveness import MONITOR, ProgressWatch, actor_class, deferred, no_progress_note, resolved
from rlhf_orch.transfer.base import Route

WINDOW = 10.0


class Clock:
    now = 0.0


@dataclass(eq=False)
class Ref:
    """A result that is ready from `at` on."""

    at: float
    name: str = ""


@dataclass(eq=False)
class Actor:
    """count(now): what `progress` answers (None: no answer)."""

    count: Callable[[float], int | None]


def moving() -> Actor:
    return Actor(lambda now: int(now))  # one unit of work a second


def standing() -> Actor:
    return Actor(lambda now: 7)


def silent() -> Actor:
    return Actor(lambda now: None)


def watch_on(clock: Clock, together: bool = False) -> ProgressWatch:
    """A watch whose `ray.wait` and looks run on `clock`: a wait returns the first result ready
    within its timeout (the clock moved to it) or none after the whole timeout."""

    def wait(refs, num_returns, timeout):
        soonest = min(refs, key=lambda r: r.at)
        if soonest.at <= clock.now + timeout:
            clock.now = max(clock.now, soonest.at)
            return [soonest], [r for r in refs if r is not soonest]
        clock.now += timeout
        return [], list(refs)

    return ProgressWatch(
        WINDOW, together=together, read=lambda actors: {k: a.count(clock.now) for k, a in actors.items()}, wait=wait
    )


@pytest.mark.parametrize("together", [False, True])
def test_a_wait_on_an_actor_whose_count_moves_goes_on_past_many_windows(together):
    clock = Clock()
    result = Ref(at=50 * WINDOW)
    assert watch_on(clock, together).first_ready([result], {0: moving()}) == [result]
    assert clock.now == 50 * WINDOW


@pytest.mark.parametrize("together", [False, True])
def test_a_wait_on_an_actor_whose_count_stands_gives_up_within_two_windows(together):
    clock = Clock()
    watch = watch_on(clock, together)
    assert watch.first_ready([Ref(at=1e9)], {"policy rank 0": standing()}) == []
    assert clock.now == 2 * WINDOW  # the first look counts as progress, the second finds the count where it was
    assert watch.stalled == ["policy rank 0"]


def test_an_actor_that_does_not_answer_is_given_up_at_the_first_look():
    clock = Clock()
    watch = watch_on(clock)
    assert watch.first_ready([Ref(at=1e9)], {0: silent()}) == []
    assert clock.now == WINDOW and watch.stalled == [0]


def test_a_count_that_stops_after_moving_is_found_two_windows_after_it_stopped():
    clock = Clock()
    watch = watch_on(clock)
    stops = Actor(lambda now: int(min(now, 35.0)))
    assert watch.first_ready([Ref(at=1e9)], {0: stops}) == []
    assert clock.now == 50.0  # looks at 10, 20, 30 (moved), 40 (moved: 30 -> 35), 50 (stood)


def test_independent_actors_each_must_move_and_only_the_stuck_one_is_named():
    clock = Clock()
    watch = watch_on(clock)
    assert watch.first_ready([Ref(at=1e9), Ref(at=1e9)], {0: standing(), 1: moving()}) == []
    assert watch.stalled == [0] and clock.now == 2 * WINDOW


def test_ranks_of_one_phase_move_together_while_any_of_them_moves():
    """The policy rank's call waits on the reference's result (or a peer in an all-reduce): its own
    count stands while the reference's moves -- the phase moves. Once nothing moves it is stuck,
    and every rank of the phase is named."""
    clock = Clock()
    watch = watch_on(clock, together=True)
    phase = {"policy rank 0": standing(), "reference rank 0": moving()}
    assert watch.all_ready([Ref(at=30 * WINDOW)], phase)
    assert clock.now == 30 * WINDOW
    clock = Clock()
    watch = watch_on(clock, together=True)
    assert not watch.all_ready([Ref(at=1e9)], {"policy rank 0": standing(), "critic rank 0": standing()})
    assert clock.now == 2 * WINDOW and watch.stalled == ["policy rank 0", "critic rank 0"]
    assert no_progress_note(watch.stalled, WINDOW) == (
        "policy rank 0, critic rank 0 made no progress within 10s (fault.step_timeout_s) or did not answer"
    )


def test_a_replaced_actor_starts_with_a_first_look():
    """Another handle under the same key (an engine replaced in its bundle) is new: its count is
    not compared with the dead one's."""
    clock = Clock()
    watch = watch_on(clock)
    watch.seen[0] = (object(), 7)  # the dead engine's last look, at the same count
    assert watch.first_ready([Ref(at=1e9)], {0: standing()}) == []
    assert clock.now == 2 * WINDOW  # not at the first look


def test_waiting_for_every_result_sees_each_as_it_comes():
    """A failure is raised as it comes (the caller's ray.get), not after its peers, which may
    wait for the failed rank in a collective for ever."""
    clock = Clock()
    watch = watch_on(clock, together=True)
    seen = []

    def on_ready(refs):
        seen.extend(r.name for r in refs)
        if "failed" in seen:
            raise RuntimeError("the rank's own error")

    with pytest.raises(RuntimeError):
        watch.all_ready([Ref(at=50.0, name="peer"), Ref(at=3.0, name="failed")], {"policy rank 0": moving()}, on_ready)
    assert seen == ["failed"] and clock.now == 3.0


def test_the_route_s_wait_names_the_stuck_engine_not_the_busy_one():
    """`Route.wait_any` (a rollout's wait on its engines) is the same watch, each engine on its own."""
    clock = Clock()
    stuck, busy = standing(), moving()
    route = Route(engines=[stuck, busy], consumers=[], get=None, timeout_s=WINDOW, _watch=watch_on(clock))
    assert route.wait_any({Ref(at=1e9): 0, Ref(at=1e9): 1}) == []
    assert route.stalled == [0] and clock.now == 2 * WINDOW
    assert route.stall_note() == "vLLM engine 0 made no engine step within 10s (fault.step_timeout_s) or did not answer"
    ready = Ref(at=40 * WINDOW)
    route = Route(engines=[busy], consumers=[], get=None, timeout_s=WINDOW, _watch=watch_on(clock))
    assert route.wait_any({ready: 0}) == [ready] and route.stalled == []


def _phase(worker, seconds: float, moves: bool) -> None:
    """(Inside a trainer actor.) A phase holding the rank's working thread for `seconds`, getting
    micro-batches done (`moves`) or stuck (in a collective whose peer is gone)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)
        if moves:
            worker.work_done.tick()


def _count(actor) -> int | None:
    from rlhf_orch.liveness import ask_progress, read_progress

    return read_progress(ask_progress({0: actor}), 10.0)[0]


@pytest.mark.integration
def test_a_trainer_rank_busy_in_a_long_phase_is_not_lost_while_its_count_moves(shared_ray):
    """The real trainer class: `progress` answers on a thread of its own while a phase holds the
    rank (its `ping` waits behind the phase). When a failure asks whether to restart
    (`lost_processes`), a rank whose count moves is busy, one whose count stands is lost."""
    from rlhf_orch.orchestration.actors import lost_processes
    from rlhf_orch.trainer.critic import CriticWorker
    from rlhf_orch.trainer.policy import PolicyWorker
    from rlhf_orch.trainer.spec import TrainerSpec

    spec = TrainerSpec(
        model_path="unused",
        dtype="float32",
        zero_stage=2,
        micro_batch_size=2,
        train_batch_size=2,
        data_parallel_size=1,
        pad_id=0,
        temperature=1.0,
        lr=1e-4,
        weight_decay=0.0,
        grad_clip=1.0,
        clip_eps=0.2,
        ppo_epochs=1,
        seed=0,
        torch_threads=1,
        optimizer="adamw",
        reference_memory="full",
    )
    ranks = [actor_class(cls).options(num_cpus=0).remote(spec, 0, 1) for cls in (PolicyWorker, CriticWorker)]
    try:
        assert ray.get([r.ping.remote() for r in ranks], timeout=60) == [0, 0]
        before = _count(ranks[0])
        for rank, moves in zip(ranks, (True, False)):  # the policy rank busy, the critic rank hung
            rank.__ray_call__.remote(_phase, 30.0, moves)
        # Asked only once the busy phase counts: on a loaded host (CI's two cores under another
        # worker's runs) both looks of a 2 s wait once landed before the phase's first tick.
        deadline = time.monotonic() + 30
        while (count := _count(ranks[0])) is None or count == before:
            assert time.monotonic() < deadline, "the busy phase never counted"
            time.sleep(0.05)
        assert lost_processes(ranks, timeout_s=2.0) == [1]
    finally:
        for r in ranks:
            ray.kill(r)


class _Rank:
    """A stand-in trainer rank: `take` is a call whose argument is a peer's result."""

    def take(self, value) -> int:
        return resolved(value)

    @ray.method(concurrency_group=MONITOR)
    def progress(self) -> int:
        return 7


def _late(seconds: float) -> int:
    import time

    time.sleep(seconds)
    return 1


@pytest.mark.extended
@pytest.mark.integration
def test_a_call_waiting_for_a_peer_s_result_leaves_progress_answering_when_deferred(shared_ray):
    """Calls of one caller to one actor start in submission order, and Ray starts one only once its
    top-level object refs are resolved: a policy rank's experience call waiting for the critic's
    values held back its `progress` too (the liveness check read no answer). Deferred, the call
    starts at once and fetches the value itself."""
    rank = actor_class(_Rank).options(num_cpus=0).remote()
    late = ray.remote(num_cpus=0)(_late)
    try:
        assert ray.get(rank.progress.remote(), timeout=60) == 7
        held = rank.take.remote(late.remote(6.0))
        assert not ray.wait([rank.progress.remote()], timeout=3.0)[0]  # behind the call that waits for its argument
        ray.get(held, timeout=60)
        taking = rank.take.remote(deferred(late.remote(6.0)))
        assert ray.get(rank.progress.remote(), timeout=3.0) == 7
        assert ray.get(taking, timeout=60) == 1
    finally:
        ray.kill(rank)


def _compiled_frames(engine) -> int:
    """(Inside an engine actor, on the thread its calls run on.) Frames torch.compile has compiled."""
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values())


@pytest.mark.extended
@pytest.mark.integration
def test_a_new_engine_s_first_engine_step_compiles_nothing(shared_ray, tiny_model_path):
    """An eager CPU engine runs vLLM's torch.compile'd sampler helpers eagerly. Its calls run on a
    Ray thread (its `progress` has a concurrency group of its own), and torch's config values are
    per thread: turned off only on the thread that built it, the first engine step of every new
    engine compiled for ~5 s (tens of seconds on a loaded machine), with no step counted -- two
    liveness windows of a small fault.step_timeout_s, and the run restarted."""
    from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngineActor
    from rlhf_orch.transfer.engine_side import RolloutJob
    from rlhf_orch.transfer.plan import whole_prompt_requests

    env = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}}
    spec = EngineSpec(model_path=tiny_model_path, dtype="float32", max_model_len=64, kv_cache_bytes=2**26)
    engine = VLLMEngineActor.options(num_cpus=0, runtime_env=env).remote(spec, 0)
    try:
        job = RolloutJob(
            prompt_ids={0: [1, 5, 6]},
            prompts={0: None},
            samples_per_prompt=2,
            max_tokens=4,
            temperature=1.0,
            scorer=None,
        )
        ray.get(engine.produce_scores.remote(whole_prompt_requests([0], 2), job), timeout=300)
        assert ray.get(engine.progress.remote()) > 0
        assert ray.get(engine.__ray_call__.remote(_compiled_frames)) == 0
    finally:
        ray.kill(engine)
