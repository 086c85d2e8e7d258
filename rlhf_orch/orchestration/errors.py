"""What a step's waits on the run's actors raise: each failure a class the restart decision reads
(`session.processes_lost` -> `restart_decision.decide_restart`: a lost process restarts the run, a
failure a restart cannot help ends it)."""

from __future__ import annotations


class ActorDiedError(RuntimeError):
    """A process of the run (an engine, a trainer rank) died while the run waited on it."""


class EngineDiedError(ActorDiedError):
    """A vLLM engine died mid-run."""


class EngineRestartBudgetError(EngineDiedError):
    """An engine died and fault.max_engine_restarts are used up: the run does not restart for it."""


class StepFailedError(RuntimeError):
    """An actor raised while working on a step (a reward returning NaN, a bad batch, ...)."""


class ActorTimeoutError(RuntimeError):
    """Actors did not answer within the timeout of what they were doing (the message names its key)."""
