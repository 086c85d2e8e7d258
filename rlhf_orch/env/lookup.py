"""`env=lookup`: the embedded tool-use task's lookup tool (`rlhf_orch.data.lookup_task`).

A turn that is the word ``call`` asks the tool, which answers with the record's value (a `tool`
message, plain text: `` got 9 0 5 =``); any other turn is the final answer, scored like the digit
task (digits in place / the longer length). Step metadata counts tool calls for `env/tool_calls_mean`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf_orch.data.base import Prompt
from rlhf_orch.data.digit_task import score_response
from rlhf_orch.data.lookup_task import CALL_WORD, tool_answer
from rlhf_orch.env.base import row_extras
from rlhf_orch.env.multi_turn import MultiTurnEnv
from rlhf_orch.env.options import LookupEnvConfig


class LookupTrajectory:
    def __init__(self, value: str):
        self.value = value

    def init(self, prompt: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return prompt, {}

    def step(self, action: str) -> dict[str, Any]:
        if action.split()[:1] == [CALL_WORD]:
            observation = {"role": "tool", "content": tool_answer(self.value)}
            return {"observations": [observation], "reward": 0.0, "done": False, "metadata": {"tool_calls": 1}}
        return {
            "observations": [],
            "reward": score_response(self.value, action),
            "done": True,
            "metadata": {"tool_calls": 0},
        }

    def close(self) -> None:
        pass


@dataclass
class LookupEnv(LookupEnvConfig, MultiTurnEnv):
    def make(self, prompt: Prompt) -> LookupTrajectory:
        return LookupTrajectory(str(row_extras(prompt)["reward_spec"]["ground_truth"]))

    def option_name(self) -> str:
        return "lookup"
