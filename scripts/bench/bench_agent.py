"""What the `env=agent` endpoint costs per call, against driving the engine directly, same run.

One vLLM engine on the tiny tool model (in this process, as an engine actor runs it) plays the
tool-use task's rollouts (`data=lookup`) three ways, on the same prompts and step seeds:

  direct        `env=lookup`: the engine's own multi-turn runner calls the lookup tool in-process
                (no HTTP, no client): the limit.
  agent_async   `env=agent` with `lookup_agent` (scripts/examples/openai_agent.py): an `async def`
                calling the endpoint with `openai.AsyncOpenAI`, the same conversations.
  agent_sync    the same agent as a plain function with `openai.OpenAI`.

(Either runs in a process of its own per trajectory, forked from the engine's agent host.)

Each at `--concurrency` trajectories in flight per engine (the `env.concurrency` default, and
more). Per mode: rollout wall time, model calls and calls/s, tokens generated, and the overhead
per call against `direct` ((wall - direct wall) / calls) and as a share of the agent's rollout.
The rollout is the step on this workload (generation is 95 % of a tool_use_agent step).

    .venv/bin/python scripts/bench/bench_agent.py                  # 64 prompts x 4, 3 rounds
    .venv/bin/python scripts/bench/bench_agent.py --prompts 16 --rounds 1

Prints a table and a final JSON line (`calls_per_s_agent`, `calls_per_s_direct`,
`overhead_ms_per_call`, `endpoint_share_of_rollout`, each for the best concurrency, and
`same_tokens_as_direct`: per-call seeds equal the runner's per-turn seeds, so every mode must draw
exactly the same tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SYNC_AGENT = '''
import asyncio, sys
sys.path.insert(0, {examples!r})
import openai, openai_agent


def lookup_agent_sync(row, client, **kwargs):
    """lookup_agent as a plain function: the same calls through the synchronous client."""

    class Sync:
        def __init__(self, client):
            self.chat = self
            self.completions = self
            self.client = client

        async def create(self, **kw):
            return self.client.chat.completions.create(**kw)

    return asyncio.run(openai_agent.lookup_agent(row, Sync(client)))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rollouts per mode (the median is reported)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--out", default=str(REPO / "outputs" / "bench_agent"))
    args = parser.parse_args()

    from hydra.utils import instantiate

    from rlhf_orch.engines.vllm_engine import EngineSpec, VLLMEngine
    from rlhf_orch.env.agent import AgentEnv
    from rlhf_orch.env.lookup import LookupEnv
    from rlhf_orch.transfer.engine_side import RolloutJob
    from rlhf_orch.transfer.plan import whole_prompt_requests
    from tests.conftest import compose_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = compose_config(["experiment=tool_use_agent"])
    model = instantiate(cfg.model)
    path = model.path()
    tokenizer = model.tokenizer()
    task = instantiate(cfg.data)
    task.bind(tokenizer)
    prompts = task.sample_prompts(args.prompts)
    engine = VLLMEngine(EngineSpec(model_path=path, dtype="float32", max_model_len=128), 0)
    sync_file = out / "sync_agent.py"
    sync_file.write_text(SYNC_AGENT.format(examples=str(REPO / "scripts" / "examples")))
    example = str(REPO / "scripts" / "examples" / "openai_agent.py")
    response_len, per_call = int(cfg.data.response_max_len), int(cfg.env.max_tokens_per_turn)

    def env_for(mode: str, concurrency: int):
        if mode == "direct":
            return LookupEnv(
                max_turns=3, max_tokens_per_turn=per_call, observation_format="plain", concurrency=concurrency
            )
        path_, name = (example, "lookup_agent") if mode == "agent_async" else (str(sync_file), "lookup_agent_sync")
        env = AgentEnv(path=path_, name=name, max_tokens_per_turn=per_call, max_calls=3, concurrency=concurrency)
        env.bind(task)
        return env

    rows, tokens_drawn = [], {}
    requests = whole_prompt_requests(range(len(prompts)), args.samples)
    for concurrency in args.concurrency:
        for mode in ("direct", "agent_async", "agent_sync"):
            job = RolloutJob(
                prompt_ids={i: list(p.prompt_ids) for i, p in enumerate(prompts)},
                prompts=dict(enumerate(prompts)),
                samples_per_prompt=args.samples,
                max_tokens=response_len,
                temperature=1.0,
                scorer=None,
                env=env_for(mode, concurrency),
            )
            walls, calls, tokens, rewards, drawn = [], [], [], [], []
            for r in range(args.rounds + 1):  # round 0 warms up (imports, the server, the clients)
                engine.reseed(1000 + r)
                t = time.perf_counter()
                samples, _ = engine.produce_samples(requests, job)
                wall = time.perf_counter() - t
                if r == 0:
                    continue
                walls.append(wall)
                masks = [s.fields["loss_mask"] for s in samples]
                # model calls = spans of the model's tokens (a call's tokens are contiguous ones)
                calls.append(sum(int(m[0] > 0) + int(((m[1:] > 0) & (m[:-1] == 0)).sum()) for m in masks))
                tokens.append(sum(int(m.sum()) for m in masks))
                rewards.append(statistics.fmean(float(s.reward) for s in samples))
                drawn.append([s.response_ids[s.fields["loss_mask"] > 0].tolist() for s in samples])
            wall = statistics.median(walls)
            rows.append(
                {
                    "mode": mode,
                    "concurrency": concurrency,
                    "wall_s": wall,
                    "calls": statistics.fmean(calls),
                    "calls_per_s": statistics.fmean(calls) / wall,
                    "tokens_per_s": statistics.fmean(tokens) / wall,
                    "reward": statistics.fmean(rewards),
                }
            )
            tokens_drawn[(mode, concurrency)] = drawn
            print(f"  {mode:12s} concurrency {concurrency:3d}: {wall:.2f}s", flush=True)
    engine_server = getattr(engine, "_server", None)
    if engine_server is not None:
        engine_server.close()

    direct = {r["concurrency"]: r for r in rows if r["mode"] == "direct"}
    for r in rows:
        d = direct[r["concurrency"]]
        # per-call seeds = per-turn seeds: the agent draws exactly the tokens env=lookup draws
        r["same_tokens_as_direct"] = (
            tokens_drawn[(r["mode"], r["concurrency"])] == tokens_drawn[("direct", r["concurrency"])]
        )
        r["overhead_ms_per_call"] = 1000 * (r["wall_s"] - d["wall_s"]) / r["calls"] if r["mode"] != "direct" else 0.0
        r["share"] = max(0.0, (r["wall_s"] - d["wall_s"]) / r["wall_s"]) if r["mode"] != "direct" else 0.0
    print(
        f"\n{args.prompts} prompts x {args.samples} samples, tool-use task, tiny tool model, median of {args.rounds} rollouts"
    )
    print(
        f"{'mode':12s} {'conc':>5s} {'wall s':>7s} {'calls':>6s} {'calls/s':>8s} {'tok/s':>7s} {'reward':>7s} "
        f"{'ms/call over direct':>20s} {'share':>6s} {'same tokens':>12s}"
    )
    for r in rows:
        print(
            f"{r['mode']:12s} {r['concurrency']:5d} {r['wall_s']:7.2f} {r['calls']:6.0f} {r['calls_per_s']:8.1f} "
            f"{r['tokens_per_s']:7.0f} {r['reward']:7.3f} {r['overhead_ms_per_call']:20.2f} {100 * r['share']:5.0f}% "
            f"{'yes' if r['same_tokens_as_direct'] else 'NO':>12s}"
        )
    best = min((r for r in rows if r["mode"] == "agent_async"), key=lambda r: r["wall_s"])
    result = {
        "bench": "agent_endpoint",
        "concurrency": best["concurrency"],
        "calls_per_s_agent": round(best["calls_per_s"], 1),
        "calls_per_s_direct": round(direct[best["concurrency"]]["calls_per_s"], 1),
        "overhead_ms_per_call": round(best["overhead_ms_per_call"], 2),
        "endpoint_share_of_rollout": round(best["share"], 3),
        "same_tokens_as_direct": all(r["same_tokens_as_direct"] for r in rows),
        "rows": rows,
    }
    (out / "bench_agent.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
