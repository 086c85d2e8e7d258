"""The run on the console: a progress bar in a terminal, one line per step elsewhere; plots in the run
dir; and what the libraries print (Ray, vLLM, DeepSpeed) kept in the run dir instead (`LibraryOutput`).

In a terminal (stdout is a TTY) a rich progress bar shows the step, the elapsed time, an ETA and the
latest reward, KL and step time; evaluations (and reward failures) are printed above it as they come.
Anywhere else -- CI, Slurm logs, a pipe, pytest's capture -- every step is one plain line
(`format_step_line`), which greps and diffs well. `verbose=True` also prints that line above the bar.

Plots: <run_dir>/plots/ is (re)written from <run_dir>/metrics.jsonl every `plot_every_n_steps` steps
(0 = never during the run) and when the run ends, whatever the outcome (see `rlhf_orch.logging.plots`).
A failure to plot is one line on the console, never a failed run.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.text import Text

from rlhf_orch.logging import runlog
from rlhf_orch.logging.base import EXIT_OK, StepLogger
from rlhf_orch.logging.options import LoggerConfig

# The keys worth a glance every step, in the order shown.
_LINE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("kl", "kl", "{:.4f}"),
    ("distill/reverse_kl", "rkl", "{:.4f}"),  # to the teacher (algo.distill_coef)
    ("loss/policy", "pg", "{:+.4f}"),
    ("loss/value", "vf", "{:.4f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
    ("time/step", "step", "{:.1f}s"),
    ("time/generate", "gen", "{:.1f}s"),
    ("time/transfer", "xfer", "{:.2f}s"),
    ("time/experience", "exp", "{:.1f}s"),
    ("time/train", "train", "{:.1f}s"),
    ("time/sync", "sync", "{:.2f}s"),
    ("time/overlap", "overlap", "{:.1f}s"),  # pipeline=one_step_off: generated while training
)
# What the progress bar shows of the latest step.
_BAR_KEYS = (("reward/mean", "reward", "{:.3f}"), ("kl", "kl", "{:.4f}"), ("distill/reverse_kl", "rkl", "{:.4f}"))
# Steps whose wall time (between two logged steps) the ETA averages.
_ETA_WINDOW = 10


def format_step_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step:>4}/{total}"]
    for key, label, fmt in _LINE_KEYS:
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts + _notable_parts(metrics))


def _notable_parts(metrics: dict[str, Any]) -> list[str]:
    """Reward failures and evaluation results (eval/<source>/mean@k, pass@k, one group per source)."""
    parts = []
    failed = (metrics.get("reward/errors") or 0) + (metrics.get("reward/timeouts") or 0)
    if failed:
        parts.append(f"reward failures {failed}")
    for key in sorted(k for k in metrics if k.startswith("eval/") and "/mean@" in k):
        source, stat = key[len("eval/") :].rsplit("/", 1)
        k = stat.split("@", 1)[1]
        mean, passed = metrics[key], metrics.get(f"eval/{source}/pass@{k}")
        if mean is None:
            continue
        parts.append(f"eval {source} mean@{k} {mean:.3f}" + (f" pass@{k} {passed:.3f}" if passed is not None else ""))
    return parts


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v else None


def is_interactive(stream: Any = None) -> bool:
    """A terminal a person watches: a TTY that can redraw a line (not TERM=dumb)."""
    stream = sys.stdout if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
    return bool(tty) and os.environ.get("TERM", "") != "dumb"


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


class _EtaColumn(ProgressColumn):
    """Counts down between steps from the estimate made at the last one (`eta_at`: when it ends)."""

    def render(self, task: Task) -> Text:
        at = task.fields.get("eta_at")
        if task.finished:
            return Text("done", style="green")
        if at is None:
            return Text("ETA -:--:--", style="cyan")
        return Text(f"ETA {_clock(at - time.monotonic())}", style="cyan")


class ConsoleLogger(StepLogger):
    def __init__(
        self,
        plot_every_n_steps: int = LoggerConfig.plot_every_n_steps,
        verbose: bool = False,
        rollouts: bool = True,
        rollouts_per_step: int = LoggerConfig.rollouts_per_step,
        rollouts_every_n_steps: int = LoggerConfig.rollouts_every_n_steps,
        report: bool = LoggerConfig.report,
    ) -> None:
        if plot_every_n_steps < 0:
            raise ValueError(f"logger.plot_every_n_steps={plot_every_n_steps} must be >= 0 (0 = plots only at the end)")
        self.plot_every_n_steps = plot_every_n_steps
        self.verbose = verbose
        # rollouts, rollouts_per_step, rollouts_every_n_steps: keys of the logger option that the rollout
        # dump reads from the config (rlhf_orch.logging.rollout_dump, built by the session), not the logger;
        # report: the run record writes the page (rlhf_orch.view sits above this layer).
        self.console = Console(highlight=False, soft_wrap=True)
        self.total_steps = 0
        self.name = ""
        self.interactive = False
        self._progress: Optional[Progress] = None
        self._task = None
        self._stamps: deque[tuple[float, int]] = deque(maxlen=_ETA_WINDOW + 1)
        self._closed = False
        # The bar is drawn on the real terminal, past run.log's tee (rlhf_orch.logging.runlog): the
        # lines it stands for are written to run.log explicitly, prints meanwhile go above it.
        self._direct = False
        self._pending = ""

    def start(self, run_dir: str, config: dict[str, Any], name: str, resume_id: str | None = None) -> None:
        super().start(run_dir, config, name, resume_id)
        self.total_steps = int(config.get("algo", {}).get("num_steps", 0))
        self.name = name
        self.interactive = is_interactive()
        if self.interactive and runlog.active():
            self._direct = True
            self.console = Console(file=runlog.terminal(), highlight=False, soft_wrap=True)
        self.console.print(Text.assemble(("rlhf_orch", "bold"), f" run '{name}' -> {run_dir}"))
        self._log_only(f"rlhf_orch run '{name}' -> {run_dir}")
        if self.interactive:
            # The task (and its elapsed clock) starts now; the bar is drawn from the first step on,
            # so start-up messages print as plain lines.
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=28),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                _EtaColumn(),
                TextColumn("{task.fields[latest]}", markup=False),
                console=self.console,
                refresh_per_second=2,
                transient=False,
                redirect_stdout=not self._direct,
                redirect_stderr=not self._direct,
            )
            self._task = self._progress.add_task("training", total=self.total_steps or None, latest="", eta_at=None)

    def _log_only(self, text: str) -> None:
        if self._direct:
            runlog.log_only(text)

    def _say(self, text: str) -> None:
        self.console.print(text, markup=False)
        self._log_only(text)

    def _above_bar(self, text: str) -> None:
        """A print while the bar is live (run.log already has it): drawn above the bar."""
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self.console.print(Text.from_ansi(line))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self._progress is None:
            self.console.print(format_step_line(step, self.total_steps, metrics), markup=False)
        else:
            self._show(step, metrics)
        if self.plot_every_n_steps and step > 0 and step % self.plot_every_n_steps == 0:
            self.plot()

    def _show(self, step: int, metrics: dict[str, Any]) -> None:
        progress = self._progress
        if not progress.live.is_started:
            progress.start()
            if self._direct:
                runlog.set_divert(self._above_bar)
        if self.verbose:
            self._say(format_step_line(step, self.total_steps, metrics))
        else:
            self._log_only(format_step_line(step, self.total_steps, metrics))  # the bar shows it here
            notable = _notable_parts(metrics)
            if notable:
                self.console.print(" | ".join([f"step {step:>4}/{self.total_steps}", *notable]), markup=False)
        if "reward/mean" not in metrics:  # an evaluation before the first step (step 0)
            return
        now = time.monotonic()
        self._stamps.append((now, step))
        (t0, s0), (t1, s1) = self._stamps[0], self._stamps[-1]
        per_step = (t1 - t0) / (s1 - s0) if s1 > s0 else _num(metrics.get("time/step"))
        latest = [
            f"{label} {fmt.format(v)}" for key, label, fmt in _BAR_KEYS if (v := _num(metrics.get(key))) is not None
        ]
        if per_step:
            latest.append(f"{per_step:.1f}s/step")
        left = max(self.total_steps - step, 0)
        progress.update(
            self._task,
            completed=step,
            latest="  ".join(latest),
            eta_at=now + left * per_step if per_step is not None else None,
        )

    def plot(self) -> list[Path]:
        """(Re)write <run_dir>/plots from metrics.jsonl; a failure is one printed line, never raised."""
        try:
            from rlhf_orch.logging.plots import plot_run

            return plot_run(self.run_dir, self.name or None)
        except Exception as e:  # a plot must never fail the run
            self._say(f"plots: not written ({type(e).__name__}: {e})")
            return []

    def close(self, exit_code: int = EXIT_OK, preempted: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self._progress is not None and self._progress.live.is_started:
            self._progress.stop()
        if self._direct:
            runlog.set_divert(None)
            if self._pending:
                self.console.print(Text.from_ansi(self._pending))
                self._pending = ""
        if getattr(self, "run_dir", None) is None:  # never started
            return
        written = self.plot()
        if written:
            self._say(f"plots: {Path(written[0]).parent}/ ({', '.join(p.name for p in written)})")


# --------------------------------------------------------------------------- library output
WORKER_LOG = "ray_workers.log"
_DEAD_WORKER = "A worker died or was killed"  # the raylet's notice the run reports in a line of its own
_RAY_MARKER = re.compile(r"^:(job_id|actor_name|task_name):")
_WORKER_FILE = re.compile(r"^worker-[0-9a-f]+-(?P<job>[0-9a-f]+)-(?P<pid>\d+)\.(?P<stream>out|err)$")


class LibraryOutput:
    """What Ray, vLLM and DeepSpeed print, kept off a normal run's console (`logger.verbose=false`).

    The launcher's Ray session drives it:

    - `init_kwargs()`, for `ray.init`: `log_to_driver=False`, so the actors' stdout and stderr (vLLM's
      and DeepSpeed's messages, Triton and NUMA notes, weight-loading progress bars) stay in Ray's
      session logs (<session dir>/logs/worker-*.out|err) instead of being streamed to this console,
      and Ray's log-dedup banner has nothing to summarise;
    - `start()`, before `ray.init`: Ray's own driver messages below ERROR ("Started a local Ray
      instance", the token-authentication note) go to <run_dir>/ray_workers.log, not the console;
    - `connected()`, after `ray.init`: says once where that output is;
    - `finish()`, after `ray.shutdown`: appends this job's worker output to <run_dir>/ray_workers.log
      (one section per actor process) and undoes `start()`.

    Errors still reach the console: Ray's ERROR messages and the run's own lines -- one per fault
    it survived ("engine 0 died making step 2's rollout: replaced ..."), the one-line `error: ...`
    of a failure (an actor's traceback is in the run dir's error.log). The raylet's notices about
    dead workers ("A worker died or was killed while executing a task ...", several long coloured
    lines per fault, which the run reports itself) go to <run_dir>/ray_workers.log.
    `verbose=True` leaves everything as Ray does it: streamed to the console.
    """

    def __init__(self, run_dir: str | Path | None, verbose: bool = False) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.verbose = verbose
        self.log_path = self.run_dir / WORKER_LOG if self.run_dir is not None else None
        self._levels: list[tuple[logging.Handler, int]] = []
        self._file: Optional[logging.Handler] = None
        self._logs_dir: Optional[Path] = None
        self._job_id: Optional[str] = None
        self._started_at = 0.0  # a session that outlives this run also holds earlier runs' workers
        self._set_ignore_unhandled = False
        self._ray_print: Any = None  # Ray's own printer of the raylet's notices, while diverted

    def init_kwargs(self) -> dict[str, Any]:
        return {"log_to_driver": self.verbose}

    def start(self) -> None:
        self._started_at = time.time()
        if self.verbose:
            return
        ray_logger = logging.getLogger("ray")
        self._levels = [(h, h.level) for h in ray_logger.handlers]
        for handler, level in self._levels:
            handler.setLevel(max(level, logging.ERROR))
        # Ray prints an "Unhandled error" with the remote traceback for every result of a call
        # nobody fetched: after a lost process, the calls the run abandoned (it reported and
        # handled the failure itself, in one line).
        self._set_ignore_unhandled = "RAY_IGNORE_UNHANDLED_ERRORS" not in os.environ
        if self._set_ignore_unhandled:
            os.environ["RAY_IGNORE_UNHANDLED_ERRORS"] = "1"
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = logging.FileHandler(self.log_path, encoding="utf-8")
            # Ray's own format (ray.init sets it on every handler of the "ray" logger anyway).
            self._file.setFormatter(
                logging.Formatter("%(asctime)s\t%(levelname)s %(filename)s:%(lineno)s -- %(message)s")
            )
            ray_logger.addHandler(self._file)
            self._divert_raylet_notices()

    def _divert_raylet_notices(self) -> None:
        """The driver's error listener prints what the raylet publishes straight to stdout through
        `ray._private.worker.print_to_stdstream`, bypassing every logger: its notices that a worker
        died or was killed (which the run reports itself) go to ray_workers.log instead; others (a
        worker killed for lack of memory says why) stay on the console. (No public switch exists; if
        Ray renames the function, they all reach the console as before.)"""
        from ray._private import worker as ray_worker

        ray_print = getattr(ray_worker, "print_to_stdstream", None)
        if ray_print is None:
            return
        file = self._file

        def print_to_stdstream(data: dict[str, Any], ignore_prefix: bool) -> None:
            lines = [str(line) for line in data.get("lines", [])]
            if data.get("pid") != "raylet" or not all(_DEAD_WORKER in line for line in lines):
                return ray_print(data, ignore_prefix)  # anything else (an OOM kill's notice) stays on the console
            for line in lines:
                file.handle(
                    logging.makeLogRecord(
                        {
                            "name": "ray",
                            "levelname": "WARNING",
                            "levelno": logging.WARNING,
                            "msg": f"(raylet) {runlog.strip_ansi(line)}",
                        }
                    )
                )

        self._ray_print = ray_print
        ray_worker.print_to_stdstream = print_to_stdstream

    def connected(self) -> None:
        """Call once Ray is up: remembers this job's session logs and prints where the output goes."""
        if self.verbose:
            return
        try:
            import ray

            self._logs_dir = Path(ray._private.worker._global_node.get_logs_dir_path())
            self._job_id = ray.get_runtime_context().get_job_id()
        except Exception:  # only the copy at the end needs it
            self._logs_dir = None
        if self.log_path is not None:
            live = f"; live: {self._logs_dir}/worker-*" if self._logs_dir else ""
            print(
                f"library output (Ray, vLLM, DeepSpeed): {self.log_path}{live} (logger.verbose=true shows it here)",
                flush=True,
            )

    def finish(self) -> None:
        """Call after ray.shutdown (the workers have exited and flushed their files)."""
        if self.verbose:
            return
        ray_logger = logging.getLogger("ray")
        if self._ray_print is not None:
            from ray._private import worker as ray_worker

            ray_worker.print_to_stdstream = self._ray_print
            self._ray_print = None
        if self._file is not None:
            ray_logger.removeHandler(self._file)
            self._file.close()
            self._file = None
        for handler, level in self._levels:
            handler.setLevel(level)
        self._levels = []
        if self._set_ignore_unhandled:
            os.environ.pop("RAY_IGNORE_UNHANDLED_ERRORS", None)
            self._set_ignore_unhandled = False
        if self.log_path is not None and self._logs_dir is not None:
            try:
                collect_worker_logs(self._logs_dir, self.log_path, self._job_id, since=self._started_at)
            except OSError as e:
                print(f"library output: not copied from {self._logs_dir} ({e})", flush=True)


