"""`env=python_tool`: tool calls parsed in both formats, run in the sandbox, answered as tool
messages with counts; a turn without a call is the scored final answer."""

from __future__ import annotations

import json
import time

import pytest

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.base import EnvError
from rlhf_orch.env.python_tool import MAX_CALLS_PER_TURN, PythonToolEnv, final_answer, parse_tool_calls


def _call(code: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"


def test_hermes_calls_are_parsed_and_bad_ones_explained():
    text = (
        _call("print(1)")
        + " and "
        + '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"x=2\\"}"}</tool_call>'
    )
    assert parse_tool_calls(text, "hermes") == [("print(1)", None), ("x=2", None)]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", "hermes")[0][1].startswith("tool call is not JSON")
    assert (
        "unknown tool" in parse_tool_calls('<tool_call>{"name": "bash", "arguments": {}}</tool_call>', "hermes")[0][1]
    )
    assert (
        "needs arguments"
        in parse_tool_calls('<tool_call>{"name": "python", "arguments": {}}</tool_call>', "hermes")[0][1]
    )
    assert parse_tool_calls("no call here", "hermes") == []


def test_tag_calls_and_final_answers():
    assert parse_tool_calls("<python>\nprint(2)\n</python>", "tags") == [("print(2)", None)]
    assert (
        final_answer("so #### 42 ") == "42"
        and final_answer("<answer> 7 </answer> done") == "7"
        and final_answer(" 5\n") == "5"
    )


def _env(**kw) -> PythonToolEnv:
    return PythonToolEnv(**{"tool_timeout_s": 15.0, **kw})


def test_a_call_runs_in_the_sandbox_and_comes_back_as_a_tool_message():
    env = _env().make(Prompt(text="q", label="42"))
    out = env.step("Let me compute. " + _call("print(6 * 7)"))
    assert out["done"] is False and out["reward"] == 0.0
    assert out["observations"] == [{"role": "tool", "content": "42\n"}]
    assert out["metadata"] == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}
    final = env.step("The answer is #### 42")
    assert final["done"] is True and final["reward"] == 1.0
    assert env.step("#### 41")["reward"] == 0.0


def test_tags_format_wraps_the_output_for_models_without_a_tool_role():
    env = _env(tool_format="tags").make(Prompt(text="q", label="1"))
    assert env.step("<python>print('hi')</python>")["observations"] == [
        {"role": "tool", "content": "<output>hi\n</output>"}
    ]


def test_hostile_and_broken_calls_give_error_observations_and_counts():
    # 5 s: time for a sandboxed process to start and raise on a loaded machine (1 s was not, in the suite);
    # the CPU limit well above it, so that the wall clock, not RLIMIT_CPU (5 s by default: a race
    # on an idle moment, seen once in CI), is what stops the loop
    env = _env(tool_timeout_s=5.0, tool_cpu_s=30).make(Prompt(text="q", label="1"))
    t0 = time.monotonic()
    out = env.step(_call("while True: pass") + _call("raise ValueError('no')") + "<tool_call>{oops}</tool_call>")
    assert time.monotonic() - t0 < 30
    assert out["metadata"] == {"tool_calls": 3, "tool_errors": 3, "tool_timeouts": 1}
    texts = [o["content"] for o in out["observations"]]
    assert (
        "timed out" in texts[0] and "ValueError: no" in texts[1] and texts[2].startswith("error: tool call is not JSON")
    )


def test_calls_beyond_the_per_turn_limit_are_not_run():
    env = _env().make(Prompt(text="q", label="1"))
    out = env.step("".join(_call(f"print({k})") for k in range(MAX_CALLS_PER_TURN + 1)))
    assert out["metadata"]["tool_errors"] == 1
    assert "not run" in out["observations"][-1]["content"]


