"""`env=python_tool`: the policy may call a sandboxed Python tool before it answers.

Each model turn is parsed for tool calls:

* `env.tool_format=hermes` (Qwen / Hermes chat models):
  `<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`
* `env.tool_format=tags` (models without a tool format, like the tiny model): `<python>code</python>`

A turn with calls runs each in the sandbox (`rlhf_orch.env.sandbox`: its own process, CPU, memory,
process and output limits, an empty directory, no inherited environment) and answers with one
`tool` message per call (calls past the first `MAX_CALLS_PER_TURN` are not run: one error message
answers all of them); the trajectory goes on. A turn without a call is the final answer: the
step is done and scores 1.0 when the answer equals the row's ground truth (the text after `####`
or inside `<answer>...</answer>` if present, else the whole turn, stripped), else 0.0. A malformed
call answers with an error message and counts as a tool error. Step metadata carries the counts the
run reports (`env/tool_calls_mean`, `env/tool_errors`, `env/tool_timeouts`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError, row_extras
from rlhf_orch.env.multi_turn import MultiTurnEnv
from rlhf_orch.env.options import PythonToolEnvConfig
from rlhf_orch.env.sandbox import SandboxLimits, SandboxSupport, run_python, sandbox_support
from rlhf_orch.env.tool_parsers import check_tool_parser, ensure_tool_parser, extract_tool_calls

TOOL_FORMATS = ("hermes", "tags")  # built in; any of vLLM's tool parsers besides (rlhf_orch.env.tool_parsers)
# The tool as chat templates show it to the model (`tools`): what Qwen / Llama / Mistral templates render.
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a sandbox and return what it prints (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
    },
}
_TAGS = re.compile(r"<python>(.*?)</python>", re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_CALLS_PER_TURN = 4  # further calls in one turn are answered with an error, not run


def parse_tool_calls(text: str, fmt: str, tokenizer: Any = None) -> list[tuple[str | None, str | None]]:
    """Per call in `text`: (code, None), or (None, what is wrong with the call)."""
    if fmt == "tags":
        return [(code.strip("\n"), None) for code in _TAGS.findall(text)]
    _, calls = extract_tool_calls(text, fmt, tokenizer, [PYTHON_TOOL])
    out: list[tuple[str | None, str | None]] = []
    for call in calls:
        if call.error is not None:
            out.append((None, call.error))
        elif call.name != "python":
            out.append((None, "unknown tool: the only tool is 'python' with arguments {\"code\": ...}"))
        else:
            code = call.arguments.get("code") if isinstance(call.arguments, dict) else None
            out.append(
                (code, None) if isinstance(code, str) else (None, 'python tool call needs arguments {"code": "..."}')
            )
    return out


def _weak_sandbox(support: SandboxSupport) -> str | None:
    """Why model-written code should not run in this host's sandbox, or None when every boundary works."""
    if not support.missing:
        return None
    return (
        f"the sandbox has no {', no '.join(support.missing)} (no namespaces: a container without them, or unprivileged "
        "user namespaces turned off): model-written code could read and write what the engine can (checkpoints, data with "
        "its answers, /proc/<pid>/environ) and reach the network; run where namespaces work (as root, or any uid with "
        "user namespaces), or set env.allow_weak_sandbox=true to run it anyway"
    )


def final_answer(text: str) -> str:
    match = _ANSWER_TAG.search(text)
    if match:
        return match.group(1).strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip()


class PythonToolTrajectory:
    """One trajectory's environment (skyrl-gym's BaseTextEnv contract)."""

    def __init__(self, ground_truth: Any, tool_format: str, limits: SandboxLimits, tokenizer: Any = None):
        self.ground_truth = None if ground_truth is None else str(ground_truth).strip()
        self.tool_format = tool_format
        self.limits = limits
        self.tokenizer = tokenizer  # the engine's: vLLM's tool parsers read its special tokens

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return prompt, {}

    def _message(self, text: str) -> dict[str, Any]:
        # The plain-text format shows the model where the tool's answer starts and ends.
        content = text if self.tool_format != "tags" else f"<output>{text}</output>"
        return {"role": "tool", "content": content}

    def step(self, action: str) -> dict[str, Any]:
        calls = parse_tool_calls(action, self.tool_format, self.tokenizer)
        if not calls:
            correct = self.ground_truth is not None and final_answer(action) == self.ground_truth
            return {"observations": [], "reward": 1.0 if correct else 0.0, "done": True, "metadata": {"tool_calls": 0}}
        observations, errors, timeouts = [], 0, 0
        for code, problem in calls[:MAX_CALLS_PER_TURN]:
            if problem is not None:
                errors += 1
                observations.append(self._message(f"error: {problem}"))
                continue
            result = run_python(code, self.limits)
            errors += int(result.error)
            timeouts += int(result.timed_out)
            observations.append(self._message(result.observation()))
        unrun = len(calls) - MAX_CALLS_PER_TURN
        if unrun > 0:
            # One message for all of them: each message costs the chat template's frame (Qwen's
            # <tool_response> tags), and ~50 frames alone exceed env.max_observation_tokens.
            errors += unrun
            verb = "was" if unrun == 1 else "were"
            observations.append(
                self._message(
                    f"error: at most {MAX_CALLS_PER_TURN} tool calls per turn; the other {unrun} {verb} not run"
                )
            )
        metadata = {"tool_calls": len(calls), "tool_errors": errors, "tool_timeouts": timeouts}
        return {"observations": observations, "reward": 0.0, "done": False, "metadata": metadata}

    def close(self) -> None:
        pass


