"""Multi-turn contexts on real chat templates, without an engine: the tokens each turn is generated
from equal what the tokenizer's chat template renders for the conversation so far (the model's
tokens kept as generated) -- on SmolLM2-135M-Instruct's ChatML, a Qwen2.5-style template with tool
messages, a Llama-3-style template and the tiny model's; long observations cut on their content;
turns cut at their token limit or by a stop string; the tokenization check's three modes."""

from __future__ import annotations

import copy

import pytest

from rlhf_orch.data.base import Prompt
from rlhf_orch.env.observations import ObservationRenderer
from rlhf_orch.env.turn_driver.runner import MultiTurnRunner, TokenizationMismatch
from rlhf_orch.env.turn_driver.trajectory import TrajectoryLimits
from tests.env.test_env_runner import ScriptedGenerator

pytestmark = pytest.mark.real_model

QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided '
    'with function signatures within <tools></tools> XML tags:\\n<tools>" }}{%- for tool in tools %}{{- "\\n" }}'
    '{{- tool | tojson }}{%- endfor %}{{- "\\n</tools>\\n\\nFor each function call, return a json object with function '
    'name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, '
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are "
    "Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    '{%- for message in messages %}{%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    "(message.role == \"assistant\" and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\\n' + "
    "message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == \"tool\" %}{%- if (loop.index0 == 0) or "
    "(messages[loop.index0 - 1].role != \"tool\") %}{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' }}"
    "{{- message.content }}{{- '\\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "run code",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    }
]


@pytest.fixture(params=["smollm2", "qwen25_tools", "llama3"])
def template(request, smollm2_tokenizer):
    """(tokenizer, chat template kwargs, observation role) for each real template family."""
    tok = copy.deepcopy(smollm2_tokenizer)
    if request.param == "smollm2":
        return tok, {}, "user"
    if request.param == "qwen25_tools":
        tok.chat_template = QWEN25_TEMPLATE
        return tok, {"tools": TOOLS}, "tool"
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok, {}, "user"


class Answering:
    """Answers each turn with `reply` (or `replies[i]`) for `turns` turns; the last step is done."""

    def __init__(self, role, reply="result: 42", turns=2, replies=None, postprocess=None):
        self.role, self.reply, self.turns, self.replies, self.postprocess = role, reply, turns, replies, postprocess
        self.seen = []

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.seen.append(action)
        done = len(self.seen) >= self.turns
        content = self.replies[len(self.seen) - 1] if self.replies else self.reply
        observations = [] if done or content is None else [{"role": self.role, "content": content}]
        out = {"observations": observations, "reward": 1.0, "done": done}
        if self.postprocess:
            out["postprocessed_action"] = self.postprocess(action)
        return out


def _run(
    tok, kwargs, env, turns, *, obs_tokens=256, per_turn=64, side="tail", check="strict", prompt_ids=None, messages=None
):
    """One trajectory; turn k generates `turns[k]` (token ids, cut to the turn's budget). The prompt's
    ids are what data=files renders for the row: the template without env.chat_template_kwargs."""
    messages = messages or [{"role": "user", "content": "What is 6 times 7? Use the tool."}]
    ids = prompt_ids or tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    generator = ScriptedGenerator({(0, k): t for k, t in enumerate(turns)})
    generator.decode = lambda t: tok.decode(t, skip_special_tokens=True)
    renderer = ObservationRenderer(tok, "chat_template", side, (), kwargs)  # re-renders the prompt with kwargs
    runner = MultiTurnRunner(
        lambda p: env, generator, renderer, TrajectoryLimits(len(turns), per_turn, 2048, obs_tokens), 1, 5.0, check
    )
    (t,) = list(runner.run([(0, Prompt(text="q", messages=tuple(messages)), ids)]))
    return t, generator, messages


def _chat(tok, messages, kwargs, generation_prompt=True):
    out = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _turn(tok, text, close=True):
    return tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if close else [])


