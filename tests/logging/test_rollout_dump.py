"""`logger.rollouts_every_n_steps`: the rollout dump of every n-th step only (steps n, 2n, ...), the
loop asking the policy ranks for sequences on those steps alone."""

from __future__ import annotations

from types import SimpleNamespace

from rlhf_orch.logging.rollout_dump import RolloutDump
from rlhf_orch.orchestration.loop import TrainLoop


def test_the_dump_is_written_on_every_n_th_step_only(tmp_path):
    every_third = RolloutDump(tmp_path, tokenizer=None, per_step=2, every_n_steps=3)
    assert [step for step in range(1, 10) if every_third.dumps(step)] == [3, 6, 9]
    every_step = RolloutDump(tmp_path, tokenizer=None, per_step=2, every_n_steps=1)
    assert all(every_step.dumps(step) for step in range(1, 10))


def test_the_loop_asks_the_policy_ranks_for_sequences_only_on_dump_steps(tmp_path):
    asked: list[tuple[int, list[int]]] = []
    rank = SimpleNamespace(sequences=SimpleNamespace(remote=lambda shard, wanted: asked.append((shard, wanted))))
    loop = SimpleNamespace(
        rollout_dump=RolloutDump(tmp_path, tokenizer=None, per_step=2, every_n_steps=2),
        actors=SimpleNamespace(policy=[rank, rank]),
    )
    delivery = SimpleNamespace(meta=SimpleNamespace(indices=[3, 0, 1, 2]))
    assert TrainLoop._dump_calls(loop, 1, delivery) is None and asked == []
    assert TrainLoop._dump_calls(loop, 2, delivery) is not None
    assert asked == [(0, [0, 1]), (1, [0, 1])]  # both ranks, the two lowest indices
