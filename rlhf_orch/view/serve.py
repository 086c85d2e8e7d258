"""`python -m rlhf_orch.view RUN_DIR --serve`: the page on 127.0.0.1 only, rewritten while the run
goes on. The server rewrites report.html when a file under a run dir changed (polled: no watcher
thread in the run's processes) and serves the page it wrote from memory, with `/__version` the
hash of that page's data (marked by the `X-Rlhf-Orch-Version` header): the page -- served here,
not opened from disk -- reloads itself when that changes (its state is in the URL's hash, so it
comes back as it was). A run writing its own report.html meanwhile (logger.report) changes
neither what is served nor its version.

Only requests whose Host header names 127.0.0.1, localhost or [::1] (any port: an SSH tunnel's) are
answered: a web page elsewhere cannot read the report through DNS rebinding. Other users of a
shared machine can reach 127.0.0.1 too (docs/run_page.md)."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path
from typing import Callable, Sequence

from rlhf_orch.view.page import expand_runs, write_page

HOST = "127.0.0.1"  # never another interface: the page shows the run's config and what the model wrote
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
VERSION_HEADER = "X-Rlhf-Orch-Version"  # what tells the page its server can refresh it


def _fingerprint(paths: Sequence[str | Path]) -> tuple:
    """What changes when the run writes something the page shows (sizes and times of its files)."""
    seen = []
    for run_dir in expand_runs(paths):
        for name in ("metrics.jsonl", "summary.json", ".hydra/config.yaml"):
            p = run_dir / name
            if p.is_file():
                st = p.stat()
                seen.append((str(p), st.st_size, st.st_mtime_ns))
        folder = run_dir / "rollouts"
        if folder.is_dir():
            for p in folder.glob("step_*.jsonl"):
                st = p.stat()
                seen.append((str(p), st.st_size, st.st_mtime_ns))
    return tuple(sorted(seen))


class ReportServer:
    """Serves `out` (the page of `paths`) and keeps it current; `serve_forever` until stopped."""

    def __init__(self, paths: Sequence[str | Path], out: Path, port: int = 0, poll_s: float = 1.0) -> None:
        self.paths, self.out, self.poll_s = list(paths), Path(out), poll_s
        self.served: tuple[bytes, str] = (b"", "")  # (the page, its version), replaced as one
        self._seen: tuple = ()
        self._stop = threading.Event()
        self.refresh()
        handler = self._handler()
        self.httpd = http.server.ThreadingHTTPServer((HOST, port), handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://{HOST}:{self.port}/"

    @property
    def version(self) -> str:
        return self.served[1]

    def refresh(self) -> bool:
        """Rewrite the page if a run file changed; whether it did."""
        seen = _fingerprint(self.paths)
        if seen == self._seen and self.out.exists():
            return False
        out, version = write_page(self.paths, self.out)
        self.served = (out.read_bytes(), version)
        self._seen = seen  # (only once written: a write that failed is tried again at the next poll)
        return True

    def _watch(self) -> None:
        failing = ""
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
                failing = ""
            except Exception as e:  # tried again at the next poll; said once, the page stays as it was
                message = f"report: not refreshed ({type(e).__name__}: {e})"
                if message != failing:
                    print(message, flush=True)
                failing = message

    def _handler(self) -> Callable[..., http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if host_name(self.headers.get("Host", "")) not in LOOPBACK_NAMES:
                    self.send_error(403, "only http://127.0.0.1:<port>/ is served")
                    return
                page, version = server.served
                if self.path.split("?")[0] == "/__version":
                    body, kind = version.encode(), "text/plain"
                elif self.path.split("?")[0] in ("/", "/" + server.out.name):
                    body, kind = page, "text/html; charset=utf-8"
                elif self.path == "/favicon.ico":  # (what a browser asks for first: nothing)
                    self.send_response(204)
                    self.end_headers()
                    return
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Cache-Control", "no-store")
                self.send_header(VERSION_HEADER, version)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:  # quiet: the console is the user's
                pass

        return Handler

    def serve_forever(self) -> None:
        watcher = threading.Thread(target=self._watch, name="report-refresh", daemon=True)
        watcher.start()
        try:
            self.httpd.serve_forever(poll_interval=0.25)
        finally:
            self._stop.set()
            self.httpd.server_close()

    def shutdown(self) -> None:
        self._stop.set()
        self.httpd.shutdown()


def host_name(host: str) -> str:
    """A Host header without its port ("127.0.0.1:8765" -> "127.0.0.1", "[::1]:80" -> "[::1]")."""
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if ":" in host else host
