"""Bad input is refused before Ray starts, with a message naming the key, the value and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import OmegaConfBaseException

from rlhf_orch.app import check
from rlhf_orch.config.validate import ConfigError
from rlhf_orch.topology.plan import PlacementError
from tests.conftest import compose_config, has_cuda
from hydra.utils import instantiate

REPO = Path(__file__).resolve().parents[2]


def _check(overrides: list[str]):
    cfg = compose_config(overrides)
    return check(cfg, instantiate(cfg.launcher))


def test_default_config_is_valid():
    typed, plan = _check([])
    assert plan.layout == "cpu_local"
    assert typed.sync.backend == "gloo"


@pytest.mark.parametrize("algo", ["ppo", "reinforce_pp", "reinforce_pp_baseline"])
def test_per_turn_rewards_are_taken_by_estimators_that_read_rewards_per_token(algo):
    # (the default data's prompts are raw text: plain observations)
    typed, _ = _check(["env=skyrl", f"algo={algo}", "env.reward=per_turn", "env.observation_format=plain"])
    assert typed.env.reward == "per_turn" and typed.algo.per_token_rewards


# (overrides, key named in the message, words of the fix)
BAD = [
    (["algo.min_response_len=17"], "algo.min_response_len=17", "set algo.min_response_len <= 16"),
    (
        ["env=lookup", "data=lookup", "model=tiny_tool", "algo.min_response_len=2"],
        "algo.min_response_len=2",
        "leave algo.min_response_len=0 with env",
    ),
    (
        [
            "env=agent",
            "env.path=scripts/examples/openai_agent.py",
            "env.name=three_tries",
            "env.max_tokens_per_turn=17",
        ],
        "env.max_tokens_per_turn=17",
        "set env.max_tokens_per_turn <= 16",
    ),
    (["env=agent"], "env.path='???'", "required by the option chosen: set env.path=<value>"),
    (
        ["env=skyrl", "algo=grpo", "env.reward=per_turn"],
        "env.reward='per_turn'",
        "use env.reward=sum, or an algorithm whose advantages read rewards per token",
    ),
    (
        ["env=lookup", "data=lookup", "model=tiny_tool", "env.reward=per_turn"],
        "env.reward='per_turn'",
        "env LookupEnv rewards only the final answer",
    ),
    (["env=skyrl", "env.max_turns=1", "env.reward=per_turn"], "env.reward='per_turn'", "with env.max_turns=1"),
    (["env=lookup", "data=lookup", "model=tiny_tool", "env.reward=each"], "env.reward='each'", "'per_turn'"),
    (
        ["env=agent", "env.path=scripts/examples/openai_agent.py", "env.name=three_tries", "env.host=public"],
        "env.host='public'",
        "'loopback' or 'node'",
    ),
    (["algo.train_batch_size=48"], "algo.train_batch_size=48", "divisor of 128"),
    (["algo.micro_batch_size=24"], "algo.micro_batch_size=24", "micro_batch_size dividing"),
    (["placement.actor_ranks=3"], "placement.actor_ranks=3", "do not split over 3 actor ranks"),
    (["placement.actor_ranks=2", "placement.critic_ranks=4"], "placement.critic_ranks=4", "divides 2"),
    (
        ["placement=split", "launcher.logical_gpus=8", "placement.actor_ranks=3"],
        "placement.actor_ranks=3",
        "set placement.actor_gpus",
    ),
    (
        ["placement=split", "launcher.logical_gpus=8", "placement.engines=2"],
        "placement.engines=2",
        "set placement.vllm_gpus",
    ),
    (["data.response_max_len=9000"], "data.response_max_len=9000", "exceeds model.context_len=8192"),
    (["algo.kl_estimator=k3"], "algo.kl_estimator='k3'", "algo.kl_placement=in_loss"),
    (["algo.kl_placement=in_loss", "algo.kl_estimator=k9"], "algo.kl_estimator='k9'", "k1, k2, k3, low_var_kl"),
    (["algo.kl_placement=sideways"], "algo.kl_placement='sideways'", "'in_reward'"),
    (["algo=grpo", "algo.samples_per_prompt=1"], "algo.samples_per_prompt=1", ">= 2"),
    (["algo=rloo", "algo.kl_placement=in_reward", "algo.kl_estimator=k1"], "algo.kl_placement='in_reward'", "in_loss"),
    (["algo.loss_agg=mean"], "algo.loss_agg='mean'", "seq-mean-token-sum-norm"),
    (["algo.clip_high=0"], "algo.clip_high=0", "(0, 1)"),
    (["algo.gamma=1.5"], "algo.gamma=1.5", "[0, 1]"),
    (["algo.actor_lr=-1e-4"], "algo.actor_lr=-0.0001", ">= 0"),
    (["algo.kl_coef=-0.1"], "algo.kl_coef=-0.1", ">= 0"),
    (["algo.value_clip_eps=0"], "algo.value_clip_eps=0", "> 0"),
    (["algo=dapo", "transfer=padded"], "algo.dynamic_sampling=True", "transfer=packed"),
    (["algo=dapo", "transfer=packed", "reward=model"], "algo.dynamic_sampling=True", "rule reward"),
    (
        ["pipeline=one_step_off", "transfer=micro_batched"],
        "transfer='MicroBatchedTransfer'",
        "use transfer=packed (or padded), or pipeline=sync",
    ),
    (
        ["pipeline=async", "transfer=micro_batched"],
        "transfer='MicroBatchedTransfer'",
        "use transfer=packed (or padded), or pipeline=sync",
    ),
    (["pipeline=async", "pipeline.max_staleness=-1"], "pipeline.max_staleness=-1", "must be in [0, 64]"),
    (
        ["pipeline=async", "algo=dapo"],
        "pipeline.max_staleness=1",
        "use pipeline=one_step_off, or pipeline.max_staleness=0",
    ),
    (["data.long_tail_frac=0.05"], "data.long_tail_frac=0.05", "does nothing alone"),
    (["data.long_tail_frac=0.05", "data.long_tail_len=64"], "data.long_tail_len=64", "<= data.response_max_len=16"),
    (["data.long_tail_frac=1.5", "data.long_tail_len=8"], "data.long_tail_frac=1.5", "must be in [0, 1]"),
    (["algo.tis_cap=0.5"], "algo.tis_cap=0.5", "null (off) or >= 1"),
    (
        ["algo.tis_cap=2", "algo.decoupled_is_cap=5"],
        "algo.decoupled_is_cap=5.0",
        "set algo.tis_cap=null (it is 2) for AReaL's decoupled PPO, or algo.decoupled_is_cap=null for truncated IS",
    ),
    (
        ["algo=dapo", "transfer=packed", "algo.overlong_buffer=16"],
        "algo.overlong_buffer=16",
        "data.response_max_len=16",
    ),
    (["trainer.zero_stage=4"], "trainer.zero_stage=4", "0, 1, 2 or 3"),
    (["sync.bucket_mb=0"], "sync.bucket_mb=0", "must be > 0"),
    (["algo.temperature=0"], "algo.temperature=0", "must be in (0, 2]"),
    (["algo.temperature=2.5"], "algo.temperature=2.5", "vLLM takes at most 2"),
    (["eval.samples_per_prompt=0"], "eval.samples_per_prompt=0", "must be >= 1"),
    (["eval.samples_per_prompt=4"], "eval.samples_per_prompt=4", "set eval.temperature > 0"),
    (["eval.every_n_steps=-1"], "eval.every_n_steps=-1", "must be >= 0"),
    (
        ["model=qwen2_5_0_5b", "model.name_or_path=/no/such/checkpoint"],
        "model.name_or_path='/no/such/checkpoint'",
        "no such directory",
    ),
    (["algo.ppo_epochs=0"], "algo.ppo_epochs=0", "must be >= 1"),
    # Hydra appends `+key=value` to a structured node; nothing would read a key the option lacks.
    (
        ["transfer=padded", "+transfer.token_budget=4096"],
        "transfer.token_budget=4096",
        "transfer (PaddedTransfer) has no such key",
    ),
    (
        ["+engine.kv_cache_space=2"],
        "engine.kv_cache_space=2",
        "(it takes: block_size, enable_prefix_caching, enforce_eager",
    ),
]


@pytest.mark.parametrize("overrides,key,fix", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_override_names_key_value_and_fix(overrides, key, fix):
    with pytest.raises(ConfigError) as err:
        _check(overrides)
    message = str(err.value)
    assert key in message
    assert fix in message


@pytest.mark.skipif(has_cuda(), reason="checks the no-GPU message")
def test_nccl_without_gpus_explains_gloo_alternative():
    with pytest.raises(ConfigError) as err:
        _check(["sync=nccl_bucketed", "data=long8k"])
    message = str(err.value)
    assert "sync.backend='nccl'" in message and "NCCL needs CUDA GPUs" in message
    assert "sync=gloo_bucketed" in message


@pytest.mark.skipif(has_cuda(), reason="checks the no-GPU message")
def test_gpu_placement_without_gpus_suggests_logical_gpus():
    with pytest.raises(ConfigError) as err:
        _check(["placement=split"])
    assert "launcher.logical_gpus=8" in str(err.value)
    assert "placement=cpu_local" in str(err.value)


def test_impossible_split_is_a_placement_error():
    with pytest.raises(PlacementError) as err:
        _check(
            [
                "placement=split",
                "placement.critic_gpus=1",
                "placement.vllm_gpus=3",
                "placement.engine_tp=2",
                "launcher.logical_gpus=8",
            ]
        )
    assert "placement.vllm_gpus" in str(err.value) and "placement.engine_tp" in str(err.value)


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as err:
        _check(["algo.kl_estimator=k9", "trainer.zero_stage=7"])
    assert len(err.value.problems) == 2


@pytest.mark.parametrize("override", ["sync.bucket_mbb=3", "algo.num_steps=abc", "sync=nope", "placement.reward=model"])
def test_hydra_refuses_unknown_keys_bad_types_and_options(override):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)):
        compose_config([override])


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "run.py", *args, "hydra.run.dir=${oc.env:TMPDIR,/tmp}/rlhf_orch_cli_${now:%H%M%S%f}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )


# (overrides, the one line's start, words of its suggestion)
HYDRA_MISTAKES = [
    (
        ["algo.clip_ratio=0.3"],
        "error: algo.clip_ratio: no such key in algo (PPOConfig); did you mean algo.clip_ratio_c",
        "`python run.py --cfg job` shows every key of algo",
    ),
    (
        ["algo=grpoo"],
        "error: algo=grpoo: no such option in algo; did you mean algo=grpo",
        "options: dapo, dr_grpo, grpo, on_policy_distill, ppo",
    ),
    (["algoo=ppo"], "error: algoo: no such key; did you mean algo?", "--cfg job"),
    (
        ["experiment=tool_use", "env=agent"],
        "error: env.max_turns (set in experiment/tool_use): no such key in env (AgentEnvConfig)",
        "env.max_calls?",
    ),
    (["data.prompt_max_len"], "error: 'data.prompt_max_len' is not an override", "write key=value"),
    (["algo.num_steps=abc"], "error: algo.num_steps='abc': not a valid int", ""),
]


@pytest.mark.parametrize("overrides, line, hint", HYDRA_MISTAKES)
def test_hydra_s_mistakes_are_one_line_with_the_closest_names_and_exit_2(overrides, line, hint):
    proc = _run(*overrides)
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith(line) and hint in lines[0], proc.stderr
    assert "HYDRA_FULL_ERROR" not in proc.stderr + proc.stdout


def test_hydra_full_error_set_by_the_user_keeps_hydra_s_report():
    proc = subprocess.run(
        [sys.executable, "run.py", "algo=grpoo"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "MissingConfigException" in proc.stderr


@pytest.mark.skipif(has_cuda(), reason="checks the no-GPU message")
def test_cli_nccl_on_cpu_exits_2_fast_with_message():
    t0 = time.perf_counter()
    proc = _run("sync=nccl_bucketed", "data=long8k")
    assert proc.returncode == 2
    assert "NCCL needs CUDA GPUs" in proc.stderr and "sync=gloo_bucketed" in proc.stderr
    assert time.perf_counter() - t0 < 60  # refused before Ray, vLLM or DeepSpeed start


# A config error comes back in ~1.3 s because no check imports torch (~1.5 s), transformers (~1 s more)
# or vLLM; a check that starts importing one of them fails here rather than only slowing every refusal.
# (A config with pipeline=one_step_off or a multi-turn env asks the transfer class what it can do,
# which imports torch: those errors take ~2.8 s.)
_IMPORTS_AFTER_RUN = """
import runpy, sys
sys.argv = ["run.py", *sys.argv[1:]]
try:
    runpy.run_path("run.py", run_name="__main__")