def _same(tok, context, conversation, kwargs):
    """The context is the template's rendering: as text always; as token ids where the template puts
    a special token on both sides of a turn (ChatML): elsewhere (Llama-3's `\n\n` before the content)
    re-tokenising the whole text merges across the boundary the model generated from."""
    text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **kwargs)
    assert tok.decode(context) == text
    if "<|im_start|>" in text:
        assert context == _chat(tok, conversation, kwargs)
    return True


def test_each_turn_is_generated_from_what_the_template_renders(template):
    tok, kwargs, role = template
    env = Answering(role, turns=3)
    t, gen, messages = _run(
        tok, kwargs, env, [_turn(tok, "Let me check."), _turn(tok, "Again."), _turn(tok, "It is 42.")]
    )
    conversation = [
        *messages,
        {"role": "assistant", "content": "Let me check."},
        {"role": role, "content": "result: 42"},
    ]
    assert _same(tok, gen.contexts[(0, 1)], conversation, kwargs)
    conversation += [{"role": "assistant", "content": "Again."}, {"role": role, "content": "result: 42"}]
    assert _same(tok, gen.contexts[(0, 2)], conversation, kwargs)
    assert t.counts.tokenization_mismatches == 0 and t.counts.closing_tokens_added == 0
    # the model's end-of-turn token is trained; what the template puts after it is context
    mask = dict(zip(range(len(t.prompt_ids), len(t.context())), t.loss_mask))
    eos_at = [i for i, x in enumerate(t.context()) if x == tok.eos_token_id and i >= len(t.prompt_ids)]
    assert mask[eos_at[0]] == 1 and mask[eos_at[0] + 1] == 0


def test_a_turn_cut_at_its_token_limit_gets_the_end_of_turn_token_as_context(template):
    tok, kwargs, role = template
    long_turn = _turn(tok, "Let me think about this for a long while before I answer", close=False)
    t, gen, messages = _run(tok, kwargs, Answering(role), [long_turn, _turn(tok, "42")], per_turn=6)
    cut = long_turn[:6]
    conversation = [
        *messages,
        {"role": "assistant", "content": tok.decode(cut)},
        {"role": role, "content": "result: 42"},
    ]
    context = gen.contexts[(0, 1)]
    assert context[: len(t.prompt_ids) + 6] == t.prompt_ids + cut
    assert context[len(t.prompt_ids) + 6] == tok.eos_token_id  # the turn is closed before the observation
    assert t.loss_mask[6] == 0 and t.counts.closing_tokens_added == 1
    assert t.counts.tokenization_mismatches == 0
    # what follows the model's tokens is what the template renders after a turn
    rendered = _chat(tok, conversation, kwargs)
    assert context[len(t.prompt_ids) + 6 :] == rendered[len(rendered) - (len(context) - len(t.prompt_ids) - 6) :]


@pytest.mark.parametrize("side", ["tail", "head", "middle"])
def test_a_long_observation_is_cut_on_its_content_and_the_template_still_closes_it(template, side):
    tok, kwargs, role = template
    output = "".join(f"line {i}: value {i * i}\n" for i in range(300))  # ~2.5k tokens of tool output
    t, gen, messages = _run(
        tok,
        kwargs,
        Answering(role, reply=output),
        [_turn(tok, "Run it."), _turn(tok, "Done.")],
        obs_tokens=64,
        side=side,
    )
    context = gen.contexts[(0, 1)]
    observation = context[len(t.prompt_ids) + len(t.turns[0]) :]
    assert len(observation) <= 64 and t.counts.observations_truncated == 1
    # the next turn starts after the template's generation prompt, not inside the tool message
    header = _chat(tok, [{"role": "user", "content": "x"}], kwargs)
    header_tail = header[len(_chat(tok, [{"role": "user", "content": "x"}], kwargs, generation_prompt=False)) :]
    assert context[-len(header_tail) :] == header_tail
    text = tok.decode(observation)
    kept = {
        "tail": "line 0:" in text and "line 299" not in text,
        "head": "line 299" in text and "line 0:" not in text,
        "middle": "line 0:" in text and "line 299" in text and "\n...\n" in text,
    }
    assert kept[side], text
    assert t.counts.tokenization_mismatches == 0


