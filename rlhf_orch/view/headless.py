"""The run page in a real browser: headless Chromium driven over the DevTools protocol (what the
page tests, the screenshot in docs/ and the page benchmark use). Debian's `chromium` package;
`websockets` talks to it. Nothing here is needed to write or serve a page.

    with Browser() as browser:
        page = browser.open("file:///.../report.html#step=1")
        page.evaluate("document.querySelectorAll('#traj-table tr.row').length")
        page.errors            # JavaScript exceptions and console errors, as text
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> str | None:
    """The Chromium binary on PATH (None: not installed; `apt-get install chromium` on Debian)."""
    return next((p for name in CANDIDATES if (p := shutil.which(name))), None)


class BrowserError(RuntimeError):
    pass


class Page:
    def __init__(self, socket: Any) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self.errors: list[str] = []
        self.events: list[dict] = []

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict:
        call_id = next(self._ids)
        self._socket.send(json.dumps({"id": call_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"{method}: no answer in {timeout_s:.0f} s")
            message = json.loads(self._socket.recv(timeout=left))
            if message.get("id") == call_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error'].get('message')}")
                return message.get("result", {})
            self._event(message)

    def _event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        self.events.append(message)
        if method == "Runtime.exceptionThrown":
            d = params.get("exceptionDetails", {})
            self.errors.append(d.get("exception", {}).get("description") or d.get("text", "exception"))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", [])))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.errors.append(params["entry"].get("text", "log error"))

    def evaluate(self, expression: str, timeout_s: float = 30.0) -> Any:
        """The value of `expression` (a promise is awaited), as JSON."""
        result = self.call("Runtime.evaluate", timeout_s, expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            d = result["exceptionDetails"]
            raise BrowserError(d.get("exception", {}).get("description") or d.get("text"))
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> bool:
        """Whether `expression` became truthy (in JavaScript's sense: a DOM node is) in `timeout_s`;
        an evaluation a navigation cut off (the document being replaced) counts as not yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.evaluate(f"!!({expression})"):
                    return True
            except BrowserError:
                pass
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def navigate(self, url: str, timeout_s: float = 60.0) -> float:
        """Load `url` and wait until the page says it is drawn (body[data-ready]); seconds taken."""
        t = time.perf_counter()
        self.call("Page.navigate", url=url)
        if not self.wait_for("document.body && document.body.getAttribute('data-ready') === '1'", timeout_s):
            raise BrowserError(f"{url}: not drawn in {timeout_s:.0f} s (errors: {self.errors})")
        return time.perf_counter() - t

    def screenshot(self, path: str | Path, width: int = 1400, height: int | None = None) -> Path:
        """A PNG of the page `width` pixels wide, `height` high (None: the whole page)."""
        import base64

        self.call(
            "Emulation.setDeviceMetricsOverride", width=width, height=height or 1000, deviceScaleFactor=1, mobile=False
        )
        if height is None:
            height = int(self.evaluate("document.documentElement.scrollHeight"))
            self.call(
                "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
            )
        data = self.call("Page.captureScreenshot", format="png")["data"]
        Path(path).write_bytes(base64.b64decode(data))
        return Path(path)


class Browser:
    """A headless Chromium with one page, for the length of a `with` block."""

    def __init__(self, binary: str | None = None, width: int = 1400, height: int = 1000) -> None:
        self.binary = binary or chromium_path()
        if self.binary is None:
            raise BrowserError("no Chromium on PATH (Debian: apt-get install chromium)")
        self.size = (width, height)

    def __enter__(self) -> "Browser":
        self._profile = tempfile.mkdtemp(prefix="rlhf-view-chromium-")
        try:
            self._start()
        except BaseException:
            self.__exit__()  # (the browser and its profile do not outlive a failed start)
            raise
        return self

    def _start(self) -> None:
        from websockets.sync.client import connect

        # Chromium's messages go to a file: a pipe nobody reads would fill and stall it.
        log_path = Path(self._profile) / "chromium.log"
        self._log = open(log_path, "wb")
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--headless=new",
                "--no-sandbox",  # (root in containers and CI)
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                f"--window-size={self.size[0]},{self.size[1]}",
                "about:blank",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or len(port_file.read_text().split()) < 2:
            if self._proc.poll() is not None or time.monotonic() > deadline:
                said = log_path.read_text(encoding="utf-8", errors="replace").strip()
                raise BrowserError(f"Chromium did not start: {said[-300:]}")
            time.sleep(0.05)
        port = port_file.read_text().split()[0]
        targets = json.loads(_http_get(f"http://127.0.0.1:{port}/json"))
        target = next(t for t in targets if t.get("type") == "page")
        connection = connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self._socket = connection.__enter__()  # (what `with connect(...)` does; closed in __exit__)
        self.page = Page(self._socket)
        for domain in ("Page", "Runtime", "Log"):
            self.page.call(f"{domain}.enable")

    def open(self, url: str, timeout_s: float = 60.0) -> Page:
        self.page.navigate(url, timeout_s)
        return self.page

    def __exit__(self, *exc: Any) -> None:
        socket = getattr(self, "_socket", None)
        if socket is not None:
            socket.close()
        if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        shutil.rmtree(getattr(self, "_profile", ""), ignore_errors=True)


def _http_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as answer:  # (127.0.0.1: the browser's own endpoint)
        return answer.read().decode()


def file_url(path: str | Path, fragment: str = "") -> str:
    url = Path(path).resolve().as_uri()
    return f"{url}#{fragment}" if fragment else url


NETWORK_REFERENCE = re.compile(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|@import|url\(\s*["']?(?:https?:)?//""", re.I)


def network_references(html_text: str) -> list[str]:
    """What in a page would load from the network (a script, style, image or font by URL)."""
    return [m.group(0) for m in NETWORK_REFERENCE.finditer(html_text)] + (
        ["fetch(http...)"] if re.search(r"fetch\(\s*[\"']https?://", html_text) else []
    )


__all__ = ["Browser", "BrowserError", "Page", "chromium_path", "file_url", "network_references"]
