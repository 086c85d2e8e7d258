"""The engine-side request stepping both rollout drivers share: `VLLMCalls` generates single
requests (n=1) from exact token ids on a `vllm.LLM` -- a multi-turn trajectory's turn
(`rlhf_orch.engines.turns`) or an agent's call (`rlhf_orch.engines.agent_rollout`) -- stepping the
engine itself or through the steps it shares with other rollouts (`SharedStepping`, pipeline=async).
Each request's seed comes from the step's seed, the sample and the turn (`turn_seed`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence


def generation_eos_ids(tokenizer: Any) -> list[int]:
    """The model's generation config's EOS ids (vLLM stops on them too): some templates close a turn
    with one of these rather than the tokenizer's EOS (Phi-3's <|end|>, Gemma's <end_of_turn>)."""
    path = getattr(tokenizer, "name_or_path", None)
    return list(_generation_eos_ids(path)) if path else []


@functools.lru_cache(maxsize=8)
def _generation_eos_ids(path: str) -> tuple[int, ...]:
    # read once per process: every rollout asks (complete_trajectories, each agent session)
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except (OSError, ValueError):
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None)


def turn_seed(step_seed: int, index: int, turn: int) -> int:
    return (step_seed * 1_000_003 + index * 7_919 + turn) % (2**31 - 1)


@dataclass
class CallOutput:
    key: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"


@dataclass
class SharedStepping:
    """An engine's continuous batching shared by several rollouts at once (`VLLMEngine`, under
    pipeline=async): requests go in with an outbox, any caller's step advances every request, and
    each finished one lands in the outbox of the rollout that made it."""

    enqueue: Callable[[list[Any], list[Any], list[Any]], list[str]]  # (prompts, params, outbox) -> request ids
    step: Callable[[], bool]  # one engine step; False when vLLM has nothing left
    take: Callable[[list[Any]], list[Any]]  # empty an outbox: the finished outputs in it
    abort: Callable[[list[str]], None]  # abort requests in vLLM and route nothing of them any more


class VLLMCalls:
    """`CallGenerator` on a `vllm.LLM`: one request per call (n=1), from the call's token ids. With
    `stepping`, the engine's steps are shared with the other rollouts it generates at once."""

    def __init__(
        self,
        llm: Any,
        temperature: float,
        stepping: SharedStepping | None = None,
        count_step: Callable[[], None] | None = None,
    ):
        self.llm = llm
        self.engine = llm.llm_engine
        self.temperature = temperature
        self.stepping = stepping
        # called after each engine step made here (not through `stepping`, which counts its own):
        # the engine's liveness count (`VLLMEngine.progress`)
        self.count_step = count_step
        self._outbox: list[Any] = []
        self._key_of: dict[str, int] = {}

    def submit(
        self,
        key: int,
        prompt_ids: list[int],
        max_tokens: int,
        seed: int,
        stop: list[str],
        sampling: Any = None,
        include_stop: bool = False,
    ) -> None:
        """`sampling`: an agent call's own settings (`chat_api.CallSampling`; None: the run's)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        own = {}
        if sampling is not None:
            own = {
                "temperature": self.temperature if sampling.temperature is None else sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty,
            }
        params = SamplingParams(
            n=1,
            max_tokens=max_tokens,
            **({"temperature": self.temperature} | own),
            logprobs=0,
            seed=seed,
            stop=stop or None,
            detokenize=bool(stop),  # stop strings are matched on text
            include_stop_str_in_output=include_stop,
        )
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        if self.stepping is not None:
            (request_id,) = self.stepping.enqueue([prompt], [params], self._outbox)
            self._key_of[request_id] = key
            return
        (request_id,) = self.llm.enqueue([prompt], [params], use_tqdm=False)
        self._key_of[str(request_id).rsplit("-", 1)[0]] = key

    def busy(self) -> bool:
        if self.stepping is not None:
            return bool(self._key_of)
        return bool(self._key_of) and self.engine.has_unfinished_requests()

    def poll(self) -> list[CallOutput]:
        if self.stepping is not None:
            if not self._outbox:
                self.stepping.step()
            finished = self.stepping.take(self._outbox)
        else:
            finished = [out for out in self.engine.step() if out.finished]
            if self.count_step is not None:
                self.count_step()
        done = []
        for out in finished:
            key = self._key_of.pop(str(out.request_id), None)
            if key is None:
                continue
            comp = out.outputs[0]
            ids = list(comp.token_ids)
            lps = [lp[tok].logprob for lp, tok in zip(comp.logprobs or [], ids)]
            done.append(CallOutput(key, ids, lps, "length" if comp.finish_reason == "length" else "stop"))
        return done

    def abort(self, keys: Sequence[int]) -> None:
        wanted = set(keys)
        ids = [rid for rid, key in self._key_of.items() if key in wanted]
        if ids and self.stepping is not None:
            self.stepping.abort(ids)
        elif ids:
            self.engine.abort_request(ids)
        for rid in ids:
            self._key_of.pop(rid, None)
