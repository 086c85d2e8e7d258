"""Every meaningless config value is refused before Ray starts, with the key, the value and the fix.

Each class of range (rates, coefficients, timeouts, fractions, sizes, lengths, enum strings, seeds,
relations between keys) goes through the real composition and `rlhf_orch.app.check`. Values that a
constructor or the planner refuses first (one at a time) are also fed straight to `validate`, which
must report them too, all at once. Nothing here starts Ray.
"""

from __future__ import annotations

import os
import time
from functools import lru_cache
from pathlib import Path

import pytest
import ray
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlhf_orch.app import check
from rlhf_orch.config.schema import register_configs
from rlhf_orch.config.ranges import RANGES
from rlhf_orch.config.validate import ConfigError, Hardware, check_run_dir_writable, validate

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
EXPERIMENTS = sorted(p.stem for p in Path(CONF_DIR, "experiment").glob("*.yaml"))
COLOCATED = ["placement=colocated", "launcher.dry_run=true"]


@pytest.fixture(scope="module", autouse=True)
def _hydra():
    """One Hydra context for the module (re-initialising it per compose would double this file's time)."""
    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        yield


def _compose(overrides: list[str]):
    return compose(config_name="config", overrides=list(overrides))


def _check(overrides: list[str]):
    cfg = _compose(overrides)
    return check(cfg, instantiate(cfg.launcher))


@lru_cache(maxsize=None)
def _composed_options(groups: tuple[str, ...]):
    return _compose(list(groups))


def _fast_config(overrides: list[str]):
    """`overrides` composed: group options by Hydra (cached per selection), values set on a copy.

    Setting a value on the structured config still converts and type-checks it against the schema.
    """
    groups = tuple(o for o in overrides if "." not in o.split("=", 1)[0])
    cfg = _composed_options(groups).copy()
    for o in overrides:
        key, value = o.split("=", 1)
        if "." in key:
            OmegaConf.update(cfg, key, _value(value), merge=False)
    return cfg


def _value(text: str):
    if text == "null":
        return None
    if text.startswith("[") and text.endswith("]"):
        return [v.strip() for v in text[1:-1].split(",") if v.strip()]
    if len(text) > 1 and text[0] == text[-1] == "'":
        return text[1:-1]
    return text  # the schema's field type converts it


# (overrides, text the message must hold: "key=value" or the key). BAD goes through Hydra's own
# composition of the overrides and check(), one or more per class of range; MORE_BAD through check()
# too, with its values set on a cached composition of its group options (`_fast_config`, faster).
BAD = [
    # rates
    (["algo.critic_lr=-1e-5"], "algo.critic_lr=-1e-05"),
    # coefficients
    (["algo=grpo", "algo.eps=0"], "algo.eps=0"),
    # timeouts
    (["sync.timeout_s=0"], "sync.timeout_s=0"),
    # fractions
    (["engine.gpu_memory_utilization=1.5"], "engine.gpu_memory_utilization=1.5"),
    ([*COLOCATED, "engine.gpu_memory_utilization=1.0"], "placement.engine_fraction=0.35"),
    # sizes and counts
    (["engine.kv_cache_gb=-1"], "engine.kv_cache_gb=-1"),
    (["launcher.num_cpus=2"], "launcher.num_cpus=2"),  # the default plan reserves 4 CPUs
    # lengths
    (["data.max_digits=20"], "data.response_max_len=16"),  # 20 digits + EOS do not fit 16 tokens
    # enum strings
    (["logger=wandb", "logger.mode=sideways"], "logger.mode='sideways'"),
    # seeds
    (["seed=-1"], "seed=-1"),
    # evaluation
    (["eval.pass_threshold=1.5"], "eval.pass_threshold=1.5"),  # the digit rule scores at most 1
    (["data=files", "data.train_files=[x.parquet]", "eval.every_n_steps=5"], "data.val_files=[]"),
    # relations between keys
    (["sync.timeout_s=900"], "fault.step_timeout_s=600"),  # a step waits on the sync
    # paths
    (["resume=/no/such/run"], "resume='/no/such/run'"),
]

