"""An engine's `env=agent` serving: its chat endpoint and the process that runs the agent functions.

Both start at the engine's first agent rollout and are kept for the next ones (importing `openai`
and the function in the agents' host process costs ~1 s); `close` ends them with the run.
"""

from __future__ import annotations

from typing import Any

import ray


class AgentServing:
    def __init__(self) -> None:
        self._server: Any = None
        self._runner: Any = None
        self._runner_for: Any = None  # (path, name, concurrency, timeout_s) the runner was made for

    def runner(self, env: Any) -> Any:
        """The agent functions' runner for `env`: its host process is started once and kept for
        the next rollouts (another function or its settings: a new one)."""
        wanted = (env.path, env.name, env.concurrency, env.timeout_s)
        if self._runner is None or self._runner_for != wanted:
            from rlhf_orch.env.agent_driver.runner import AgentRunner

            if self._runner is not None:
                self._runner.close()
            self._runner = AgentRunner(env.load(), env.concurrency, env.timeout_s)
            self._runner_for = wanted
        return self._runner

    def chat_server(self, env: Any) -> Any:
        """The engine's `env=agent` endpoint, started at its first agent rollout, closed with the engine."""
        if self._server is None:
            from rlhf_orch.env.agent_driver.chat_server import MAX_CONNECTIONS, ChatServer

            # each agent running at once may hold a few connections (its client's pool, calls fanned out)
            limit = max(MAX_CONNECTIONS, 4 * env.concurrency)
            self._server = ChatServer(serving_host(env.host), env.served_model_name, max_connections=limit)
        return self._server

    def endpoint(self) -> dict[str, Any] | None:
        """Where the agent endpoint listens (None before any agent rollout)."""
        return None if self._server is None else {"host": self._server.host, "port": self._server.port}

    def close(self) -> None:
        """Stop serving agents (the port is free when this returns) and their host process."""
        if self._runner is not None:
            self._runner.close()
            self._runner, self._runner_for = None, None
        if self._server is not None:
            self._server.close()
            self._server = None


def serving_host(host: str) -> str:
    """env.host: the loopback interface (`auto`, `loopback`: every agent runs in a process this
    engine starts on its node, on any cluster), or this node's address (`node`: for agents that call from elsewhere)."""
    if host in ("auto", "loopback"):
        return "127.0.0.1"
    return ray.util.get_node_ip_address()
