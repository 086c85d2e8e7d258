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


def pytest_itemcollected(item):
    # Under `pytest -n 2 --dist loadgroup` (`make test`) the in-process end-to-end tests of one module
    # stay on one worker (an xdist group per module), so its module-scoped Ray session and actors are
    # built once; modules and every other test are spread over both workers by load (docs/testing.md).
    # Needs pytest < 9 (pyproject.toml's test extra): under pytest 9 xdist 3.8 ignores every group.
    if "integration" in item.keywords and "own_processes" not in item.keywords:
        item.add_marker(pytest.mark.xdist_group(item.module.__name__))


def pytest_configure(config):
    # xdist's loadgroup/loadscope queue their work units (a module's group, or one test) largest group
    # first, so a long test that is a unit of its own (the kill-and-resume test: ~4 min) used to start
    # last and run alone at the end. Queue them in collection order, which `_longest_first` sets
    # (this overrides `--loadscope-reorder`; without xdist, or under `--dist load`, nothing reads it).
    config.option.loadscopereorder = False


def _unit_of(item) -> str:
    """The xdist work unit an item runs in: its group, named as xdist's worker names it (every
    `xdist_group` mark's name, sorted, joined with "_"), or the test alone."""
    names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")}
    return "@" + "_".join(sorted(names)) if names else item.nodeid


def _cost_tier(item) -> int:
    """0: end-to-end runs of a minute or more (slow, the real model, own processes); 1: other tests with
    Ray actors, vLLM or DeepSpeed; 2: the pure tests, which fill in at the end on whichever worker is
    free first."""
    if "integration" not in item.keywords:
        return 2
    return 0 if any(mark in item.keywords for mark in ("slow", "real_model", "own_processes")) else 1


def _longest_first(items) -> None:
    tier: dict[str, int] = {}
    for item in items:
        unit = _unit_of(item)
        tier[unit] = min(tier.get(unit, 2), _cost_tier(item))
    items.sort(key=lambda item: tier[_unit_of(item)])  # stable: collection order within a tier


@pytest.hookimpl(trylast=True)  # after `-m` deselection: tiers of the tests that run
def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def digit_files(tmp_path_factory) -> dict[str, dict[str, str]]:
    """The digit task written as veRL (parquet, chat messages) and OpenRLHF (jsonl, input/label)
    files: `digit_files[layout][split]` is a path (rlhf_orch.data.export)."""
    from rlhf_orch.data.export import export_digit_task

    return export_digit_task(tmp_path_factory.mktemp("digits"), train=512, test=32)


@pytest.fixture(scope="session")
def tiny_model():
    """The default `model=tiny` (built once into RLHF_ORCH_CACHE or ~/.cache/rlhf_orch)."""
    cfg = compose_config()
    return instantiate(cfg.model)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model) -> str:
    return tiny_model.path()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real chat model (`model=smollm2_135m`), built once into the model cache (~30 s the first
    time on a machine, then loaded from there)."""
    cfg = compose_config(["model=smollm2_135m"])
    model = instantiate(cfg.model)
    model.check()
    return model.path()


@pytest.fixture(scope="session")
def smollm2_student_path(smollm2_path, tmp_path_factory) -> str:
    """SmolLM2 cut to its first 2 decoder layers (`model.layers`, rlhf_orch.models.gguf.keep_first_layers):
    its tokenizer, chat template, embeddings and head, for tests whose behaviour depends on those and
    not on the depth (a float64 forward and backward of the whole model took ~30 s of CI's tier)."""
    from rlhf_orch.models.gguf import keep_first_layers

    out = tmp_path_factory.mktemp("smollm2_first2layers")
    keep_first_layers(Path(smollm2_path), out, 2)
    return str(out)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


# Overrides that make an in-process run join the module's Ray session (`shared_ray`) instead of
# starting and stopping its own: Ray starts once per module, and a run on the plan of the run
# before it takes that run's actors, reset, instead of starting new processes (keep_actors).
SHARED_RAY = ["launcher.reuse_session=true", "launcher.keep_actors=true"]


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray session (16 logical CPUs, 8 logical GPUs, loopback only) for the in-process
    runs of a module; they pass `SHARED_RAY`. Tests that must own their processes (signals, kills
    of the driver, resume in a fresh process) start their own instead."""
    import ray

    from launchers.local import LocalRayLauncher
    from rlhf_orch.orchestration import warm_actors

    with LocalRayLauncher(logical_gpus=8, reuse_session=True).session():
        pass  # started, and left up (reuse_session) for the module's runs
    yield SHARED_RAY
    warm_actors.release()
    ray.shutdown()


def start_trainer_ranks(cls, spec, ranks: int, runtime_env: dict) -> list:
    """`ranks` data-parallel ranks of a trainer class (`PolicyWorker`, `CriticWorker`) as bare Ray actors,
    joined in one torch.distributed world (rank 0 hosts it; every rank joins at once). Not built."""
    import ray

    from rlhf_orch.liveness import actor_class

    workers = [
        actor_class(cls).options(num_cpus=1, runtime_env=runtime_env).remote(spec, r, ranks) for r in range(ranks)
    ]
    host, port = ray.get(workers[0].rendezvous_address.remote())
    ray.get([w.init_distributed.remote(host, port) for w in workers])
    return workers


def train_in_process(overrides: list[str], run_dir: Path, callbacks=()) -> dict:
    """One run in this process, as run.py would start it (composed, checked, trained); its summary."""
    from rlhf_orch.app import check
    from rlhf_orch.orchestration.session import run_training

    cfg = compose_config(overrides)
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    return run_training(cfg, typed, plan, launcher, run_dir, callbacks=list(callbacks))


def all_resources_free(timeout_s: float = 30.0) -> bool:
    """Nothing a finished run started still holds resources of the shared session (actors,
    placement groups) but what it parked for the next run (`launcher.keep_actors`), which is
    released first: every CPU and GPU is free again within `timeout_s` (killing is asynchronous)."""
    import time

    import ray

    from rlhf_orch.orchestration import warm_actors

    warm_actors.release()

    deadline = time.monotonic() + timeout_s
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        if all(free.get(k, 0) == total.get(k, 0) for k in ("CPU", "GPU")):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(autouse=True, scope="session")
def _quiet_env():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    yield