def test_a_turn_the_environment_shortened_ends_properly(smollm2_tokenizer):
    tok = smollm2_tokenizer
    # the environment used the turn up to its closing tag only (skyrl-gym's postprocessed_action)
    turn = _turn(tok, "<sql>SELECT 1</sql> and some trailing words", close=False)
    env = Answering("user", postprocess=lambda a: a[: a.index("</sql>") + len("</sql>")] if "</sql>" in a else a)
    t, gen, messages = _run(tok, {}, env, [turn, _turn(tok, "<solution>1</solution>")])
    assert tok.decode(t.turns[0]).startswith("<sql>SELECT 1</sql>") and len(t.turns[0]) < len(turn)
    assert "trailing" not in tok.decode(gen.contexts[(0, 1)])
    assert t.counts.postprocessed_actions == 1 and t.counts.closing_tokens_added == 1
    assert t.counts.tokenization_mismatches == 0


def test_a_prompt_with_assistant_messages_of_its_own_is_checked_around_them(smollm2_tokenizer):
    """Few-shot examples (or a conversation's history) in the prompt are not the model's turns."""
    tok = smollm2_tokenizer
    few_shot = [
        {"role": "user", "content": "What is 2 times 3?"},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "What is 6 times 7?"},
    ]
    t, gen, _ = _run(tok, {}, Answering("user"), [_turn(tok, "Let me check."), _turn(tok, "42")], messages=few_shot)
    assert t.counts.tokenization_mismatches == 0 and t.turn_messages == [3, 5]
    assert _same(
        tok,
        gen.contexts[(0, 1)],
        [*few_shot, {"role": "assistant", "content": "Let me check."}, {"role": "user", "content": "result: 42"}],
        {},
    )


def test_a_step_without_observations_still_closes_the_turn_and_opens_the_next(smollm2_tokenizer):
    tok = smollm2_tokenizer
    t, gen, messages = _run(tok, {}, Answering("user", replies=[None, None]), [_turn(tok, "Hmm."), _turn(tok, "42")])
    assert tok.decode(gen.contexts[(0, 1)]).endswith("Hmm.<|im_end|>\n<|im_start|>assistant\n")
    assert t.counts.tokenization_mismatches == 0


def test_the_check_refuses_a_prompt_that_is_not_the_template_s(smollm2_tokenizer):
    """A prompt the data did not chat-template (the config check refuses such data with chat-template
    observations; this is what the engines would see): the mismatch is in the prompt, at token 0,
    and the message says so and how to fix it -- not to train anyway in warn mode."""
    tok = smollm2_tokenizer
    plain = tok("What is 6 times 7? Use the tool.", add_special_tokens=False)["input_ids"]  # data.chat_template=false
    turns = [_turn(tok, "Let me check."), _turn(tok, "42")]
    with pytest.raises(
        TokenizationMismatch,
        match=r"at token 0 of \d+, inside the prompt: the prompt was not chat-templated .*"
        r"set env.observation_format=plain or chat-template the prompts",
    ) as refused:
        _run(tok, {}, Answering("user"), turns, prompt_ids=plain, check="strict")
    assert "mode=warn" not in str(refused.value)
    t, _, _ = _run(tok, {}, Answering("user"), turns, prompt_ids=plain, check="warn")
    assert t.counts.tokenization_mismatches == 1
    t, _, _ = _run(tok, {}, Answering("user"), turns, prompt_ids=plain, check="off")
    assert t.counts.tokenization_mismatches == 0


def test_the_tiny_template_is_exact_too(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model.path())
    env = Answering("user", reply="4 2")
    t, gen, messages = _run(tok, {}, env, [_turn(tok, "1 2"), _turn(tok, "3")])
    conversation = [*messages, {"role": "assistant", "content": "1 2"}, {"role": "user", "content": "4 2"}]
    assert gen.contexts[(0, 1)] == _chat(tok, conversation, {})  # a word-level tokenizer: ids compare
    assert t.counts.tokenization_mismatches == 0


