"""An OpenAI Agents SDK agent (`pip install openai-agents`), trained as it is written.

    python run.py experiment=tool_use_agent env.path=scripts/examples/agents_sdk_agent.py env.name=agents_sdk_agent

`agents_sdk_agent` is the SDK's own pattern: an `Agent` with a `@function_tool`, run by
`Runner.run`, on the SDK's default model API (the Responses API: `POST <base_url>/responses`). The
only change from the SDK's docs is the client: an `AsyncOpenAI` on the trajectory's base URL and
key, handed to the model. The SDK sends the whole conversation with every call (the user message,
its `function_call` and the `function_call_output`), so its calls train as one sequence.

On the tool-use task (`find 3 1 4 =`) the lookup tool returns the record's value; on the digit
task there are no records and the tool shows the question again. The reward is 1.0 when the final
output contains the ground truth.
"""

from __future__ import annotations

import openai
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    OpenAIResponsesModel,
    Runner,
    function_tool,
)
from openai import AsyncOpenAI


async def agents_sdk_agent(row, base_url, api_key, **kwargs):
    # (The SDK's trace upload to api.openai.com is off in the run's agent processes:
    # OPENAI_AGENTS_DISABLE_TRACING=1, set by the run unless the job's environment sets it.)
    row_record = (row.get("extra_info") or {}).get("record")

    @function_tool
    def lookup(record: str) -> str:
        """The value stored in a record."""
        if record.strip() == row_record:
            return f" got {row['ground_truth']} ="
        return " " + row["prompt"]  # no such record (the digit task has none): the question again

    # `async with`: the client's connections close in this event loop, before it ends.
    async with AsyncOpenAI(base_url=base_url, api_key=api_key) as client:
        agent = Agent(
            name="lookup_agent", tools=[lookup], model=OpenAIResponsesModel(model="policy", openai_client=client)
        )
        try:
            # row["messages"]: the row's chat messages are Responses API input items as they are.
            result = await Runner.run(agent, row["messages"], max_turns=3)
        except (MaxTurnsExceeded, ModelBehaviorError, openai.BadRequestError):
            # Still calling tools after 3 turns; a turn cut at its token limit (the SDK raises on a
            # response whose status is `incomplete`) or a call of a tool that does not exist; no
            # room left in the trajectory's budget (HTTP 400): the trajectory failed the task.
            return 0.0
    return float(row["ground_truth"] in str(result.final_output))
