"""`python -m rlhf_orch.view RUN_DIR --serve`: the page on 127.0.0.1 only, rewritten while the run
goes on. The server rewrites report.html when a file under a run dir changed (polled: no watcher
thread in the run's processes), answers `/__version` with the data's hash, and the page -- served
over http, not opened from disk -- reloads itself when that changes (its state is in the URL's
hash, so it comes back as it was). The file is the one `write_report` and `logger.report` write,
so a run writing its own page meanwhile writes the same thing.

Only requests naming 127.0.0.1 or localhost (with this port) in their Host header are answered: a
web page elsewhere cannot read the report through DNS rebinding. Other users of a shared machine
can reach 127.0.0.1 too (docs/run_page.md)."""

from __future__ import annotations

import http.server
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from rlhf_orch.view.page import expand_runs, write_page

HOST = "127.0.0.1"  # never another interface: the page shows the run's config and what the model wrote


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
        self.version = ""
        self._seen: tuple = ()
        self._stop = threading.Event()
        self.refresh()
        handler = self._handler()
        self.httpd = http.server.ThreadingHTTPServer((HOST, port), handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://{HOST}:{self.port}/"
        self.hosts = {f"{HOST}:{self.port}", f"localhost:{self.port}"}

    def refresh(self) -> bool:
        """Rewrite the page if a run file changed; whether it did."""
        seen = _fingerprint(self.paths)
        if seen == self._seen and self.out.exists():
            return False
        self.version = write_page(self.paths, self.out)[1]
        self._seen = seen  # (only once written: a write that failed is tried again at the next poll)
        return True

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
            except OSError:  # a file replaced while read: the next poll reads it again
                pass

    def _handler(self) -> Callable[..., http.server.BaseHTTPRequestHandler]:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.headers.get("Host", "") not in server.hosts:
                    self.send_error(403, "only http://127.0.0.1:<port>/ is served")
                    return
                if self.path.split("?")[0] == "/__version":
                    body, kind = server.version.encode(), "text/plain"
                elif self.path.split("?")[0] in ("/", "/" + server.out.name):
                    body, kind = server.out.read_bytes(), "text/html; charset=utf-8"
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


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
