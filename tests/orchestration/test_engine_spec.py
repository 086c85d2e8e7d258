"""What every engine process is given (`session.engine_spec`), from the composed config: the keys
that reach the engine and what each pipeline changes of them (no engine is started)."""

from __future__ import annotations

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlhf_orch.orchestration.session import engine_spec
from tests.conftest import compose_config


def _spec(overrides: list[str]):
    cfg = compose_config(overrides)
    typed = OmegaConf.to_object(cfg)
    plan = instantiate(cfg.placement).plan(
        reward_model=False, critic=typed.algo.needs_critic, reference=typed.algo.needs_reference_ranks
    )
    return engine_spec(typed, plan, "unused", instantiate(cfg.pipeline), None)


@pytest.mark.parametrize("pipeline,at_once", [("sync", 1), ("one_step_off", 1), ("async", 2)])
def test_prefix_caching_stays_on_under_every_pipeline(pipeline, at_once):
    """Under async an update lands while requests run; publishing it drops every cached block, so
    prefix caching is kept (it was switched off there once: each sample recomputed the shared prompt)."""
    spec = _spec([f"pipeline={pipeline}"])
    assert spec.enable_prefix_caching and spec.max_concurrency == at_once
    assert not _spec([f"pipeline={pipeline}", "engine.enable_prefix_caching=false"]).enable_prefix_caching


def test_the_engine_s_threads_reach_its_spec():
    assert _spec([]).torch_threads == 1  # (Ray's one-CPU actor: OMP_NUM_THREADS=1)
    assert _spec(["engine.torch_threads=2"]).torch_threads == 2