@pytest.mark.real_model
def test_fifty_calls_in_one_turn_fold_into_one_message_and_the_trajectory_goes_on(smollm2_tokenizer):
    """A degenerate policy writing ~50 calls in one turn: the first MAX_CALLS_PER_TURN run, the rest
    are answered by ONE error message (not one each), so the observation fits Qwen2.5's tool template
    (each tool message costs its <tool_response> frame) and the trajectory goes on to its answer --
    one message per call took 660 template tokens, over env.max_observation_tokens, and ended the run."""
    import copy

    from tests.env.test_chat_template_turns import QWEN25_TEMPLATE, _run, _turn

    env = _env()
    turn = "".join(_call(f"print({k})") for k in range(50))
    out = env.make(Prompt(text="q", label="42")).step(turn)
    texts = [o["content"] for o in out["observations"]]
    assert len(texts) == MAX_CALLS_PER_TURN + 1 and texts[:2] == ["0\n", "1\n"]
    assert texts[-1].startswith(f"error: at most {MAX_CALLS_PER_TURN} tool calls per turn; the other 46 were not run")
    assert out["metadata"] == {"tool_calls": 50, "tool_errors": 46, "tool_timeouts": 0}

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN25_TEMPLATE
    trajectory_env = env.make(Prompt(text="q", label="42"))
    t, gen, _ = _run(
        tok, env.chat_template_kwargs, trajectory_env, [_turn(tok, turn), _turn(tok, "#### 42")], per_turn=2048
    )
    assert t.counts.turns == 2 and not t.truncated and t.counts.observations_too_long == 0
    assert t.turn_rewards == [0.0, 1.0] and t.counts.tool_calls == 50 and t.counts.tool_errors == 46
    assert "at most 4 tool calls per turn" in tok.decode(gen.contexts[(0, 1)])


def test_bad_tool_settings_are_refused_before_ray():
    with pytest.raises(EnvError, match="tool_format"):
        _env(tool_format="xml")
    with pytest.raises(EnvError, match="memory_mb"):
        _env(tool_memory_mb=1)


