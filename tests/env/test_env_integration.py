"""Multi-turn rollouts on a real vLLM engine and in whole runs (tiny model, CPU).

The environment is a user's file, written here as a user writes one (`env=custom`): two tries at
the digit task, the prompt shown again after the first answer. On a real engine: every token the
model generated is kept as generated (the trainer's log-probs of them equal the engine's), the
observation's tokens are masked context, and decoding then re-encoding would have changed the ids
(so keeping them matters). In whole runs: the env metrics, evaluation, and exact resume under
one_step_off with the held multi-turn rollout carried in the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import ray
import torch
from hydra.utils import instantiate

from rlhf_orch.app import check
from rlhf_orch.data.digit_task import score_response
from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngineActor
from rlhf_orch.env.agent import AgentEnv
from rlhf_orch.env.custom import CustomEnv
from rlhf_orch.logging.base import read_metrics
from rlhf_orch.orchestration.session import run_training
from rlhf_orch.transfer.batch import LOSS_MASK, SAMPLING_TEMPERATURE
from rlhf_orch.transfer.engine_side import RolloutJob
from rlhf_orch.transfer.plan import whole_prompt_requests
from tests.conftest import SHARED_RAY, compose_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("shared_ray")]

TOLERANCE = 1e-4  # nats, float32 on both sides (as the weight-sync tests)
ENGINE_ENV = {
    "env_vars": {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
}

DIGIT_RETRY = '''
from rlhf_orch.data.digit_task import score_response


class DigitRetry:
    """Two tries at the digit task: after the first answer the prompt is shown again."""

    def __init__(self, env_config=None, extras=None):
        self.answer = extras["reward_spec"]["ground_truth"]
        self.turns = 0

    def init(self, prompt):
        self.prompt = prompt[-1]["content"]
        return prompt, {}

    def step(self, action):
        self.turns += 1
        done = self.turns >= 2
        observations = [] if done else [{"role": "user", "content": " " + self.prompt}]
        return {"observations": observations, "reward": score_response(self.answer, action), "done": done, "metadata": {}}
'''


@pytest.fixture(scope="module")
def env_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("env") / "digit_retry.py"
    path.write_text(DIGIT_RETRY)
    return str(path)


def _env_overrides(env_file: str) -> list[str]:
    return [
        "env=custom",
        f"env.path={env_file}",
        "env.name=DigitRetry",
        "env.observation_format=plain",
        "env.max_turns=2",
        "env.max_tokens_per_turn=12",
        "data.response_max_len=40",
    ]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    spec = EngineSpec(model_path=tiny_model_path, dtype="float32", max_model_len=128)
    actor = VLLMEngineActor.options(num_cpus=1, runtime_env=ENGINE_ENV).remote(spec, 0)
    ray.get(actor.ping.remote())
    yield actor
    ray.kill(actor)


def _digit_prompts(tokenizer, n: int):
    task = instantiate(compose_config([]).data)
    task.bind(tokenizer)
    return task.sample_prompts(n)


def _trainer_logprobs(model, s) -> torch.Tensor:
    """The trainer's model over the whole sequence: each response token's log-prob, at the
    temperature it was sampled at (its `sampling_temperature`; 0 or none: the run's, 1 here)."""
    full = torch.cat([s.prompt_ids, s.response_ids]).long()
    with torch.no_grad():
        logits = model(full[None]).logits[0, len(s.prompt_ids) - 1 : -1]
    own = s.fields.get(SAMPLING_TEMPERATURE)
    scored = torch.ones(len(s.response_ids)) if own is None else torch.where(own > 0, own, torch.ones_like(own))
    return torch.log_softmax(logits / scored[:, None], -1).gather(-1, s.response_ids[:, None].long())[:, 0]


def _assert_trainer_logprobs_equal_the_engine_s(model, s) -> None:
    """The trainer's model over the whole sequence scores the model's tokens (loss mask 1) as the
    engine did when it sampled them."""
    trainer = _trainer_logprobs(model, s)
    keep = s.fields[LOSS_MASK].bool()
    assert torch.allclose(trainer[keep], s.engine_logprobs[keep], atol=TOLERANCE)


def _agent_job(prompts, env, samples_per_prompt: int) -> RolloutJob:
    """A rollout of `env` (an AgentEnv) over `prompts`, at temperature 1 with 40 tokens per trajectory."""
    return RolloutJob(
        prompt_ids={i: list(p.prompt_ids) for i, p in enumerate(prompts)},
        prompts=dict(enumerate(prompts)),
        samples_per_prompt=samples_per_prompt,
        max_tokens=40,
        temperature=1.0,
        scorer=None,
        env=env,
    )


def test_trajectories_keep_the_engines_tokens_and_mask_observations(engine, env_file, tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    prompts = _digit_prompts(tokenizer, 4)
    env = CustomEnv(path=env_file, name="DigitRetry", max_turns=2, max_tokens_per_turn=10, observation_format="plain")
    job = RolloutJob(
        prompt_ids={i: list(p.prompt_ids) for i, p in enumerate(prompts)},
        prompts=dict(enumerate(prompts)),
        samples_per_prompt=2,
        max_tokens=32,
        temperature=1.0,
        scorer=None,
        env=env,
    )
    requests = whole_prompt_requests(range(4), 2)
    ray.get(engine.reseed.remote(123))
    samples, _ = ray.get(engine.produce_samples.remote(requests, job))
    assert len(samples) == 8
    re_encoding_changes_ids = 0
    for s in samples:
        prompt = prompts[s.index // 2]
        ids = s.response_ids.tolist()
        mask = s.fields[LOSS_MASK].tolist()
        observation = tokenizer(" " + prompt.text, add_special_tokens=False)["input_ids"]
        # turn 1 (model), the observation (context), turn 2 (model)
        start = mask.index(0.0)
        end = start + len(observation)
        assert ids[start:end] == observation and set(mask[start:end]) == {0.0}
        assert start >= 1 and end < len(ids) and set(mask[:start]) == set(mask[end:]) == {1.0}
        assert s.engine_logprobs[start:end].abs().sum() == 0  # no log-prob for what the model did not write
        # the trainer's view of the same ids: log-probs of the model's tokens equal the engine's
        _assert_trainer_logprobs_equal_the_engine_s(model, s)
        # the environment's reward: the digit score of the second try
        assert s.reward == pytest.approx(
            score_response(prompt.label, tokenizer.decode(ids[end:], skip_special_tokens=True))
        )
        # what re-tokenising the transcript would have trained on instead
        text = tokenizer.decode(ids, skip_special_tokens=True)
        re_encoding_changes_ids += tokenizer(text, add_special_tokens=False)["input_ids"] != ids
    assert re_encoding_changes_ids >= 1
    # Per-turn seeds: the same step seed draws the same trajectories, whatever order turns finish in.
    ray.get(engine.reseed.remote(123))
    again, _ = ray.get(engine.produce_samples.remote(requests, job))
    assert [a.response_ids.tolist() for a in again] == [s.response_ids.tolist() for s in samples]


EXAMPLE_AGENT = str(Path(__file__).resolve().parents[2] / "scripts" / "examples" / "openai_agent.py")
AGENT_LOG = '''
import json, os, sys
sys.path.insert(0, {examples!r})
import openai_agent


def three_tries_logged(row, client, base_url, **kwargs):
    """The example agent, writing down every reply it was sent."""
    replies = []
    create = client.chat.completions.create

    def logged(**kw):
        reply = create(**kw)
        replies.append(reply.choices[0].message.content)
        return reply

    client.chat.completions.create = logged
    result = openai_agent.three_tries(row, client)
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"url": base_url, "replies": replies, "score": result["score"]}}) + "\\n")
    return result
'''


def test_an_openai_agent_s_calls_train_as_the_engine_generated_them(engine, tiny_model_path, tmp_path):
    """The example agent (the `openai` client; three dependent calls with a tool message between
    them) on a real engine: each trajectory is one sequence whose model tokens decode to exactly
    the replies the agent was sent, whose tool messages are masked context, and whose log-probs,
    recomputed by the trainer's model over the merged sequence, equal the engine's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    prompts = _digit_prompts(tokenizer, 3)
    log = tmp_path / "replies.jsonl"
    path = tmp_path / "agent.py"
    path.write_text(AGENT_LOG.format(examples=str(Path(EXAMPLE_AGENT).parent), log=str(log)))
    env = AgentEnv(path=str(path), name="three_tries_logged", max_tokens_per_turn=8, prompt_max_len=32)
    job = _agent_job(prompts, env, samples_per_prompt=2)
    ray.get(engine.reseed.remote(5))
    samples, _ = ray.get(engine.produce_samples.remote(whole_prompt_requests(range(3), 2), job))
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(samples) == len(seen) == 6 and all(len(s["replies"]) == 3 for s in seen)
    trained_replies = []
    for s in samples:
        ids, mask = s.response_ids.tolist(), s.fields[LOSS_MASK].tolist()
        spans, context = [[]], []
        for t, m in zip(ids, mask):
            if m:
                spans[-1].append(t)
            else:
                context.append(t)
                if spans[-1]:
                    spans.append([])
        trained_replies.append(tuple(tokenizer.decode(span, skip_special_tokens=True) for span in spans if span))
        tool = tokenizer(" " + prompts[s.index // 2].text, add_special_tokens=False)["input_ids"]
        # the two tool messages as the chat template renders them (after the EOS it closes a reply
        # cut at max_tokens with)
        assert [t for t in context if t != tokenizer.eos_token_id] == tool + tool
        assert s.prompt_ids.tolist() == list(prompts[s.index // 2].prompt_ids)  # the first call's prompt is the row's
        _assert_trainer_logprobs_equal_the_engine_s(model, s)
        assert s.engine_logprobs[~torch.tensor(mask, dtype=torch.bool)].abs().sum() == 0
    assert sorted(trained_replies) == sorted(tuple(r["replies"]) for r in seen)
    assert sorted(s.reward for s in samples) == pytest.approx(sorted(r["score"] for r in seen))


OWN_SAMPLING = '''
def own_sampling(row, client, **kwargs):
    """Calls as agents write them: two choices at 0.6, an answer at 1.4 extending the first, a
    greedy one, one truncated by top_p."""
    messages = list(row["messages"])
    two = client.chat.completions.create(model="policy", messages=messages, n=2, temperature=0.6, max_tokens=6)
    first = two.choices[0].message.content
    messages += [{{"role": "assistant", "content": first}}, {{"role": "tool", "content": " " + row["prompt"]}}]
    client.chat.completions.create(model="policy", messages=messages, temperature=1.4, max_tokens=6)
    client.chat.completions.create(model="policy", messages=list(row["messages"]), temperature=0, max_tokens=4)
    client.chat.completions.create(model="policy", messages=list(row["messages"]), top_p=0.5, max_tokens=6)
    return 1.0
'''


def test_calls_at_their_own_sampling_train_at_it_on_a_real_engine(engine, tiny_model_path, tmp_path):
    """env.sampling=call on vLLM: each token's log-prob recomputed by the trainer's model at the
    temperature its call asked for equals the engine's; n=2 makes two sequences of one prompt; a
    greedy call's tokens are context; top-p's tokens the engine drew from the truncated distribution
    (its log-prob is above the whole vocabulary's: the gap importance weights are for) and, the job
    having none, are context too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, torch_dtype=torch.float32).eval()
    prompts = _digit_prompts(tokenizer, 2)
    path = tmp_path / "agent.py"
    path.write_text(OWN_SAMPLING.format())
    env = AgentEnv(path=str(path), name="own_sampling", max_tokens_per_turn=8, prompt_max_len=32)
    job = _agent_job(prompts, env, samples_per_prompt=1)
    ray.get(engine.reseed.remote(5))
    samples, _ = ray.get(engine.produce_samples.remote(whole_prompt_requests(range(2), 1), job))
    assert len(samples) == 2 * 4  # per trajectory: the two choices (one extended), the greedy call, the top-p one
    top_p_gaps = []
    for s in samples:
        temperature = s.fields[SAMPLING_TEMPERATURE]
        trainer = _trainer_logprobs(model, s)  # each token at its own temperature
        keep = s.fields[LOSS_MASK].bool()
        assert torch.all(temperature[keep] > 0)  # only the calls at their own temperatures train
        assert {round(t, 3) for t in temperature[keep].tolist()} <= {0.6, 1.4}
        assert torch.allclose(trainer[keep], s.engine_logprobs[keep], atol=TOLERANCE)
        if not keep.any():  # the greedy call (scored as the engine did: no gap) or the top-p one
            top_p_gaps.append(float((s.engine_logprobs - trainer).min()))
    # greedy: the engine's log-probs are the whole vocabulary's at temperature 1, as the trainer's;
    # top_p=0.5 renormalises every drawn token up
    greedy, top_p = sorted(top_p_gaps)[:2], sorted(top_p_gaps)[2:]
    assert max(map(abs, greedy)) < TOLERANCE and min(top_p) > 1e-3, top_p_gaps
    by_prompt = {}
    for s in samples:
        by_prompt.setdefault(tuple(s.prompt_ids.tolist()), []).append(s)
    assert sorted(len(v) for v in by_prompt.values()) == [4, 4]  # every call of a trajectory starts from its row
    assert sum(not s.fields[LOSS_MASK].any() for s in samples) == 4  # the greedy and the top-p sequences
    assert sum(bool((s.fields[SAMPLING_TEMPERATURE] > 1.0).any()) for s in samples) == 2  # the extended choice


def _run(overrides: list[str], run_dir: Path) -> list[dict]:
    cfg = compose_config([*overrides, *SHARED_RAY])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    summary = run_training(cfg, typed, plan, launcher, run_dir)
    assert summary["status"] == "completed"
    return read_metrics(run_dir)


def _skyrl_parquet(verl_parquet: str, out: Path) -> str:
    """The digit task's veRL parquet rewritten in SkyRL's layout, as docs/environments.md shows."""
    import pandas as pd

    rows = pd.read_parquet(verl_parquet)
    rows["env_class"] = "gsm8k_multi_turn"
    rows["reward_spec"] = [{"method": "rule", "ground_truth": rm["ground_truth"]} for rm in rows["reward_model"]]
    rows["extra_info"] = [{"max_turns": 2} for _ in range(len(rows))]
    rows.drop(columns=["reward_model"]).to_parquet(out)
    return str(out)


def test_a_skyrl_gym_environment_trains_from_a_skyrl_parquet_and_evaluates(tmp_path, digit_files):
    """skyrl-gym's gsm8k_multi_turn, unchanged, on rows in SkyRL's parquet layout: every trajectory
    plays both turns (the tiny model never writes '####', so the environment asks again), the
    observation is skyrl's own follow-up, evaluation plays held-out rows the same way."""
    train = _skyrl_parquet(digit_files["verl"]["train"], tmp_path / "train.parquet")
    val = _skyrl_parquet(digit_files["verl"]["test"], tmp_path / "val.parquet")
    rows = _run(
        [
            "env=skyrl",
            "env.observation_format=plain",
            "env.max_turns=2",
            "env.max_tokens_per_turn=12",
            "env.max_observation_tokens=24",
            "data=files",
            f"data.train_files=[{train}]",
            f"data.val_files=[{val}]",
            "data.label_key=reward_spec.ground_truth",
            "data.response_max_len=48",
            "data.prompt_max_len=32",
            "experiment=quick",
            "algo.num_steps=2",
            "eval.every_n_steps=2",
            "eval.num_prompts=8",
            "checkpoint.export_final=false",
        ],
        tmp_path / "run",
    )
    train_rows = [r for r in rows if r["step"] > 0]
    for r in train_rows:
        assert r["env/turns_mean"] == 2.0 and r["env/step_errors"] == 0
        assert r["env/observation_tokens_mean"] > 0 and r["reward/mean"] == 0.0
        assert r["rollout/logprob_diff_max"] < 1e-3  # on-policy: the trainer recomputes what the engine sampled
    assert any(k.startswith("eval/") for k in train_rows[-1])


def test_one_step_off_multi_turn_resume_is_exact(tmp_path, env_file):
    """PPO on per-turn rewards (env.reward=per_turn): each try's reward reaches the policy ranks on
    its turn's last token (the rollout dump reads them back from the rank). The step-1 checkpoint
    carries step 2's held multi-turn rollout (loss masks, turn rewards and env counters included);
    the resumed run's metrics equal the uninterrupted run's."""
    overrides = [
        *_env_overrides(env_file),
        "env.reward=per_turn",
        "experiment=quick",
        "algo.num_steps=3",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=3",
        "checkpoint.export_final=false",
        "pipeline=one_step_off",
        "algo.tis_cap=2",
    ]
    whole = tmp_path / "whole"
    rows = _run(overrides, whole)
    assert all(r["env/turns_mean"] == 2.0 for r in rows)
    dumped = [
        json.loads(line)
        for p in sorted((whole / "rollouts").glob("step_*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    assert dumped and all(d["turns"] == 2 and len(d["turn_rewards"]) == len(d["turn_advantages"]) == 2 for d in dumped)
    assert all(sum(d["turn_rewards"]) == pytest.approx(d["reward"], abs=1e-5) for d in dumped)
    assert any(d["turn_rewards"][0] > 0 for d in dumped), "no first try was rewarded on its own turn"
    cut = tmp_path / "cut"
    shutil.copytree(whole / "checkpoints" / "step_00000001", cut / "checkpoints" / "step_00000001")
    (cut / "metrics.jsonl").write_text((whole / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    resumed = _run([*overrides, f"resume={cut}"], cut)
    timing = ("time/", "perf/", "share/", "sync/gb_per_s", "transfer/metadata")
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(timing)} for r in rs]  # noqa: E731
    assert strip(resumed) == strip(rows)


# slow (~60-100 s): the tiny tool model is built on first use (~30 s), then 20 steps of learning --
# learning needs the steps.
@pytest.mark.extended
@pytest.mark.slow
def test_tool_use_learns_to_call_the_lookup_tool_under_the_async_pipeline(tmp_path):
    """`experiment=tool_use`: the tiny tool model starts calling the lookup tool about half the
    time and copying its answer unsurely (reward ~0.3); PPO takes it to calling it nearly always
    and copying it (recorded, pipeline=sync: first fifth 0.31, last fifth 0.81 over the 20 steps;
    pipeline=async, as here: 0.27 -> 0.79). The bar: the last fifth of the steps at least 0.3
    above the first fifth, with tool calls in every step. Under `pipeline=async`
    (max_staleness=1): multi-turn rollouts generated a step ahead, the weights landing between
    turns, corrected by AReaL's decoupled PPO -- the sync pipeline's multi-turn runs are the
    other tests of this file."""
    rows = _run(
        ["experiment=tool_use", "checkpoint.export_final=false", "pipeline=async", "algo.decoupled_is_cap=5"], tmp_path
    )
    assert max(r["rollout/staleness_max"] for r in rows) == 1
    rewards = [r["reward/mean"] for r in rows]
    fifth = max(len(rewards) // 5, 1)
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    assert last >= first + 0.3, (first, last, rewards)
    assert all(r["env/tool_calls_mean"] > 0 for r in rows)
    assert rows[-1]["env/tool_calls_mean"] > rows[0]["env/tool_calls_mean"]


KILLING_ENV = (
    DIGIT_RETRY
    + '''

import os


class DigitRetryThatKillsItsEngine(DigitRetry):
    """Once the test arms it, the first step to see the marker kills its engine's process."""

    def step(self, action):
        marker = {marker!r}
        if os.path.exists(marker):
            try:
                os.rename(marker, marker + ".taken")  # exactly one engine dies
            except FileNotFoundError:
                pass
            else:
                os._exit(1)
        return super().step(action)
'''
)


# slow (~60-100 s): two engines, one killed inside an environment step and started again (a second
# vLLM start-up) -- the replacement is what the test proves.
@pytest.mark.extended
@pytest.mark.slow
def test_an_engine_dying_inside_an_environment_step_is_replaced(tmp_path):
    """An environment step takes its engine's process down mid-trajectory (a tool crashing it):
    the engine is replaced, its trajectories are played again from the start, and the step trains
    on every sample exactly once."""
    marker = tmp_path / "kill"
    path = tmp_path / "killing_env.py"
    path.write_text(KILLING_ENV.replace("{marker!r}", repr(str(marker))))
    cfg_overrides = [
        *_env_overrides(str(path)),
        "env.name=DigitRetryThatKillsItsEngine",
        "experiment=quick",
        "algo.num_steps=3",
        "placement.engines=2",
        "checkpoint.export_final=false",
    ]
    cfg = compose_config([*cfg_overrides, *SHARED_RAY])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)

    def arm(step: int, loop) -> None:
        if step == 1:
            marker.write_text("")  # step 2's rollout loses an engine inside an env.step

    run_training(cfg, typed, plan, launcher, tmp_path / "run", callbacks=[arm])
    rows = read_metrics(tmp_path / "run")
    assert [r["fault/engine_restarts"] for r in rows] == [0, 1, 1]
    assert Path(str(marker) + ".taken").exists()
    assert all(r["rollout/samples"] == 8 * 2 and r["env/turns_mean"] == 2.0 for r in rows)


# The plan of the agent runs below (one set of actors, kept from run to run: launcher.keep_actors): two
# engines, each serving its agents' calls; two policy ranks, each hosting its reference rank
# (placement.reference_in_actor).
AGENT_PLAN = ["placement.engines=2", "placement.actor_ranks=2", "placement.reference_ranks=2"]


@pytest.mark.extended
def test_the_example_agent_trains_and_leaves_no_listener(tmp_path):
    """`env=agent` with the example agent in a whole run: every trajectory's calls merge (none
    unmerged, no agent errors), the policy trains on them, and once the run has ended nothing
    listens where the engines served the agents, and no agent host process is left."""
    import socket

    cfg = compose_config(
        [
            "experiment=quick",
            "algo.num_steps=2",
            "checkpoint.export_final=false",
            "env=agent",
            f"env.path={EXAMPLE_AGENT}",
            "env.name=three_tries",
            "env.max_tokens_per_turn=8",
            "data.response_max_len=40",
            *AGENT_PLAN,
            *SHARED_RAY,
        ]
    )
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    endpoints = []

    engine_pids = set()

    def where(step: int, loop) -> None:
        endpoints.extend(e for e in ray.get([engine.chat_endpoint.remote() for engine in loop.actors.engines]) if e)
        engine_pids.update(
            ray.get([engine.__ray_call__.remote(lambda self: os.getpid()) for engine in loop.actors.engines])
        )

    summary = run_training(cfg, typed, plan, launcher, tmp_path, callbacks=[where])
    assert summary["status"] == "completed"
    rows = read_metrics(tmp_path)
    for r in rows:
        assert r["env/calls_mean"] > 2.5 and r["env/unmerged_calls"] == 0 and r["env/agent_errors"] == 0
        assert r["env/tries_mean"] == r["env/calls_mean"] and r["rollout/samples"] == 16
    assert (
        rows[-1]["policy/grad_norm"] > 0
    )  # it trains (the on-policy PPO loss of whitened advantages can be exactly 0)
    assert len({(e["host"], e["port"]) for e in endpoints}) == 2  # one server per engine, for the engine's life
    for e in endpoints:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((e["host"], e["port"]), timeout=2)
    # nor is any agent host of these engines left (each engine's, closed with its endpoint; the
    # engines themselves live on for the next test: launcher.keep_actors)
    hosts = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            if b"agent_driver/host.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                hosts.append((pid, int(status.split("\nPPid:")[1].split()[0])))
        except OSError:
            pass
    assert len(engine_pids) == 2 and [h for h in hosts if h[1] in engine_pids] == []


TWO_CONVERSATIONS = '''
import sys
sys.path.insert(0, {examples!r})
import openai_agent


def answer_then_retry_afresh(row, client, **kwargs):
    """Answers once; then starts a second conversation from the question alone (it extends
    nothing) and is scored on that one."""
    first = client.chat.completions.create(model="policy", messages=list(row["messages"]), max_tokens=8)
    second = client.chat.completions.create(model="policy", messages=list(row["messages"]), max_tokens=6)
    return openai_agent.digit_score(row["ground_truth"], second.choices[0].message.content)
'''


EXITING_AGENT = '''
import os
import sys
sys.path.insert(0, {examples!r})
import openai_agent


def answer_or_exit(row, client, **kwargs):
    """Answers; on a question whose answer starts with an odd digit, ends its own process
    (`os._exit(1)`) right after."""
    reply = client.chat.completions.create(model="policy", messages=list(row["messages"]), max_tokens=8)
    if int(row["ground_truth"].split()[0]) % 2:
        os._exit(1)
    return openai_agent.digit_score(row["ground_truth"], reply.choices[0].message.content)
'''


@pytest.mark.extended  # (~107 s in CI's tier: docs/testing.md says what CI runs of it)
def test_an_agent_that_ends_its_process_scores_zero_and_the_step_completes(tmp_path):
    """Agents that call `os._exit(1)` mid-trajectory inside a whole run: each such trajectory
    scores 0 and is counted in env/agent_errors; no engine is lost (the agents run out of its
    process), every step completes and trains."""
    path = tmp_path / "agent.py"
    path.write_text(EXITING_AGENT.format(examples=str(Path(EXAMPLE_AGENT).parent)))
    rows = _run(
        [
            "experiment=quick",
            "algo.num_steps=2",
            "checkpoint.export_final=false",
            "env=agent",
            f"env.path={path}",
            "env.name=answer_or_exit",
            "env.max_tokens_per_turn=8",
            "data.response_max_len=16",
            *AGENT_PLAN,
        ],
        tmp_path / "run",
    )
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/samples"] == 16 and r["fault/engine_restarts"] == 0
        assert 0 < r["env/agent_errors"] < 16 and r["env/calls_mean"] == 1.0
    assert (
        rows[-1]["policy/grad_norm"] > 0
    )  # it trains (the on-policy PPO loss of whitened advantages can be exactly 0)


# The full tier only (~130 s in CI's tier, most of it starting AGENT_PLAN's two engines and four ranks).
@pytest.mark.extended
@pytest.mark.parametrize("transfer", ["packed", "micro_batched"])
def test_every_conversation_of_an_agent_trains_on_every_rank_layout(tmp_path, transfer):
    """An agent whose trajectories hold two conversations (the second extends nothing): both train,
    with the trajectory's reward, over two policy ranks (the sequences then do not divide evenly:
    the ranks still step together), under the default packed transfer and the streaming one; the
    trainer's log-probs of every sequence equal the engine's."""
    path = tmp_path / "agent.py"
    path.write_text(TWO_CONVERSATIONS.format(examples=str(Path(EXAMPLE_AGENT).parent)))
    rows = _run(
        [
            "experiment=quick",
            "algo.num_steps=2",
            "checkpoint.export_final=false",
            "env=agent",
            f"env.path={path}",
            "env.name=answer_then_retry_afresh",
            "env.max_tokens_per_turn=8",
            "data.response_max_len=16",
            *AGENT_PLAN,
            f"transfer={transfer}",
        ],
        tmp_path / "run",
    )
    for r in rows:
        assert r["rollout/samples"] == 16 and r["rollout/sequences"] == 32
        assert r["env/calls_mean"] == 2.0 and r["env/unmerged_calls"] == 16 and r["env/agent_errors"] == 0
        assert r["rollout/logprob_diff_max"] < TOLERANCE
    assert (
        rows[-1]["policy/grad_norm"] > 0
    )  # it trains (the on-policy PPO loss of whitened advantages can be exactly 0)
