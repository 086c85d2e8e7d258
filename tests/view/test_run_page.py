"""The run page without a browser: what it reads from a run dir (whole, half-written, empty, a
sweep), the turns it cuts a sequence into on SmolLM2's chat template, the page's self-containment,
the command's exit codes and --serve."""

from __future__ import annotations

import base64
import gzip
import json
import re
import threading
import urllib.request

import pytest

from rlhf_orch.logging.rollout_dump import token_texts
from rlhf_orch.view.__main__ import main
from rlhf_orch.view.headless import network_references
from rlhf_orch.view.page import build_page, page_data, write_report
from rlhf_orch.view.run_data import read_run_page, topics
from rlhf_orch.view.serve import ReportServer, host_name
from rlhf_orch.view.trajectories import read_step, segments
from tests.view.run_dirs import trajectory_line, wait_for, write_run


def _blocks(html_text: str) -> dict[str, list]:
    return {
        m.group(1): json.loads(gzip.decompress(base64.b64decode(m.group(2))))
        for m in re.finditer(r'<script type="application/gzip-base64" id="([^"]+)">([^<]*)</script>', html_text)
    }


def _data(html_text: str) -> dict:
    m = re.search(r'<script type="application/json" id="rlhf-data">(.*?)</script>', html_text, re.S)
    return json.loads(m.group(1))


def test_every_metric_is_in_one_topic_the_plots_topics_first():
    rows = [
        {
            "step": 1,
            "reward/mean": 0.1,
            "kl": 0.0,
            "loss/policy": 0.2,
            "time/step": 1.0,
            "time/train": 0.5,
            "policy/grad_norm": 1.0,
            "policy/clipfrac": 0.0,
            "eval/digits/mean@4": 0.3,
            "weight_version": 1,
        }
    ]
    keys = sorted(k for k in rows[0] if k != "step")
    found = topics(keys, rows)
    names = [t["name"] for t in found]
    assert names[:4] == ["reward", "kl", "loss", "step_time"]
    assert sorted(k for t in found for k in t["keys"]) == keys  # each once
    assert {t["name"]: t["keys"] for t in found}["step_time"] == ["time/step", "time/train"]
    assert "eval/digits/mean@4" in found[0]["keys"] and {"name": "other", "keys": ["weight_version"]} in found


def test_a_whole_run_dir_gives_curves_config_summary_and_every_step_s_sequences(tmp_path):
    run = write_run(tmp_path / "run")
    text = build_page([run])[0]
    data = _data(text)
    [r] = data["runs"]
    assert r["status"] == "completed" and r["notes"] == [] and r["name"] == "page_test"
    assert r["metrics"]["steps"] == [1, 2, 3] and r["metrics"]["series"]["reward/mean"] == pytest.approx(
        [0.1, 0.2, 0.3]
    )
    assert r["rollout_steps"] == [1, 2, 3] and "num_steps: 3" in r["config"]
    blocks = _blocks(text)
    assert sorted(blocks) == ["t-0-1", "t-0-2", "t-0-3"]
    first = blocks["t-0-1"]
    assert [t["reward"] for t in first] == pytest.approx([0, 1 / 3, 2 / 3, 1])
    two_turns = first[1]
    assert [(s["role"], s["model"]) for s in two_turns["seg"]] == [
        ("user", False),
        ("assistant", True),
        ("tool", False),
        ("assistant", True),
    ]
    assert network_references(text) == []  # self-contained: nothing loads from a URL


def test_text_in_the_data_cannot_end_the_script_block(tmp_path):
    """A config, an error or a note holding `</script>` or `<!--` stays data (the JSON block would
    otherwise end there, or stop parsing: a blank page)."""
    run = write_run(tmp_path / "run")
    hostile = "system_prompt: '</script><!--<script>alert(1)</script>'\n"
    (run / ".hydra" / "config.yaml").write_text(hostile)
    text = build_page([run])[0]
    block = re.search(r'<script type="application/json" id="rlhf-data">(.*?)</script>', text, re.S).group(1)
    assert "<" not in block and _data(text)["runs"][0]["config"] == hostile


