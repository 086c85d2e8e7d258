"""`env=agent`'s endpoint: keys, lengths and connection limits checked before a body is read; one key
per trajectory, held by its agent's process alone; reached past a proxy set in the environment."""

from __future__ import annotations

import json
import socket
import time

import openai
import pytest

from rlhf_orch.engines.agent_rollout import AgentRolloutSession
from rlhf_orch.env.agent_driver.chat_server import ChatServer
from rlhf_orch.env.agent_driver.record import AgentLimits
from rlhf_orch.env.agent_driver.runner import AgentRunner

from tests.env.agent_fakes import EchoTokenizer, ScriptedGenerator, Seen, agent_rows, make_session


def _raw(server, request: bytes, timeout_s: float = 5.0) -> tuple[bytes, bool]:
    """Send raw bytes; (what came back before the server closed or went quiet, closed by the server)."""
    with socket.create_connection((server.host, server.port), timeout=timeout_s) as sock:
        sock.sendall(request)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except socket.timeout:
            return got, False
        return got, True


def test_the_endpoint_checks_the_key_and_the_length_before_it_reads_a_body(server):
    """Answered at once and the connection closed, the body never read: a request without the key
    (however large it says its body is), a Content-Length that is not a number, a body over
    MAX_BODY_BYTES. Only then an authorised request's body is read."""
    from rlhf_orch.env.agent_driver.chat_server import MAX_BODY_BYTES

    path = "/trajectories/abc/v1/chat/completions"
    no_key, closed = _raw(
        server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES}\r\n\r\n".encode()
    )
    assert no_key.startswith(b"HTTP/1.1 401") and closed  # its 16 MiB never sent: not waited for
    key = f"Authorization: Bearer {server.issue_keys(['abc'])['abc']}\r\n"  # (what a rollout hands trajectory abc)
    bad_length, closed = _raw(server, f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Content-Length: ten\r\n\r\n".encode())
    assert bad_length.startswith(b"HTTP/1.1 400") and b"not a number" in bad_length and closed
    too_big, closed = _raw(
        server, f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode()
    )
    assert too_big.startswith(b"HTTP/1.1 413") and closed
    # a refusal with part of a body already sent: answered, then closed (the server drains what came,
    # since a close with unread bytes may reset the connection; on loopback here the answer arrives
    # either way, so this does not show the drain is needed)
    partial, closed = _raw(
        server, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n".encode() + b"x" * 50000
    )
    assert partial.startswith(b"HTTP/1.1 401") and closed
    superscript, _ = _raw(
        server, f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Content-Length: \u00b2\r\n\r\n".encode("latin-1")
    )
    assert superscript.startswith(b"HTTP/1.1 400")
    chunked, closed = _raw(
        server,
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n".encode(),
    )
    assert chunked.startswith(b"HTTP/1.1 411") and closed
    # with the key and a body: read, and answered on a connection that stays open (keep-alive)
    body = b'{"model": "policy", "messages": []}'
    ok, closed = _raw(
        server,
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{key}Content-Length: {len(body)}\r\n\r\n".encode() + body,
        timeout_s=2.0,
    )
    assert ok.startswith(b"HTTP/1.1 410") and not closed  # no rollout runs: gone, the connection kept


def test_the_endpoint_refuses_connections_past_its_limit():
    server = ChatServer("127.0.0.1", "policy", max_connections=2)
    try:
        held = [socket.create_connection((server.host, server.port), timeout=5) for _ in range(2)]
        time.sleep(0.3)  # both accepted, each holding its thread
        refused, closed = _raw(server, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 503") and b"more than 2 connections" in refused and closed
        for sock in held:
            sock.close()
        time.sleep(0.3)  # their threads end and give their places back
        key = server.issue_keys(["t"])["t"]
        again, _ = _raw(
            server, f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode(), timeout_s=2.0
        )
        assert again.startswith(b"HTTP/1.1 200")
    finally:
        server.close()


def test_each_trajectory_has_its_own_key_and_cannot_call_as_another(server, tmp_path):
    """Two trajectories of one rollout: each agent's key works for its own base URL (and the model
    list), not for the other's -- an agent cannot spend another's call budget or read its
    conversation -- and no key of a rollout works once the next rollout has its keys."""
    seen = Seen(tmp_path)

    def agent(row, client, base_url, api_key, **kwargs):
        index = int(row["prompt"][1:])
        seen[index] = (base_url, api_key)
        other_url, _ = seen.wait_for(1 - index)  # both trajectories are live
        try:
            openai.OpenAI(base_url=other_url, api_key=api_key, max_retries=0).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "x"}]
            )
            seen[10 + index] = ("called as the other", "")
        except openai.AuthenticationError as e:
            seen[10 + index] = ("refused", str(e.status_code))
        assert [m.id for m in client.models.list()] == ["policy"]
        root = base_url.split("/trajectories/")[0] + "/v1"  # the model list outside any trajectory: any live key
        assert [m.id for m in openai.OpenAI(base_url=root, api_key=api_key, max_retries=0).models.list()] == ["policy"]
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        return 1.0 if reply.choices[0].message.content else 0.0

    session, _ = make_session(agent, server)
    results = session.run(agent_rows(2))
    assert seen[10] == seen[11] == ["refused", "401"]
    assert seen[0][1] != seen[1][1]
    assert all(r.outcome.reward == 1.0 for r in results)
    server.issue_keys(["next"])  # the next rollout
    late = openai.OpenAI(base_url=seen[0][0], api_key=seen[0][1], max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        late.models.list()


def _key_shaped_strings_in_own_memory() -> tuple[int, set[bytes]]:
    """(regions read, what was found): every readable region of this process's memory
    (/proc/self/maps, /proc/self/mem), its environment and command line included (they sit on its
    stack), searched for anything shaped like a trajectory's key (`rlhf-` and 32 URL-safe
    characters) or base URL (`/trajectories/<16 hex>/`). For agents (it runs in their processes)."""
    import re

    # (two patterns with a literal prefix each: searched ~5x faster than one with both)
    patterns = [re.compile(rb"rlhf-[A-Za-z0-9_-]{32}"), re.compile(rb"/trajectories/[0-9a-f]{16}/")]
    found: set[bytes] = set()
    chunk, overlap = 1 << 24, 64
    with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", buffering=0) as mem:
        regions = [line.split() for line in maps]
        for fields in regions:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if not fields[1].startswith("r") or fields[-1] in ("[vvar]", "[vvar_vclock]", "[vsyscall]"):
                continue
            for at in range(start, end, chunk):
                try:
                    mem.seek(at)
                    data = mem.read(min(chunk + overlap, end - at))
                except (OSError, ValueError, OverflowError):
                    break
                for pattern in patterns:
                    found.update(pattern.findall(data))
    return len(regions), found


def test_an_agent_s_process_holds_its_own_key_and_no_other_trajectory_s(server, tmp_path):
    """16 trajectories, 4 at a time: each agent reads all of its own process's memory and finds its
    own key and base URL there, and no other trajectory's of the batch (with the batch's list
    forked into every process, the first agent found all 16 of each)."""
    issued: dict[str, str] = {}
    issue_keys = server.issue_keys

    def recording(ids):
        issued.update(keys := issue_keys(ids))
        return keys

    server.issue_keys = recording
    seen = Seen(tmp_path)

    def agent(row, client, base_url, api_key, **kwargs):
        regions, found = _key_shaped_strings_in_own_memory()
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        seen[row["prompt"]] = {
            "key": api_key,
            "url": base_url,
            "regions": regions,
            "keys": sorted(f.decode() for f in found if f.startswith(b"rlhf-")),
            "urls": sorted(f.decode() for f in found if f.startswith(b"/trajectories/")),
        }
        return 1.0 if reply.choices[0].message.content else 0.0

    limits = AgentLimits(max_prompt_tokens=200, max_response_tokens=400, max_tokens_per_call=8, max_calls=4)
    runner = AgentRunner(agent, concurrency=4, timeout_s=60.0)
    session = AgentRolloutSession(server, ScriptedGenerator(), EchoTokenizer(), runner, limits, 1.0, 7, "hermes", 60.0)
    try:
        results = session.run(agent_rows(16))
    finally:
        runner.close()
    assert all(r.outcome.reward == 1.0 for r in results), [r.outcome for r in results]
    assert len(issued) == 16
    urls = {server.base_url(t) for t in issued}
    for i in range(16):
        report = seen[f"q{i}"]
        assert report["key"] in issued.values() and report["url"] in urls
        assert report["keys"] == [report["key"]], (
            f"trajectory {i} holds {len(report['keys']) - 1} other trajectories' keys"
        )
        own_path = report["url"][report["url"].index("/trajectories/") : -len("v1")]
        assert report["urls"] == [own_path], f"trajectory {i} holds {len(report['urls']) - 1} other trajectories' URLs"


def test_agents_reach_the_endpoint_past_a_proxy_set_in_the_environment(server, tmp_path, monkeypatch):
    """HTTP(S)_PROXY and ALL_PROXY name a dead proxy (a cluster's job environment often sets one):
    the client handed to the agent, a client the agent builds from `base_url` (`openai`, httpx's
    default: proxies from the environment) and the standard library's urllib all still reach the
    engine's loopback endpoint, not the proxy."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.setenv(name, dead)
        monkeypatch.setenv(name.lower(), dead)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    seen = Seen(tmp_path)

    def agent(row, client, base_url, api_key, **kwargs):
        import urllib.request

        def reached(call):
            try:
                return call()
            except Exception as e:  # reported to the test
                return f"{type(e).__name__}: {e}"

        request = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
        own = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        plain = urllib.request.Request(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"})
        seen[row["prompt"]] = {
            "given": reached(lambda: client.chat.completions.create(**request).choices[0].message.content),
            "own": reached(lambda: own.chat.completions.create(**request).choices[0].message.content),
            "urllib": reached(lambda: json.load(urllib.request.urlopen(plain, timeout=5))["data"][0]["id"]),
        }
        return 1.0

    session, _ = make_session(agent, server)
    try:
        session.run(agent_rows(1))
    finally:
        session.runner.close()
    assert seen["q0"] == {"given": "1", "own": "2", "urllib": "policy"}