except SystemExit as e:
    print("exit", e.code)
print("heavy", sorted(m for m in ("torch", "transformers", "vllm", "deepspeed") if m in sys.modules))
"""


@pytest.mark.skipif(has_cuda(), reason="on a GPU machine torch is asked how many GPUs it can use")
@pytest.mark.parametrize(
    "overrides",
    [
        ["sync=nccl_bucketed", "data=long8k"],  # a relation between keys (no GPUs here)
        ["algo.actor_lr=-1"],  # one key's range
        ["model=hf", "model.name_or_path=nobody/missing-model"],  # a hub id not in the local cache
    ],
)
def test_config_errors_import_no_torch(overrides):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _IMPORTS_AFTER_RUN,
            *overrides,
            "hydra.run.dir=${oc.env:TMPDIR,/tmp}/rlhf_orch_cli_${now:%H%M%S%f}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "exit 2" in proc.stdout, proc.stdout + proc.stderr
    assert "heavy []" in proc.stdout, proc.stdout


def test_cli_unknown_key_exits_nonzero():
    proc = _run("sync.bucket_mbb=3")
    assert proc.returncode != 0
    assert "bucket_mbb" in proc.stderr


def test_cli_dry_run_prints_split_plan():
    proc = _run("launcher.dry_run=true", "placement=split")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for word in ("engine", "actor", "critic", "reference", "node"):
        assert word in out


def _skyrl_rows(path: Path, env_classes: list[str]) -> str:
    import pandas as pd

    pd.DataFrame(
        [
            {
                "prompt": [{"role": "user", "content": "Add the two numbers."}],
                "env_class": c,
                "reward_spec": {"method": "rule", "ground_truth": "[]"},
            }
            for c in env_classes
        ]
    ).to_parquet(path)
    return str(path)


@pytest.mark.parametrize("chosen_by", ["env_class", "rows"])
def test_skyrl_environments_that_run_the_model_s_code_are_refused_in_a_dry_run(chosen_by, tmp_path):
    """skyrl-gym's lcb runs the model's code in the engine's process, outside the sandbox: chosen by
    env.env_class or by one row of the data's env_class column, a dry run refuses it (exit 2,
    nothing started, no traceback) in one problem line naming the key that allows it."""
    if chosen_by == "env_class":
        overrides = ["env.env_class=lcb"]
        where = "env.env_class"
    else:
        rows = _skyrl_rows(tmp_path / "train.parquet", ["gsm8k", "lcb", "gsm8k"])
        overrides = ["data=files", f"data.train_files=[{rows}]", "data.label_key=reward_spec.ground_truth"]
        where = "the env_class column of data.train_files[0]"
    proc = _run("env=skyrl", *overrides, "launcher.dry_run=true")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "env.allow_unsandboxed_code" in line]
    assert line.strip().startswith("- env.allow_unsandboxed_code=False: skyrl-gym's lcb")
    assert where in line and "outside rlhf_orch's sandbox" in line and "set env.allow_unsandboxed_code=true" in line


def test_skyrl_environments_that_run_the_model_s_code_run_when_allowed(tmp_path):
    rows = _skyrl_rows(tmp_path / "train.parquet", ["lcb"])
    proc = _run(
        "env=skyrl",
        "env.env_class=lcb",
        "data=files",
        f"data.train_files=[{rows}]",
        "data.label_key=reward_spec.ground_truth",
        "env.allow_unsandboxed_code=true",
        "launcher.dry_run=true",
    )
    assert proc.returncode == 0, proc.stderr


def test_cli_cfg_job_prints_composed_config():
    proc = subprocess.run(
        [sys.executable, "run.py", "--cfg", "job", "sync=gloo_per_tensor"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    assert "PerTensorBroadcastSync" in proc.stdout and "placement:" in proc.stdout


# ----------------------------------------------------------------------------- exit codes of app.main
def _main_with_training(monkeypatch, tmp_path, training, overrides=("experiment=quick",), start_ray=False):
    """app.main on a composed config, with run_training replaced: (exit code, stderr). Ray is not
    started unless `start_ray` (the app starts it before training, overlapping its own imports)."""
    import io
    from contextlib import redirect_stderr

    from launchers.base import RayLauncher
    from rlhf_orch import app
    from rlhf_orch.orchestration import session

    monkeypatch.setattr(session, "run_training", training)
    if not start_ray:
        monkeypatch.setattr(RayLauncher, "connect_early", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(app, "run_dir", lambda: tmp_path / "run")
    err = io.StringIO()
    with redirect_stderr(err):
        code, _ = app.main(compose_config(list(overrides)))
    return code, err.getvalue()


def test_unexpected_failure_exits_3_with_one_line(monkeypatch, tmp_path):
    # Not a RunFailed: an exception the session did not wrap (e.g. while the inputs are prepared).
    def training(*args, **kwargs):
        raise RuntimeError("tokenizer cache is corrupt\nsecond line of the message")

    code, err = _main_with_training(monkeypatch, tmp_path, training)
    assert code == 3
    assert err.splitlines() == ["error: RuntimeError: tokenizer cache is corrupt second line of the message"]
    assert "Traceback" in (tmp_path / "run" / "error.log").read_text()
    summary = __import__("json").loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("RuntimeError: tokenizer cache")


@pytest.mark.integration
def test_an_input_error_shuts_down_the_ray_started_early(monkeypatch, tmp_path):
    # Ray starts while the driver imports and reads its inputs; an input error must not leave it running.
    import ray

    from rlhf_orch.orchestration.inputs import InputError

    seen = {}

    def training(cfg, typed, plan, launcher, out):
        seen["starting"] = launcher._early is not None  # Ray was coming up while the inputs were read
        raise InputError("data.path='/nowhere.jsonl' does not exist; give a JSONL or Parquet file")

    assert not ray.is_initialized()
    code, err = _main_with_training(monkeypatch, tmp_path, training, start_ray=True)
    assert code == 2 and err.strip() == "error: data.path='/nowhere.jsonl' does not exist; give a JSONL or Parquet file"
    assert seen["starting"]
    assert not ray.is_initialized()
    assert "Started a local Ray instance" in (tmp_path / "run" / "ray_workers.log").read_text()


def test_sigint_during_start_up_exits_130(monkeypatch, tmp_path):
    # A SIGINT before the run's own handler is installed arrives as KeyboardInterrupt.
    def training(*args, **kwargs):
        raise KeyboardInterrupt

    code, err = _main_with_training(monkeypatch, tmp_path, training)
    assert code == 130
    assert err.startswith("error: SIGINT") and len(err.splitlines()) == 1


def test_a_launcher_refusing_its_value_exits_2(monkeypatch, tmp_path):
    code, err = _main_with_training(monkeypatch, tmp_path, None, ("launcher.logical_gpus=-1",))
    assert code == 2 and err.strip() == "error: launcher.logical_gpus=-1 must be >= 0"


@pytest.mark.parametrize("key", ["reward.timeout_s=5", "reward.pool_size=2"])
def test_a_reward_model_has_no_rule_execution_keys(key):
    """They used to be accepted and ignored; an added rule has its own (reward.rule.*)."""
    with pytest.raises(ConfigCompositionException, match=f"Could not override '{key.split('=')[0]}'"):
        compose_config(["reward=model", key])


def test_a_batched_custom_reward_refuses_a_pool(tmp_path):
    batched = tmp_path / "batched_reward.py"
    batched.write_text(
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos=None):\n"
        "    return [1.0] * len(solution_strs)\n"
    )
    overrides = ["reward=custom", f"reward.path={batched}", "reward.batched=true"]
    _check(overrides)
    with pytest.raises(
        ConfigError, match=r"reward.pool_size=2: reward.batched=true scores the whole batch in one call"
    ):
        _check([*overrides, "reward.pool_size=2"])


class _ClusterFromACpuHead:
    """launcher=cluster as seen from a CPU-only head node: the cluster offers 8 GPUs; whether they are
    real is the launcher's answer (`ClusterRayLauncher.cuda_present`), not this machine's CUDA."""

    dry_run = False
    address = "head:6379"

    def __init__(self, real: bool) -> None:
        self.real = real

    def gpus_present(self) -> int:
        return 8

    def cuda_present(self) -> bool:
        return self.real


@pytest.mark.skipif(has_cuda(), reason="the point is a driver without CUDA")
def test_a_cpu_only_head_node_plans_a_gpu_cluster_on_its_gpus():
    """A GPU layout with NCCL, checked on this CUDA-less machine for a cluster whose GPUs are real:
    accepted, and the memory plan puts the roles on GPUs; the same cluster with logical GPUs (CPU
    testing) refuses NCCL and plans host processes. (Before: both followed the driver's CUDA.)"""
    from rlhf_orch.app import memory_verdict

    overrides = ["placement=split", "sync=nccl_bucketed", "model=qwen2_5_0_5b", "launcher=cluster"]
    cfg = compose_config(overrides)
    typed, plan = check(cfg, _ClusterFromACpuHead(real=True))
    assert plan.total_gpus == 8
    assert (
        "memory plan (GB = 1e9 bytes; GPU;" in memory_verdict(cfg, typed, plan, _ClusterFromACpuHead(real=True)).table()
    )
    with pytest.raises(ConfigError, match="NCCL needs CUDA GPUs"):
        check(cfg, _ClusterFromACpuHead(real=False))
    cpu = compose_config([*overrides[:-2], "sync=gloo_bucketed", "launcher=cluster"])
    typed, plan = check(cpu, _ClusterFromACpuHead(real=False))
    assert "host (CPU)" in memory_verdict(cpu, typed, plan, _ClusterFromACpuHead(real=False)).table()


def test_ray_detected_gpus_are_the_ones_with_a_type():
    from launchers.cluster import detected_gpus

    assert detected_gpus({"CPU": 64.0, "GPU": 8.0, "accelerator_type:H100": 1.0})
    assert not detected_gpus({"CPU": 64.0, "GPU": 8.0})  # `ray start --num-gpus=8` on a machine without any
    assert not detected_gpus({"CPU": 64.0, "accelerator_type:H100": 1.0})


def _user_env(tmp_path) -> str:
    path = tmp_path / "my_env.py"
    path.write_text(
        "class MyEnv:\n    def init(self, prompt):\n        return prompt, {}\n"
        "    def step(self, action):\n        return {'observations': [], 'reward': 0.0, 'done': True}\n"
    )
    return str(path)


def test_raw_prompts_with_chat_template_observations_are_refused_naming_both_keys(tmp_path):
    """Observations rendered by the chat template continue a prompt the template rendered: over
    raw-text prompts (the embedded tasks, data.chat_template=false) every context differs at token
    0, which used to end the run at step 1. The data option says whether its prompts are
    chat-templated, the env option whether it continues the template."""
    env = ["env=custom", f"env.path={_user_env(tmp_path)}", "env.name=MyEnv"]
    rows = tmp_path / "train.jsonl"
    rows.write_text('{"prompt": "What is 6 times 7?"}\n')
    files = ["data=files", f"data.train_files=[{rows}]"]
    for data, why in (
        (["data=default"], "data DigitReverseTask gives raw-text prompts"),
        ([*files, "data.chat_template=false"], "data.chat_template=false renders the prompts as plain text"),
        (["data=reasoning_gym", "data.task=chain_sum", "data.chat_template=false"], "data.chat_template=false"),
    ):
        with pytest.raises(ConfigError) as err:
            _check(["model=smollm2_135m", *data, *env, "env.observation_format=chat_template"])
        (problem,) = err.value.problems
        assert (
            problem.key == "env.observation_format"
            and why in problem.fix
            and "env.observation_format=plain" in problem.fix
        )
    _check(["model=smollm2_135m", "data=default", *env, "env.observation_format=plain"])
    _check(["model=smollm2_135m", *files, *env])  # chat-templated rows under chat-template observations


def test_cli_dry_run_refuses_raw_prompts_with_chat_template_observations(tmp_path):
    proc = _run(
        "model=smollm2_135m",
        "data=default",
        "env=custom",
        f"env.path={_user_env(tmp_path)}",
        "env.name=MyEnv",
        "env.observation_format=chat_template",
        "launcher.dry_run=true",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if "env.observation_format" in x]
    assert "env.observation_format='chat_template'" in line and "data DigitReverseTask gives raw-text prompts" in line
