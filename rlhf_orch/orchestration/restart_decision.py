"""What a failed attempt of a run leads to, decided once from a plain description of the failure:
restart every role from the checkpoint, or give up (exit 3, one line), and whether a final
checkpoint is written first. The supervisor (`session.run_training`) reads the facts off the
exception and the actors, then only does what `decide_restart` says. The engine budget
(`engine_restart_refusal`) is the same kind of decision for one engine replaced in place.

Pure: no Ray, no actors; tests/orchestration/test_restart_decision.py covers every branch."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The exit code of a run that gives up after it started (any failure once the run started; app.py).
EXIT_RUNTIME = 3

# What one failed attempt is: (last finished step, step in progress, failure_signature). The same
# triple twice is a crash loop.
FailurePoint = tuple[int, "int | None", str]


@dataclass(frozen=True)
class Failure:
    """One failed attempt, in plain values read off its exception and the run's actors.

    `error_line`: the error in one line (`one_line.named`); `lost_process`: a process of the run
    was lost (dead or not answering) and the failure is of a kind a restart can help (not a NaN,
    an engine budget used up or an actor that did not start: `session.processes_lost`);
    `stuck`: an actor stopped answering (a timeout in the error's chain; a replacement that did not
    start is not one); `point`: where it failed (`FailurePoint`)."""

    error_line: str
    lost_process: bool
    stuck: bool
    point: FailurePoint


@dataclass(frozen=True)
class RestartDecision:
    """`restart`: every role starts again from the last checkpoint (the roles: all of them; an
    engine alone is replaced in place by the loop, never here). Otherwise the run gives up with
    `exit_code` and `give_up_line` (None: the failure's own line stands). `final_checkpoint`:
    write one of the last finished step first (`exact_only`: only one a restart would resume bit
    for bit); `final_note` when none may be written."""

    restart: bool
    crash_loop: bool
    final_checkpoint: bool
    exact_only: bool
    final_note: str
    give_up_line: str | None = None
    exit_code: int | None = None


def decide_restart(
    failure: Failure,
    earlier: list[FailurePoint] | tuple[FailurePoint, ...],
    trainer_restarts_used: int,
    max_trainer_restarts: int,
) -> RestartDecision:
    """The decision for `failure`, given the `earlier` failed attempts of this invocation and the
    trainer restart budget (fault.max_trainer_restarts; `trainer_restarts_used` of it so far).

    A failure that lost no process gives up (a restart would run the same inputs into it again);
    a lost process restarts every role, unless the budget is used up or the same failure came at
    the same point before (a crash loop: CrashLoopError's line)."""
    crash_loop = failure.lost_process and failure.point in earlier
    budget_left = trainer_restarts_used < max_trainer_restarts
    restart = failure.lost_process and not crash_loop and budget_left
    # (an actor that stopped answering may be a trainer: a checkpoint would queue behind its stuck call)
    note = "no final checkpoint: an actor stopped answering" if failure.stuck else ""
    give_up_line = None
    if failure.lost_process and budget_left and crash_loop:
        in_step = failure.point[1]
        give_up_line = (
            f"the same failure twice{f' at step {in_step}' if in_step is not None else ''}, "
            f"so a restart would repeat it: {failure.error_line} -- not restarting "
            f"({trainer_restarts_used}/{max_trainer_restarts} restarts used)"
        )
    return RestartDecision(
        restart=restart,
        crash_loop=crash_loop,
        final_checkpoint=not failure.stuck,
        exact_only=restart,
        final_note=note,
        give_up_line=give_up_line,
        exit_code=None if restart else EXIT_RUNTIME,
    )


def restart_line(
    where: str, error_line: str, resume_step: int | None, trainer_restarts_used: int, max_trainer_restarts: int
) -> str:
    """The console line of a restart (`where`: "step N: " or empty)."""
    source = (
        f"the checkpoint of step {resume_step}"
        if resume_step is not None
        else "the initial weights (no checkpoint yet)"
    )
    return (
        f"{where}{error_line} -- restarting every role from {source} "
        f"(restart {trainer_restarts_used}/{max_trainer_restarts})"
    )


def engine_restart_refusal(
    engines: list[int], what: str, engine_restarts_used: int, max_engine_restarts: int
) -> str | None:
    """Replacing `engines` (each one charged to fault.max_engine_restarts, `engine_restarts_used`
    of it so far): None when they fit, else EngineRestartBudgetError's line, naming the first
    engine that does not fit."""
    allowed = max_engine_restarts - engine_restarts_used
    if len(engines) <= allowed:
        return None
    return (
        f"vLLM engine {engines[max(allowed, 0)]} {what} and the engine restart budget is used up "
        f"(fault.max_engine_restarts={max_engine_restarts})"
    )


def failure_signature(error: BaseException) -> str:
    """What makes two failures the same (a crash loop): the error's type and message with its
    numbers taken out (process ids, ports, addresses and timings differ between attempts; the
    role, the phase and the cause do not)."""
    return f"{type(error).__name__}: {re.sub(r'[0-9a-f]{8,}|[0-9]+(?:[.][0-9]+)?', '#', str(error))}"
