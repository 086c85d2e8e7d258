"""Scoring batches under errors, timeouts and bad return values: inline, off the main thread, and in a Ray pool."""

from __future__ import annotations

import math
import os
import signal
import sys
import textwrap
import threading
import time

import pytest

from rlhf_orch.reward.base import Response, RewardError, RewardFunction
from rlhf_orch.reward.custom import CustomReward
from rlhf_orch.reward.execution import ScoredBatch, score_batch

from rlhf_orch.data.base import Prompt


def _batch(*texts: str):
    return [Prompt(text=f"q{i}", label="1") for i in range(len(texts))], [Response(t, 1, False) for t in texts]


class ByText(RewardFunction):
    """len(text), except: "boom" raises, "slow" sleeps, "spin" loops forever, "nan"/"str" return junk."""

    name = "by_text"

    def score(self, prompt, response):
        text = response.text
        if text == "boom":
            raise ValueError("boom at scoring")
        if text == "slow":
            time.sleep(5)
        if text == "spin":
            while True:
                pass
        if text == "nan":
            return math.nan
        if text == "str":
            return "1.0"
        if text == "swallow":  # catches the timeout and returns promptly: still a timeout
            try:
                time.sleep(5)
            except BaseException:
                return 1.0
        return float(len(text))


def test_errors_are_counted_and_the_rest_scored():
    prompts, responses = _batch("ab", "boom", "abcd", "boom")
    out = score_batch(ByText(), prompts, responses, timeout_s=5.0)
    assert isinstance(out, ScoredBatch)
    assert out.scores == [2.0, 0.0, 4.0, 0.0]
    assert (out.errors, out.timeouts) == (2, 0)
    assert out.first_error == "sample 1: ValueError('boom at scoring')"


