"""`RolloutMeta`: the small facts the driver keeps about a rollout's sequences (never their tokens).

One record knows every per-sample field: each is declared with `per_sample(...)`, and filtering
(`select`), merging (`merge`) and the trajectory view (`trajectories_only`) go through that
declaration, so a field added here is carried everywhere at once. Every per-sample list is as long
as `indices` -- checked whenever a record is made -- and a field a producer leaves empty is filled
per row from its declared default. Counts and sums over samples (interrupted sequences, env
counters, env metrics) are derived from the per-sample fields, so they describe exactly the samples
the record holds: after DAPO's dynamic sampling drops a group, its samples count nowhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlhf_orch.transfer.plan import is_extra_sequence, trajectory_of

# A per-sample field's default for one row, from the row's other values (None: the field is optional
# as a whole -- absent until someone sets it, e.g. the reward model's scores).
RowDefault = Callable[[dict[str, Any]], Any]


def per_sample(row_default: RowDefault | None = None, *, optional: bool = False) -> Any:
    """Declare a per-sample field (a list with one value per index)."""
    metadata = {"per_sample": True, "row_default": row_default, "optional": optional}
    if optional:
        return field(default=None, metadata=metadata)
    return field(default_factory=list, metadata=metadata)


def _per_sample_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(RolloutMeta) if f.metadata.get("per_sample")]


class RolloutMetaError(ValueError):
    """A record whose per-sample fields disagree in length, or parts that cannot be merged."""


@dataclass
class RolloutMeta:
    """The small facts the driver keeps about sequences (never their tokens), by global sample index."""

    indices: list[int] = per_sample()
    seq_lens: list[int] = per_sample()
    response_lens: list[int] = per_sample()
    rewards: list[float] = per_sample()
    score_s: float = 0.0
    generated_at: float = 0.0  # wall clock (time.time) when the engine's last sequence finished
    # Events of scoring, over every sample scored (a dropped DAPO group's too: the verifier ran on it).
    reward_errors: int = 0  # samples whose reward function raised (scored 0)
    reward_timeouts: int = 0  # samples whose reward function ran past reward.timeout_s (scored 0)
    truncated: list[bool] = per_sample(lambda row: False)  # hit max_tokens (or a turn/context limit)
    weight_versions: list[int] = per_sample(lambda row: 0)  # the engine weights that sampled it (its first token)
    model_rewards: list[float] | None = per_sample(optional=True)  # reward-model scores (before weighting)
    rule_rewards: list[float] | None = per_sample(
        optional=True
    )  # the weighted rule term, when a reward model adds to it
    # Multi-turn rollouts: the trajectory's env counters (None: none), and its environment's own
    # episode metrics (skyrl-gym's get_metrics) as (class, dict) (None: none).
    env_stats: list[dict[str, float] | None] = per_sample(lambda row: None)
    env_metrics: list[tuple[str, dict] | None] = per_sample(lambda row: None)
    # A weight update reached the sequence while it was generating (pipeline=async).
    interrupted: list[bool] = per_sample(lambda row: False)
    token_version_means: list[float] = per_sample(
        lambda row: float(row["weight_versions"])
    )  # its tokens' mean weight version
    # The weight version of each of its response tokens, as runs (start, end, version) (None: all
    # its weight_version): what the rollout dump shows per token.
    version_spans: list[tuple[tuple[int, int, int], ...] | None] = per_sample(lambda row: None)
    # The tokens the policy generated (a multi-turn response without its observations: what DAPO's
    # overlong penalty counts).
    model_token_lens: list[int] = per_sample(lambda row: row["response_lens"])

    def __post_init__(self) -> None:
        n = len(self.indices)
        for f in _per_sample_fields():
            values = getattr(self, f.name)
            if values is None:
                continue
            if len(values) == n:
                setattr(self, f.name, list(values))
            elif not values and f.metadata["row_default"] is not None:
                rows = self._rows()
                setattr(self, f.name, [f.metadata["row_default"](row) for row in rows])
            else:
                raise RolloutMetaError(f"RolloutMeta.{f.name} has {len(values)} values for {n} samples")

    def _rows(self) -> list[dict[str, Any]]:
        """Per sample, the per-sample fields filled so far (what a row default reads)."""
        filled = {f.name: getattr(self, f.name) for f in _per_sample_fields()}
        filled = {k: v for k, v in filled.items() if v is not None and len(v) == len(self.indices)}
        return [{k: v[r] for k, v in filled.items()} for r in range(len(self.indices))]

    def __setstate__(self, state: dict) -> None:
        # A rollout held in a checkpoint written before a field existed (or before a count became
        # per sample) reads with the field's default; a count keeps its total.
        n = len(state.get("indices", []))
        if isinstance(state.get("interrupted"), int):
            k = state["interrupted"]
            state["interrupted"] = [True] * k + [False] * (n - k)
        if isinstance(state.get("env_stats"), dict) or state.get("env_stats") is None:
            # (the total on the first sample keeps the logged sums; its masked count is no one
            # sample's, so it is dropped: it would mask the first sample)
            total = {k: v for k, v in (state.get("env_stats") or {}).items() if k != "masked"}
            state["env_stats"] = ([total] + [None] * (n - 1)) if total and n else []
        metrics = state.get("env_metrics")
        if isinstance(metrics, list) and len(metrics) != n:
            state["env_metrics"] = (list(metrics) + [None] * n)[:n] if len(metrics) <= n else []
        defaults = {
            f.name: f.default_factory()
            for f in dataclasses.fields(self)
            if f.default_factory is not dataclasses.MISSING
        }
        self.__dict__.update({**defaults, **state})
        self.__post_init__()

    # ------------------------------------------------------------------ per-sample views
    def select(self, rows: Sequence[int]) -> "RolloutMeta":
        """The samples at positions `rows` (every per-sample field, in that order); the scoring
        events and timings stay the record's."""
        picked = {}
        for f in _per_sample_fields():
            values = getattr(self, f.name)
            picked[f.name] = None if values is None else [values[r] for r in rows]
        return dataclasses.replace(self, **picked)

    def where(self, keep: Callable[[int], bool]) -> "RolloutMeta":
        """The samples whose index `keep` accepts."""
        return self.select([r for r, i in enumerate(self.indices) if keep(i)])

    def trajectories_only(self) -> "RolloutMeta":
        """The first sequence of every trajectory (a trajectory may train as several:
        `plan.extra_sequence_index`): what rewards, groups and evaluation count."""
        if not any(is_extra_sequence(i) for i in self.indices):
            return self
        return self.where(lambda i: not is_extra_sequence(i))

    def share_trajectory_rewards(self) -> None:
        """Every further sequence takes its trajectory's reward (a reward model scored each alone)."""
        first = {i: r for i, r in zip(self.indices, self.rewards) if not is_extra_sequence(i)}
        self.rewards = [first[trajectory_of(i)] for i in self.indices]

    @classmethod
    def merge(cls, parts: Sequence["RolloutMeta"]) -> "RolloutMeta":
        """Several records as one, sorted by index (an index in two parts is refused)."""
        fields = _per_sample_fields()
        for f in fields:
            present = {getattr(p, f.name) is not None for p in parts if p.indices}
            if len(present) > 1:
                raise RolloutMetaError(f"cannot merge rollout records where only some have {f.name}")
        rows = sorted(((i, p, r) for p in parts for r, i in enumerate(p.indices)), key=lambda row: row[0])
        indices = [i for i, _, _ in rows]
        if len(set(indices)) != len(indices):
            raise RolloutMetaError(
                f"cannot merge rollout records holding the same sample twice ({len(indices) - len(set(indices))} repeated)"
            )
        merged: dict[str, Any] = {}
        for f in fields:
            if any(getattr(p, f.name) is None for p in parts if p.indices):
                merged[f.name] = None
            else:
                merged[f.name] = [getattr(p, f.name)[r] for _, p, r in rows]
        return cls(
            score_s=max((p.score_s for p in parts), default=0.0),
            generated_at=max((p.generated_at for p in parts), default=0.0),
            reward_errors=sum(p.reward_errors for p in parts),
            reward_timeouts=sum(p.reward_timeouts for p in parts),
            **merged,
        )

    # ------------------------------------------------------------------ derived totals
    @property
    def interrupted_count(self) -> int:
        """Sequences a weight update reached while they were generating."""
        return sum(bool(x) for x in self.interrupted)

    @property
    def masked(self) -> list[bool]:
        """Per sample: a trajectory that trains nothing (env.mask_failed / env.mask_truncated
        zeroed its loss mask on the engine; its env counters say so)."""
        return [bool(s and s.get("masked")) for s in self.env_stats]

    def env_stats_total(self) -> dict[str, float] | None:
        """The env counters added up over the samples (None when none has any)."""
        return sum_env_stats(self.env_stats)

    def env_metrics_list(self) -> list[tuple[str, dict]]:
        """Every trajectory's (class, get_metrics()) that has any."""
        return [m for m in self.env_metrics if m]


def sum_env_stats(per_sample: Sequence[dict[str, float] | None]) -> dict[str, float] | None:
    """Env counters of several samples added up; None when none has any."""
    present = [s for s in per_sample if s]
    if not present:
        return None
    total: dict[str, float] = {}
    for stats in present:
        for k, v in stats.items():
            total[k] = total.get(k, 0.0) + float(v)
    return total