MORE_BAD = [
    # rates and coefficients
    (["trainer.weight_decay=-0.1"], "trainer.weight_decay=-0.1"),
    (["algo.entropy_coef=-0.01"], "algo.entropy_coef=-0.01"),
    (["algo.clip_ratio_c=1.0"], "algo.clip_ratio_c=1.0"),  # the dual-clip bound must exceed 1
    (["algo.decoupled_is_cap=1.0"], "algo.decoupled_is_cap=1.0"),  # AReaL's drop threshold must exceed 1
    # every group of one: every advantage 0, the run would train on nothing
    (
        ["algo=reinforce_pp_baseline", "algo.samples_per_prompt=1", "algo.rollout_batch_size=64"],
        "algo.samples_per_prompt=1",
    ),
    (["trainer.optimizer=lion"], "trainer.optimizer='lion'"),
    (["algo=dapo", "algo.overlong_penalty=-1"], "algo.overlong_penalty=-1"),
    (["algo=dapo", "algo.max_gen_batches=0"], "algo.max_gen_batches=0"),
    (["algo.grad_clip=-1"], "algo.grad_clip=-1"),
    # timeouts
    (["sync.timeout_s=-5"], "sync.timeout_s=-5"),
    (["launcher.startup_timeout_s=0"], "launcher.startup_timeout_s=0"),
    (["fault.step_timeout_s=nan"], "fault.step_timeout_s=nan"),
    (["reward.timeout_s=1000"], "reward.timeout_s=1000"),  # beyond the whole step's limit
    # a tool call makes no engine step: past the step's limit the engine reads as hung
    (
        ["env=python_tool", "env.allow_weak_sandbox=true", "fault.step_timeout_s=150", "env.tool_timeout_s=40"],
        "env.tool_timeout_s=40",
    ),
    # fractions
    (["engine.gpu_memory_utilization=0"], "engine.gpu_memory_utilization=0"),
    # sizes and counts
    (["model.num_heads=3"], "model.num_heads=3"),  # 128 is not divisible by 3
    (["engine.kv_cache_gb=0"], "engine.kv_cache_gb=0"),
    (["engine.block_size=48"], "engine.block_size=48"),  # vLLM's CPU attention takes multiples of 32
    (["engine.block_size=0"], "engine.block_size=0"),
    (["transfer=padded", "trainer.share_prompts=true"], "trainer.share_prompts=True"),
    (["model.vocab_size=32"], "model.vocab_size=32"),
    (["model.num_layers=0"], "model.num_layers=0"),
    (["sync.bucket_mb=-1"], "sync.bucket_mb=-1"),
    (["sync=gloo_multi_sender", "placement.actor_ranks=2", "sync.senders=0"], "sync.senders=0"),
    (["checkpoint.every_n_steps=-1"], "checkpoint.every_n_steps=-1"),
    (["fault.max_engine_restarts=-1"], "fault.max_engine_restarts=-1"),
    (["eval.num_prompts=-1"], "eval.num_prompts=-1"),
    # lengths
    (["data.response_max_len=0"], "data.response_max_len=0"),
    (["data.filler_tokens=40"], "data.prompt_max_len=32"),
    (["data.filler_tokens=-1"], "data.filler_tokens=-1"),
    (["model.context_len=0"], "model.context_len=0"),
    # enum strings and names
    (["logger=wandb", "logger.project=team/run"], "logger.project='team/run'"),
    (["sync=gloo_multi_sender", "placement.actor_ranks=2", "sync.shard_by=layers"], "sync.shard_by='layers'"),
    (["model.dtype=float8"], "model.dtype='float8'"),
    # seeds
    (["trainer.seed=-1"], "trainer.seed=-1"),
    (["trainer.torch_threads=0"], "trainer.torch_threads=0"),
    (["logger.rollouts_per_step=0"], "logger.rollouts_per_step=0"),
    (["logger.rollouts_every_n_steps=0"], "logger.rollouts_every_n_steps=0"),
    (["data=reasoning_gym", "data.size=0"], "data.size=0"),
    (["data=reasoning_gym", "data.few_shot=-1"], "data.few_shot=-1"),
    (["data=reasoning_gym", "data.task="], "data.task=''"),
    (["reward=reasoning_gym"], "reward='reasoning_gym'"),  # its labels come only from data=reasoning_gym
    (["data.seed=-1"], "data.seed=-1"),
    # evaluation
    (["eval.pass_threshold=0"], "eval.pass_threshold=0"),  # the digit rule scores >= 0: every sample would pass
    (["eval.temperature=-1"], "eval.temperature=-1"),
    (["eval.before_train=true", "data.eval_size=0"], "data.eval_size=0"),
    # relations between keys
    (["algo.tis_cap=2", "algo.decoupled_is_cap=5"], "algo.decoupled_is_cap=5.0"),  # two importance weights
    (["data=files", "data.train_files=[x.parquet]", "data.prompt_key=null"], "data.prompt_template=None"),
    (["data=files", "data.train_files=[x.parquet]", "data.label_regex='(unclosed'"], "data.label_regex='(unclosed'"),
    (["data=files", "data.train_files=[]"], "data.train_files=[]"),
    (["data=files", "data.train_files=[x.parquet]", "data.default_source=''"], "data.default_source=''"),
    # moved here from BAD to keep the file fast (the same classes go through Hydra there)
    (["algo.lam=1.5"], "algo.lam=1.5"),
    (["fault.step_timeout_s=0"], "fault.step_timeout_s=0"),
    (["model.num_heads=8"], "head_dim = model.hidden_size / num_heads = 16 < 32"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last=0"),
    (["data.prompt_max_len=0"], "data.prompt_max_len=0"),
    (["data=files", "data.train_files=[x.parquet]", "data.overlong=truncate"], "data.overlong='truncate'"),
    (["data.min_digits=6"], "data.min_digits=6"),  # > max_digits=5
    (["reward=gsm8k", "reward.score=0"], "reward.score=0"),  # no more than a wrong answer (format_score 0)
    (["experiment_name=a/b"], "experiment_name='a/b'"),
    (["model=smollm2_student", "model.layers=0"], "model.layers=0"),  # a student keeps >= 1 layer
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_meaningless_value_is_refused_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as err:
        _check(overrides)
    _assert_names(err.value, expected)


@pytest.mark.parametrize("overrides,expected", MORE_BAD, ids=[" ".join(b[0]) for b in MORE_BAD])
def test_more_meaningless_values_are_refused(overrides, expected):
    cfg = _fast_config(overrides)
    with pytest.raises(ConfigError) as err:
        check(cfg, instantiate(cfg.launcher))
    _assert_names(err.value, expected)


def _assert_names(error: ConfigError, expected: str) -> None:
    message = str(error)
    assert expected in message, message
    for problem in error.problems:  # one line each: key, value, fix
        assert "\n" not in str(problem) and problem.fix


# Refused before validate runs, by the planner (PlacementError) or a constructor (ValueError); the
# message still names the key. `validate` repeats each (test below), so all are listed at once.
REFUSED_EARLIER = [
    (["placement.engines=0"], "placement.engines=0"),
    (["placement.engine_tp=0"], "placement.engine_tp=0"),
    (["placement.gpus_per_node=-1"], "placement.gpus_per_node=-1"),
    ([*COLOCATED, "placement.nodes=0"], "placement.nodes=0"),
    ([*COLOCATED, "placement.actor_fraction=0"], "placement.actor_fraction=0"),
    ([*COLOCATED, "placement.engine_fraction=0.6"], "placement.engine_fraction"),  # fractions sum to 1.25
    (["placement=split", "launcher.dry_run=true", "placement.ratio=3:0"], "placement.ratio='3:0'"),
    (["reward.timeout_s=0"], "reward.timeout_s=0"),
    (["reward.pool_size=-1"], "reward.pool_size=-1"),
]


@pytest.mark.parametrize("overrides,expected", REFUSED_EARLIER, ids=[" ".join(b[0]) for b in REFUSED_EARLIER])
def test_value_refused_by_planner_or_constructor_names_the_key(overrides, expected):
    cfg = _fast_config(overrides)
    with pytest.raises(ValueError) as err:  # ConfigError, PlacementError and constructor errors are ValueErrors
        check(cfg, instantiate(cfg.launcher))
    assert expected in str(err.value)


@pytest.fixture(scope="module")
def default_plan():
    _, plan = _check([])
    return plan


# Fed straight to validate (the plan of the default config): what constructors, the planner or
# instantiate(cfg.launcher) would refuse first is in the table too.
DIRECT = [
    (["placement.engines=0"], "placement.engines=0"),
    (["placement.engine_tp=0"], "placement.engine_tp=0"),
    (["placement.nodes=2"], "placement.nodes=2"),  # cpu_local is this machine
    (["placement.gpus_per_node=1"], "placement.gpus_per_node=1"),  # cpu_local has no GPUs
    (["placement=colocated", "placement.actor_fraction=0"], "placement.actor_fraction=0"),
    (["placement=colocated", "placement.critic_fraction=1.5"], "placement.critic_fraction=1.5"),
    (["placement=colocated", "placement.engine_fraction=0.6"], "placement.actor_fraction+placement.critic_fraction"),
    (["placement=colocated", "placement.engine_tp=3"], "placement.engine_tp=3"),  # does not divide 8 GPUs per node
    (["placement=split", "placement.ratio=3:0"], "placement.ratio='3:0'"),
    (["placement=split", "placement.ratio=a:b"], "placement.ratio='a:b'"),
    (["placement=split", "placement.reference_fraction=1.0"], "placement.reference_fraction=1.0"),
    (["placement=split", "placement.vllm_gpus=0"], "placement.vllm_gpus=0"),
    (["placement=split", "placement.vllm_gpus=3", "placement.engine_tp=2"], "placement.vllm_gpus=3"),
    (["reward.timeout_s=0"], "reward.timeout_s=0"),
    (["reward.pool_size=-1"], "reward.pool_size=-1"),
    (["reward=gsm8k", "reward.method=fuzzy"], "reward.method='fuzzy'"),
    (["reward=countdown", "reward.score=inf"], "reward.score=inf"),
    (["reward=model", "reward.micro_batch_size=0"], "reward.micro_batch_size=0"),
    (["reward=model", "reward.weight=0"], "reward.weight=0"),
    (["reward=custom", "reward.path=x.py", "reward.name=not-a-name"], "reward.name='not-a-name'"),
    (["placement=colocated", "engine.kv_cache_gb=0"], "engine.kv_cache_gb=0"),
    (["launcher.logical_gpus=-1"], "launcher.logical_gpus=-1"),
    (["launcher.num_cpus=0"], "launcher.num_cpus=0"),
    (["launcher=cluster", "launcher.num_cpus=4"], "launcher.num_cpus=4"),
    (["launcher.address=10.0.0.1:6379"], "launcher.address='10.0.0.1:6379'"),  # launcher=local never joins
    (["launcher.keep_actors=true"], "launcher.keep_actors=True"),  # needs reuse_session=true
]


@pytest.mark.parametrize("overrides,expected", DIRECT, ids=[" ".join(b[0]) for b in DIRECT])
def test_validate_itself_reports_values_refused_earlier(overrides, expected, default_plan):
    typed = OmegaConf.to_object(_fast_config(overrides))  # builds no group option
    with pytest.raises(ConfigError) as err:
        validate(typed, default_plan, Hardware(gpus=8, cuda=False))
    assert expected in str(err.value)


def test_every_problem_is_reported_at_once():
    overrides = [
        "algo.critic_lr=-1",
        "sync.timeout_s=0",
        "engine.gpu_memory_utilization=2",
        "engine.kv_cache_gb=0",
        "data.min_digits=0",
        "seed=-3",
        "checkpoint.keep_last=0",
        "eval.temperature=-1",
        "logger=wandb",
        "logger.mode=loud",
        "trainer.weight_decay=-1",
    ]
    with pytest.raises(ConfigError) as err:
        _check(overrides)
    keys = {p.key for p in err.value.problems}
    for key in (
        "algo.critic_lr",
        "sync.timeout_s",
        "engine.gpu_memory_utilization",
        "engine.kv_cache_gb",
        "data.min_digits",
        "seed",
        "checkpoint.keep_last",
        "eval.temperature",
        "logger.mode",
        "trainer.weight_decay",
    ):
        assert key in keys, (key, keys)


def test_every_range_row_names_a_schema_key():
    from dataclasses import fields

    from rlhf_orch.config import schema

    known = {
        f"{group}.{f.name}"
        for group, options in schema._GROUP_SCHEMAS.items()
        for node in options.values()
        for f in fields(node)
    }
    known |= {
        f"{name}.{f.name}"
        for name, node in (
            ("trainer", schema.TrainerConfig),
            ("engine", schema.EngineConfig),
            ("eval", schema.EvalConfig),
            ("checkpoint", schema.CheckpointConfig),
            ("fault", schema.FaultConfig),
        )
        for f in fields(node)
    }
    known |= {f.name for f in fields(schema.RootConfig)}
    known |= {f"model.lora.{f.name}" for f in fields(schema.LoraConfig)}  # a node every model option has
    assert [r.key for r in RANGES if r.key not in known] == []


def test_default_config_passes():
    typed, plan = _check([])
    assert plan.layout == "cpu_local" and typed.algo.num_steps >= 1


ONE_CAP = [["algo.tis_cap=2"], ["algo.decoupled_is_cap=5"], ["algo=grpo", "algo.decoupled_is_cap=1.5"]]


@pytest.mark.parametrize("overrides", ONE_CAP, ids=[" ".join(o) for o in ONE_CAP])
def test_either_importance_weight_cap_alone_passes(overrides):
    # Only the pair is refused (tests above); each correction alone is a valid run.
    cfg = _fast_config(overrides)
    typed, _ = check(cfg, instantiate(cfg.launcher))
    assert (typed.algo.tis_cap is None) != (typed.algo.decoupled_is_cap is None)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_passes(name):
    # The published experiments ask for GPU clusters: a dry run plans for them on any machine.
    cfg = _compose([f"experiment={name}", "launcher.dry_run=true"])
    typed, plan = check(cfg, instantiate(cfg.launcher))
    assert typed.experiment_name == name
    if plan.total_gpus == 0:  # a CPU experiment passes as a real run here too
        OmegaConf.update(cfg, "launcher.dry_run", False)
        check(cfg, instantiate(cfg.launcher))


def test_a_bad_value_is_refused_in_seconds():
    _check([])  # warm: the first check imports torch
    t0 = time.perf_counter()
    with pytest.raises(ConfigError):
        _check(["algo.critic_lr=-1"])
    assert time.perf_counter() - t0 < 5


# --------------------------------------------------------------------------- the cluster address
def test_unreachable_cluster_address_is_a_connection_error_within_seconds():
    assert not ray.is_initialized()
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError) as err:
        _check(["launcher=cluster", "launcher.address=127.0.0.1:1"])
    assert time.perf_counter() - t0 < 10
    assert "127.0.0.1:1" in str(err.value)
    assert not ray.is_initialized()  # refused before ray.init


def test_ray_client_address_is_probed_too():
    from launchers.cluster import check_reachable, resolve_address

    assert resolve_address("ray://head.example:10002") == ("head.example", 10002)
    assert resolve_address("ray://head.example") == ("head.example", 10001)
    with pytest.raises(ConnectionError, match="127.0.0.1:1"):
        check_reachable("ray://127.0.0.1:1")


def test_auto_without_any_cluster_fails_fast(monkeypatch):
    from ray._private import services

    from launchers.cluster import resolve_address

    def nothing(addr, temp_dir=None):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "canonicalize_bootstrap_address", nothing)
    with pytest.raises(ConnectionError, match="launcher.address='auto' found no Ray cluster"):
        resolve_address("auto")


