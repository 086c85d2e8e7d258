"""Fixtures of the env tests: the agent endpoint's `ChatServer` (tests/env/test_agent_*.py)."""

from __future__ import annotations

import pytest

from rlhf_orch.env.agent_driver.chat_server import ChatServer


@pytest.fixture
def server():
    s = ChatServer("127.0.0.1", "policy")
    yield s
    s.close()
