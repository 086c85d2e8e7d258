"""An `env=agent` rollout on one engine: serve the agents' calls, drive the engine, record tokens.

`AgentRolloutSession` owns one rollout: it gives every trajectory a random id (its base URL on
the engine's `ChatServer`), starts the agent functions (`AgentRunner`), and from the actor's own
thread feeds their calls to the engine, continuous-batched like every other rollout, until every
function has returned. A call, on the server's thread: checked (`chat_api.parse_request`),
rendered with the tokenizer's chat template (tools included), given its budget by the
trajectory's record, queued, answered once the engine finished it, and recorded
(`AgentRecord.add`). Each call samples with its own seed from (step seed, trajectory, call
number), so a trajectory draws the same tokens whatever the other trajectories do -- or with the
seed and sampling settings it asked for (`env.sampling=call`). A call with n > 1 is n requests to
the engine, each recorded as a branch of the conversation.

The engine side is a `CallGenerator` (`rlhf_orch.engines.request_steps.VLLMCalls`, which the multi-turn
runner's turns use too; tests a scripted one), so the session runs without vLLM.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch

from rlhf_orch.engines.request_steps import CallOutput, VLLMCalls, generation_eos_ids, turn_seed
from rlhf_orch.env.agent_driver.record import AGENT_METRIC_PREFIX, AgentLimits, AgentRecord, CallRefused
from rlhf_orch.env.agent_driver.runner import AgentOutcome, AgentRunner
from rlhf_orch.env.agent_driver.chat_api import (
    TOOL_PARSERS,
    CallSampling,
    ChatAPIError,
    completion_body,
    merged_choices,
    parse_request,
)
from rlhf_orch.env.observations import token_ids
from rlhf_orch.env.reasoning_parsers import reasoning_parser as reasoning_parser_of
from rlhf_orch.env.tool_parsers import ensure_tool_parser
from rlhf_orch.transfer.batch import LOSS_MASK, SAMPLING_TEMPERATURE
from rlhf_orch.transfer.engine_side import Completion
from rlhf_orch.transfer.plan import extra_sequence_index, trajectory_of


class CallGenerator(Protocol):
    def submit(
        self,
        key: int,
        prompt_ids: list[int],
        max_tokens: int,
        seed: int,
        stop: list[str],
        sampling: CallSampling | None = None,
    ) -> None: ...

    def poll(self) -> list[CallOutput]:
        """Advance generation a little; the calls that finished meanwhile."""

    def busy(self) -> bool: ...

    def abort(self, keys: Sequence[int]) -> None: ...


@dataclass
class _Pending:
    key: int
    index: int
    prompt_ids: list[int]
    max_tokens: int
    seed: int
    stop: list[str]
    sampling: CallSampling
    future: Future


@dataclass
class TrajectoryResult:
    index: int
    record: AgentRecord
    outcome: AgentOutcome


class AgentRolloutSession:
    def __init__(
        self,
        server: Any,
        generator: CallGenerator,
        tokenizer: Any,
        runner: AgentRunner,
        limits: AgentLimits,
        temperature: float,
        step_seed: int,
        tool_parser: str,
        call_timeout_s: float,
        reasoning_parser: str = "none",
        sampling: str = "call",
        train_truncated_sampling: bool = False,
    ):
        self.server = server
        self.generator = generator
        self.tokenizer = tokenizer
        self.runner = runner
        self.limits = limits
        self.temperature = temperature
        self.step_seed = step_seed
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.sampling = sampling  # env.sampling
        # the run corrects for the engine's distribution (algo.tis_cap / decoupled_is_cap): top-p,
        # top-k and penalised tokens train; without, they are context
        self.train_truncated_sampling = train_truncated_sampling
        # built before the first call: a parser that cannot read this model's turns fails the rollout
        # here, in one line, not every agent call with an HTTP 500
        ensure_tool_parser(tool_parser, tokenizer)
        if reasoning_parser != "none":
            reasoning_parser_of(reasoning_parser, tokenizer)
        self._stop_ids = {tokenizer.eos_token_id, *generation_eos_ids(tokenizer)}
        self.call_timeout_s = call_timeout_s
        self.records: dict[str, AgentRecord] = {}
        self._calls_made: dict[int, int] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._in_flight: dict[int, _Pending] = {}
        self._next_key = 0
        self._open = False

    # ------------------------------------------------------------------ the actor's thread
    def run(self, items: Sequence[tuple[int, Any]]) -> list[TrajectoryResult]:
        """items: (trajectory index, row). Returns once every agent function has returned."""
        ids = {index: secrets.token_hex(8) for index, _ in items}
        self.records = {
            ids[index]: AgentRecord(index, self.limits, self.train_truncated_sampling) for index, _ in items
        }
        self._open = True
        keys = self.server.issue_keys(list(ids.values()))
        self.server.serve(self.handle)
        try:
            self.runner.start(
                [(index, row, self.server.base_url(ids[index]), keys[ids[index]]) for index, row in items]
            )
            while not self.runner.done():
                if self.generator.busy():
                    self._feed()
                    self._deliver(self.generator.poll())
                else:
                    self._feed(wait_s=0.02)
            self.runner.wait(0)  # re-raises a crash of the runner's own loop
        finally:
            if not self.runner.done():
                self.runner.close()  # a rollout given up: its agents must not run on into the next one
            self._close()
        by_index = {r.index: r for r in self.records.values()}
        return [
            TrajectoryResult(i, by_index[i], self.runner.outcomes.get(i, AgentOutcome(i, error="no outcome")))
            for i, _ in items
        ]

    def _feed(self, wait_s: float = 0.0) -> None:
        """Submit every queued call; with `wait_s`, first wait that long for one (the engine is idle)."""
        while True:
            try:
                call = self._queue.get(timeout=wait_s) if wait_s else self._queue.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            self._in_flight[call.key] = call
            self.generator.submit(call.key, call.prompt_ids, call.max_tokens, call.seed, call.stop, call.sampling)

    def _deliver(self, outputs: Sequence[CallOutput]) -> None:
        for out in outputs:
            call = self._in_flight.pop(out.key, None)
            if call is not None:
                call.future.set_result(out)

    def _close(self) -> None:
        """No call is answered after this: new ones get 410, waiting ones an error."""
        self.server.serve(None)
        with self._lock:
            self._open = False
        self._feed()
        if self._in_flight:
            self.generator.abort(list(self._in_flight))
        for call in self._in_flight.values():
            call.future.set_exception(ChatAPIError(410, "the rollout ended before this call was answered", kind="gone"))
        self._in_flight.clear()

    # ------------------------------------------------------------------ the server's threads
    def handle(self, trajectory_id: str, body: Any) -> dict[str, Any]:
        record = self.records.get(trajectory_id)
        if record is None or not self._open:
            raise ChatAPIError(
                410, f"trajectory {trajectory_id} is not part of the running rollout (its rollout ended)", kind="gone"
            )
        call = parse_request(body, self.server.model_name, self.sampling)
        try:
            prompt_ids = self._render(call.messages, call.tools)
        except Exception as e:  # the template's error, to the agent
            raise ChatAPIError(
                400, f"the chat template could not render these messages: {type(e).__name__}: {e}", "messages"
            ) from e
        # The temperature each token is scored at: None where it is the run's (the trainers' plain path).
        temperature = call.sampling.temperature
        if temperature is not None and temperature == self.temperature:
            temperature = None
        t = time.perf_counter()
        with self._lock:
            if not self._open:
                raise ChatAPIError(410, "the rollout ended", kind="gone")
            if call.overridden:  # (the driver says so once: AgentEnv.notices)
                record.counts.sampling_overridden += 1
            try:
                # Admitted and counted under the lock the record is written under: calls made at
                # once see each other (env.max_calls; the conversation each one branches from).
                max_tokens, branch = record.admit(prompt_ids, call.max_tokens, call.n)
            except CallRefused as e:
                record.counts.refused_calls += 1
                raise ChatAPIError(400, str(e), "messages", e.kind) from e
            number = self._calls_made.get(record.index, 0)
            self._calls_made[record.index] = number + call.n
            pending = []
            for k in range(call.n):
                key, self._next_key = self._next_key, self._next_key + 1
                if call.sampling.seed is None:  # the run's: from the step, the trajectory and its call number
                    seed = turn_seed(self.step_seed, record.index, number + k)
                else:  # the call's own, made the trajectory's: a group's trajectories asking for one seed
                    # would otherwise draw the same tokens and teach nothing (reproducible all the same)
                    seed = turn_seed(call.sampling.seed, record.index, k)
                pending.append(
                    _Pending(key, record.index, prompt_ids, max_tokens, seed, call.stop, call.sampling, Future())
                )
                self._queue.put(pending[-1])
        try:
            deadline = time.monotonic() + self.call_timeout_s  # one for the call's n completions
            outs: list[CallOutput] = [p.future.result(timeout=max(0.0, deadline - time.monotonic())) for p in pending]
        except BaseException:
            with self._lock:
                record.done(branch)
            raise
        with self._lock:
            record.done(branch)
            record.counts.generation_seconds += time.perf_counter() - t
            for out in outs:
                record.add(
                    prompt_ids,
                    out.token_ids,
                    out.logprobs,
                    out.finish_reason == "length",
                    temperature,
                    branch,
                    truncated_sampling=call.sampling.truncates,
                )
        return merged_choices([self._completion(call, prompt_ids, out) for out in outs])

    def _completion(self, call: Any, prompt_ids: list[int], out: CallOutput) -> dict[str, Any]:
        if self.tool_parser in TOOL_PARSERS and self.reasoning_parser == "none":
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        else:  # vLLM's parsers read their markers, which may be special tokens (mistral's [TOOL_CALLS], <think>)
            ids = out.token_ids[:-1] if out.token_ids and out.token_ids[-1] in self._stop_ids else out.token_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return completion_body(
            self.server.model_name,
            text,
            out.finish_reason,
            len(prompt_ids),
            len(out.token_ids),
            self.tool_parser,
            self.tokenizer,
            call.tools,
            self.reasoning_parser,
        )

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        kwargs = {"tools": tools} if tools else {}
        return token_ids(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        )


def trajectory_completions(
    results: Sequence[TrajectoryResult], fallback_prompt_ids: Mapping[int, Sequence[int]], eos_id: int
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Per sequence of every trajectory: its index and the fields of its `Completion`. The first
    sequence has the trajectory's index and carries its counters; further ones (a second
    conversation, rewritten history) get `extra_sequence_index`; all carry the trajectory's reward."""
    for r in results:
        sequences = r.record.trained_sequences(fallback_prompt_ids[r.index], eos_id)
        counts = r.record.counts
        counts.agent_errors = int(r.outcome.error is not None)
        counts.agent_timeouts = int(r.outcome.timed_out)
        counts.agent_seconds = max(0.0, r.outcome.seconds - counts.generation_seconds)
        counts.truncated = int(sequences[0].last_hit_length)
        # nothing to train (no call: one EOS; only greedy or untrainable tokens): out of the group statistics
        counts.masked = int(not any(any(s.loss_mask) for s in r.record.sequences))
        stats = counts.as_dict()
        for k, v in r.outcome.metrics.items():
            stats[f"{AGENT_METRIC_PREFIX}{k}"] = v
        for k, seq in enumerate(sequences):
            yield (
                r.index if k == 0 else extra_sequence_index(r.index, k),
                {
                    "prompt_ids": seq.prompt_ids,
                    "response_ids": seq.response_ids,
                    "logprobs": seq.logprobs,
                    "loss_mask": seq.loss_mask,
                    "temperatures": seq.temperatures,
                    "truncated": seq.last_hit_length,
                    "reward": r.outcome.reward,
                    "stats": stats if k == 0 else None,
                },
            )


