"""The HTTP side of the `env=agent` endpoint: one server per engine, for the engine's lifetime.

Routes (every one needs `Authorization: Bearer <a trajectory's key>`: each trajectory of the running
rollout gets a key of its own, good for its own base URL only -- one agent cannot call as another,
spend its budget or read its conversation -- and for the model list; a new rollout's keys replace
the last one's):

    GET  /v1/models                                    the served model
    GET  /trajectories/<id>/v1/models                  the same, under a trajectory's base URL
    POST /trajectories/<id>/v1/chat/completions        a call of trajectory <id>
    POST /trajectories/<id>/v1/responses               the same call in the Responses API (`responses_api`)

A trajectory's base URL (`http://host:port/trajectories/<id>/v1`) is what binds its calls to it:
the id is random per rollout, and once the rollout has ended its calls are answered 410. What a
call does is the rollout's business (`rlhf_orch.engines.agent_rollout`): the server hands it the
trajectory id and the JSON body and writes back what it returns. Requests are served on threads,
so calls of many trajectories wait for the engine at once.

What a client cannot do to the engine's process: have a body read before its key is checked (a
request without the key, with a body over `MAX_BODY_BYTES`, a Content-Length that is not a number
or a chunked body is answered and its connection closed, the body not read -- at most `_DRAIN_BYTES`
already sent are discarded first, so that the close does not reset the connection before the client
reads the answer), hold more connections than the server's limit (more are answered 503 and
closed) or a thread for ever (a connection idle for `IDLE_TIMEOUT_S` is closed).
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Protocol

from rlhf_orch.env.agent_driver.chat_api import ChatAPIError, models_body, stream_events, stream_flags
from rlhf_orch.env.agent_driver.responses_api import (
    conversation_messages,
    parse_responses_request,
    response_body,
    response_stream_events,
)

_CALL = re.compile(r"^/trajectories/([A-Za-z0-9_-]+)/v1/chat/completions/?$")
_RESPONSES = re.compile(r"^/trajectories/([A-Za-z0-9_-]+)/v1/responses/?$")
_MODELS = re.compile(r"^(/trajectories/[A-Za-z0-9_-]+)?/v1/models/?$")
_TRAJECTORY = re.compile(r"^/trajectories/([A-Za-z0-9_-]+)/")
MAX_BODY_BYTES = 16 * 2**20
# Every trajectory in flight on the engine (env.concurrency, 16 by default) holds one or two
# keep-alive connections; an agent fanning out holds more: far below this, which bounds the threads.
MAX_CONNECTIONS = 256  # the least a server allows; an engine's allows 4 per agent it runs at once if more
_DRAIN_BYTES = 64 * 2**10  # of a refused request's body, read and dropped before the close (0.2 s at most)
# An agent's client keeps its connection between calls while the agent works (tools, thinking);
# a connection silent for this long is dropped (the client opens a new one for its next call).
IDLE_TIMEOUT_S = 300.0


class CallHandler(Protocol):
    def __call__(self, trajectory_id: str, body: Any) -> dict[str, Any]:
        """The completion body; raises ChatAPIError for an error answered to the agent."""


class ChatServer:
    def __init__(self, host: str, model_name: str, max_connections: int = MAX_CONNECTIONS):
        self.model_name = model_name
        self._keys: dict[str, bytes] = {}  # trajectory id -> its key (the last rollout's trajectories)
        # response id -> (trajectory id, the conversation's chat messages): previous_response_id
        self._responses: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        self._handler: CallHandler | None = None
        self._lock = threading.Lock()
        self._httpd = _Server((host, 0), _handler_class(self), max_connections=max_connections)
        self._httpd.daemon_threads = True
        self.host, self.port = self._httpd.server_address[:2]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="chat-server", daemon=True
        )
        self._thread.start()

    def base_url(self, trajectory_id: str) -> str:
        return f"http://{self.host}:{self.port}/trajectories/{trajectory_id}/v1"

    def issue_keys(self, trajectory_ids: list[str]) -> dict[str, str]:
        """A key per trajectory of a new rollout (the last rollout's keys stop working)."""
        keys = {t: "rlhf-" + secrets.token_urlsafe(24) for t in trajectory_ids}
        with self._lock:
            self._keys = {t: k.encode() for t, k in keys.items()}
            self._responses = {}
        return keys

    def authorised(self, token: str, trajectory_id: str | None) -> bool:
        """Whether `token` is that trajectory's key (no trajectory: any trajectory's, the model list)."""
        given = token.encode()
        with self._lock:
            keys = [self._keys.get(trajectory_id, b"")] if trajectory_id is not None else list(self._keys.values())
        return any(hmac.compare_digest(given, key) for key in keys if key)

    def serve(self, handler: CallHandler | None) -> None:
        """Calls go to `handler` from now on (None: no rollout is running, every call is 410)."""
        with self._lock:
            self._handler = handler

    def handle_call(self, trajectory_id: str, body: Any) -> dict[str, Any]:
        with self._lock:
            handler = self._handler
        if handler is None:
            raise ChatAPIError(
                410,
                f"trajectory {trajectory_id}: no rollout is running on this engine (its rollout ended)",
                kind="gone",
            )
        return handler(trajectory_id, body)

    def handle_response(self, trajectory_id: str, body: Any) -> dict[str, Any]:
        """A Responses API call: the chat call it maps to, answered as a `response` object (stored
        for a later previous_response_id unless `store` is false)."""
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        history = None
        if isinstance(previous, str):
            with self._lock:
                owner, messages = self._responses.get(previous, (None, None))
            history = list(messages) if owner == trajectory_id else None  # another trajectory's: not found
        call = parse_responses_request(body, history)
        completion = self.handle_call(trajectory_id, call.chat_body)
        response_id = f"resp_{secrets.token_hex(16)}"
        if call.store:
            with self._lock:
                if trajectory_id in self._keys:  # (a call answered as the next rollout's keys came: not kept)
                    self._responses[response_id] = (trajectory_id, conversation_messages(call, completion))
        return response_body(call, completion, response_id)

    def close(self) -> None:
        """Stop listening (the port is free when this returns)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # every trajectory in flight may connect at once (the default backlog is 5)

    def __init__(self, address: Any, handler: Any, max_connections: int) -> None:
        super().__init__(address, handler)
        self.max_connections = max_connections
        self._connections = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        # One thread per connection, at most max_connections of them: one more is refused at once.
        if not self._connections.acquire(blocking=False):
            try:
                request.sendall(
                    _plain_response(
                        503,
                        ChatAPIError(
                            503,
                            f"more than {self.max_connections} connections to this engine's endpoint at once",
                            kind="overloaded",
                        ).body(),
                    )
                )
                _drain(request)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()


def _drain(sock: Any) -> None:
    """Read and drop up to _DRAIN_BYTES the client already sent (0.2 s at most): closing a socket with
    unread data resets the connection, and the client may lose the answer written just before."""
    try:
        sock.settimeout(0.2)
        left = _DRAIN_BYTES
        while left > 0 and (chunk := sock.recv(min(left, 16384))):
            left -= len(chunk)
    except OSError:
        pass


def _plain_response(status: int, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    reason = {503: "Service Unavailable"}.get(status, "Error")
    head = f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    return head.encode() + data


def _handler_class(server: ChatServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: an agent's client reuses its connection
        timeout = IDLE_TIMEOUT_S  # the socket's: a connection silent this long gives its thread back
        # Headers and body go out as separate writes: with Nagle's algorithm on, the body waits for
        # the client's delayed ACK of the headers (~40 ms per call on Linux).
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:  # the base class's name
            pass  # one line per call would flood the engine's log

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            given = self.headers.get("Authorization", "")
            token = given[7:] if given.startswith("Bearer ") else ""
            trajectory = _TRAJECTORY.match(self.path)
            if server.authorised(token, trajectory.group(1) if trajectory else None):
                return True
            self._refuse(
                401,
                ChatAPIError(
                    401,
                    "missing or wrong API key: use the api_key the run passed to this agent "
                    "(each trajectory has its own)",
                    kind="authentication_error",
                ),
            )
            return False

        def _refuse(self, status: int, error: ChatAPIError) -> None:
            """Answer, then close the connection: a body left unread must not be taken for the next request."""
            self.close_connection = True
            self._send(status, error.body())
            self.wfile.flush()
            _drain(self.connection)

        def _send_events(self, data: bytes) -> None:
            """A streamed answer (stream=true): the whole event stream at once, its length known."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _answer(self, route: Callable[[], dict[str, Any]], events: Callable[[dict], bytes] | None = None) -> None:
            """`events`: how a streamed call's answer is sent (server-sent events); None: as JSON."""
            try:
                answer = route()
                if events is not None:
                    self._send_events(events(answer))
                else:
                    self._send(200, answer)
            except ChatAPIError as e:
                self._send(e.status, e.body())
            except Exception as e:  # the agent gets a message; the rollout goes on
                self._send(500, ChatAPIError(500, f"{type(e).__name__}: {e}", kind="server_error").body())

        def do_GET(self) -> None:  # http.server's name
            if not self._authorised():
                return
            if _MODELS.match(self.path):
                self._answer(lambda: models_body(server.model_name))
            else:
                self._send(404, ChatAPIError(404, f"no route GET {self.path}", kind="not_found").body())

        def do_POST(self) -> None:
            if not self._authorised():  # before a byte of the body is read
                return
            if self.headers.get("Transfer-Encoding"):
                self._refuse(411, ChatAPIError(411, "send the body with a Content-Length (no Transfer-Encoding)"))
                return
            declared = self.headers.get("Content-Length") or "0"
            if not (declared.isascii() and declared.isdigit()):
                self._refuse(400, ChatAPIError(400, f"Content-Length {declared[:40]!r} is not a number of bytes"))
                return
            length = int(declared)
            if length > MAX_BODY_BYTES:
                self._refuse(
                    413,
                    ChatAPIError(
                        413, f"the body is {length} bytes; at most {MAX_BODY_BYTES} are read", kind="request_too_large"
                    ),
                )
                return
            raw = self.rfile.read(length) if length else b""
            chat, responses = _CALL.match(self.path), _RESPONSES.match(self.path)
            if chat is None and responses is None:
                self._send(
                    404,
                    ChatAPIError(
                        404,
                        f"no route POST {self.path}; calls go to <base_url>/chat/completions or <base_url>/responses",
                        kind="not_found",
                    ).body(),
                )
                return
            try:
                body = json.loads(raw or b"null")
            except json.JSONDecodeError as e:
                self._send(400, ChatAPIError(400, f"the body is not JSON: {e.msg}").body())
                return
            if responses is not None:
                streamed = isinstance(body, dict) and body.get("stream") is True
                trajectory = responses.group(1)
                self._answer(
                    lambda: server.handle_response(trajectory, body), response_stream_events if streamed else None
                )
                return
            try:
                stream, include_usage = stream_flags(body)
            except ChatAPIError as e:
                self._send(e.status, e.body())
                return
            self._answer(
                lambda: server.handle_call(chat.group(1), body),
                (lambda answer: stream_events(answer, include_usage=include_usage)) if stream else None,
            )

    return Handler
