"""The run page in a real browser (headless Chromium, Debian's `chromium`; `.ci/run` installs it and
sets RLHF_ORCH_REQUIRE_BROWSER=1, so there a missing browser fails instead of skipping).

The issue's command, as a user types it: `run.py experiment=tool_use algo.num_steps=3
logger.rollouts=true logger.report=true`, then `python -m rlhf_orch.view <run dir>`; the page,
opened from disk, shows the first step's dumped responses with their rewards, a multi-turn
trajectory's turns, filters that change what is shown, per-token values on hover, and logs no
JavaScript error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_orch.view.headless import Browser, chromium_path, file_url, network_references
from tests.view.run_dirs import write_run

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration

if chromium_path() is None:
    if os.environ.get("RLHF_ORCH_REQUIRE_BROWSER") == "1":
        raise RuntimeError("RLHF_ORCH_REQUIRE_BROWSER=1 but no Chromium on PATH (apt-get install chromium)")
    pytest.skip("no Chromium on PATH (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def tool_use_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("view") / "tool_use"
    cli = [
        "experiment=tool_use",
        "algo.num_steps=3",
        "logger.rollouts=true",
        "logger.report=true",
        "checkpoint.export_final=false",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run([sys.executable, "run.py", *cli], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def _rows(page) -> list[dict]:
    return page.evaluate(
        "[...document.querySelectorAll('#traj-table tr.row')].map(r => ({i: Number(r.dataset.index),"
        " reward: r.querySelector('td.reward').textContent, response: r.querySelector('td.response').textContent}))"
    )


def _set(page, key: str, value: str) -> None:
    page.evaluate(
        f"(() => {{ const e = document.querySelector('[data-filter={key}]'); e.value = {json.dumps(value)};"
        " e.dispatchEvent(new Event('change')); })()"
    )
    page.evaluate("new Promise(r => setTimeout(r, 50))")


# (~110 s in CI's tier, nearly all of it the CLI run's start-up: docs/testing.md says what CI runs of it)
@pytest.mark.extended
def test_the_page_of_a_tool_use_run_shows_what_the_model_did(tool_use_run):
    assert (tool_use_run / "report.html").is_file()  # logger.report=true wrote it at the end
    done = subprocess.run(
        [sys.executable, "-m", "rlhf_orch.view", str(tool_use_run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == str(tool_use_run / "report.html"), done.stderr
    html_text = (tool_use_run / "report.html").read_text()
    assert network_references(html_text) == []
    dumped = [json.loads(x) for x in (tool_use_run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]

    with Browser() as browser:
        page = browser.open(file_url(tool_use_run / "report.html"))
        assert page.evaluate("document.querySelector('header h1').textContent") == "tool_use"  # experiment_name
        assert page.evaluate("document.querySelector('#runs td.status-completed').textContent") == "completed"
        rows = _rows(page)
        assert [r["i"] for r in rows] == [d["index"] for d in dumped]  # step 1, every dumped sequence
        for row, d in zip(rows, dumped):
            # (the response as the whole text holds it: a tokenizer may drop a leading space when
            # it decodes the response alone, as the dump's "response" field is)
            assert row["response"] == d["text"][len(d["prompt"]) :] and row["response"].strip() == d["response"].strip()
            assert float(row["reward"]) == pytest.approx(d["reward"], abs=1e-3)

        # A multi-turn trajectory opens as its conversation: the model's turns and the tool's between.
        multi = next(d for d in dumped if d["turns"] >= 2)
        page.evaluate(f"document.querySelector('#traj-table tr.row[data-index=\"{multi['index']}\"]').click()")
        assert page.wait_for("document.querySelector('#open-trajectory')", 10)
        turns = page.evaluate(
            "[...document.querySelectorAll('#open-trajectory .turn')].map(t => [t.className, t.querySelector('.body').textContent])"
        )
        model_turns = [body for cls, body in turns if "assistant" in cls]
        assert len(model_turns) == multi["turns"] and any("tool observation" in cls for cls, _ in turns)
        assert "".join(body for _, body in turns) == multi["text"]  # every token, in order, once

        # Hovering a token shows its id, text and values.
        tip = page.evaluate(
            "(() => { const s = [...document.querySelectorAll('.tokens span.tk')];"
            " const k = s.length - 1; s[k].dispatchEvent(new MouseEvent('mousemove', {clientX: 5, clientY: 5}));"
            " return document.querySelector('.tip').textContent; })()"
        )
        assert f"id {multi['tokens']['ids'][-1]}" in tip and "engine log-prob" in tip and "trainer log-prob" in tip
        page.evaluate(
            "(() => { const e = document.getElementById('field'); e.value = 'gap'; e.dispatchEvent(new Event('change')); })()"
        )
        assert "nats" in page.evaluate("document.querySelector('.token-view').textContent")

        # Filters change what is shown (a threshold between step 1's lowest and highest reward).
        rewards = sorted({d["reward"] for d in dumped})
        assert len(rewards) > 1, rewards  # (the tiny tool model's rewards differ within a step: 0 .. 1)
        threshold = (rewards[0] + rewards[-1]) / 2
        _set(page, "rmin", str(threshold))
        high = _rows(page)
        assert {r["i"] for r in high} == {d["index"] for d in dumped if d["reward"] >= threshold}
        assert 0 < len(high) < len(rows)
        _set(page, "rmin", "")
        _set(page, "tmin", "2")
        multi_rows = _rows(page)
        assert {r["i"] for r in multi_rows} == {d["index"] for d in dumped if d["turns"] >= 2}
        _set(page, "tmin", "")
        # A search for one sequence's own text: a strict subset of the rows, that sequence among them.
        # (one line of it: a search box drops newlines)
        responses = [d["text"][len(d["prompt"]) :].split("\n")[0] for d in dumped]
        needle = min((r for r in responses if r.strip()), key=lambda r: sum(r in d["text"] for d in dumped))
        _set(page, "q", needle)
        found = {r["i"] for r in _rows(page)}
        assert found == {d["index"] for d in dumped if needle.lower() in d["text"].lower()}
        assert 0 < len(found) < len(rows)
        _set(page, "q", "")

        # Another step, and another topic of curves.
        page.evaluate(
            "(() => { const e = document.getElementById('step'); e.value = '3'; e.dispatchEvent(new Event('change')); })()"
        )
        assert page.wait_for("document.getElementById('traj-count').textContent.startsWith('step 3:')", 30)
        step3 = [json.loads(x) for x in (tool_use_run / "rollouts" / "step_000003.jsonl").read_text().splitlines()]
        assert [r["response"] for r in _rows(page)] == [d["text"][len(d["prompt"]) :] for d in step3]
        page.evaluate("document.querySelector('button.topic[data-topic=\"env\"]').click()")
        charts = page.evaluate("[...document.querySelectorAll('.chart')].map(c => c.dataset.key)")
        assert charts and all(k.startswith("env/") for k in charts)
        assert page.errors == []


def test_a_comparison_and_an_empty_run_draw_without_errors(tmp_path):
    a = write_run(tmp_path / "runs" / "a", overrides=["algo.lr=1"])
    b = write_run(tmp_path / "runs" / "b", steps=2, overrides=["algo.lr=2"])
    empty = tmp_path / "empty"
    empty.mkdir()
    from rlhf_orch.view.page import write_report

    with Browser() as browser:
        page = browser.open(file_url(write_report([a, b])))
        assert page.evaluate("document.querySelectorAll('#runs tr').length") == 3
        assert page.evaluate("document.querySelectorAll('.chart path').length") >= 2  # both runs' lines
        assert page.evaluate("document.getElementById('run').options.length") == 2
        page = browser.open(file_url(write_report([empty])))
        notes = page.evaluate("document.getElementById('notes').innerText")
        assert "no metrics.jsonl" in notes and "no summary.json" in notes
        assert page.errors == []


def test_every_filter_sort_and_colouring_and_hostile_text_on_a_synthetic_run(tmp_path):
    """The filters the tool-use run cannot show (its sequences are never truncated or errored):
    source, truncated, errored; sorting; the advantage and weight-version colourings; and text
    the model wrote that looks like HTML, shown as text."""
    from rlhf_orch.view.page import write_report

    run = write_run(tmp_path / "run", per_step=6)
    lines = [json.loads(x) for x in (run / "rollouts" / "step_000001.jsonl").read_text().splitlines()]
    hostile = '<img src=x onerror="throw new Error(1)"></script><!--'
    lines[5]["tokens"]["text"][-2] = hostile  # (the model's last turn)
    lines[5]["tokens"]["weight_version"][-2:] = [1, 1]  # an update reached it: two versions
    (run / "rollouts" / "step_000001.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    count = "document.querySelectorAll('#traj-table tr.row').length"
    indices = "[...document.querySelectorAll('#traj-table tr.row')].map(r => Number(r.dataset.index))"
    with Browser() as browser:
        page = browser.open(file_url(write_report([run])))
        assert page.evaluate(count) == 6
        _set(page, "src", "lookup")
        assert page.evaluate(indices) == [0, 2, 4]
        _set(page, "src", "")
        _set(page, "trunc", "true")
        assert page.evaluate(indices) == [2]
        _set(page, "trunc", "false")
        assert page.evaluate(count) == 5
        _set(page, "trunc", "")
        _set(page, "err", "true")
        assert page.evaluate(indices) == [3]
        _set(page, "err", "")
        page.evaluate("document.querySelector('th[data-sort=reward]').click()")
        assert page.evaluate(indices) == [0, 1, 2, 3, 4, 5]  # ascending reward (index order here)
        page.evaluate("document.querySelector('th[data-sort=reward]').click()")
        assert page.evaluate(indices) == [5, 4, 3, 2, 1, 0]  # clicked again: descending
        page.evaluate("document.querySelector('#traj-table tr.row[data-index=\"5\"]').click()")
        assert page.wait_for("document.querySelector('#open-trajectory .tokens')", 10)
        # The hostile text is text: no element made from it, no script run.
        assert page.evaluate("document.querySelectorAll('#open-trajectory img').length") == 0
        assert hostile in page.evaluate("document.querySelector('#open-trajectory .tokens').textContent")
        colours = "[...document.querySelectorAll('.tokens span.tk')].map(s => s.style.background)"
        for field, note in (("adv", "full colour at |A|"), ("ver", "versions 0, 1"), ("gap", "nats")):
            page.evaluate(
                f"(() => {{ const e = document.getElementById('field'); e.value = '{field}';"
                " e.dispatchEvent(new Event('change')); })()"
            )
            assert note in page.evaluate("document.querySelector('.token-view').textContent"), field
            if field == "ver":
                assert len(set(page.evaluate(colours))) == 3  # context, version 0, version 1
        assert page.errors == []


def test_a_served_page_reloads_itself_as_the_run_goes_on(tmp_path):
    """--serve: the page served over http polls, reloads when the run wrote another step, and comes
    back with what it showed (the step chosen, from the URL's hash)."""
    import threading
    import time

    from rlhf_orch.view.page import write_report
    from rlhf_orch.view.serve import ReportServer

    run = write_run(tmp_path / "run", steps=2)
    server = ReportServer([run], run / "report.html", port=0, poll_s=0.1)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with Browser() as browser:
            page = browser.open(server.url + "#step=2")
            assert page.wait_for("document.querySelector('.live')", 10)  # its server answered
            steps = "[...document.getElementById('step').options].map(o => o.value)"
            assert page.evaluate(steps) == ["1", "2"]
            page.evaluate("window.stillHere = true")
            write_run(tmp_path / "run", steps=3)  # the run went on: a third step
            assert page.wait_for(
                "!window.stillHere && document.body && document.body.getAttribute('data-ready') === '1'", 30
            )
            assert page.evaluate(steps) == ["1", "2", "3"]
            assert page.evaluate("document.getElementById('step').value") == "2"  # as it was
            # The run writes its own report.html meanwhile (logger.report; another path spelling:
            # another version): what is served, and the page, stay; no reload after reload.
            write_report([run.parent / ".." / run.parent.name / run.name])
            page.evaluate("window.stillHere = false")
            page.call("Page.reload")  # (a reload after it: what is served now)
            assert page.wait_for("window.stillHere === undefined && document.body && document.body.dataset.ready", 30)
            page.evaluate("window.stillHere = true")
            time.sleep(4.5)  # (two polls)
            assert page.evaluate("window.stillHere === true")
            assert page.errors == []
    finally:
        server.shutdown()
        thread.join(5)
