"""A LangGraph ReAct agent over LangChain's `ChatOpenAI`, trained as it is written
(`pip install langgraph langchain langchain-openai`).

    python run.py experiment=tool_use_agent env.path=scripts/examples/langgraph_agent.py env.name=langgraph_agent

`langgraph_agent` is LangGraph's prebuilt tool-calling loop: the model, then the tools it called,
then the model again, until it answers without a tool call. Since LangGraph 1.0 it is
`langchain.agents.create_agent` (a LangGraph graph; `langgraph.prebuilt.create_react_agent` is
deprecated in its favour and sends the same requests). The only change from the docs is the
model's `base_url` and `api_key`: the trajectory's. ChatOpenAI calls `POST <base_url>/chat/completions`
with the whole conversation each time, so the calls train as one sequence.

On the tool-use task (`find 3 1 4 =`) the lookup tool returns the record's value; on the digit
task there are no records and the tool shows the question again. The reward is 1.0 when the last
message contains the ground truth.
"""

from __future__ import annotations

import openai
from langchain.agents import create_agent
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError


def langgraph_agent(row, base_url, api_key, **kwargs):
    row_record = (row.get("extra_info") or {}).get("record")

    @tool
    def lookup(record: str) -> str:
        """The value stored in a record."""
        if record.strip() == row_record:
            return f" got {row['ground_truth']} ="
        return " " + row["prompt"]  # no such record (the digit task has none): the question again

    # LangSmith tracing stays off unless LANGSMITH_TRACING=true is in the environment.
    model = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key)
    agent = create_agent(model, tools=[lookup])
    try:
        # recursion_limit counts graph steps (a model call, a round of tools): 5 = 3 model calls,
        # as max_turns=3 in agents_sdk_agent.py.
        state = agent.invoke({"messages": row["messages"]}, {"recursion_limit": 5})
    except (GraphRecursionError, openai.BadRequestError):  # still calling tools / out of budget
        return 0.0
    return float(row["ground_truth"] in state["messages"][-1].text)
