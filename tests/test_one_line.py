"""Failures in one plain line (rlhf_orch/one_line.py): Ray's multi-line errors, colour codes and
traceback fragments reduced to what happened and who it happened to."""

from __future__ import annotations

from rlhf_orch.one_line import dead_actor, named, one_line

RAY_ACTOR_DIED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: PolicyWorker\n\tactor_id: 2eeca5\n"
    "\tpid: 17138\n\tnamespace: 13f2\n\tip: 127.0.0.1\nThe actor is dead because it was killed by `ray.kill`."
)
RAY_TASK_ERROR = (
    "\x1b[36mray::PolicyWorker.run_weight_sync()\x1b[39m (pid=1, ip=127.0.0.1)\n"
    'Traceback (most recent call last):\n  File "x.py", line 3, in send\n    raise WeightSyncError(...)\n'
    "rlhf_orch.sync.base.WeightSyncError: weight broadcast from policy rank 0 failed"
)


class WrappedTaskError(Exception):
    """What ray.exceptions.RayTaskError looks like here: the actor's exception as `cause`."""

    def __init__(self, cause: BaseException):
        super().__init__(RAY_TASK_ERROR)
        self.cause = cause


def test_a_dead_actor_is_named_by_its_role_and_why():
    assert dead_actor(RuntimeError(RAY_ACTOR_DIED)) == ("a policy rank", "it was killed by `ray.kill`")
    assert one_line(RuntimeError(RAY_ACTOR_DIED)) == "The actor is dead because it was killed by `ray.kill`."


def test_a_task_error_is_its_cause_without_colour_codes_or_traceback():
    error = WrappedTaskError(ValueError("weight broadcast from policy rank 0 failed\nmore detail"))
    assert named(error) == "ValueError: weight broadcast from policy rank 0 failed"
    # Ray's text of it: the exception line that ends the remote traceback, nothing of the frames
    assert one_line(RAY_TASK_ERROR) == "rlhf_orch.sync.base.WeightSyncError: weight broadcast from policy rank 0 failed"
    assert one_line("x" * 1000).endswith("...") and len(one_line("x" * 1000)) == 400
