"""An engine's rollout production: vLLM's completions for `RolloutProducer` (`rlhf_orch.transfer.engine_side`),
which builds, scores and hands over the experience where it was generated.

One-turn requests go through the engine's shared steps (`SharedEngineSteps`: several rollouts at
once under pipeline=async); multi-turn ones through the environment's driver (`turns`: on the
caller's thread, sharing the steps; `agent`: through the engine's chat endpoint, on vLLM's thread).
"""

from __future__ import annotations

from typing import Any

from rlhf_orch.engines.agent_serving import AgentServing
from rlhf_orch.engines.shared_steps import SharedEngineSteps, mean_version, version_spans
from rlhf_orch.transfer.engine_side import Completion, RolloutJob, RolloutProducer
from rlhf_orch.transfer.plan import CompletionRequest


class VLLMRollouts(RolloutProducer):
    """`llm`: the engine's vllm.LLM; `seed`: the engine's (multi-turn seeds derive from it until the
    driver reseeds a step, `step_seed`)."""

    def __init__(self, llm: Any, seed: int, steps: SharedEngineSteps, agents: AgentServing):
        self.llm = llm
        self.step_seed = seed
        self.steps = steps
        self.agents = agents

    @property
    def weight_version(self) -> int:
        return self.steps.weight_version

    def _sample_scored(self) -> None:
        self.steps.samples_scored.tick()

    def _decode(self, token_ids):
        return self.llm.get_tokenizer().batch_decode([list(map(int, t)) for t in token_ids], skip_special_tokens=True)

    def _complete(self, requests, job: RolloutJob):
        """Continuous batching over all `requests`; yields each request's completions as it finishes
        (multi-turn trajectories when the job has an environment: `rlhf_orch.engines.turns`)."""
        if job.env is not None:
            yield from self._complete_env(requests, job)
            return
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # No per-request seed: with one, vLLM draws the n samples of a prompt identically. The
        # engine's own seed (LLM(seed=...)) makes runs reproducible instead.
        params = [
            SamplingParams(
                n=r.count,
                max_tokens=job.max_tokens,
                min_tokens=max(job.min_tokens, _min_response_len(job.prompts[r.prompt_index])),
                temperature=job.temperature,
                logprobs=0,
                detokenize=False,
            )
            for r in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=job.prompt_ids[r.prompt_index]) for r in requests]
        outbox: list[Any] = []  # this call's finished outputs, filled by whichever call steps vLLM
        steps = self.steps
        by_id: dict[str, CompletionRequest] = dict(zip(steps.submit(prompts, params, outbox), requests))
        try:
            while by_id:
                if not outbox and not steps.advance() and not outbox:
                    break  # vLLM has nothing left, and none of ours came back
                ready, versions, interrupted = steps.take_versioned(outbox)
                for out in ready:
                    key = str(out.request_id)
                    request = by_id.pop(key)
                    first = request.indices(job.samples_per_prompt).start
                    prompt_ids = list(out.prompt_token_ids)
                    completions = []
                    for j, comp in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                        ids = list(comp.token_ids)
                        lps = [lp[tok].logprob for lp, tok in zip(comp.logprobs or [], ids)]
                        completions.append(
                            Completion(
                                first + j,
                                prompt_ids,
                                ids,
                                lps,
                                truncated=comp.finish_reason == "length",
                                weight_version=versions[key],
                                interrupted=key in interrupted,
                                token_version_mean=mean_version(comp.weight_versions, versions[key]),
                                version_spans=version_spans(comp.weight_versions),
                            )
                        )
                    yield completions
        finally:
            steps.forget(list(by_id))  # a call that failed or was abandoned leaves nothing behind
        if by_id:
            raise RuntimeError(f"vLLM finished without answering {len(by_id)} request(s)")

    def _complete_env(self, requests, job: RolloutJob):
        """Multi-turn trajectories. `turns`: the driver runs on this (the caller's) thread and
        shares the engine's steps with the other rollouts in flight (`stepping`). `agent`: its
        endpoint takes every output vLLM gives, so it runs on vLLM's thread, one rollout at a
        time on this engine. A weight update may land between two steps; a trajectory's staleness
        counts from the version it started with."""
        steps = self.steps
        seed = self.step_seed
        steps.session_starts()  # (after any update it had to wait for)
        started = self.weight_version
        try:
            if not job.env.calls_through_endpoint:
                steps.run(steps.weights_present)
                for item in self._complete_turns(requests, job, seed):
                    yield self._stamped(item, started)
                return
            with steps.env_rollout:

                def start():
                    steps.weights_present()
                    return self._complete_agents(requests, job, seed)

                trajectories = steps.run(start)
                done = object()
                while True:
                    item = steps.run(next, trajectories, done)
                    if item is done:
                        return
                    yield self._stamped(item, started)
        finally:
            steps.session_ends()

    def _stamped(self, completions: list[Completion], started: int) -> list[Completion]:
        for c in completions:
            if c.weight_version is None:
                c.weight_version = started
                c.interrupted = self.weight_version != started
        return completions

    def _complete_turns(self, requests, job: RolloutJob, step_seed: int):
        from rlhf_orch.engines.turns import complete_trajectories

        return complete_trajectories(self.llm, requests, job, step_seed, self.steps.stepping())

    def _complete_agents(self, requests, job: RolloutJob, step_seed: int):
        from rlhf_orch.engines.agent_rollout import complete_agent_trajectories

        return complete_agent_trajectories(
            self.llm,
            self.agents.chat_server(job.env),
            self.agents.runner(job.env),
            requests,
            job,
            step_seed,
            self.steps.count_step,
        )

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of every token after the first, as the engine's current weights score it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        self.steps.wait_for_update()

        def score():
            self.steps.weights_present()
            return self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)

        outs = self.steps.run(score)
        result = []
        for seq, out in zip(sequences, outs):
            lps = out.prompt_logprobs[1:]
            result.append([lp[tok].logprob for lp, tok in zip(lps, seq[1:])])
        return result


def _min_response_len(prompt: Any) -> int:
    """The tokens this prompt's response runs at least (a task's long-tail profile; 0: none)."""
    return int(getattr(prompt, "min_response_len", 0) or 0)