# ----------------------------------------------------------------------------- skyrl-gym unchanged
def _text2sql_prompts(tmp_path, tok):
    from hydra.utils import instantiate

    from tests.conftest import compose_config
    from tests.env.text2sql_rows import make_text2sql

    parquet, db_path = make_text2sql(tmp_path)
    cfg = compose_config(
        [
            "data=files",
            f"data.train_files=[{parquet}]",
            f"data.val_files=[{parquet}]",
            "data.prompt_max_len=512",
            "data.label_key=reward_spec.ground_truth",
            "env=skyrl",
            f"env.env_config.db_path={db_path}",
        ]
    )
    data = instantiate(cfg.data)
    data.bind(tok)
    return data.sample_prompts(8), instantiate(cfg.env)


def test_text2sql_runs_unchanged_on_rows_in_skyrl_sql_s_layout(tmp_path, smollm2_tokenizer):
    """skyrl-gym's text2sql on SkyRL-SQL rows read by data=files: every column but the prompt reaches
    the environment (`db_id`, `data`, `max_turns`), env.env_config (set without Hydra's `+`) arrives as
    a DictConfig, the SQL result comes back as ChatML context and the gold query scores 1."""
    tok = smollm2_tokenizer
    prompts, env = _text2sql_prompts(tmp_path, tok)
    prompt = next(p for p in prompts if "How many singers" in p.messages[-1]["content"])
    made = env.make(prompt)
    assert type(made).__name__ == "SQLEnv" and made.db_id == "concert_singer" and made.max_turns == 3
    turns = [
        _turn(tok, "<think>Look at the table.</think><sql>SELECT name, age FROM singer</sql>"),
        _turn(tok, "<think>Six rows.</think><solution>SELECT count(*) FROM singer</solution>"),
    ]
    generator = ScriptedGenerator({(0, k): t for k, t in enumerate(turns)})
    generator.decode = lambda t: tok.decode(t, skip_special_tokens=True)
    runner = MultiTurnRunner(env.make, generator, env.renderer(tok), env.limits(512), 1, 10.0, "strict")
    (t,) = list(runner.run([(0, prompt, list(prompt.prompt_ids))]))
    assert t.counts.turns == 2 and t.counts.env_errors == 0 and t.done and not t.truncated
    assert t.reward("last") == 1.0 and t.counts.tokenization_mismatches == 0
    context = tok.decode(generator.contexts[(0, 1)])
    assert "Joe Sharp" in context and "Tribal King" in context  # the database answered
    assert context.endswith(
        "</sql><|im_end|>\n<|im_start|>user\n" + t.messages[3]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_environment_metrics_are_aggregated_by_the_environment_s_class(smollm2_tokenizer):
    """skyrl-gym's get_metrics per episode, aggregate_metrics per class (gsm8k_multi_turn averages its
    steps as `avg_steps`), logged as env/<registered id>/<key>."""
    from rlhf_orch.env.skyrl import SkyRLEnv

    tok = smollm2_tokenizer
    env = SkyRLEnv(env_class="gsm8k_multi_turn")
    prompt = Prompt(
        text="q",
        label="42",
        messages=({"role": "user", "content": "What is 6 times 7?"},),
        env_fields={"reward_spec": {"method": "rule", "ground_truth": "42"}, "extra_info": {"max_turns": 3}},
    )
    ids = _chat(tok, list(prompt.messages), {})
    scripts = {(0, 0): _turn(tok, "#### 42"), (1, 0): _turn(tok, "I think 40"), (1, 1): _turn(tok, "#### 42")}
    generator = ScriptedGenerator(scripts)
    generator.decode = lambda t: tok.decode(t, skip_special_tokens=True)
    runner = MultiTurnRunner(env.make, generator, env.renderer(tok), env.limits(256), 2, 10.0, "strict")
    out = sorted(runner.run([(0, prompt, ids), (1, prompt, ids)]), key=lambda t: t.index)
    assert [t.counts.turns for t in out] == [1, 2]
    assert env.aggregate([t.env_metrics for t in out]) == {"env/gsm8k_multi_turn/avg_steps": 1.5}


def test_per_turn_rewards_sit_on_each_turn_s_last_token(smollm2_tokenizer):
    """env.reward=per_turn with skyrl-gym's gsm8k_multi_turn (turn-level rewards: 1 for the right
    answer, 0.2 / max_turns for a well-formatted wrong one): each step's reward lands on its turn's
    closing <|im_end|>, the score is their sum, and REINFORCE++'s return-to-go then gives a turn's
    tokens the rewards from that turn on -- where env.reward=sum gives every token the sum."""
    import torch

    from rlhf_orch.algo.advantages import reinforce_pp_returns
    from rlhf_orch.env.skyrl import SkyRLEnv

    tok = smollm2_tokenizer
    env = SkyRLEnv(env_class="gsm8k_multi_turn", reward="per_turn", max_turns=3)
    assert env.places_turn_rewards and not SkyRLEnv(env_class="gsm8k_multi_turn", reward="sum").places_turn_rewards
    prompt = Prompt(
        text="q",
        label="42",
        messages=({"role": "user", "content": "What is 6 times 7?"},),
        env_fields={"reward_spec": {"method": "rule", "ground_truth": "42"}, "extra_info": {"max_turns": 3}},
    )
    scripts = {(0, 0): _turn(tok, "I think 40"), (0, 1): _turn(tok, "#### 41"), (0, 2): _turn(tok, "#### 42")}
    generator = ScriptedGenerator(scripts)
    generator.decode = lambda t: tok.decode(t, skip_special_tokens=True)
    runner = MultiTurnRunner(env.make, generator, env.renderer(tok), env.limits(256), 1, 10.0, "strict")
    (t,) = list(runner.run([(0, prompt, _chat(tok, list(prompt.messages), {}))]))
    assert t.turn_rewards == pytest.approx([0.0, 0.2 / 3, 1.0]) and t.reward("per_turn") == pytest.approx(0.2 / 3 + 1.0)
    placed = t.turn_reward_field()
    ends = [k for k, r in enumerate(placed) if r]
    assert [t.response_ids[k] for k in ends] == [
        tok.convert_tokens_to_ids("<|im_end|>")
    ] * 2  # turns 2 and 3 close there
    assert [placed[k] for k in ends] == pytest.approx([0.2 / 3, 1.0]) and all(t.loss_mask[k] for k in ends)
    assert ends[-1] == len(t.response_ids) - 1

    mask = torch.tensor([t.loss_mask], dtype=torch.bool)
    score = torch.tensor([t.reward("per_turn")])
    per_turn = reinforce_pp_returns(score, mask, placed=torch.tensor([placed]))[0]
    summed = reinforce_pp_returns(score, mask)[0]
    turn_of = [k for k, (a, b) in enumerate(_spans(t.loss_mask)) for _ in range(a, b)]
    model = [k for k, m in enumerate(t.loss_mask) if m]
    by_turn = {turn: {round(float(per_turn[k]), 5) for k, tt in zip(model, turn_of) if tt == turn} for turn in range(3)}
    assert by_turn == {0: {round(0.2 / 3 + 1, 5)}, 1: {round(0.2 / 3 + 1, 5)}, 2: {1.0}}
    assert {round(float(summed[k]), 5) for k in model} == {round(0.2 / 3 + 1, 5)}


def _spans(mask):
    from rlhf_orch.transfer.batch import model_turn_spans

    return model_turn_spans(mask)


def test_a_template_closing_turns_with_another_token_than_the_tokenizer_s_eos(smollm2_tokenizer):
    """Phi-3 / Gemma style: the tokenizer's EOS is <|endoftext|>, the template closes turns with
    <|im_end|> -- an engine stop id from the generation config. Given it, the newline is kept."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.eos_token = "<|endoftext|>"
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = ObservationRenderer(tok, "chat_template", "tail", [im_end])
    obs = renderer.observation([{"role": "user", "content": "result"}], True, None)
    assert tok.decode(obs.ids) == "\n<|im_start|>user\nresult<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.closes_turn(tok("ok", add_special_tokens=False)["input_ids"] + [im_end])


class ManyToolMessages:
    """A degenerate turn's answer: one tool message per call, `calls` of them (what an environment
    answering each of ~50 tool calls in one turn returns), then a final turn."""

    def __init__(self, calls=50):
        self.calls, self.steps = calls, 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action):
        self.steps += 1
        if self.steps > 1:
            return {"observations": [], "reward": 1.0, "done": True}
        return {
            "observations": [{"role": "tool", "content": f"out {k}"} for k in range(self.calls)],
            "reward": 0.0,
            "done": False,
            "metadata": {"tool_calls": self.calls},
        }


def test_a_turn_whose_tool_messages_cannot_fit_ends_its_trajectory_truncated_not_the_run(smollm2_tokenizer):
    """Qwen2.5's tool template: 50 tool messages take ~15 tokens of the template's own each (their
    <tool_response> frames), more than env.max_observation_tokens=256 with every content cut to
    nothing: the trajectory ends there, truncated and counted (env/observations_too_long), instead
    of the EnvError that ended the run."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN25_TEMPLATE
    turns = [_turn(tok, "<tool_call>...</tool_call>" * 50), _turn(tok, "It is 42.")]
    t, gen, _ = _run(tok, {"tools": TOOLS}, ManyToolMessages(50), turns)
    assert t.done and t.truncated and t.counts.observations_too_long == 1 and t.counts.turns == 1
    assert t.turn_rewards == [0.0] and len(gen.submitted) == 1  # no second turn was asked for
    # a handful of messages still fits: cut on their content, the trajectory goes on
    t, _, _ = _run(tok, {"tools": TOOLS}, ManyToolMessages(5), turns)
    assert not t.truncated and t.counts.observations_too_long == 0 and t.counts.turns == 2