def test_auto_follows_ray_address(monkeypatch):
    from launchers.cluster import check_reachable

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with pytest.raises(ConnectionError, match="127.0.0.1:1"):
        check_reachable("auto")


@pytest.mark.parametrize("address", ["head-without-port", "http://head:8265", "head:notaport"])
def test_malformed_address_names_the_key(address):
    from launchers.cluster import resolve_address

    with pytest.raises(ValueError, match="launcher.address="):
        resolve_address(address)


# --------------------------------------------------------------------------- the run directory
def test_writable_run_dir_passes_and_is_left_clean(tmp_path):
    run_dir = tmp_path / "outputs" / "run"
    check_run_dir_writable(run_dir)
    assert run_dir.is_dir() and list(run_dir.iterdir()) == []


def test_unwritable_run_dir_is_refused(tmp_path):
    if os.geteuid() == 0:
        # root ignores permission bits: a directory below a regular file can never be created.
        (tmp_path / "afile").write_text("x")
        run_dir = tmp_path / "afile" / "run"
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        run_dir = locked / "run"
    try:
        with pytest.raises(ConfigError) as err:
            check_run_dir_writable(run_dir)
    finally:
        if os.geteuid() != 0:
            (tmp_path / "locked").chmod(0o700)
    assert err.value.problems[0].key == "hydra.run.dir"
    assert str(run_dir) in str(err.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_read_only_existing_run_dir_is_refused(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="hydra.run.dir"):
            check_run_dir_writable(tmp_path)
    finally:
        tmp_path.chmod(0o700)


def test_full_disk_is_refused(tmp_path, monkeypatch):
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("rlhf_orch.config.validate.tempfile.mkstemp", full)
    with pytest.raises(ConfigError, match="hydra.run.dir.*No space left on device"):
        check_run_dir_writable(tmp_path / "run")


def test_ranges_alone_need_no_plan():
    from rlhf_orch.config.ranges import validate_values

    validate_values(OmegaConf.to_object(_fast_config([])))
    with pytest.raises(ConfigError) as err:  # what the planner and reward constructors would refuse one by one
        validate_values(OmegaConf.to_object(_fast_config(["placement.engines=0", "reward.timeout_s=0", "algo.lam=2"])))
    assert [p.key for p in err.value.problems] == ["placement.engines", "reward.timeout_s", "algo.lam"]


def test_one_seed_sets_the_data_order_the_engines_and_the_trainers():
    typed = OmegaConf.to_object(_fast_config(["seed=7"]))
    assert typed.seed == typed.data.seed == typed.trainer.seed == 7
    pinned = OmegaConf.to_object(_fast_config(["seed=7", "data.seed=3"]))  # one part pinned alone
    assert (pinned.data.seed, pinned.trainer.seed) == (3, 7)


COLOCATED = [
    "placement=colocated",
    "placement.gpus_per_node=2",
    "launcher.logical_gpus=2",
    "placement.engines=1",
]  # sleep needs GPUs


def test_lora_keys_are_checked_and_do_nothing_at_rank_zero():
    typed, _ = _check(["model.lora.rank=16"])
    assert typed.model.lora.alpha is None  # null: 4 x rank
    for overrides, key in (
        (["model.lora.alpha=32"], "model.lora.alpha"),
        (["model.lora.sync=merged"], "model.lora.sync"),
        (["model.lora.target_modules=[q_proj]"], "model.lora.target_modules"),
        (["model.lora.rank=-1"], "model.lora.rank"),
        (["model.lora.rank=600"], "model.lora.rank"),
        (["model.lora.rank=8", "model.lora.dropout=1.0"], "model.lora.dropout"),
        (["model.lora.rank=8", "model.lora.alpha=0"], "model.lora.alpha"),
        (["model.lora.rank=8", "model.lora.sync=both"], "model.lora.sync"),
        (["model.lora.rank=8", "model.lora.target_modules=[]"], "model.lora.target_modules"),
        (["model.lora.rank=8", "model.lora.target_modules=[embed_tokens,q_proj]"], "model.lora.target_modules"),
        (
            ["model.lora.rank=8", "model.lora.target_modules=[lm_head,q_proj]", "model.lora.sync=merged"],
            "model.lora.target_modules",
        ),
        (["model.lora.rank=8", "model.lora.target_modules=q_proj"], "model.lora.target_modules"),  # a PEFT regex
        (["model.lora.rank=8", "engine.sleep_level=2", *COLOCATED], "engine.sleep_level"),
    ):
        with pytest.raises(ConfigError) as err:
            _check(overrides)
        assert key in {p.key for p in err.value.problems}, (overrides, err.value)
    # merged weights restore what sleep level 2 drops
    _check(["model.lora.rank=8", "model.lora.sync=merged", "engine.sleep_level=2", *COLOCATED])


def test_a_tool_timeout_whose_step_wait_fits_the_step_timeout_passes():
    """env.tool_timeout_s=35 under python_tool: one step may take 4 x 35 + 5 = 145 s, within
    fault.step_timeout_s=150 (40 s would be 165 s: refused, MORE_BAD)."""
    cfg = _fast_config(
        [
            "env=python_tool",
            "env.allow_weak_sandbox=true",
            "fault.step_timeout_s=150",
            "env.tool_timeout_s=35",
            "env.observation_format=plain",
        ]
    )  # (the default data's prompts are raw text)
    typed, _ = check(cfg, instantiate(cfg.launcher))
    assert typed.env.tool_timeout_s == 35