def test_network_references_are_found():
    """(The check above can fail: what it looks for.)"""
    assert network_references('<script src="https://cdn.example/x.js"></script><link href="//x/y.css">')
    assert network_references("<style>@import 'x.css'</style>")


def test_a_half_written_or_empty_run_dir_gives_a_page_that_says_what_is_missing(tmp_path):
    run = write_run(tmp_path / "killed", summary=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # a kill mid-write
    with open(run / "rollouts" / "step_000003.jsonl", "a") as f:
        f.write('{"step": 3, "ind')
    data, blocks = page_data([run])
    [r] = data["runs"]
    assert r["metrics"]["steps"] == [1, 2, 3]
    assert any("no summary.json" in n for n in r["notes"]) and any("1 line(s) cut" in n for n in r["notes"])
    assert any("step_000003.jsonl: 1 line(s)" in n for n in r["notes"]) and len(blocks) == 3
    assert r["status"] == "running or killed"

    empty = tmp_path / "empty"
    empty.mkdir()
    [e] = page_data([empty])[0]["runs"]
    assert e["status"] == "no steps" and len(e["notes"]) == 4
    assert main([str(empty)]) == 0 and (empty / "report.html").is_file()


def test_superseded_steps_and_restarts_are_marked(tmp_path):
    run = write_run(tmp_path / "run")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rerun = json.loads(lines[1]) | {"superseded": True, "reward/mean": 9.0}
    restart = json.loads(lines[2]) | {"fault/engine_restarts": 1}
    (run / "metrics.jsonl").write_text("\n".join([lines[0], json.dumps(rerun), lines[1], json.dumps(restart)]) + "\n")
    r = read_run_page(run)
    assert r["metrics"]["series"]["reward/mean"] == pytest.approx([0.1, 0.2, 0.3])
    assert r["superseded"] == [
        {"step": 2, "reward/mean": 9.0, "time/step": 1.0, "time/generate": 0.5, "policy/grad_norm": 0.5, "kl": 0.002}
    ]
    assert {"step": 3, "what": "engine restarted (1)"} in r["restarts"]
    assert {"step": 1, "what": "run again from step 2 (resume or restart)"} in r["restarts"]


def test_several_runs_and_a_sweep_dir_give_a_comparison(tmp_path):
    a = write_run(tmp_path / "sweep" / "0_lr=1", overrides=["algo.lr=1"])
    b = write_run(tmp_path / "sweep" / "1_lr=2", overrides=["algo.lr=2"])
    (tmp_path / "sweep" / "multirun.yaml").write_text("hydra: {}\n")
    for given in ([a, b], [tmp_path / "sweep"]):
        data, blocks = page_data(given)
        assert [r["label"] for r in data["runs"]] == ["algo.lr=1", "algo.lr=2"]
        assert {b_.split('"')[3] for b_ in blocks} >= {"t-0-1", "t-1-3"}
    assert main([str(a), str(b)]) == 0 and (tmp_path / "sweep" / "report.html").is_file()
    assert main([str(tmp_path / "sweep")]) == 0


def test_the_command_refuses_a_missing_dir_with_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a run dir" in err and "Traceback" not in err
    run = write_run(tmp_path / "run")
    assert main([str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report.html")


@pytest.mark.parametrize("observed_as", ["tool", "user"])
def test_segments_follow_smollm2_s_chat_template(smollm2_tokenizer, observed_as):
    """A tool-calling conversation rendered by SmolLM2's own template: the prompt's system and user
    turns from its role headers, the model's turns from the loss mask, the observation's role from
    its header -- also where the template's newline after the model's end-of-turn token is context
    (an environment that answers as the user, as skyrl-gym's do)."""
    tok = smollm2_tokenizer
    messages = [{"role": "system", "content": "You look things up."}, {"role": "user", "content": "Price of 3?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    call = '<tool_call>{"name": "lookup", "arguments": {"x": 3}}</tool_call><|im_end|>'
    tool = f"\n<|im_start|>{observed_as}\n42<|im_end|>\n<|im_start|>assistant\n"
    answer = "<think>It said 42.</think>42 €<|im_end|>"
    ids, mask = [], []
    for part, model in ((prompt, 0), (call, 1), (tool, 0), (answer, 1)):
        part_ids = tok(part, add_special_tokens=False)["input_ids"]
        ids += part_ids
        mask += [model] * len(part_ids)
    pieces = token_texts(tok, ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False)  # "€" spans byte tokens
    found = segments(pieces, mask)
    assert [(s["role"], s["model"]) for s in found] == [
        ("system", False),
        ("user", False),
        ("assistant", True),  # the generation prompt's header opens the model's turn
        (observed_as, False),
        ("assistant", True),
    ]
    assert [s["env"] for s in found] == [False, False, False, True, False]  # the environment's answer
    assert found[0]["start"] == 0 and found[-1]["end"] == len(ids)
    assert all(a["end"] == b["start"] for a, b in zip(found, found[1:]))  # every token in one turn
    user = "".join(pieces[found[1]["start"] : found[1]["end"]])
    assert user.startswith("<|im_start|>user") and "Price of 3?" in user
    model_turn = "".join(pieces[found[2]["start"] : found[2]["end"]])
    assert model_turn.startswith("<|im_start|>assistant\n<tool_call>") and model_turn.endswith("<|im_end|>\n")


def test_a_dump_without_per_token_fields_still_reads(tmp_path):
    old = {k: v for k, v in trajectory_line(1, 0, 1.0).items() if k not in ("tokens", "truncated", "errors")}
    path = tmp_path / "step_000001.jsonl"
    path.write_text(json.dumps(old) + "\n[1, 2]\n")
    [record], bad = read_step(path)
    assert record["seg"] is None and record["reward"] == 1.0 and bad == 1


def test_serve_rewrites_the_page_as_the_run_goes_on(tmp_path):
    run = write_run(tmp_path / "run", steps=2)
    server = ReportServer([run], run / "report.html", port=0, poll_s=0.05)
    assert server.url.startswith("http://127.0.0.1:") and server.httpd.server_address[0] == "127.0.0.1"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        get = lambda path: urllib.request.urlopen(server.url + path, timeout=10).read().decode()  # noqa: E731
        first = get("__version")
        assert _data(get(""))["runs"][0]["metrics"]["steps"] == [1, 2]
        # Only loopback names are answered (DNS rebinding: a page elsewhere naming another host),
        # on any port (an SSH tunnel's local one).
        other = urllib.request.Request(server.url, headers={"Host": f"attacker.example:{server.port}"})
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(other, timeout=10)
        tunnel = urllib.request.Request(server.url + "__version", headers={"Host": "localhost:9000"})
        answer = urllib.request.urlopen(tunnel, timeout=10)
        assert answer.read().decode() == first and answer.headers["X-Rlhf-Orch-Version"] == first
        assert [host_name(h) for h in ("127.0.0.1:8765", "[::1]:80", "localhost", "a.example:1")] == [
            "127.0.0.1", "[::1]", "localhost", "a.example"
        ]  # fmt: skip
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 3, "reward/mean": 0.3}) + "\n")
        assert wait_for(lambda: get("__version") != first, 10)
        assert _data(get(""))["runs"][0]["metrics"]["steps"] == [1, 2, 3]
        with pytest.raises(urllib.error.HTTPError):
            get("../etc/passwd")
    finally:
        server.shutdown()
        thread.join(5)


def test_the_report_is_written_whole(tmp_path):
    run = write_run(tmp_path / "run")
    out = write_report([run])
    assert out == run / "report.html" and out.read_text().rstrip().endswith("</html>")
    assert not list(run.glob(".report.html.tmp*"))
