"""The memory plan against measured memory: predicted peak of every role process vs its RSS high-water mark.

For each configuration the plan (`rlhf_orch.memory`) is made exactly as `python run.py` makes it,
then the run itself is started (`run.py`, a few steps) while a poller reads `VmHWM` (the kernel's
RSS high-water mark) of every process it started: Ray's actor processes by their title
(`ray::PolicyWorker` -> actor, ...), the driver row = run.py plus Ray's own daemons (raylet, GCS,
idle workers). Per process: predicted, measured, error = (predicted - measured) / measured, and
beside it the process's sampled PSS peak (its shared pages -- libraries, the checkpoint file --
split between the processes that map them), with the run's summed PSS peak per configuration.

Configurations: the tiny model at ZeRO-2 and ZeRO-3, colocated and split on Ray logical GPUs, a long
context (8k tokens), and a model with Qwen2.5-0.5B's shape (its config.json, random weights, built
here; its tokenizer is the tiny one padded with placeholder tokens to the 151936-token vocabulary)
at ZeRO-2 and ZeRO-3, in float32 (bf16 training is too slow on this CPU: over 600 s for a step).
Optimizer offload is a GPU-only setting (refused without CUDA), not measured.

    .venv/bin/python scripts/bench_memory.py                  # every configuration (~15 min)
    .venv/bin/python scripts/bench_memory.py --only tiny_zero2,qwen05b_zero2
    python scripts/bench_memory.py --gpu      # on a CUDA GPU: the trainer's terms against
                                              # torch.cuda.max_memory_allocated and nvidia-smi
                                              # per process (scripts/bench/bench_gpu.py's memory part)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

from process_memory import pss_bytes
from rlhf_orch.config.schema import register_configs
from rlhf_orch.memory.check import check_memory
from rlhf_orch.memory.shapes import KNOWN_CONFIGS
from rlhf_orch.memory.terms import ProcessMemory

GB = 1e9
QWEN05B = "Qwen/Qwen2.5-0.5B-Instruct"
SHORT_RUN = [
    "launcher.memory_check=warn",
    "algo.num_steps=1",
    "checkpoint.at_end=false",
    "checkpoint.export_final=false",
    "logger.plot_every_n_steps=0",
]
PSS_EVERY_S = 2.0  # (a run's ~12 processes: ~0.2 s to read on this 2-core machine, loaded)
ROLE_OF_ACTOR_CLASS = {
    "VLLMEngine": "engine",
    "PolicyWorker": "actor",
    "CriticWorker": "critic",
    "ReferenceWorker": "reference",
    "RewardModelWorker": "reward",
}


def configurations(qwen_dir: str) -> dict[str, list[str]]:
    # float32: DeepSpeed's bf16 training on this CPU took over 600 s for one step's first micro-batches.
    qwen = [
        "model=hf",
        f"model.name_or_path={qwen_dir}",
        "model.context_len=32768",
        "model.dtype=float32",
        "fault.step_timeout_s=3000",
        "algo.rollout_batch_size=8",
        "algo.train_batch_size=32",
        "algo.micro_batch_size=8",
    ]
    return {
        "tiny_zero2": ["trainer.zero_stage=2"],
        "tiny_zero3_colocated": [
            "trainer.zero_stage=3",
            "placement=colocated",
            "placement.gpus_per_node=2",
            "launcher.logical_gpus=2",
            "placement.engines=1",
        ],
        "tiny_zero2_split": [
            "placement=split",
            "placement.gpus_per_node=4",
            "placement.actor_gpus=2",
            "placement.critic_gpus=1",
            "placement.vllm_gpus=1",
            "launcher.logical_gpus=4",
        ],
        "tiny_long_context": ["experiment=long8k_packed"],
        # No KL reference (DAPO): with GRPO's reference (~2.5 GB more) this host ran out of memory
        # and Ray's memory monitor killed the policy in one run of two -- no figure to compare.
        "qwen05b_zero2": [*qwen, "algo=dapo", "algo.dynamic_sampling=false", "trainer.zero_stage=2"],
        # ZeRO-3 without the reference (DAPO has no KL term) and with plain SGD: with AdamW's moments this
        # machine runs out of memory (measured: Ray killed the policy at 17 GB; the plan refuses it).
        "qwen05b_zero3_sgd": [
            *qwen,
            "algo=dapo",
            "algo.dynamic_sampling=false",
            "trainer.zero_stage=3",
            "trainer.optimizer=sgd",
        ],
    }


def build_qwen_shape(directory: Path) -> None:
    """A checkpoint with Qwen2.5-0.5B-Instruct's config.json and random bf16 weights."""
    if (directory / "config.json").exists():
        return
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tiny = instantiate(compose_config([]).model).path()
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    fields = {k: v for k, v in KNOWN_CONFIGS[QWEN05B].items() if k != "model_type"}
    tokenizer.add_tokens([f"<x{i}>" for i in range(fields["vocab_size"] - len(tokenizer))])
    config = Qwen2Config(
        **fields,
        max_position_embeddings=32768,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def compose_config(overrides: list[str]):
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def predicted(overrides: list[str]) -> tuple[dict[str, float], float, float]:
    """(per process (role+rank, 'driver'): the plan's total, the host's need, its capacity), bytes."""
    cfg = compose_config(overrides)
    typed = OmegaConf.to_object(cfg)
    plan = instantiate(cfg.placement).plan(
        reward_model=False, critic=typed.algo.needs_critic, reference=typed.algo.needs_reference_ranks
    )
    verdict = check_memory(typed, plan, on_gpu=False, reward_model=False)
    load = verdict.plan.loads[0]
    by_process: dict[str, list] = {}
    for p in load.processes:
        # A reference inside the policy rank's process (placement.reference_in_actor) is measured in
        # it: one process, whose peak is its largest phase of both roles' terms together.
        name = (
            "driver"
            if p.role == "driver"
            else f"actor{p.rank}"
            if p.role == "reference" and plan.reference_in_actor
            else f"{p.role}{p.rank}"
        )
        by_process.setdefault(name, []).extend(p.terms)
    totals = {name: ProcessMemory(name, 0, terms).peak() for name, terms in by_process.items()}
    return totals, load.need, load.device.capacity


def _hwm_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Poller(threading.Thread):
    """VmHWM of every process under the run (polled: a process's last value before it exits counts),
    and its PSS (the kernel keeps no high-water mark of it: the peak of samples every
    `PSS_EVERY_S`, ~25x the cost of reading VmHWM; scripts/bench/process_memory.py), per process and
    summed over the run's processes."""

    def __init__(self, root_pid: int):
        super().__init__(daemon=True)
        self.root_pid, self.peaks, self.titles, self.done = root_pid, {}, {}, False
        self.pss_peaks: dict[int, int] = {}  # pid -> its sampled PSS peak
        self.peak_pss_sum = 0  # the peak of the summed PSS of every process of the run at once
        self.parents: dict[int, int] = {}  # pid -> parent pid, as seen while polling
        # The host's used memory (total - available, what Ray's memory monitor watches), above what
        # was used before the run started.
        self.baseline_used = self._used()
        self.peak_used = 0

    @staticmethod
    def _used() -> int:
        vm = psutil.virtual_memory()
        return vm.total - vm.available

    def run(self) -> None:
        last_pss = -float("inf")
        while not self.done:
            try:
                procs = [psutil.Process(self.root_pid), *psutil.Process(self.root_pid).children(recursive=True)]
            except psutil.Error:
                break
            self.peak_used = max(self.peak_used, self._used() - self.baseline_used)
            if time.monotonic() - last_pss >= PSS_EVERY_S:
                last_pss, pss_sum = time.monotonic(), 0
                for proc in procs:
                    pss = pss_bytes(proc.pid) or 0
                    pss_sum += pss
                    self.pss_peaks[proc.pid] = max(self.pss_peaks.get(proc.pid, 0), pss)
                self.peak_pss_sum = max(self.peak_pss_sum, pss_sum)
            for proc in procs:
                try:
                    self.parents.setdefault(proc.pid, proc.ppid())
                except psutil.Error:
                    pass
                hwm = _hwm_bytes(proc.pid)
                if hwm:
                    self.peaks[proc.pid] = max(self.peaks.get(proc.pid, 0), hwm)
                    try:
                        title = " ".join(proc.cmdline())[:80]
                    except psutil.Error:
                        continue
                    known = re.match(r"ray::(\w+)", self.titles.get(proc.pid, ""))
                    if not (known and known.group(1) in ROLE_OF_ACTOR_CLASS):  # an idle worker becomes an actor
                        self.titles[proc.pid] = title
            time.sleep(0.2)

    def _role(self, pid: int) -> str | None:
        match = re.match(r"ray::(\w+)", self.titles.get(pid, ""))
        return ROLE_OF_ACTOR_CLASS.get(match.group(1)) if match else None

    def _role_ancestor(self, pid: int) -> int | None:
        """The role actor process `pid` descends from, if any."""
        seen = set()
        while pid in self.parents and pid not in seen:
            seen.add(pid)
            pid = self.parents[pid]
            if self._role(pid):
                return pid
        return None

    def by_role(self, pss: bool = False) -> dict[str, float]:
        """role+index -> peak bytes (VmHWM; `pss`: the sampled PSS peak) of that actor's own process;
        '<role><index> helpers' -> the summed peaks of the short-lived processes it starts (torch inductor's compile and ISA checks under a
        CPU vLLM engine: how many the poller catches alive depends on the machine's load, so they are
        reported apart, not planned); 'driver' -> everything else (run.py and Ray's own daemons)."""
        peaks = self.pss_peaks if pss else self.peaks
        measured, counts, names = {"driver": 0}, {}, {}
        for pid in sorted(self.peaks):
            role = self._role(pid)
            if role is not None:
                index = counts.get(role, 0)
                counts[role] = index + 1
                names[pid] = f"{role}{index}"
                measured[names[pid]] = peaks.get(pid, 0)
        for pid in sorted(self.peaks):
            if self._role(pid) is not None:
                continue
            owner = self._role_ancestor(pid)
            key = f"{names[owner]} helpers" if owner in names else "driver"
            measured[key] = measured.get(key, 0) + peaks.get(pid, 0)
        return measured


def run_polled(overrides: list[str], run_dir: Path) -> tuple[Poller, int, str]:
    """`run.py` with `overrides` into `run_dir`, its process tree polled while it runs: the poller,
    the exit code and the console output (its tail printed to stderr when the run failed)."""
    cmd = [sys.executable, str(ROOT / "run.py"), *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    poller = Poller(proc.pid)
    poller.start()
    out, _ = proc.communicate()
    poller.done = True
    poller.join()
    if proc.returncode != 0:
        print(out[-3000:], file=sys.stderr)
    return poller, proc.returncode, out


def measure(overrides: list[str], run_dir: Path) -> tuple[dict[str, float], dict[str, float], int, int, int]:
    """(VmHWM per process, sampled PSS peak per process, exit code, host memory used, peak summed PSS)."""
    poller, returncode, _ = run_polled([*overrides, *SHORT_RUN], run_dir)
    return poller.by_role(), poller.by_role(pss=True), returncode, poller.peak_used, poller.peak_pss_sum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument(
        "--work-dir",
        default=os.environ.get("RLHF_ORCH_BENCH_DIR", str(Path(tempfile.gettempdir()) / "rlhf_orch_bench_memory")),
    )
    parser.add_argument(
        "--gpu", action="store_true", help="measure on a CUDA GPU (scripts/bench/bench_gpu.py --parts memory)"
    )
    args = parser.parse_args()
    if args.gpu:
        sys.path.insert(0, str(ROOT / "scripts" / "bench"))
        from bench_gpu import main as bench_gpu_main

        sys.exit(bench_gpu_main(["--parts", "memory"]))
    work = Path(args.work_dir)
    qwen_dir = work / "qwen2_5_0_5b_shape"
    configs = configurations(str(qwen_dir))
    chosen = [c for c in args.only.split(",") if c] or list(configs)
    if any(name.startswith("qwen") for name in chosen):
        build_qwen_shape(qwen_dir)
    rows, errors, role_errors, hosts, helpers = [], [], [], [], []
    for name in chosen:
        pred, need, capacity = predicted(configs[name])
        meas, meas_pss, rc, used, pss_sum = measure(configs[name], work / "runs" / name)
        fits = need <= capacity
        # A plan that does not fit is run anyway (launcher.memory_check=warn): does the run agree?
        hosts.append(
            {
                "config": name,
                "host_need_gb": round(need / GB, 2),
                "host_capacity_gb": round(capacity / GB, 2),
                "plan_fits": fits,
                "host_used_gb": round(used / GB, 2),
                "summed_pss_gb": round(pss_sum / GB, 2),
                "exit": rc,
            }
        )
        verdict = "fits" if fits else "does NOT fit"
        print(
            f"{name:22s} host        need      {need / GB:6.2f} GB  of {capacity / GB:.2f} GB ({verdict})  used {used / GB:6.2f} GB  "
            f"(above the machine's use before the run)  summed PSS {pss_sum / GB:6.2f} GB  exit {rc}",
            flush=True,
        )
        for proc in sorted(pred, key=lambda k: (k != "driver", k)):
            m = meas.get(proc, 0)
            err = (pred[proc] - m) / m if m else float("nan")
            if m:
                errors.append(abs(err))
                if proc != "driver":
                    role_errors.append(abs(err))
            rows.append((name, proc, pred[proc] / GB, m / GB, err, rc, meas_pss.get(proc, 0) / GB))
            print(
                f"{name:22s} {proc:11s} predicted {pred[proc] / GB:6.2f} GB  measured {m / GB:6.2f} GB  error {err:+.1%}  "
                f"PSS {meas_pss.get(proc, 0) / GB:6.2f} GB  (exit {rc})",
                flush=True,
            )
        for proc in sorted(k for k in meas if k.endswith(" helpers")):
            print(f"{name:22s} {proc:11s} (not planned: short-lived) measured {meas[proc] / GB:6.2f} GB", flush=True)
            helpers.append({"config": name, "process": proc, "measured_gb": round(meas[proc] / GB, 3)})
    print()
    print(
        f"{'configuration':22s} {'process':11s} {'predicted GB':>12s} {'measured GB':>12s} {'error':>8s} {'PSS GB':>8s}"
    )
    for name, proc, p, m, err, rc, pss in rows:
        print(f"{name:22s} {proc:11s} {p:12.2f} {m:12.2f} {err:+8.1%} {pss:8.2f}")
    result = {
        "benchmark": "memory_plan",
        "configurations": chosen,
        "processes": len(errors),
        "max_abs_error_fraction": round(max(errors), 3) if errors else None,
        "mean_abs_error_fraction": round(sum(errors) / len(errors), 3) if errors else None,
        # Role actors alone; the driver row also holds Ray's own daemons, whose size varies run to run.
        "max_abs_error_fraction_roles": round(max(role_errors), 3) if role_errors else None,
        "goal_max_abs_error_fraction": 0.2,
        "hosts": hosts,
        "helpers": helpers,
        "rows": [
            {
                "config": n,
                "process": pr,
                "predicted_gb": round(p, 3),
                "measured_gb": round(m, 3),
                "measured_pss_gb": round(pss, 3),
                "exit": rc,
            }
            for n, pr, p, m, _, rc, pss in rows
        ],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
