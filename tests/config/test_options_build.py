"""Every option of every group, composed as a user picks it: the class its `_target_` names takes
every key of the composed node (what `hydra.utils.instantiate` passes), so a key declared in an
`options.py` and not taken by its runtime class fails here, not at a run's start. Pure: classes are
resolved by name and their signatures read; nothing is built."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from rlhf_orch.reward.options import RuleRewardConfig
from tests.conftest import CONF_DIR, compose_config

GROUPS = ("placement", "pipeline", "transfer", "sync", "data", "reward", "env", "model", "algo", "logger", "launcher")
# Keys a group's builder takes before it instantiates the rest (`reward.scoring.build_reward`: the
# execution settings of the run, and a reward model's nested rule).
TAKEN_BY_THE_BUILDER = {"reward": {*RuleRewardConfig.execution_keys, "rule"}}
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((Path(CONF_DIR) / g).glob("*.yaml"))]


def keys_not_taken(target: type, keys: set[str]) -> set[str]:
    """The keys `target(**node)` would refuse: none when it takes **kwargs."""
    parameters = inspect.signature(target).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return set()
    return keys - {p.name for p in parameters}


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_key_of_an_option_is_taken_by_its_target(group, option):
    node = compose_config([f"{group}={option}"])[group]
    keys = set(OmegaConf.to_container(node, resolve=False)) - {"_target_", *TAKEN_BY_THE_BUILDER.get(group, ())}
    target = get_class(node._target_)
    assert keys_not_taken(target, keys) == set(), f"{group}={option}: {node._target_} does not take these keys"


def test_the_check_finds_a_key_a_class_does_not_take():
    class Takes:
        def __init__(self, a: int, b: int = 1) -> None: ...

    class TakesAny:
        def __init__(self, **settings) -> None: ...

    assert keys_not_taken(Takes, {"a", "b", "c"}) == {"c"}
    assert keys_not_taken(TakesAny, {"c"}) == set()
