"""Waiting on the run's actors: `ActorWaits.get` is `ray.get` within fault.step_timeout_s (or waited
for by the actors' progress), each failure turned into the error class the restart decision reads
(`rlhf_orch.orchestration.errors`) with one line naming what was being done."""

from __future__ import annotations

from typing import Any

import ray

from rlhf_orch.liveness import ProgressWatch, no_progress_note
from rlhf_orch.one_line import ROLES, dead_actor, one_line
from rlhf_orch.orchestration.errors import ActorDiedError, ActorTimeoutError, EngineDiedError, StepFailedError


class ActorWaits:
    def __init__(self, step_timeout_s: float):
        self.step_timeout_s = step_timeout_s  # fault.step_timeout_s

    def get(
        self,
        refs: list[ray.ObjectRef],
        what: str,
        engine_call: bool = False,
        timeout: tuple[float, str] | None = None,
        remaining_s: float | None = None,
        progress_of: dict[str, Any] | None = None,
    ) -> list[Any]:
        """`ray.get` within `timeout` (seconds and the config key that sets them; default
        fault.step_timeout_s) or the `remaining_s` of it a caller has left, each failure turned
        into one line naming what was being done. `progress_of` (name -> trainer rank: the ranks
        whose calls `refs` are, and those their calls wait on): waited for by progress instead
        (rlhf_orch.liveness) -- however long, while any of them moves; given up
        once none did over a fault.step_timeout_s window."""
        timeout_s, key = timeout or (self.step_timeout_s, "fault.step_timeout_s")
        try:
            if progress_of is not None and timeout is None and remaining_s is None:
                watch = ProgressWatch(timeout_s, together=True)
                if not watch.all_ready(
                    refs, progress_of, on_ready=ray.get
                ):  # (ray.get: a failure is raised as it comes)
                    raise ActorTimeoutError(
                        f"no answer within {timeout_s:g}s ({key}) while {what}: {no_progress_note(watch.stalled, timeout_s)}"
                    )
            return ray.get(refs, timeout=timeout_s if remaining_s is None else remaining_s)
        except ray.exceptions.RayActorError as e:
            who, why = dead_actor(e)
            who = who or (ROLES["VLLMEngine"] if engine_call else "a trainer or engine process")
            died = EngineDiedError if who == ROLES["VLLMEngine"] else ActorDiedError
            raise died(f"{who} died while {what} ({why})") from e
        except ray.exceptions.GetTimeoutError as e:
            raise ActorTimeoutError(f"no answer within {timeout_s:g}s ({key}) while {what}") from e
        except ray.exceptions.RayTaskError as e:
            # The actor's own exception, in one line (its traceback went to the actor's log).
            cause = e.cause if e.cause is not None else e
            raise StepFailedError(f"{type(cause).__name__} while {what}: {one_line(cause)}") from e