def completion_fields(f: Mapping[str, Any], sampling: str) -> dict[str, torch.Tensor]:
    """A sequence's per-token fields: its loss mask, and with env.sampling=call the temperature
    each token was sampled at (0: the run's), which the trainers score it at. Every sequence of
    the run carries the same fields (batches need that); with env.sampling=run every token is the run's."""
    fields = {LOSS_MASK: torch.tensor(f["loss_mask"], dtype=torch.float32)}
    if sampling == "call":
        fields[SAMPLING_TEMPERATURE] = torch.tensor(f["temperatures"], dtype=torch.float32)
    return fields


def complete_agent_trajectories(
    llm: Any,
    server: Any,
    runner: AgentRunner,
    requests: Sequence[Any],
    job: Any,
    step_seed: int,
    count_step: Callable[[], None] | None = None,
) -> Iterator[list[Any]]:
    """Every requested sample as an agent trajectory; yields each request's completions (every
    sequence of all its samples) in request order once every agent function has returned.
    `runner`: the engine's, for job.env (its host process outlives the rollout). `count_step`:
    called after each engine step (the engine's liveness count)."""
    env = job.env
    tokenizer = llm.get_tokenizer()
    session = AgentRolloutSession(
        server,
        VLLMCalls(llm, job.temperature, count_step=count_step),
        tokenizer,
        runner,
        env.limits(job.max_tokens),
        job.temperature,
        step_seed,
        env.tool_parser,
        env.timeout_s,
        env.reasoning_parser,
        env.sampling,
        job.corrects_engine_sampling,
    )
    owner = {i: r for r in requests for i in r.indices(job.samples_per_prompt)}
    items = [(i, env.row(job.prompts[owner[i].prompt_index])) for i in owner]
    results = session.run(items)
    fallback = {i: job.prompt_ids[r.prompt_index] for i, r in owner.items()}
    done: dict[Any, list[Completion]] = {r: [] for r in requests}
    for index, f in trajectory_completions(results, fallback, tokenizer.eos_token_id):
        done[owner[trajectory_of(index)]].append(
            Completion(
                index,
                f["prompt_ids"],
                f["response_ids"],
                f["logprobs"],
                fields=completion_fields(f, env.sampling),
                truncated=f["truncated"],
                env_reward=f["reward"],
                env_stats=f["stats"],
            )
        )
    for request in requests:
        yield sorted(done[request], key=lambda c: c.index)
