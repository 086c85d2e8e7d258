"""scripts/bench/process_memory.py: a process tree's summed RSS counts a shared page in every process
that maps it, its summed PSS once; its processes are named by what they are."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from process_memory import ProcessTreeMemory, process_label  # noqa: E402

SHARED_MB = 128

# A parent and its forked child both touch every page of one shared mapping, then wait.
TWO_PROCESSES_ONE_MAPPING = textwrap.dedent(
    f"""
    import mmap, os, sys, time
    shared = mmap.mmap(-1, {SHARED_MB} << 20)
    shared.write(b"x" * ({SHARED_MB} << 20))
    if os.fork() == 0:
        sum(shared[i] for i in range(0, len(shared), 4096))  # the child maps every page too
        print("ready", flush=True)
        time.sleep(60)
    else:
        time.sleep(60)
    """
)


def test_a_page_two_processes_share_is_counted_twice_in_summed_rss_and_once_in_summed_pss():
    proc = subprocess.Popen([sys.executable, "-c", TWO_PROCESSES_ONE_MAPPING], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        memory = ProcessTreeMemory(proc.pid, every_s=0.05, pss_every_s=0.05)
        time.sleep(0.5)
        memory.stop()
        report = memory.report()
    finally:
        for child in __import__("psutil").Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()
    shared = SHARED_MB * 2**20
    assert report["pss_samples"] >= 2 and report["rss_samples"] + report["pss_samples"] >= 5
    # Both processes hold the mapping in RSS; PSS gives each half of it.
    assert memory.peak_rss >= 2 * shared
    assert memory.peak_rss - memory.peak_pss >= 0.9 * shared
    assert memory.peak_pss >= shared
    assert report["at_peak_rss_gb"] == {"driver": report["peak_gb"]}  # (two plain processes: neither is Ray's)


def test_processes_are_named_by_their_role_or_ray_program():
    venv = "/v/lib/python3.11/site-packages/ray"
    assert process_label("ray::PolicyWorker.train") == "policy"
    assert process_label("ray::VLLMEngine") == "engine"
    assert process_label("ray::IDLE") == "ray idle worker"
    assert process_label(f"{venv}/core/src/ray/raylet/raylet --raylet_socket_name=x --dashboard_agent_command=a") == (
        "ray raylet"
    )
    assert process_label(f"/v/bin/python -u {venv}/dashboard/dashboard.py --host=127.0.0.1") == "ray dashboard"
    assert process_label(f"/v/bin/python {venv}/_private/workers/default_worker.py --raylet-name=x") == (
        "ray idle worker"
    )
    assert process_label("/v/bin/python run.py algo=grpo") == "driver"