@pytest.mark.parametrize("slow", ["slow", "spin", "swallow"])
def test_a_sample_past_the_timeout_scores_zero(slow):
    prompts, responses = _batch("a", slow, "abc")
    start = time.monotonic()
    out = score_batch(ByText(), prompts, responses, timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    assert out.scores == [1.0, 0.0, 3.0]
    assert (out.errors, out.timeouts) == (0, 1)
    assert out.first_error == "sample 1: timed out after 0.3 s"


def test_the_function_can_ask_for_a_tighter_timeout():
    fn = ByText()
    fn.timeout_s = 0.2
    start = time.monotonic()
    out = score_batch(fn, *_batch("slow"), timeout_s=60.0)
    assert out.timeouts == 1 and time.monotonic() - start < 2.0


def test_previous_alarm_handler_and_timer_are_restored():
    fired = []

    def outer(signum, frame):
        fired.append(signum)

    old = signal.signal(signal.SIGALRM, outer)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        score_batch(ByText(), *_batch("slow", "a"), timeout_s=0.2)
        assert signal.getsignal(signal.SIGALRM) is outer
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 28.0 < remaining < 30.0
        assert fired == []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("bad, shown", [("nan", "nan"), ("str", "'1.0'")])
def test_a_non_number_stops_the_run(bad, shown):
    prompts, responses = _batch("a", "b", bad)
    with pytest.raises(RewardError) as info:
        score_batch(ByText(), prompts, responses, timeout_s=5.0)
    message = str(info.value)
    assert f"reward 'by_text' returned {shown} for sample 2 (response '{bad}')" in message


def test_numpy_and_bool_results_are_numbers():
    import numpy as np

    class Numpy(RewardFunction):
        name = "numpy"

        def score(self, prompt, response):
            return {"f": np.float32(0.25), "b": np.bool_(True), "0d": np.array(2.0), "i": True}[response.text]

    out = score_batch(Numpy(), *_batch("f", "b", "0d", "i"), timeout_s=5.0)
    assert out.scores == [0.25, 1.0, 2.0, 1.0]
    assert all(type(x) is float for x in out.scores)

    class OneD(RewardFunction):
        name = "one_d"

        def score(self, prompt, response):
            return np.array([1.0])  # a 1-element array is not a scalar reward

    with pytest.raises(RewardError, match=r"returned array\(\[1\.\]\) for sample 0"):
        score_batch(OneD(), *_batch("x"), timeout_s=5.0)


def test_a_dict_without_score_stops_the_run(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def compute_score(solution_str):\n    return {'acc': 1.0}\n")
    with pytest.raises(RewardError, match="returned a dict without a 'score' key for sample 0"):
        score_batch(CustomReward(str(path), "compute_score"), *_batch("x"), timeout_s=5.0)


def test_off_the_main_thread_a_watchdog_times_samples_out():
    """Signals only reach the main thread, and every engine scores on another (its liveness check
    has a thread of its own): there a watchdog raises the timeout into the scoring thread. A Python
    loop stops at the deadline; a sleep ends first, then counts as timed out; the rest is scored
    and nothing is raised into the thread afterwards."""

    class Sleepy(RewardFunction):
        name = "sleepy"

        def score(self, prompt, response):
            if response.text == "nap":
                time.sleep(0.3)
            return ByText().score(prompt, response)

    result: list = []
    took: list = []

    def score_off_main() -> None:
        start = time.monotonic()
        result.append(score_batch(Sleepy(), *_batch("a", "spin", "nap", "abc"), timeout_s=0.2))
        took.append(time.monotonic() - start)
        time.sleep(0.5)  # a late watchdog would raise here
        took.append("no late timeout")

    worker = threading.Thread(
        target=score_off_main, daemon=True
    )  # (a verifier that never stops must not hang the suite)
    worker.start()
    worker.join(20)
    assert result[0].scores == [1.0, 0.0, 0.0, 3.0] and result[0].timeouts == 2
    assert took[0] < 2.0 and took[1] == "no late timeout"


def _user_file(tmp_path) -> str:
    path = tmp_path / "user_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            import os
            import time

            def compute_score(data_source, solution_str, ground_truth, extra_info=None):
                if solution_str == "boom":
                    return 1 / 0
                if solution_str == "spin":
                    while True:
                        pass
                if solution_str == "stubborn":  # swallows the alarm: only killing the worker stops it
                    with open(__file__ + ".pid", "w") as f:
                        f.write(str(os.getpid()))
                    while True:
                        try:
                            while True:
                                pass
                        except BaseException:
                            pass
                return float(len(solution_str))

            def batched(data_sources, solution_strs, ground_truths, extra_infos):
                if "boom" in solution_strs:
                    raise KeyError("boom")
                if "slow" in solution_strs:
                    time.sleep(5)
                return [len(s) for s in solution_strs]
            """
        )
    )
    return str(path)


def test_batched_function_is_one_timed_call(tmp_path):
    fn = CustomReward(_user_file(tmp_path), "batched", batched=True)
    assert score_batch(fn, *_batch("a", "bcd"), timeout_s=1.0).scores == [1.0, 3.0]
    out = score_batch(fn, *_batch("a", "boom", "cc"), timeout_s=1.0)
    assert out.scores == [0.0] * 3 and (out.errors, out.timeouts) == (3, 0)
    assert out.first_error.startswith(f"{fn.path}:") and "KeyError: 'boom'" in out.first_error
    start = time.monotonic()
    out = score_batch(fn, *_batch("a", "slow"), timeout_s=0.25)  # the whole call gets 2 x 0.25 s
    assert out.scores == [0.0, 0.0] and (out.errors, out.timeouts) == (0, 2)
    assert 0.4 < time.monotonic() - start < 2.0


def test_every_sample_scored_counts_as_it_goes():
    """`on_scored` is the engine's liveness count (`VLLMEngine.progress`): called after every
    sample, those that raise or time out included, so a slow verifier keeps the engine moving."""
    seen = []

    class Counting(ByText):
        def score(self, prompt, response):
            seen.append(len(ticks))  # the count when this sample starts
            return super().score(prompt, response)

    ticks: list[int] = []
    out = score_batch(
        Counting(), *_batch("ab", "boom", "slow", "abc"), timeout_s=0.25, on_scored=lambda: ticks.append(1)
    )
    assert (out.errors, out.timeouts) == (1, 1) and len(ticks) == 4 and seen == [0, 1, 2, 3]


def test_a_batched_function_counts_once_when_its_call_returns(tmp_path):
    ticks: list[int] = []
    fn = CustomReward(_user_file(tmp_path), "batched", batched=True)
    assert score_batch(fn, *_batch("a", "bcd"), timeout_s=1.0, on_scored=lambda: ticks.append(1)).scores == [1.0, 3.0]
    assert ticks == [1]


def test_arguments_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="timeout_s"):
        score_batch(ByText(), *_batch("a"), timeout_s=0)
    with pytest.raises(ValueError, match="pool_size"):
        score_batch(ByText(), *_batch("a"), timeout_s=1.0, pool_size=-1)
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="Ray is not initialised"):
        score_batch(ByText(), *_batch("a"), timeout_s=1.0, pool_size=2)


# ----------------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False)
    # Test-module classes travel by value: workers need not import `tests`.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield ray
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _probe_thread():
    return threading.current_thread() is threading.main_thread()


@pytest.mark.integration
def test_ray_pool(ray_local, tmp_path):
    ray = ray_local
    fn = CustomReward(_user_file(tmp_path), "compute_score")

    # What execution.py relies on: plain actors' methods and tasks run in the worker's main thread.
    @ray.remote(num_cpus=0)
    class Engine:
        def main_thread(self):
            return _probe_thread()

        def score(self, fn, prompts, responses):
            return score_batch(fn, prompts, responses, timeout_s=0.5)

    engine = Engine.remote()
    assert ray.get(engine.main_thread.remote()) is True
    assert ray.get(ray.remote(num_cpus=0)(_probe_thread).remote()) is True
    # ... so an engine scoring inline gets the per-sample timeout.
    out = ray.get(engine.score.remote(fn, *_batch("ab", "spin", "c")))
    assert out.scores == [2.0, 0.0, 1.0] and out.timeouts == 1

    prompts, responses = _batch("a", "bb", "boom", "ccc", "spin", "dddd", "eeeee")
    out = score_batch(fn, prompts, responses, timeout_s=0.5, pool_size=3)
    assert out.scores == [1.0, 2.0, 0.0, 3.0, 0.0, 4.0, 5.0]
    assert (out.errors, out.timeouts) == (1, 1)
    assert out.first_error.startswith(f"sample 2: {fn.path}:7: ZeroDivisionError")

    # A verifier that swallows the alarm: its task is killed at timeout_s * chunk + grace. Waiting
    # for it within that deadline counts as the engine's progress, at least every POOL_PROGRESS_S.
    start, ticks = time.monotonic(), []
    out = score_batch(
        fn,
        *_batch("a", "stubborn", "bb", "ccc"),
        timeout_s=0.5,
        pool_size=2,
        grace_s=3.0,
        on_scored=lambda: ticks.append(1),
    )
    assert time.monotonic() - start < 3.0 + 2 * 0.5 + 3.0
    assert len(ticks) >= 3  # the killed task's 4 s, a count at least every second
    assert out.scores == [0.0, 0.0, 2.0, 3.0]  # the whole killed chunk scores 0
    assert (out.errors, out.timeouts) == (0, 2)
    assert "pool task killed" in out.first_error
    pid = int(open(fn.path + ".pid").read())
    deadline = time.monotonic() + 5.0
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the hung worker process was not killed"

    # A bad return value inside a task still stops the run, naming the batch index.
    class Bad(RewardFunction):
        name = "bad"

        def score(self, prompt, response):
            return None if response.text == "x" else 1.0

    with pytest.raises(RewardError, match="reward 'bad' returned None for sample 2"):
        score_batch(Bad(), *_batch("a", "b", "x"), timeout_s=5.0, pool_size=2)
