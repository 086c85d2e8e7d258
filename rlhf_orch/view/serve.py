"""`python -m rlhf_orch.view RUN_DIR --serve`: the page on 127.0.0.1 only, rewritten while the run
goes on. The server rewrites report.html when a file under a run dir changed (polled: no watcher
thread in the run's processes), answers `/__version` with the data's hash, and the page reloads
itself when that changes (its state is in the URL's hash, so it comes back as it was)."""

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
        self.url = f"http://{HOST}:{self.httpd.server_address[1]}/"

    def refresh(self) -> bool:
        """Rewrite the page if a run file changed; whether it did."""
        seen = _fingerprint(self.paths)
        if seen == self._seen and self.out.exists():
            return False
        self._seen = seen
        self.version = write_page(self.paths, self.out, live=True)[1]
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
                if self.path.split("?")[0] == "/__version":
                    body, kind = server.version.encode(), "text/plain"
                elif self.path.split("?")[0] in ("/", "/" + server.out.name):
                    body, kind = server.out.read_bytes(), "text/html; charset=utf-8"
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