def test_tool_formats_beyond_hermes_are_vllm_s_parsers(smollm2_tokenizer):
    """env.tool_format=<a vLLM tool parser> reads the calls the way vLLM's OpenAI server does, with
    the engine's tokenizer (here SmolLM2's, given the format's marker tokens); an unknown name is
    refused before Ray naming them."""
    import copy

    from rlhf_orch.env.base import EnvError

    with pytest.raises(
        EnvError, match=r"env.tool_format='json': must be one of hermes, tags or a vLLM tool parser \(.*llama3_json"
    ):
        _env(tool_format="json")
    # the turn as the environment gets it: decoded without special tokens (skyrl-gym's contract)
    cases = {
        "llama3_json": (
            '<|python_tag|>{"name": "python", "parameters": {"code": "print(6*7)"}}',
            ["<|python_tag|>"],
            True,
        ),
        "qwen3_coder": (
            "<tool_call>\n<function=python>\n<parameter=code>\nprint(6*7)\n</parameter>\n</function>\n</tool_call>",
            ["<tool_call>", "</tool_call>"],
            False,
        ),  # added, not special, as in Qwen's tokenizers
    }
    for fmt, (turn, markers, special) in cases.items():
        tok = copy.deepcopy(smollm2_tokenizer)
        tok.add_special_tokens({"additional_special_tokens": markers}) if special else tok.add_tokens(markers)
        env = _env(tool_format=fmt)
        env.attach(tok)
        action = tok.decode(tok(turn, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        out = env.make(Prompt(text="q", label="42")).step(action)
        assert out["metadata"] == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0}, (fmt, out)
        assert out["observations"][0]["content"].strip() == "42"
    # a parser that cannot read this tokenizer's turns is refused where the turns run, in one line
    env = _env(tool_format="mistral")
    with pytest.raises(EnvError, match="tool parser 'mistral' cannot parse this model's turns"):
        env.attach(smollm2_tokenizer)
    # the schema reaches the model through the chat template's `tools`
    assert _env().chat_template_kwargs["tools"][0]["function"]["name"] == "python"


def test_a_tool_format_whose_marker_is_a_special_token_reads_the_turn_with_it(smollm2_tokenizer):
    """env.tool_format=mistral: `[TOOL_CALLS]` is a special token (here added to SmolLM2's tokenizer),
    gone from the action skyrl-gym's contract decodes. The option's action decoder keeps special
    tokens, as vLLM's OpenAI server does for its tool parsers, without the turn's closing EOS: the
    call runs in the sandbox and the final answer still scores."""
    import copy

    from rlhf_orch.env.turn_driver.runner import MultiTurnRunner
    from tests.env.test_env_runner import ScriptedGenerator

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    env = _env(tool_format="mistral")
    env.attach(tok)
    eos = [tok.eos_token_id]
    call = (
        tok('[TOOL_CALLS][{"name": "python", "arguments": {"code": "print(6*7)"}}]', add_special_tokens=False)[
            "input_ids"
        ]
        + eos
    )
    assert (
        parse_tool_calls(tok.decode(call, skip_special_tokens=True), "mistral", tok) == []
    )  # what skyrl-gym's action holds
    generator = ScriptedGenerator({(0, 0): call, (0, 1): tok("#### 42", add_special_tokens=False)["input_ids"] + eos})
    generator.decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    prompt = Prompt(text="q", label="42", messages=({"role": "user", "content": "What is 6 times 7?"},))
    runner = MultiTurnRunner(
        env.make, generator, env.renderer(tok), env.limits(256), 1, 30.0, "strict", env.action_decoder(tok)
    )
    (t,) = list(runner.run([(0, prompt, [])]))
    assert (t.counts.turns, t.counts.tool_calls, t.counts.tool_errors) == (2, 1, 0) and t.turn_rewards == [0.0, 1.0]
    assert "42" in tok.decode(generator.contexts[(0, 1)])  # the tool's output is the second turn's context
    assert _env(tool_format="hermes").action_decoder(tok) is None  # built-in formats: skyrl-gym's action


def test_a_host_whose_sandbox_lacks_a_boundary_is_refused_before_ray_unless_allowed(monkeypatch, tiny_model_path):
    """Not root, or a container without namespaces: the config check names what is missing and
    env.allow_weak_sandbox; the engine (another host on a cluster) refuses too; the console says."""
    from hydra.utils import instantiate

    import rlhf_orch.env.python_tool as python_tool
    from rlhf_orch.app import check
    from rlhf_orch.config.problems import ConfigError
    from rlhf_orch.env.sandbox import SandboxSupport
    from tests.conftest import compose_config

    weak = SandboxSupport(network_namespace=True, private_filesystem=False, separate_uid=False)
    monkeypatch.setattr(python_tool, "sandbox_support", lambda: weak)

    def checked(*overrides: str):
        cfg = compose_config(
            ["env=python_tool", "env.observation_format=plain", *overrides]
        )  # (the default data is raw text)
        return check(cfg, instantiate(cfg.launcher))

    with pytest.raises(ConfigError) as refused:
        checked()
    text = str(refused.value)
    assert "env.allow_weak_sandbox" in text and "no private read-only filesystem, no separate uid" in text
    typed, _ = checked("env.allow_weak_sandbox=true")  # allowed: runs with what works
    assert typed.env.allow_weak_sandbox

    env = PythonToolEnv(tool_format="tags")
    with pytest.raises(EnvError, match="on this engine's host the sandbox has no private read-only filesystem"):
        env.attach(None)
    assert any("separate uid no (this host) -- env.allow_weak_sandbox=true" in line for line in env.describe())
    PythonToolEnv(tool_format="tags", allow_weak_sandbox=True).attach(None)

    monkeypatch.setattr(python_tool, "sandbox_support", lambda: SandboxSupport(True, True, True))
    checked()  # every boundary: nothing to allow
