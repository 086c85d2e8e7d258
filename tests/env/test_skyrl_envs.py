"""Every environment skyrl-gym registers, unchanged, on its own row layout, without an engine (a
scripted model turn, SmolLM2's tokenizer and ChatML template, the tokenization check strict):
gsm8k, gsm8k_multi_turn, aime, lcb, text2sql (tests/env/test_chat_template_turns.py) and search against a
local stand-in retrieval server; without one, search and searchcode are refused before Ray,
naming the URL and the key."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError
from rlhf_orch.env.turn_driver.runner import MultiTurnRunner
from tests.env.test_env_runner import ScriptedGenerator

pytestmark = pytest.mark.real_model
skyrl_gym = pytest.importorskip("skyrl_gym")

from rlhf_orch.env.skyrl import SkyRLEnv, registered_env_ids  # noqa: E402


def _play(tok, env, env_fields, replies, question="Solve it."):
    """One trajectory of `env` on a row with `env_fields`; turn k of the model writes replies[k]."""
    messages = ({"role": "user", "content": question},)
    prompt = Prompt(text=question, label=None, messages=messages, env_fields=env_fields)
    ids = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    turns = {(0, k): tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for k, r in enumerate(replies)}
    generator = ScriptedGenerator(turns)
    generator.decode = lambda t: tok.decode(t, skip_special_tokens=True)
    runner = MultiTurnRunner(env.make, generator, env.renderer(tok), env.limits(1024), 1, 30.0, "strict")
    (t,) = list(runner.run([(0, prompt, ids)]))
    assert t.counts.env_errors == 0 and t.counts.env_timeouts == 0 and t.counts.tokenization_mismatches == 0
    return t, generator


ROWS = {
    # (env_class, the row's extra columns, the model's replies, expected turns, expected reward)
    "gsm8k": ({"reward_spec": {"method": "rule", "ground_truth": "42"}}, ["6 times 7 is 42.\n#### 42"], 1, 1.0),
    "gsm8k_multi_turn": (
        {"reward_spec": {"method": "rule", "ground_truth": "42"}, "extra_info": {"max_turns": 3}},
        ["It is 40.", "#### 42"],
        2,
        1.0,
    ),
    "aime": ({"reward_model": {"style": "rule", "ground_truth": "42"}}, ["6 times 7 is 42.\nAnswer: 42"], 1, 1.0),
    "lcb": (
        {
            "reward_spec": {
                "method": "rule",
                "ground_truth": json.dumps(
                    [
                        {"input": "3 4\n", "output": "7\n", "testtype": "stdin"},
                        {"input": "10 -2\n", "output": "8\n", "testtype": "stdin"},
                    ]
                ),
            }
        },
        ["```python\na, b = map(int, input().split())\nprint(a + b)\n```"],
        1,
        1.0,
    ),
}


@pytest.mark.parametrize("env_class", sorted(ROWS))
def test_offline_environments_run_unchanged_on_their_rows(env_class, smollm2_tokenizer):
    fields, replies, turns, reward = ROWS[env_class]
    env = SkyRLEnv(env_class=env_class)
    t, _ = _play(smollm2_tokenizer, env, {"env_class": env_class, **fields}, replies)
    assert t.counts.turns == turns and t.done and t.reward("last") == reward


class _Retriever(BaseHTTPRequestHandler):
    """SkyRL's retrieval server's protocol: POST {query, topk, return_scores} -> {"result": [[{document: {contents}}]]}."""

    seen: list = []

    def do_POST(self):  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Retriever.seen.append(body)
        docs = [
            [{"document": {"contents": f'"Paris"\nParis is the capital of France. ({body["query"]})'}, "score": 1.0}]
        ]
        payload = json.dumps({"result": docs}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def retriever():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Retriever)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/retrieve"
    server.shutdown()


def test_search_queries_the_retrieval_server_and_scores_the_answer(smollm2_tokenizer, retriever):
    env = SkyRLEnv(env_class="search", env_config={"search_url": retriever, "log_requests": False})
    fields = {
        "env_class": "search",
        "reward_spec": {"method": "rule", "ground_truth": {"target": ["Paris"]}},
        "max_turns": 3,
    }
    prompt = Prompt(
        text="q", messages=({"role": "user", "content": "What is the capital of France?"},), env_fields=fields
    )
    env.check(prompt, smollm2_tokenizer)  # the server answers: accepted
    t, generator = _play(
        smollm2_tokenizer, env, fields, ["<search>capital of France</search>", "<answer>Paris</answer>"]
    )
    assert t.counts.turns == 2 and t.reward("last") == 1.0
    assert _Retriever.seen and _Retriever.seen[-1]["query"] == "capital of France"
    assert "Paris is the capital of France" in smollm2_tokenizer.decode(generator.contexts[(0, 1)])


@pytest.mark.parametrize("env_class", ["search", "searchcode"])
def test_a_retrieval_environment_without_its_server_is_refused_naming_the_url(env_class, smollm2_tokenizer):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/retrieve"
    env = SkyRLEnv(env_class=env_class, env_config={"search_url": url} if env_class == "search" else {})
    fields = {"env_class": env_class, "reward_spec": {"method": "rule", "ground_truth": {"target": ["x"]}}}
    prompt = Prompt(text="q", messages=({"role": "user", "content": "q"},), env_fields=fields)
    with pytest.raises(
        EnvError, match=f"env=skyrl: {env_class} queries a retrieval server at http://127.0.0.1:.*does not answer"
    ):
        env.check(prompt, smollm2_tokenizer)


def test_every_registered_environment_is_covered():
    covered = set(ROWS) | {"text2sql", "search", "searchcode"}
    assert set(registered_env_ids()) - {"rlm"} <= covered, sorted(set(registered_env_ids()) - covered)
