"""What the `env=agent` tests share: a report channel out of agent processes (`Seen`), a tokenizer and
a generator that stand in for vLLM's, and a scripted rollout session on a real `ChatServer`."""

from __future__ import annotations

import json
import os
import time

from rlhf_orch.engines.agent_rollout import AgentRolloutSession, CallOutput
from rlhf_orch.env.agent import agent_row
from rlhf_orch.env.agent_driver.record import AgentLimits
from rlhf_orch.env.agent_driver.runner import AgentRunner
from rlhf_orch.data.base import Prompt


class Seen:
    """What agent functions report to the test: they run in processes of their own (the runner's
    host forks one per trajectory), so a dict in the test would stay empty. One JSON file per key."""

    def __init__(self, directory):
        self.directory = str(directory)

    def __setitem__(self, key, value) -> None:
        path = os.path.join(self.directory, f"{key}.json")
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump(value, f)
        os.replace(f"{path}.{os.getpid()}", path)  # a reader never sees half a value

    def __getitem__(self, key):
        try:
            with open(os.path.join(self.directory, f"{key}.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            raise KeyError(key) from None

    def get(self, key, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def wait_for(self, key, timeout_s: float = 10.0):
        deadline = time.monotonic() + timeout_s
        while (value := self.get(key)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {key!r} reported")
            time.sleep(0.02)
        return value


# --------------------------------------------------------------------------- a whole session over HTTP
class EchoTokenizer:
    """Token ids are characters' code points (0 is EOS); the chat template writes `r:content|` per
    message, an assistant's as `a:content<EOS>`, and `a:` as the generation prompt."""

    eos_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
        text = "".join(
            f"a:{m.get('content') or ''}\x00"
            if m["role"] == "assistant"
            else f"{m['role'][0]}:{m.get('content') or ''}|"
            for m in messages
        )
        return [ord(c) for c in text + ("a:" if add_generation_prompt else "")]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


class ScriptedGenerator:
    """Answers each call with the digits of its call number, one per token, then EOS."""

    def __init__(self):
        self.pending, self.submitted, self.aborted, self.sampling = [], [], [], []

    def submit(self, key, prompt_ids, max_tokens, seed, stop, sampling=None):
        self.submitted.append((key, list(prompt_ids), max_tokens, seed))
        self.sampling.append(sampling)
        ids = [ord(c) for c in str(len(self.submitted))][: max_tokens - 1] + [0]
        self.pending.append(CallOutput(key, ids, [-0.5] * len(ids), "stop"))

    def busy(self):
        return bool(self.pending)

    def poll(self):
        out, self.pending = self.pending, []
        return out

    def abort(self, keys):
        self.aborted.extend(keys)


def make_session(fn, server, timeout_s=10.0):
    limits = AgentLimits(max_prompt_tokens=200, max_response_tokens=400, max_tokens_per_call=8, max_calls=4)
    runner = AgentRunner(fn, concurrency=4, timeout_s=timeout_s)
    gen = ScriptedGenerator()
    return AgentRolloutSession(server, gen, EchoTokenizer(), runner, limits, 1.0, 7, "hermes", timeout_s), gen


def three_calls_with_a_tool(row, client, **kwargs):
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "tool", "content": f"tool saw {reply.choices[0].message.content}"},
        ]
    return {"score": float(row["ground_truth"]), "calls": 3}


def agent_rows(n):
    return [(i, agent_row(Prompt(text=f"q{i}", label=str(i / 10)))) for i in range(n)]