# A Llama-3.2-Instruct-style template: the system turn stamps today's date with strftime_now.
DATED_TEMPLATE = (
    "{{- bos_token }}{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\nToday Date: ' + date_string + "
    "'\\n\\n<|eot_id|>' }}{% for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def test_a_date_stamped_template_renders_the_run_s_date_across_midnight(tmp_path, smollm2_tokenizer, monkeypatch):
    """Llama-3.2-Instruct's template writes `Today Date` with strftime_now. The data renders the
    prompt before midnight, the environment answers after it, and the tokenization check renders
    the conversation later still: every rendering reads the run's date (the env option's, fixed
    where it is built), so the context matches the template in strict mode -- with the clock's date
    the check rendered a day later than the prompt and ended the run."""
    import datetime as dt
    import json

    import transformers.utils.chat_template_utils as chat_template_utils

    from rlhf_orch.data.files import PromptDataset
    from rlhf_orch.env.multi_turn import MultiTurnEnv

    now = [dt.datetime(2026, 11, 28, 23, 59, 59)]

    class Clock(dt.datetime):  # what transformers' own strftime_now reads
        @classmethod
        def now(cls, tz=None):
            return now[0]

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)

    class PastMidnight(Answering):
        def step(self, action):
            now[0] = dt.datetime(2026, 11, 29, 0, 0, 1)
            return super().step(action)

    class Dated(MultiTurnEnv):
        def make(self, prompt):
            return PastMidnight("user", turns=2)

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = DATED_TEMPLATE
    env = Dated(template_time=now[0].timestamp())  # built on the driver, before midnight
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 6 times 7?"}]}) + "\n")
    data = PromptDataset(train_files=[str(rows)], label_key=None, prompt_max_len=256, response_max_len=256)
    data.render_prompts_with(env.prompt_template_kwargs())
    data.bind(tok)
    prompt = data.sample_prompts(1)[0]
    assert "Today Date: 28 Nov 2026" in prompt.text

    generator = ScriptedGenerator({(0, 0): _turn(tok, "Let me check."), (0, 1): _turn(tok, "42")})
    generator.decode = lambda t: tok.decode(t, skip_special_tokens=True)
    runner = MultiTurnRunner(env.make, generator, env.renderer(tok), env.limits(256), 1, 5.0, "strict")
    (t,) = list(runner.run([(0, prompt, list(prompt.prompt_ids))]))
    assert now[0].day == 29 and t.counts.turns == 2 and t.counts.tokenization_mismatches == 0
    context = tok.decode(t.context())
    assert "28 Nov 2026" in context and "29 Nov" not in context


