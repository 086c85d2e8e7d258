"""`env=python_tool`: the policy may call a sandboxed Python tool before it answers.

Each model turn is parsed for tool calls:

* `env.tool_format=hermes` (Qwen / Hermes chat models):
  `<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`
* `env.tool_format=tags` (models without a tool format, like the tiny model): `<python>code</python>`

A turn with calls runs each in the sandbox (`rlhf_orch.env.sandbox`: its own process, CPU, memory,
process and output limits, an empty directory, no inherited environment) and answers with one
`tool` message per call; the trajectory goes on. A turn without a call is the final answer: the
step is done and scores 1.0 when the answer equals the row's ground truth (the text after `####`
or inside `<answer>...</answer>` if present, else the whole turn, stripped), else 0.0. A malformed
call answers with an error message and counts as a tool error. Step metadata carries the counts the
run reports (`env/tool_calls_mean`, `env/tool_errors`, `env/tool_timeouts`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError, row_extras
from rlhf_orch.env.multi_turn import MultiTurnEnv
from rlhf_orch.env.sandbox import SandboxLimits, run_python

TOOL_FORMATS = ("hermes", "tags")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_TAGS = re.compile(r"<python>(.*?)</python>", re.DOTALL)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_CALLS_PER_TURN = 4  # further calls in one turn are answered with an error, not run


def parse_tool_calls(text: str, fmt: str) -> list[tuple[str | None, str | None]]:
    """Per call in `text`: (code, None), or (None, what is wrong with the call)."""
    if fmt == "tags":
        return [(code.strip("\n"), None) for code in _TAGS.findall(text)]
    calls: list[tuple[str | None, str | None]] = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append((None, f"tool call is not JSON: {e.msg} at column {e.colno}"))
            continue
        if not isinstance(call, dict) or call.get("name") != "python":
            calls.append((None, "unknown tool: the only tool is 'python' with arguments {\"code\": ...}"))
            continue
        args = call.get("arguments")
        if isinstance(args, str):  # some models send the arguments JSON-encoded once more
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        code = args.get("code") if isinstance(args, dict) else None
        calls.append((code, None) if isinstance(code, str) else (None, "python tool call needs arguments {\"code\": \"...\"}"))
    return calls


def final_answer(text: str) -> str:
    match = _ANSWER_TAG.search(text)
    if match:
        return match.group(1).strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text.strip()


class PythonToolTrajectory:
    """One trajectory's environment (skyrl-gym's BaseTextEnv contract)."""

    def __init__(self, ground_truth: Any, tool_format: str, limits: SandboxLimits):
        self.ground_truth = None if ground_truth is None else str(ground_truth).strip()
        self.tool_format = tool_format
        self.limits = limits

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return prompt, {}

    def _message(self, text: str) -> dict[str, Any]:
        # The plain-text format shows the model where the tool's answer starts and ends.
        content = text if self.tool_format == "hermes" else f"<output>{text}</output>"
        return {"role": "tool", "content": content}

    def step(self, action: str) -> dict[str, Any]:
        calls = parse_tool_calls(action, self.tool_format)
        if not calls:
            correct = self.ground_truth is not None and final_answer(action) == self.ground_truth
            return {"observations": [], "reward": 1.0 if correct else 0.0, "done": True, "metadata": {"tool_calls": 0}}
        observations, errors, timeouts = [], 0, 0
        for k, (code, problem) in enumerate(calls):
            if k >= MAX_CALLS_PER_TURN:
                problem = f"at most {MAX_CALLS_PER_TURN} tool calls per turn; this one was not run"
            if problem is not None:
                errors += 1
                observations.append(self._message(f"error: {problem}"))
                continue
            result = run_python(code, self.limits)
            errors += int(result.error)
            timeouts += int(result.timed_out)
            observations.append(self._message(result.observation()))
        metadata = {"tool_calls": len(calls), "tool_errors": errors, "tool_timeouts": timeouts}
        return {"observations": observations, "reward": 0.0, "done": False, "metadata": metadata}

    def close(self) -> None:
        pass


@dataclass
class PythonToolEnv(MultiTurnEnv):
    tool_format: str = "hermes"
    tool_memory_mb: int = 512
    tool_cpu_s: int = 5
    tool_max_output_bytes: int = 2000

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tool_format not in TOOL_FORMATS:
            raise EnvError(f"env.tool_format={self.tool_format!r}: must be one of {', '.join(TOOL_FORMATS)}")
        self.sandbox_limits()  # bad limits refused here, before Ray

    def sandbox_limits(self) -> SandboxLimits:
        try:
            return SandboxLimits(
                timeout_s=self.tool_timeout_s, cpu_s=self.tool_cpu_s, memory_mb=self.tool_memory_mb,
                max_output_bytes=self.tool_max_output_bytes,
            )
        except ValueError as e:
            raise EnvError(f"env: {e}") from e

    def step_timeout_s(self) -> float:
        # A turn runs up to MAX_CALLS_PER_TURN calls, each within tool_timeout_s (the sandbox kills it).
        return self.tool_timeout_s * MAX_CALLS_PER_TURN + 5.0

    def make(self, prompt: Prompt) -> PythonToolTrajectory:
        ground_truth = row_extras(prompt)["reward_spec"].get("ground_truth")
        return PythonToolTrajectory(ground_truth, self.tool_format, self.sandbox_limits())

    def option_name(self) -> str:
        return "python_tool"
