"""Sync config options: every YAML composes and builds its class; what a strategy cannot do here is
refused with the key and the fix; multi-sender groups and routes are what the docs say (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.config.validate import ConfigError
from rlhf_orch.sync.base import WeightSync
from rlhf_orch.sync.buckets import TensorMeta, plan_buckets
from rlhf_orch.sync.multi_sender import MultiSenderBroadcastSync
from tests.conftest import compose_config, has_cuda

SYNC_OPTIONS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "sync").glob("*.yaml"))


def _check(overrides: list[str]):
    cfg = compose_config(overrides)
    return check(cfg, instantiate(cfg.launcher))


@pytest.mark.parametrize("option", SYNC_OPTIONS)
def test_every_sync_option_builds_its_strategy(option):
    cfg = compose_config([f"sync={option}"])
    strategy = instantiate(cfg.sync)
    assert isinstance(strategy, WeightSync)
    assert strategy.backend == cfg.sync.backend  # the configured backend is the one kept


def test_cpu_strategies_pass_validation():
    _check(["sync=gloo_bucketed"])
    _check(["sync=object_store"])
    _check(["sync=gloo_multi_sender", "placement.actor_ranks=2"])


@pytest.mark.skipif(has_cuda(), reason="checks the refusal on a machine without CUDA")
def test_cuda_ipc_refused_without_gpu_and_colocation():
    with pytest.raises(ConfigError) as err:
        _check(["sync=cuda_ipc"])
    message = str(err.value)
    assert "CUDA IPC needs CUDA GPUs" in message and "sync=gloo_bucketed" in message
    assert "placement=colocated" in message


def test_multi_sender_with_one_policy_rank_says_what_to_do():
    with pytest.raises(ConfigError) as err:
        _check(["sync=gloo_multi_sender"])
    assert "placement.actor_ranks=1" in str(err.value) and "placement.actor_ranks=2" in str(err.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["sync=gloo_multi_sender", "placement.actor_ranks=2", "sync.shard_by=layers"], "sync.shard_by='layers'"),
        (["sync=gloo_multi_sender", "placement.actor_ranks=2", "sync.senders=0"], "sync.senders=0"),
        (["sync=object_store", "sync.backend=gloo"], "sync.backend='gloo'"),
    ],
)
def test_bad_sync_values_name_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        _check(overrides)
    assert key in str(err.value)


def _multi_sender(senders: int, shard_by: str) -> MultiSenderBroadcastSync:
    return MultiSenderBroadcastSync(backend="gloo", timeout_s=60.0, bucket_mb=1.0, senders=senders, shard_by=shard_by)


def _buckets(n: int):
    return plan_buckets([TensorMeta(f"model.layers.{i}.w", "float32", (256,)) for i in range(n)], 1024)


def test_multi_sender_by_buckets_every_engine_hears_every_sender():
    sync = _multi_sender(senders=2, shard_by="buckets")
    specs = sync._specs = sync.group_specs(policy_ranks=4, engines=3)
    assert [(s.sender, s.engines) for s in specs] == [(0, (0, 1, 2)), (1, (0, 1, 2))]
    assert len({s.name for s in specs}) == 2
    route = sync.route(_buckets(6), engines=3)
    assert route[0] == route[2] == [0, 1, 0, 1, 0, 1]
    assert sync.receive_ahead() == 2


def test_multi_sender_by_engines_splits_engines():
    sync = _multi_sender(senders=2, shard_by="engines")
    specs = sync._specs = sync.group_specs(policy_ranks=2, engines=3)
    assert [(s.sender, s.engines) for s in specs] == [(0, (0, 2)), (1, (1,))]
    assert sync.route(_buckets(4), engines=3) == [[0] * 4, [1] * 4, [0] * 4]


def test_multi_sender_never_uses_more_senders_than_ranks_or_engines():
    assert len(_multi_sender(senders=4, shard_by="buckets").group_specs(policy_ranks=1, engines=2)) == 1
    assert len(_multi_sender(senders=4, shard_by="engines").group_specs(policy_ranks=8, engines=2)) == 2