# Qwen3's template (its parts that matter here): the assistant turns after the last user query get a
# <think> block -- the last one always (empty when the content has none), earlier ones only when they
# carry reasoning, which it splits off the content at </think>; tool messages go in a user turn.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not(message.content.startswith('<tool_response>') "
    "and message.content.endswith('</tool_response>')) %}{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def test_a_qwen3_style_template_runs_in_warn_mode_and_strict_is_refused_before_ray(smollm2_tokenizer):
    """Qwen3's template renders the last assistant turn with a <think> block that the same turn
    loses once a message follows it: no context kept as generated can be its rendering of the
    conversation. Observations still render (the template's text after a turn's end-of-turn token);
    env.tokenization_sanity_check_mode=warn trains, counting the trajectories the template renders
    otherwise; strict (the default with chat_template observations) is refused before Ray, naming
    the key. Before, every observation raised EnvError ("use env.observation_format=plain")."""
    from rlhf_orch.env.base import EnvError
    from rlhf_orch.env.multi_turn import MultiTurnEnv

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = QWEN3_TEMPLATE
    after_turn = "\n<|im_start|>user\n<tool_response>\nresult: 42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    obs = ObservationRenderer(tok, "chat_template").observation([{"role": "tool", "content": "result: 42"}], True, 256)
    assert tok.decode(obs.ids) == after_turn and not obs.truncated

    turns = [
        _turn(tok, "<think>\nI need the tool.\n</think>\n\nLet me check."),
        _turn(tok, "<think>\nIt said 42.\n</think>\n\n42"),
    ]
    t, gen, _ = _run(tok, {}, Answering("tool"), turns, check="warn")
    assert t.counts.turns == 2 and t.done and not t.truncated and t.turn_rewards == [1.0, 1.0]
    second = tok.decode(gen.contexts[(0, 1)])  # the first turn as generated, reasoning kept, then the tool turn
    assert second.endswith("<think>\nI need the tool.\n</think>\n\nLet me check.<|im_end|>" + after_turn)
    # the template renders the conversation's last turn with an empty <think> block before it: counted
    assert t.counts.tokenization_mismatches == 1
    t, _, _ = _run(tok, {}, Answering("tool"), turns, check="off")
    assert t.counts.turns == 2 and t.counts.tokenization_mismatches == 0

    class Tool(MultiTurnEnv):
        def make(self, prompt):
            return Answering("tool")

    prompt = Prompt(text="q", messages=({"role": "user", "content": "What is 6 times 7?"},))
    with pytest.raises(
        EnvError,
        match=r"^env.tokenization_sanity_check_mode=strict: this tokenizer's chat template renders the last "
        r"assistant turn otherwise than earlier ones .* set env.tokenization_sanity_check_mode=warn",
    ):
        Tool().check(prompt, tok)  # the default: strict
    Tool(tokenization_sanity_check_mode="warn").check(prompt, tok)
    Tool(tokenization_sanity_check_mode="off").check(prompt, tok)
    Tool().check(prompt, smollm2_tokenizer)  # ChatML renders every turn alike: strict holds
