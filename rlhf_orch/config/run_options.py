"""The run's own sections, read by `rlhf_orch.orchestration` (the pipeline, evaluation, checkpoints,
failures). Orchestration sits above config (it takes the typed `RootConfig`), so these are declared
here, not in an options module of orchestration (config would import it back).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING


@dataclass
class PipelineConfig:
    """When a step's rollout is generated relative to the weights that train on it
    (`rlhf_orch.orchestration.pipeline`): `sync` (on-policy, one phase after the other) or
    `one_step_off` (the next rollout is generated while the trainers train, one version behind)
    or `async` (`AsyncPipelineConfig`)."""

    _target_: str = MISSING


@dataclass
class AsyncPipelineConfig(PipelineConfig):
    """`pipeline=async`: rollouts generate ahead of the trainers, several at once, and take new
    weights mid-generation."""

    # eta: no sequence trains on weights more than this many versions newer than those that drew
    # its first token (AReaL's bound); the engines run up to eta + 1 rollouts ahead. 0 = sync.
    max_staleness: int = 1
    # A weight update reaches the sequences in flight (true: they go on with the new weights from
    # where they are, no token drawn again) or waits until they finish (false).
    partial_rollout: bool = True


@dataclass
class EvalConfig:
    """Held-out evaluation on the engines with the current weights, scored by the run's reward."""

    every_n_steps: int = 0  # 0 = off
    before_train: bool = False
    num_prompts: int = 0  # 0 = the whole validation set
    samples_per_prompt: int = 1  # k of mean@k / pass@k
    temperature: float = 0.0  # 0 = greedy
    pass_threshold: float = 1.0  # a sample "passes" when its score reaches this

    # Derived (not a key): whether the run evaluates at all (the driver, the engines' KV cache and
    # the memory plan all ask).
    @property
    def enabled(self) -> bool:
        return self.every_n_steps > 0 or self.before_train


@dataclass
class CheckpointConfig:
    """What a run keeps so it can continue (`resume=`) and what it exports (rlhf_orch.checkpoint_dirs, rlhf_orch.orchestration.checkpoint)."""

    every_n_steps: int = 0  # 0 = no periodic checkpoints (the end of the run and signals still write one)
    # Also a checkpoint after the first step that ends this long after the last one (or the start):
    # a crash loses at most about this much work. 0 = off.
    every_n_minutes: float = 30.0
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted (>= 1)
    dir: Optional[str] = None  # null = <run dir>/checkpoints; must be shared by every node of a cluster
    on_signal: bool = True  # SIGINT/SIGTERM: finish the step, write a checkpoint, then stop
    at_end: bool = True  # a checkpoint after the last step (so a longer num_steps can resume it)
    export_hf: bool = False  # also export the policy in Hugging Face format at every checkpoint
    export_final: bool = True  # export the policy in Hugging Face format at the end of the run
    # Seconds writing one checkpoint (every role's DeepSpeed state) or one Hugging Face export may
    # take: a large ZeRO-3 save can outlast fault.step_timeout_s without anything being dead.
    timeout_s: float = 3600.0


@dataclass
class FaultConfig:
    """How a run reacts to failures it can survive."""

    # Engines replaced in their bundle per invocation at most (a resumed run starts with it whole;
    # an engine left stuck in a broadcast a dead one broke is replaced with it at no charge); 0 = none.
    max_engine_restarts: int = 3
    # Liveness by progress: the window of a wait on actors. A rollout's engines (generating,
    # scoring: engine steps and scored samples) and a trainer phase's ranks (experience, reward-model
    # scoring, the update: micro-batches, decoder layers, collectives) are waited for as long as
    # their counts move, looked at every step_timeout_s; a stuck one (its count standing between
    # two looks, or no answer) is found within two windows, however long the healthy phase. Any
    # other wait on an actor within a step (a hand-over, seeding an engine) gets one window.
    step_timeout_s: float = 600.0
    # Whole-run restarts per invocation when a process the run cannot continue without (a trainer
    # rank; under sync / one_step_off an engine lost outside generation) died or stopped answering:
    # every role starts again in its bundles from the last checkpoint (the initial weights without
    # one) and the run goes on. 0 = none.
    max_trainer_restarts: int = 2
