"""Multi-turn rollouts on a vLLM engine: the engine side of `rlhf_orch.env.turn_driver.runner`.

`VLLMTurns` is the runner's `TurnGenerator` over `VLLMCalls` (rlhf_orch.engines.request_steps):
each turn is one request continuing from the trajectory's token ids exactly (a `TokensPrompt`: nothing is re-tokenised), stepped by the same
continuous-batching loop as single-turn rollouts, so a trajectory waiting on its environment never
holds the others. Each turn has its own sampling seed derived from the step's seed, the sample
and the turn: a trajectory draws the same tokens whatever order its turns reach the engine in
(environments finish in any order), so a resumed or replaced engine repeats an uninterrupted run.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from rlhf_orch.engines.request_steps import SharedStepping, VLLMCalls, generation_eos_ids, turn_seed
from rlhf_orch.env.turn_driver.runner import MultiTurnRunner, TurnOutput
from rlhf_orch.transfer.batch import LOSS_MASK, TURN_REWARDS
from rlhf_orch.transfer.engine_side import Completion, RolloutJob
from rlhf_orch.transfer.plan import CompletionRequest


class VLLMTurns:
    """The multi-turn runner's `TurnGenerator`: each turn one `VLLMCalls` request with its turn seed.
    A turn ended by one of `stop` (env.stop) keeps the stop string; the runner then closes the turn
    with the template's end-of-turn token as context (SkyRL appends EOS after a stop string)."""

    def __init__(
        self,
        llm: Any,
        temperature: float,
        step_seed: int,
        stepping: SharedStepping | None = None,
        stop: Sequence[str] = (),
    ):
        self.calls = VLLMCalls(llm, temperature, stepping)
        self.step_seed = step_seed
        self.stop = list(stop)
        self.tokenizer = llm.get_tokenizer()

    def submit(self, key: int, context: list[int], max_tokens: int, turn: int) -> None:
        self.calls.submit(key, context, max_tokens, turn_seed(self.step_seed, key, turn), self.stop, include_stop=True)

    def busy(self) -> bool:
        return self.calls.busy()

    def poll(self) -> list[TurnOutput]:
        return [TurnOutput(o.key, o.token_ids, o.logprobs, o.finish_reason == "length") for o in self.calls.poll()]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def abort(self, keys: Sequence[int]) -> None:
        self.calls.abort(keys)


def complete_trajectories(
    llm: Any,
    requests: Sequence[CompletionRequest],
    job: RolloutJob,
    step_seed: int,
    stepping: SharedStepping | None = None,
) -> Iterator[list[Completion]]:
    """Every requested sample as a multi-turn trajectory; yields each request's completions (all of
    its samples) once the last of them finishes, like the single-turn `_complete`."""
    env = job.env
    generator = VLLMTurns(llm, job.temperature, step_seed, stepping, env.stop)
    env.attach(generator.tokenizer)
    stop_ids = generation_eos_ids(generator.tokenizer)
    renderer = env.renderer(generator.tokenizer, stop_ids)
    runner = MultiTurnRunner(
        env.make,
        generator,
        renderer,
        env.limits(job.max_tokens),
        env.concurrency,
        env.step_timeout_s(),
        env.tokenization_sanity_check_mode,
        env.action_decoder(generator.tokenizer, stop_ids),
    )
    owner = {i: r for r in requests for i in r.indices(job.samples_per_prompt)}
    waiting = {r: r.count for r in requests}
    done: dict[CompletionRequest, list[Completion]] = {r: [] for r in requests}
    items = [
        (i, job.prompts[r.prompt_index], job.prompt_ids[r.prompt_index])
        for r in requests
        for i in r.indices(job.samples_per_prompt)
    ]
    for t in runner.run(items):
        request = owner[t.index]
        mask = torch.tensor(t.loss_mask, dtype=torch.float32)
        if env.masks_out(t):
            mask.zero_()
            t.counts.masked = 1
        fields = {LOSS_MASK: mask}
        if env.places_turn_rewards:
            fields[TURN_REWARDS] = torch.tensor(t.turn_reward_field(), dtype=torch.float32)
        done[request].append(
            Completion(
                t.index,
                t.prompt_ids,
                t.response_ids,
                t.logprobs,
                fields=fields,
                truncated=t.truncated or t.last_turn_hit_length,
                env_reward=t.reward(env.reward),
                env_stats=t.counts.as_dict(),
                env_metrics=t.env_metrics,
            )
        )
        waiting[request] -= 1
        if not waiting[request]:
            yield sorted(done.pop(request), key=lambda c: c.index)
