"""A chat-completions agent that streams one call and sets its own sampling on the next.

    python run.py experiment=tool_use_agent env.path=scripts/examples/streamed_agent.py env.name=streamed_then_sampled

`streamed_then_sampled` shows the two things openai_agent.py leaves out: a streamed call
(`stream=True`, `stream_options={"include_usage": True}`) whose chunks the agent adds up into the
assistant message itself (text and tool-call pieces), and a call with its own sampling settings
(`temperature=0.7`, `top_p=0.9`, `stop=["\\n\\n"]`). With `env.sampling=call` (the default) the
engine samples at those settings; the trainers score the second answer at temperature 0.7 and, for
its top_p, train it only where the run weighs tokens by the engine's probability (algo.tis_cap or
algo.decoupled_is_cap; otherwise it is context). `env.sampling=run` replaces them with the run's.
Streaming changes nothing that is trained: the endpoint sends the chunks of the same completion a
plain call gets.

On the tool-use task (`find 3 1 4 =`) the lookup tool returns the record's value; on the digit
task there are no records and the tool shows the question again. The reward is 1.0 when the last
answer contains the ground truth.
"""

from __future__ import annotations

import json

import openai

MODEL = "policy"
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value stored in a record",
        "parameters": {"type": "object", "properties": {"record": {"type": "string"}}, "required": ["record"]},
    },
}


def lookup(row, record) -> str:
    """The tool: the value of the row's record (the tool-use task), else the question again."""
    if record is not None and str(record).strip() == (row.get("extra_info") or {}).get("record"):
        return f" got {row['ground_truth']} ="
    return " " + row["prompt"]


def record_asked(arguments: str):
    """The `record` argument of a tool call (None when the model wrote something else)."""
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return None
    return args.get("record") if isinstance(args, dict) else None


def streamed_message(stream) -> tuple[dict, int]:
    """(the assistant message, completion tokens) added up from a stream of chat.completion.chunk."""
    content, calls, tokens = "", {}, 0
    for chunk in stream:
        if chunk.usage:  # include_usage: one last chunk with no choices, only the usage
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            content += choice.delta.content or ""
            # A tool call comes in pieces at its `index`: its id and name first, then its arguments.
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(
                    piece.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] = piece.id or call["id"]
                if piece.function:
                    call["function"]["name"] += piece.function.name or ""
                    call["function"]["arguments"] += piece.function.arguments or ""
    message = {"role": "assistant", "content": content}
    if calls:  # (as OpenAI's messages: beside tool calls, no text is null)
        message.update(content=content or None, tool_calls=[calls[i] for i in sorted(calls)])
    return message, tokens


def streamed_then_sampled(row, client, **kwargs):
    messages = list(row["messages"])
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[LOOKUP_TOOL], stream=True, stream_options={"include_usage": True}
    )
    message, tokens = streamed_message(stream)
    answer = message["content"] or ""
    messages.append(message)
    # The tool's answers go back as `tool` messages: one per call the model made. The tiny models
    # write the word `call` instead (their prompt names the record); any other reply gets the
    # question shown again, and the model answers once more.
    for call in message.get("tool_calls", []):
        record = record_asked(call["function"]["arguments"])
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": lookup(row, record)})
    if "tool_calls" not in message:
        record = (row.get("extra_info") or {}).get("record") if answer.split()[:1] == ["call"] else None
        messages.append({"role": "tool", "content": lookup(row, record)})
    try:
        # The same tools as the first call: the prompt then renders as the first call's prompt +
        # completion + the tool's answer, and the two calls train as one sequence.
        reply = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[LOOKUP_TOOL], temperature=0.7, top_p=0.9, stop=["\n\n"]
        )
        answer = reply.choices[0].message.content or ""
        tokens += reply.usage.completion_tokens if reply.usage else 0
    except openai.BadRequestError:  # no room left in the trajectory's budget: the first answer stands
        pass
    return {"score": float(row["ground_truth"] in answer), "completion_tokens": tokens}