@dataclass
class PythonToolEnv(PythonToolEnvConfig, MultiTurnEnv):
    @classmethod
    def host_problems(cls, config: Any) -> list[tuple[str, Any, str]]:
        """Before Ray (the config check): (key, value, why) when this host's sandbox lacks a boundary
        and `env.allow_weak_sandbox` is not set. Probes the host once per process (a few child runs)."""
        if config.allow_weak_sandbox:
            return []
        return [("env.allow_weak_sandbox", False, why) for why in [_weak_sandbox(sandbox_support())] if why]

    def __post_init__(self) -> None:
        super().__post_init__()
        check_tool_parser("env.tool_format", self.tool_format, TOOL_FORMATS)
        self.sandbox_limits()  # bad limits refused here, before Ray
        if self.tool_format != "tags" and self.observation_format == "chat_template":
            # the tool's schema reaches the model the way chat templates show tools (their `tools`)
            self.chat_template_kwargs = {"tools": [PYTHON_TOOL], **self.chat_template_kwargs}

    def sandbox_limits(self) -> SandboxLimits:
        try:
            return SandboxLimits(
                timeout_s=self.tool_timeout_s,
                cpu_s=self.tool_cpu_s,
                memory_mb=self.tool_memory_mb,
                max_output_bytes=self.tool_max_output_bytes,
            )
        except ValueError as e:
            raise EnvError(f"env: {e}") from e

    @classmethod
    def step_wait_s(cls, tool_timeout_s: float) -> float:
        # A turn runs up to MAX_CALLS_PER_TURN calls, each within tool_timeout_s (the sandbox kills it).
        return tool_timeout_s * MAX_CALLS_PER_TURN + 5.0

    def attach(self, tokenizer: Any) -> None:
        super().attach(tokenizer)
        ensure_tool_parser(self.tool_format, tokenizer, [PYTHON_TOOL])  # before the first turn, in one line
        # The engine's host (on a cluster not the driver's, which the config check probed).
        why = None if self.allow_weak_sandbox else _weak_sandbox(sandbox_support())
        if why:
            raise EnvError(f"env.allow_weak_sandbox=false: on this engine's host {why}")

    def action_decoder(self, tokenizer: Any, stop_ids: Sequence[int] = ()) -> Callable[[Sequence[int]], str] | None:
        """A vLLM tool parser reads the turn with its special tokens, as vLLM's OpenAI server hands
        it over (its parsers' `adjust_request` turns skip_special_tokens off): markers such as
        mistral's `[TOOL_CALLS]` are special tokens, gone from skyrl-gym's decoded action. The
        turn's closing end-of-turn token is not part of its text (nor is it in the server's)."""
        if self.tool_format in TOOL_FORMATS:
            return None
        stops = {int(i) for i in stop_ids} | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())

        def decode(token_ids: Sequence[int]) -> str:
            ids = list(token_ids)
            if ids and ids[-1] in stops:
                ids = ids[:-1]
            return tokenizer.decode(ids, skip_special_tokens=False)

        return decode

    def describe(self) -> list[str]:
        support = sandbox_support()
        weak = " -- env.allow_weak_sandbox=true: runs anyway" if support.missing else ""
        return [*super().describe(), f"{support.describe()} (this host){weak}"]

    def make(self, prompt: Prompt) -> PythonToolTrajectory:
        ground_truth = row_extras(prompt)["reward_spec"].get("ground_truth")
        return PythonToolTrajectory(ground_truth, self.tool_format, self.sandbox_limits(), self.engine_tokenizer)

    def option_name(self) -> str:
        return "python_tool"