def collect_worker_logs(logs_dir: Path, dest: Path, job_id: Optional[str] = None, since: float = 0.0) -> int:
    """Append the output of this job's Ray workers (logs_dir/worker-*.out|err) to `dest`: one section
    per process and stream (by actor class, then pid), Ray's marker lines dropped, each progress-bar
    redraw (\\r) on a line of its own; `since` (a time.time()) leaves out files last written before
    it (workers of earlier runs in a session that outlives them). Returns the sections written (a
    silent worker gets none)."""
    sections = []
    for path in Path(logs_dir).glob("worker-*"):
        m = _WORKER_FILE.match(path.name)
        if not m or (job_id is not None and m["job"] != job_id) or path.stat().st_mtime < since:
            continue
        lines = (
            path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n").splitlines()
        )
        actor = next((line.split(":", 2)[2] for line in lines[:5] if line.startswith(":actor_name:")), "worker")
        body = [line for line in lines if line.strip() and not _RAY_MARKER.match(line)]
        if body:
            sections.append((actor, int(m["pid"]), "stdout" if m["stream"] == "out" else "stderr", body))
    if sections:
        with open(dest, "a", encoding="utf-8") as f:
            for actor, pid, stream, body in sorted(sections, key=lambda s: s[:3]):
                f.write(f"==== {actor} pid={pid} ({stream}) ====\n" + "\n".join(body) + "\n")
    return len(sections)
