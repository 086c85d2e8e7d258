"""Transfer settings that cannot work are refused before Ray starts (key, value, fix)."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.config.validate import ConfigError
from tests.conftest import compose_config


def _check(overrides):
    cfg = compose_config(overrides)
    return check(cfg, instantiate(cfg.launcher))


@pytest.mark.parametrize(
    "overrides, key, fix",
    [
        (["transfer=packed", "transfer.token_budget=40"], "transfer.token_budget=40", "transfer.token_budget >= 48"),
        (["transfer=packed", "transfer.token_budget=-1"], "transfer.token_budget=-1", "must be >= 0"),
        (["transfer=micro_batched", "transfer.max_in_flight=0"], "transfer.max_in_flight=0", "must be >= 1"),
        (["transfer=packed", "data=long8k", "transfer.token_budget=4096"], "transfer.token_budget=4096", ">= 8192"),
    ],
)
def test_bad_transfer_settings_are_refused(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        _check(overrides)
    assert key in str(err.value) and fix in str(err.value)


@pytest.mark.parametrize("name", ["padded", "micro_batched", "packed"])
def test_each_strategy_is_one_yaml_building_its_class(name):
    cfg = compose_config([f"transfer={name}"])
    _check([f"transfer={name}"])
    transfer = instantiate(cfg.transfer)
    assert type(transfer).__module__ == f"rlhf_orch.transfer.{name}"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["transfer=padded", "transfer.token_budget=4096"], "transfer.token_budget"),
        (["transfer=micro_batched", "transfer.token_budget=4096"], "transfer.token_budget"),
        (["transfer=packed", "transfer.max_in_flight=2"], "transfer.max_in_flight"),
        (["transfer=padded", "transfer.max_in_flight=2"], "transfer.max_in_flight"),
    ],
)
def test_a_knob_the_strategy_does_not_read_is_refused(overrides, key):
    """Each strategy's schema has only the keys its class reads: Hydra refuses any other."""
    with pytest.raises(ConfigCompositionException, match=f"Could not override '{key}'"):
        compose_config(overrides)


def test_long8k_packed_experiment_is_valid():
    typed, _ = _check(["experiment=long8k_packed"])
    assert typed.transfer.token_budget >= typed.data.prompt_max_len + typed.data.response_max_len
