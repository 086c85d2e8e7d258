"""Shared fixtures: the composed default config and the tiny model it builds (cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from rlhf_orch.config.schema import register_configs

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()


def compose_config(overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=overrides or [])


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model():
    """The default `model=tiny` (built once into RLHF_ORCH_CACHE or ~/.cache/rlhf_orch)."""
    cfg = compose_config()
    return instantiate(cfg.model)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model) -> str:
    return tiny_model.path()


@pytest.fixture(autouse=True, scope="session")
def _quiet_env():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    yield
