"""Run a user's agent function over many trajectories at once (`env=agent`; no engine here).

Each trajectory calls `fn(row, client=..., base_url=..., api_key=...)`: the data row, an `openai`
client bound to the trajectory's own base URL (`AsyncOpenAI` for an `async def`, `OpenAI` for a
plain function), that URL and the trajectory's own key (for code that makes its own client). Only the keywords
the function accepts are passed (all of them to `**kwargs`). At most `concurrency` trajectories run
at once; each has `timeout_s`. The function returns the reward: a number, or a mapping with
`score` (its other numeric entries are summed as metrics). An exception or a timeout scores 0 and is
counted; the rollout still completes.

The functions run on an event loop in a thread of their own (a plain function in the loop's thread
pool), so the caller's thread stays free to drive the engine that answers their calls.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from rlhf_orch.env import abandonable

CLIENT_KEYWORDS = ("client", "base_url", "api_key")


@dataclass
class AgentOutcome:
    index: int
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # "TypeError: ..." when the function raised
    timed_out: bool = False
    seconds: float = 0.0


def reward_of(result: Any) -> tuple[float, dict[str, float]]:
    """The function's return value as (reward, extra metrics); TypeError when it is neither."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise TypeError(f"an agent's dict result needs a 'score' key, got keys {sorted(result)}")
        extra = {str(k): float(v) for k, v in result.items() if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        return _finite(result["score"]), extra
    return _finite(result), {}


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"an agent must return its reward as a number or a dict with 'score', got {type(value).__name__}")
    if not math.isfinite(float(value)):
        raise TypeError(f"an agent returned a non-finite reward {value}")
    return float(value)


def accepted_keywords(fn: Callable) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return CLIENT_KEYWORDS
    names = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return tuple(k for k in CLIENT_KEYWORDS if k in names)


class AgentRunner:
    """Start every trajectory's function; `wait` for them; `outcomes` once done."""

    def __init__(self, fn: Callable, concurrency: int, timeout_s: float):
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)
        self.keywords = accepted_keywords(fn)
        self.concurrency = max(1, int(concurrency))
        self.timeout_s = float(timeout_s)
        self.outcomes: dict[int, AgentOutcome] = {}
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._crash: BaseException | None = None

    def start(self, items: Sequence[tuple[int, Any, str, str]]) -> None:
        """items: (trajectory index, row, base_url, api_key): each trajectory's own URL and key."""
        self._thread = threading.Thread(target=self._main, args=(list(items),), name="agents", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        finished = self._done.wait(timeout)
        if finished and self._crash is not None:
            raise self._crash
        return finished

    # ------------------------------------------------------------------ the loop's thread
    def _main(self, items: list[tuple[int, Any, str, str]]) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._all(items))
            loop.run_until_complete(loop.shutdown_asyncgens())
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self._crash = e
        finally:
            loop.close()
            self._done.set()

    async def _all(self, items: list[tuple[int, Any, str, str]]) -> None:
        import httpx

        # One connection pool for every trajectory's client: an `openai` client builds its own
        # otherwise, with an SSL context (~17 ms each, more than a call to the tiny model costs).
        limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=self.concurrency * 2)
        timeout = httpx.Timeout(self.timeout_s)
        self._http = httpx.AsyncClient(limits=limits, timeout=timeout) if self.is_async else httpx.Client(limits=limits, timeout=timeout)
        gate = asyncio.Semaphore(self.concurrency)
        try:
            await asyncio.gather(*(self._one(gate, index, row, url, key) for index, row, url, key in items))
        finally:
            if self.is_async:
                await self._http.aclose()
            else:
                self._http.close()  # a timed-out function still calling gets an error: its rollout is over

    async def _one(self, gate: asyncio.Semaphore, index: int, row: Any, base_url: str, api_key: str) -> None:
        async with gate:
            out = AgentOutcome(index)
            t = time.perf_counter()
            client = None
            try:
                client = self._client(base_url, api_key)
                kwargs = {k: v for k, v in (("client", client), ("base_url", base_url), ("api_key", api_key)) if k in self.keywords}
                if self.is_async:
                    result = await asyncio.wait_for(self.fn(row, **kwargs), self.timeout_s)
                else:
                    # A plain function blocks a thread of its own (not a pool's: one that hangs would
                    # hold a worker the next trajectory waits for); past env.timeout_s it is abandoned.
                    call = abandonable.start(self.fn, row, name="agent", **kwargs)
                    try:
                        result = await asyncio.wait_for(asyncio.wrap_future(call), self.timeout_s)
                    except asyncio.TimeoutError:
                        abandonable.abandon(call)
                        raise
                out.reward, out.metrics = reward_of(result)
            except asyncio.TimeoutError:
                out.timed_out = True
            except Exception as e:  # noqa: BLE001 - the agent's bug or its model's output: counted, scored 0
                out.error = f"{type(e).__name__}: {e}"
            finally:
                out.seconds = time.perf_counter() - t
            self.outcomes[index] = out

    def _client(self, base_url: str, api_key: str) -> Any:
        import openai

        # No retries: a refused call is the agent's to handle, and a retry would be a second call.
        cls = openai.AsyncOpenAI if self.is_async else openai.OpenAI
        return cls(base_url=base_url, api_key=api_key, max_retries=0, timeout=self.timeout_s, http_client=self._http)
