"""The restart supervisor's decision as a pure function of what failed (no Ray): every branch of
`decide_restart`, the restart line, the engine budget (`engine_restart_refusal`)."""

from __future__ import annotations

from rlhf_orch.orchestration.restart_decision import (
    EXIT_RUNTIME,
    Failure,
    decide_restart,
    engine_restart_refusal,
    failure_signature,
    restart_line,
)

LOST = Failure(
    "ActorDiedError: policy rank 0 died while training the policy",
    lost_process=True,
    stuck=False,
    point=(3, 4, "ActorDiedError: policy rank # died while training the policy"),
)


def test_a_failure_that_lost_no_process_gives_up_with_a_final_checkpoint():
    bug = Failure(
        "StepFailedError: ValueError while scoring", lost_process=False, stuck=False, point=(3, 4, "StepFailedError: x")
    )
    d = decide_restart(bug, [], trainer_restarts_used=0, max_trainer_restarts=3)
    assert (d.restart, d.crash_loop, d.final_checkpoint, d.exact_only) == (False, False, True, False)
    assert d.exit_code == EXIT_RUNTIME and d.give_up_line is None and d.final_note == ""


def test_a_lost_process_with_budget_left_restarts_every_role_keeping_only_an_exact_checkpoint():
    d = decide_restart(LOST, [], trainer_restarts_used=1, max_trainer_restarts=2)
    assert (d.restart, d.crash_loop, d.final_checkpoint, d.exact_only) == (True, False, True, True)
    assert d.exit_code is None and d.give_up_line is None


def test_a_lost_process_with_the_trainer_budget_used_up_gives_up_with_its_own_line():
    d = decide_restart(LOST, [], trainer_restarts_used=2, max_trainer_restarts=2)
    assert (d.restart, d.final_checkpoint, d.exact_only) == (False, True, False)
    assert d.exit_code == EXIT_RUNTIME and d.give_up_line is None
    # No restarts allowed at all (fault.max_trainer_restarts=0): the same.
    assert not decide_restart(LOST, [], trainer_restarts_used=0, max_trainer_restarts=0).restart


def test_the_same_failure_at_the_same_point_is_a_crash_loop():
    d = decide_restart(LOST, [(1, 2, "other"), LOST.point], trainer_restarts_used=1, max_trainer_restarts=3)
    assert (d.restart, d.crash_loop, d.final_checkpoint, d.exact_only) == (False, True, True, False)
    assert d.exit_code == EXIT_RUNTIME
    assert d.give_up_line == (
        "the same failure twice at step 4, so a restart would repeat it: ActorDiedError: policy rank 0 died while "
        "training the policy -- not restarting (1/3 restarts used)"
    )
    between = Failure(LOST.error_line, True, False, (3, None, LOST.point[2]))
    assert decide_restart(between, [between.point], 1, 3).give_up_line.startswith(
        "the same failure twice, so a restart"
    )


def test_a_crash_loop_with_the_budget_used_up_gives_up_with_the_failure_own_line():
    d = decide_restart(LOST, [LOST.point], trainer_restarts_used=3, max_trainer_restarts=3)
    assert (d.restart, d.crash_loop, d.give_up_line) == (False, True, None)


def test_the_same_error_at_another_step_is_restarted():
    moved_on = Failure(LOST.error_line, True, False, (4, 5, LOST.point[2]))
    assert decide_restart(moved_on, [LOST.point], 1, 3).restart


def test_an_actor_that_stopped_answering_gets_no_final_checkpoint():
    hung = Failure(
        "ActorTimeoutError: no answer within 5s", lost_process=True, stuck=True, point=(3, 4, "ActorTimeoutError")
    )
    d = decide_restart(hung, [], 0, 1)
    assert (d.restart, d.final_checkpoint) == (True, False)
    assert d.final_note == "no final checkpoint: an actor stopped answering"
    assert decide_restart(hung, [], 1, 1).final_note == "no final checkpoint: an actor stopped answering"


def test_the_restart_line_names_the_checkpoint_or_the_initial_weights():
    assert (
        restart_line("step 4: ", "E: x", 2, 1, 3)
        == "step 4: E: x -- restarting every role from the checkpoint of step 2 (restart 1/3)"
    )
    assert (
        restart_line("", "E: x", None, 1, 1)
        == "E: x -- restarting every role from the initial weights (no checkpoint yet) (restart 1/1)"
    )


def test_the_engine_budget_refuses_the_first_engine_that_does_not_fit():
    assert engine_restart_refusal([1], "died during step 3", engine_restarts_used=0, max_engine_restarts=1) is None
    assert engine_restart_refusal([0, 2], "lost receiving weight version 4", 1, 2) == (
        "vLLM engine 2 lost receiving weight version 4 and the engine restart budget is used up (fault.max_engine_restarts=2)"
    )
    assert engine_restart_refusal([3], "died", 5, 2).startswith("vLLM engine 3 died and the engine restart budget")


def test_failure_signatures_ignore_numbers():
    assert failure_signature(RuntimeError("rank 3 at 10.0.0.1:6379 pid 4242")) == failure_signature(
        RuntimeError("rank 1 at 10.0.0.2:6380 pid 7")
    )
    assert failure_signature(RuntimeError("a")) != failure_signature(TimeoutError("a"))
