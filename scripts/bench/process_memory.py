"""Memory of a process tree, sampled from outside: the summed RSS and the summed PSS of a process and
all its descendants, their peaks, and what each process held at those peaks.

RSS counts a page in every process that maps it: the shared libraries (torch, vLLM, Ray) that every
process of a run maps, and a memory-mapped checkpoint, are counted once per process, so a run of
many processes sums to more than the host holds for it. PSS (proportional set size, the kernel's
/proc/<pid>/smaps_rollup) splits each shared page between the processes that map it: summed over
the tree it is what the tree holds, a page shared with a process outside the tree counted in part.
Both are reported; `peak_gb` (RSS) keeps the meaning it had in the benchmarks' JSON.

Reading PSS makes the kernel walk every page table of the process: a SmolLM2 run's tree (~12
processes, 1-6 GB each) took 185-230 ms a sample on this 2-core machine, loaded, against 8-9 ms for
RSS (`report()` gives both costs). So RSS is sampled every 0.2 s and PSS every 2 s: ~4 % and ~10 % of
one core while a run is measured, the same period on both sides of a comparison. A phase shorter
than that can be missed by the PSS peak (not by the RSS one).

    python scripts/bench/process_memory.py -- python run.py algo=grpo algo.num_steps=3
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

GiB = 2**30
# What a process of a run is, from its command line: Ray actors by their class (`ray::PolicyWorker`),
# Ray's own daemons by their program, everything else (run.py, the peer's script) as itself.
_ROLE_OF_ACTOR_CLASS = {
    "VLLMEngine": "engine",
    "PolicyWorker": "policy",
    "CriticWorker": "critic",
    "ReferenceWorker": "reference",
    "RewardModelWorker": "reward",
}
_RAY_DAEMONS = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor", "runtime_env_agent", "ray_client_server")


def process_label(cmdline: str) -> str:
    """`engine`, `policy`, ... for a role actor; `ray idle worker` for a Ray worker without an actor;
    `ray <daemon>` for Ray's own processes (by the program run, not its arguments, which name other
    daemons); `driver` for the rest (the command measured, its helpers)."""
    actor = re.match(r"ray::(\w+)", cmdline)
    if actor:
        name = actor.group(1)
        return _ROLE_OF_ACTOR_CLASS.get(name, "ray idle worker" if name in ("IDLE", "idle") else f"ray {name}")
    # The program: the first word that is not the interpreter or one of its flags.
    program = next((w for w in cmdline.split() if not w.startswith("-") and "python" not in Path(w).name), "")
    name = Path(program).name.removesuffix(".py")
    if name == "default_worker":
        return "ray idle worker"
    return f"ray {name}" if name in _RAY_DAEMONS else "driver"


def pss_bytes(pid: int) -> int | None:
    """The process's PSS from /proc/<pid>/smaps_rollup (None where it cannot be read: gone, not ours)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                if line.startswith(b"Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class TreeSample:
    """One sample of the tree: per process (pid -> label, rss, pss) and the sums."""

    processes: dict[int, tuple[str, int, int]] = field(default_factory=dict)

    @property
    def rss(self) -> int:
        return sum(rss for _, rss, _ in self.processes.values())

    @property
    def pss(self) -> int:
        return sum(pss for _, _, pss in self.processes.values())

    def by_label(self, column: int) -> dict[str, int]:
        """label -> summed bytes of that column (1: RSS, 2: PSS)."""
        out: dict[str, int] = {}
        for values in self.processes.values():
            out[values[0]] = out.get(values[0], 0) + values[column]
        return out


def sample_tree(root: psutil.Process, labels: dict[int, str], with_pss: bool) -> TreeSample | None:
    """RSS (and, `with_pss`, PSS; else 0) of `root` and its descendants now (None once the root is
    gone). `labels` keeps each pid's label across samples: an idle Ray worker that becomes an actor
    is relabelled."""
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    sample = TreeSample()
    for p in procs:
        try:
            rss = p.memory_info().rss
            if labels.get(p.pid) not in _ROLE_OF_ACTOR_CLASS.values():  # (a worker becomes an actor)
                labels[p.pid] = process_label(" ".join(p.cmdline()))
        except psutil.Error:
            continue
        pss = (pss_bytes(p.pid) or 0) if with_pss else 0
        sample.processes[p.pid] = (labels[p.pid], rss, pss)
    return sample


class ProcessTreeMemory:
    """Peaks of the summed RSS and of the summed PSS of a process and all its descendants, sampled in
    a thread, and the tree's composition (per process label) at each peak. RSS every `every_s`;
    PSS, whose reading costs ~25x more, every `pss_every_s` (at most as often as RSS)."""

    def __init__(self, pid: int, every_s: float = 0.2, pss_every_s: float = 2.0) -> None:
        self._root, self._stop = psutil.Process(pid), threading.Event()
        self.peak_rss = self.peak_pss = 0
        self.at_peak_rss: dict[str, int] = {}
        self.at_peak_pss: dict[str, int] = {}
        # The sampler's cost: samples taken and seconds spent, RSS-only ones and those with PSS apart.
        self.cost = {"rss": [0, 0.0], "pss": [0, 0.0]}
        self._labels: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, args=(every_s, pss_every_s), daemon=True)
        self._thread.start()

    def _run(self, every_s: float, pss_every_s: float) -> None:
        last_pss = -float("inf")
        while not self._stop.is_set():
            t0 = time.perf_counter()
            with_pss = t0 - last_pss >= pss_every_s
            sample = sample_tree(self._root, self._labels, with_pss)
            if sample is None:
                return
            kind = "pss" if with_pss else "rss"
            self.cost[kind][0] += 1
            self.cost[kind][1] += time.perf_counter() - t0
            if sample.rss > self.peak_rss:
                self.peak_rss, self.at_peak_rss = sample.rss, sample.by_label(1)
            if with_pss:
                last_pss = t0
                if sample.pss > self.peak_pss:
                    self.peak_pss, self.at_peak_pss = sample.pss, sample.by_label(2)
            self._stop.wait(every_s)

    def stop(self) -> float:
        """Stop sampling; the peak summed RSS in GiB (as `peak_gb` has always been)."""
        self._stop.set()
        self._thread.join()
        return self.peak_rss / GiB

    @property
    def peak_pss_gb(self) -> float:
        return self.peak_pss / GiB

    def report(self) -> dict:
        """Both peaks (GiB), per process label at each peak, and the sampler's cost per sample."""
        return {
            "peak_gb": round(self.peak_rss / GiB, 3),
            "peak_pss_gb": round(self.peak_pss / GiB, 3),
            "at_peak_rss_gb": {k: round(v / GiB, 3) for k, v in sorted(self.at_peak_rss.items())},
            "at_peak_pss_gb": {k: round(v / GiB, 3) for k, v in sorted(self.at_peak_pss.items())},
            **{f"{kind}_samples": n for kind, (n, _) in self.cost.items()},
            **{f"{kind}_sample_ms": round(1000 * s / max(n, 1), 2) for kind, (n, s) in self.cost.items()},
        }


def main(argv: list[str]) -> int:
    """Run the command after `--` and print its tree's memory report as one JSON line."""
    cmd = argv[argv.index("--") + 1 :] if "--" in argv else argv
    proc = subprocess.Popen(cmd, cwd=Path.cwd())
    memory = ProcessTreeMemory(proc.pid)
    code = proc.wait()
    memory.stop()
    print(json.dumps({"exit": code, **memory.report()}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
