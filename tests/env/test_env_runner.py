"""Multi-turn trajectories without an engine: token in / token out, loss masks, limits, counters,
trajectories that progress independently (a scripted generator stands in for vLLM)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.turn_driver.runner import EnvRuntimeError, MultiTurnRunner, TurnOutput
from rlhf_orch.env.turn_driver.trajectory import Trajectory, TrajectoryLimits


class ScriptedGenerator:
    """Turn t of trajectory k is [k, t, 7] (logprobs -0.5 each), unless `script` says otherwise;
    finishes one queued turn per poll, in submission order."""

    def __init__(self, script=None):
        self.queue: list[tuple[int, list[int], int, int]] = []
        self.submitted: list[tuple[int, int]] = []
        self.contexts: dict[tuple[int, int], list[int]] = {}
        self.max_tokens: dict[tuple[int, int], int] = {}  # what each turn was allowed to generate
        self.script = script or {}

    def submit(self, key, context, max_tokens, turn):
        self.max_tokens[(key, turn)] = max_tokens
        self.queue.append((key, list(context), max_tokens, turn))
        self.submitted.append((key, turn))
        self.contexts[(key, turn)] = list(context)

    def busy(self):
        return bool(self.queue)

    def poll(self):
        key, _, max_tokens, turn = self.queue.pop(0)
        ids = self.script.get((key, turn), [key, turn, 7])
        return [TurnOutput(key, ids[:max_tokens], [-0.5] * len(ids[:max_tokens]), len(ids) > max_tokens)]

    def decode(self, ids):
        return " ".join(map(str, ids))

    def abort(self, keys):
        self.aborted = [*getattr(self, "aborted", []), *keys]
        self.queue = [q for q in self.queue if q[0] not in keys]


class CountdownEnv:
    """Answers every turn with the observation [obs] for `turns` turns, reward = turn number."""

    def __init__(self, turns=3, obs="x", delay=0.0, fail_at=None):
        self.turns, self.obs, self.delay, self.fail_at = turns, obs, delay, fail_at
        self.seen: list[str] = []
        self.closed = False

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.seen.append(action)
        if self.delay:
            time.sleep(self.delay)
        if self.fail_at == len(self.seen):
            raise ValueError("the model's action broke me")
        done = len(self.seen) >= self.turns
        obs = [] if done else [{"role": "tool", "content": self.obs}]
        return {"observations": obs, "reward": float(len(self.seen)), "done": done, "metadata": {"tool_calls": 1}}

    def close(self):
        self.closed = True


class OneTokenPerMessage:
    """A stand-in `Rendering` without a template: each message one token (900 + its length)."""

    format = "plain"

    def observation(self, messages, turn_closed, max_tokens):
        ids = [900 + len(str(m["content"])) for m in messages]
        return SimpleNamespace(
            ids=ids[:max_tokens],
            truncated=len(ids) > max_tokens,
            messages=list(messages)[:max_tokens],
            closing_added=False,
        )

    def closes_turn(self, ids):
        return bool(ids) and ids[-1] == 7

    def prompt(self, messages):
        return [60 + len(messages)]

    def renders_prompts(self):
        return False


render = OneTokenPerMessage()


def limits(turns=4, per_turn=8, total=64, obs=16):
    return TrajectoryLimits(turns, per_turn, total, obs)


def run(envs, generator=None, lim=None, concurrency=8, timeout=5.0, prompts=None):
    generator = generator or ScriptedGenerator()
    made = iter(envs)
    runner = MultiTurnRunner(lambda p: next(made), generator, render, lim or limits(), concurrency, timeout)
    items = prompts or [(i, Prompt(text=f"p{i}"), [50, 51]) for i in range(len(envs))]
    return list(runner.run(items)), generator


def test_tokens_are_kept_as_generated_and_observations_are_masked_context():
    env = CountdownEnv(turns=3)
    (t,), gen = run([env])
    # turn 0, observation, turn 1, observation, turn 2 (done: no observation after the last turn)
    assert t.response_ids == [0, 0, 7, 901, 0, 1, 7, 901, 0, 2, 7]
    assert t.loss_mask == [1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1]
    assert t.logprobs == [-0.5] * 3 + [0.0] + [-0.5] * 3 + [0.0] + [-0.5] * 3
    # each turn continues from exactly the ids so far: nothing re-tokenised
    assert gen.contexts[(0, 1)] == [50, 51, 0, 0, 7, 901]
    assert env.seen == ["0 0 7", "0 1 7", "0 2 7"] and env.closed
    assert t.reward("last") == 3.0 and t.reward("sum") == 6.0
    assert t.counts.turns == 3 and t.counts.tool_calls == 3  # summed from each step's metadata
    assert not t.truncated


def test_runner_sums_tool_counters_from_step_metadata():
    (t,), _ = run([CountdownEnv(turns=2)])
    assert t.counts.tool_calls == 2 and t.counts.observation_tokens == 1


def test_max_turns_ends_a_trajectory_truncated_without_a_trailing_observation():
    (t,), _ = run([CountdownEnv(turns=10)], lim=limits(turns=2))
    assert t.counts.turns == 2 and t.truncated and t.loss_mask[-1] == 1


def test_the_whole_trajectory_stays_within_the_response_budget():
    (t,), gen = run([CountdownEnv(turns=10)], lim=limits(turns=10, per_turn=8, total=9))
    assert len(t.response_ids) <= 9 and t.truncated
    # each turn may generate what is left of the 9 tokens after the context so far (2 prompt tokens), at most 8
    assert len(gen.max_tokens) >= 2
    for (key, turn), allowed in gen.max_tokens.items():
        assert allowed == min(8, 9 - (len(gen.contexts[(key, turn)]) - 2)), (turn, allowed)


def test_long_observations_are_cut_and_counted():
    class Long(CountdownEnv):
        def step(self, action):
            out = super().step(action)
            out["observations"] = [{"role": "tool", "content": "a"}] * 5 if not out["done"] else []
            return out

    (t,), _ = run([Long(turns=2)], lim=limits(obs=3))
    assert t.loss_mask.count(0) == 3 and t.counts.observations_truncated == 1


def test_a_slow_environment_does_not_hold_the_other_trajectories():
    slow, fast = CountdownEnv(turns=2, delay=0.6), CountdownEnv(turns=3)
    done_order = []
    generator = ScriptedGenerator()
    made = iter([slow, fast])
    runner = MultiTurnRunner(lambda p: next(made), generator, render, limits(), 8, 5.0)
    t0 = time.monotonic()
    for t in runner.run([(0, Prompt(text="a"), [1]), (1, Prompt(text="b"), [1])]):
        done_order.append((t.index, time.monotonic() - t0))
    # the fast trajectory played all three turns while the slow one's first step was running
    assert done_order[0][0] == 1 and done_order[0][1] < 0.6
    assert [i for i, _ in done_order] == [1, 0]


def test_concurrency_bounds_trajectories_in_flight():
    live, peak = set(), [0]
    lock = threading.Lock()

    class Tracked(CountdownEnv):
        def init(self, prompt):
            with lock:
                live.add(id(self))
                peak[0] = max(peak[0], len(live))
            return prompt, {}

        def close(self):
            live.discard(id(self))

    out, _ = run([Tracked(turns=2) for _ in range(6)], concurrency=2)
    assert len(out) == 6 and peak[0] == 2


def test_a_raising_step_ends_its_trajectory_and_is_counted():
    out, _ = run([CountdownEnv(turns=3, fail_at=2), CountdownEnv(turns=2)])
    broken = next(t for t in out if t.index == 0)
    assert broken.counts.env_errors == 1 and broken.truncated and broken.turn_rewards == [1.0, 0.0]
    assert next(t for t in out if t.index == 1).counts.env_errors == 0


def test_a_hanging_step_times_out_and_the_rollout_finishes():
    t0 = time.monotonic()
    out, _ = run([CountdownEnv(turns=2, delay=30.0), CountdownEnv(turns=2)], timeout=0.5)
    assert time.monotonic() - t0 < 5
    hung = next(t for t in out if t.index == 0)
    assert hung.counts.env_timeouts == 1 and hung.truncated


class SpinningEnv(CountdownEnv):
    """Its first step never returns: a Python loop (what a hung tool written in Python does)."""

    def step(self, action):
        self.seen.append(action)
        while True:
            pass


def test_a_hung_step_holds_no_worker_and_a_later_step_gets_its_whole_timeout():
    """One trajectory at a time (env.concurrency=1): the first one's step hangs, is given up at the
    timeout, and the next trajectory's steps still run -- each timed from its own start, not queued
    behind the hung one (which a fixed pool of one thread would do: they would time out unstarted)."""
    out, _ = run([CountdownEnv(turns=2, delay=3.0), CountdownEnv(turns=2, delay=0.2)], concurrency=1, timeout=1.0)
    hung, later = sorted(out, key=lambda t: t.index)
    assert hung.counts.env_timeouts == 1 and hung.truncated
    assert later.counts.env_timeouts == 0 and later.turn_rewards == [1.0, 2.0] and not later.truncated


def test_a_step_spinning_in_python_is_stopped_when_given_up():
    before = set(threading.enumerate())
    out, _ = run([SpinningEnv(turns=2)], timeout=0.5)
    assert out[0].counts.env_timeouts == 1
    deadline = time.monotonic() + 5
    while (new := [t for t in threading.enumerate() if t not in before]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not new  # the spinning thread ended (Abandoned raised in it)


def test_a_prompt_rewritten_by_init_past_data_prompt_max_len_is_refused_naming_the_sample():
    class LongInit(CountdownEnv):
        def init(self, prompt):
            return [{"role": "system", "content": "s"}] * 20 + list(prompt), {}  # 21 messages

    class TokenPerMessage(OneTokenPerMessage):
        def prompt(self, messages):
            return [60] * len(messages)

    def runner(longest, envs):
        made = iter(envs)
        return MultiTurnRunner(
            lambda p: next(made),
            ScriptedGenerator(),
            TokenPerMessage(),
            TrajectoryLimits(4, 8, 64, 16, max_prompt_tokens=longest),
            8,
            5.0,
        )

    items = [(i, Prompt(text=f"p{i}"), [50, 51]) for i in range(2)]
    done = list(runner(21, [CountdownEnv(), LongInit()]).run(items))  # at the limit: runs
    assert sorted(len(t.prompt_ids) for t in done) == [2, 21]
    with pytest.raises(
        EnvRuntimeError,
        match=r"sample 1: the environment's init made the prompt 21 tokens, more than data.prompt_max_len=20",
    ):
        list(runner(20, [CountdownEnv(), LongInit()]).run(items))

    class WithTools(TokenPerMessage):  # env.chat_template_kwargs (tools) re-render every prompt, longer
        def prompt(self, messages):
            return [60] * 30

        def renders_prompts(self):
            return True

    tools = MultiTurnRunner(
        lambda p: CountdownEnv(),
        ScriptedGenerator(),
        WithTools(),
        TrajectoryLimits(4, 8, 64, 16, max_prompt_tokens=20),
        8,
        5.0,
    )
    with pytest.raises(
        EnvRuntimeError, match=r"sample 0: the chat template with env.chat_template_kwargs made the prompt 30 tokens"
    ):
        list(tools.run(items))


def test_a_failed_rollout_stops_the_turns_it_left_generating():
    submitted = threading.Event()

    class Broken(CountdownEnv):
        def init(self, prompt):
            submitted.wait(10)  # (environments start on threads of their own: fail once trajectory 0 generates)
            raise KeyError("db_id")

    class Generator(ScriptedGenerator):  # a turn, once submitted, stays in flight
        def submit(self, *args):
            super().submit(*args)
            submitted.set()

        def poll(self):
            return []

    generator = Generator()
    made = iter([CountdownEnv(), Broken()])
    runner = MultiTurnRunner(lambda p: next(made), generator, render, limits(), 8, 5.0)
    with pytest.raises(EnvRuntimeError):
        list(runner.run([(i, Prompt(text=f"p{i}"), [50, 51]) for i in range(2)]))
    assert generator.submitted == [(0, 0)] and generator.aborted == [0]  # trajectory 0's first turn, in flight


def test_an_environment_that_cannot_start_names_the_sample():
    class Broken(CountdownEnv):
        def init(self, prompt):
            raise KeyError("reward_spec")

    with pytest.raises(EnvRuntimeError, match="sample 0 could not start: KeyError"):
        run([Broken()])


def test_trajectory_refuses_mismatched_logprobs():
    t = Trajectory(0, [1], limits())
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        t.add_turn([1, 2], [0.0], False)


def test_async_def_init_and_step_are_awaited():
    """An environment written with `async def init` / `async def step` (an HTTP tool client, say)."""
    import asyncio

    class AsyncCountdown(CountdownEnv):
        async def init(self, prompt):
            await asyncio.sleep(0)
            return prompt, {}

        async def step(self, action):
            await asyncio.sleep(0.01)
            return CountdownEnv.step(self, action)

    (t,), _ = run([AsyncCountdown(turns=2)])
    assert t.counts.turns == 2 and t.counts.env_errors == 0 and t.turn_rewards == [1.0, 2.0] and not t.truncated


@pytest.mark.parametrize("mask_failed, mask_truncated", [(False, False), (True, False), (False, True), (True, True)])
def test_failed_or_truncated_trajectories_can_train_nothing(mask_failed, mask_truncated):
    """env.mask_failed masks a trajectory whose step raised; env.mask_truncated one that a limit cut
    (here env.max_turns) -- each only its own kind."""
    from rlhf_orch.env.lookup import LookupEnv

    env = LookupEnv(mask_failed=mask_failed, mask_truncated=mask_truncated)
    out, _ = run([CountdownEnv(turns=3, fail_at=1), CountdownEnv(turns=9), CountdownEnv(turns=1)], lim=limits(turns=2))
    broken, cut, fine = sorted(out, key=lambda t: t.index)
    assert broken.counts.env_errors == 1 and cut.counts.env_errors == 0 and cut.truncated and not fine.truncated
    assert env.masks_out(broken) == mask_failed
    assert env.masks_out(cut) == mask_truncated
    assert not env.masks_out(fine)
    fine.counts.init_timeouts = 1  # an environment that never started: nothing to train, whatever the keys
    assert env.masks_out(fine)


def test_vllm_turns_keep_the_stop_string_in_the_turn():
    """env.stop reaches vLLM with include_stop_str_in_output: the turn holds `</sql>` (SkyRL keeps it)."""
    from rlhf_orch.engines.turns import VLLMTurns

    class FakeLLM:
        llm_engine = SimpleNamespace(has_unfinished_requests=lambda: True)

        def __init__(self):
            self.params = []

        def get_tokenizer(self):
            return None

        def enqueue(self, prompts, params, use_tqdm=False):
            self.params += params
            return ["0-0"]

    llm = FakeLLM()
    VLLMTurns(llm, 0.7, step_seed=1, stop=["</sql>"]).submit(0, [1, 2], 8, 0)
    (params,) = llm.params
    assert params.stop == ["</sql>"] and params.include_stop_str_in_output and params.temperature == 0.7


def test_turn_rewards_are_placed_on_each_turn_s_last_model_token():
    """env.reward=per_turn's field: step k's reward on turn k's last token, after an environment
    shortened the turn (skyrl-gym's postprocessed_action) on the new last token, and a turn with no
    token of its own on the model token before it."""
    from rlhf_orch.env.turn_driver.trajectory import Trajectory

    t = Trajectory(0, [1, 2], limits())
    t.add_turn([10, 11, 12], [0.0] * 3, hit_length=False)
    t.turn_rewards.append(0.25)
    t.shorten_last_turn(2)  # the environment used "10 11" only
    assert t.add_observation([90, 91])
    t.add_turn([], [], hit_length=False)  # an empty turn (EOS only, dropped by the engine)
    t.turn_rewards.append(0.5)
    assert t.add_observation([92])
    t.add_turn([13, 14], [0.0] * 2, hit_length=False)
    t.turn_rewards.append(1.0)
    assert t.response_ids == [10, 11, 90, 91, 92, 13, 14]
    assert t.turn_reward_field() == [0.0, 0.75, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert t.reward("per_turn") == t.reward("sum") == 1.75 and t.reward("last") == 1.0


# --------------------------------------------------------------------------- deadlines of env.make / init / close / get_metrics
class Hangs:
    """Sleeps in short naps until released or 30 s pass (a hung call: `Abandoned` ends the naps)."""

    def __init__(self):
        self.released = threading.Event()

    def __call__(self):
        deadline = time.monotonic() + 30
        while not self.released.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)


class HangingLifecycle(CountdownEnv):
    """A CountdownEnv whose `init`, `close` or `get_metrics` (named by `where`) hangs."""

    def __init__(self, where, hang, **kw):
        super().__init__(**kw)
        self.where, self.hang = where, hang

    def init(self, prompt):
        if self.where == "init":
            self.hang()
        return prompt, {}

    def close(self):
        if self.where == "close":
            self.hang()
        self.closed = True

    def get_metrics(self):
        if self.where == "get_metrics":
            self.hang()
        return {"steps": len(self.seen)}


class PlaceholderRender(OneTokenPerMessage):
    def end_of_turn_id(self):
        return 7


@pytest.mark.parametrize("where", ["make", "init"])
def test_a_hung_make_or_init_ends_its_trajectory_counted_and_the_others_go_on(where):
    """env.make / env.init past the step deadline (env.tool_timeout_s): that trajectory ends before
    its first turn -- one end-of-turn token, masked out, reward 0, counted in env/init_timeouts --
    and the other trajectories play meanwhile (the call runs on a thread of its own)."""
    hang = Hangs()
    envs = {0: CountdownEnv(turns=2), 1: HangingLifecycle(where, hang, turns=2), 2: CountdownEnv(turns=3)}

    def make(prompt):
        index = int(prompt.text[1:])
        if where == "make" and index == 1:
            hang()
        return envs[index]

    generator = ScriptedGenerator()
    runner = MultiTurnRunner(make, generator, PlaceholderRender(), limits(), 8, 1.0)
    t0 = time.monotonic()
    finished = []
    try:
        for t in runner.run([(i, Prompt(text=f"p{i}"), [50, 51]) for i in range(3)]):
            finished.append(t)
    finally:
        hang.released.set()
    assert time.monotonic() - t0 < 20  # (the hang lasts 30 s unless given up)
    out = {t.index: t for t in finished}
    hung = out[1]
    assert hung.counts.init_timeouts == 1 and hung.done and hung.truncated and hung.counts.turns == 0
    assert hung.response_ids == [7] and hung.loss_mask == [0] and hung.logprobs == [0.0] and hung.reward("last") == 0.0
    assert out[0].turn_rewards == [1.0, 2.0] and out[2].turn_rewards == [1.0, 2.0, 3.0]
    assert [t.index for t in finished][-1] == 1  # the others played while it hung
    assert (0, 0) in generator.submitted and (1, 0) not in generator.submitted


def test_an_environment_whose_init_was_given_up_is_closed_after_init_ends_not_beside_it():
    """env.init sleeps past the deadline inside one C call (`Abandoned` can only land once it
    returns): the trajectory is given up at the deadline, and the environment's close waits for
    the abandoned init to end instead of running beside it on another thread."""
    events: list[str] = []

    class SlowInit(CountdownEnv):
        def init(self, prompt):
            try:
                time.sleep(1.5)  # one C call: past the 1 s deadline
            finally:  # (Abandoned lands as the sleep returns)
                events.append("init ended")
            return prompt, {}

        def close(self):
            events.append("close")

    envs = iter([SlowInit(turns=1), CountdownEnv(turns=1)])
    runner = MultiTurnRunner(lambda prompt: next(envs), ScriptedGenerator(), PlaceholderRender(), limits(), 8, 1.0)
    out = list(runner.run([(i, Prompt(text=f"p{i}"), [50, 51]) for i in range(2)]))
    time.sleep(1.0)  # (past the end of the abandoned init in any case)
    assert {t.index: t.counts.init_timeouts for t in out} == {0: 1, 1: 0}
    assert events == ["init ended", "close"]  # not close, then init


@pytest.mark.parametrize("where", ["close", "get_metrics"])
def test_a_hung_close_or_get_metrics_is_given_up_counted_and_the_rollout_finishes(where):
    """env.close / env.get_metrics past the deadline: given up, counted in env/close_timeouts; the
    trajectory keeps its turns and rewards, the rollout finishes."""
    hang = Hangs()
    envs = [HangingLifecycle(where, hang, turns=2), CountdownEnv(turns=2)]
    t0 = time.monotonic()
    try:
        out, _ = run(envs, timeout=1.0)
    finally:
        hang.released.set()
    assert time.monotonic() - t0 < 20  # (the hang lasts 30 s unless given up)
    hung, fine = sorted(out, key=lambda t: t.index)
    assert hung.counts.close_timeouts == 1 and hung.turn_rewards == [1.0, 2.0] and not hung.truncated
    assert fine.counts.close_timeouts == 0 and envs[1].closed
