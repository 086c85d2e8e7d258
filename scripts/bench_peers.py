"""rlhf_orch beside TRL on the same model, task and GRPO settings, and rlhf_orch beside its own parts.

    pip install -e '.[peers]'                    # TRL (not a runtime dependency)
    .venv/bin/python scripts/bench_peers.py      # both settings, two seeds each (~10 min here)
    .venv/bin/python scripts/bench_peers.py --settings default --seeds 0 --steps 10

Per setting, seed and system, the whole command is run as its own process tree and measured from
outside: time from the command to the first finished step (`startup_s`), wall per step after
`--skip` warm-up steps, generation tokens/s (generated tokens / time generating), trained tokens/s
(response tokens / wall per step), peak memory of all its processes (the sum of their RSS, sampled
every 0.2 s: Ray's GCS, raylet and workers included) and the reward of every step.

  rlhf_orch  `python run.py algo=grpo ...` (engine, policy and reference as Ray actors)
  trl        `scripts/peers/trl_grpo.py`: GRPOTrainer, one process, transformers' generate; the
             settings matched to ours are listed in that file, the prompts are the ones our run
             draws in the same order, the reward is our digit-task score.
  parts      `scripts/peers/bare_parts.py`: a bare vllm.LLM generating the same prompts + a bare
             PyTorch pass over the generated sequences; overhead_vs_parts = our wall per step /
             (generation + training alone), with our step's phases beside it.

Settings: `default` (the digit task as `python run.py algo=grpo` runs it) and `generation_heavy`
(every response 256 tokens: algo.min_response_len=256 on our side, min_new_tokens on TRL's).
Prints a table, writes rewards.png (both systems' reward curves) and summary.json to --out, and
ends with one JSON line: speedup_vs_trl_default (goal >= 1.0), speedup_vs_trl_generation_heavy
(goal >= 2.0), startup_s_ours (goal <= 10), startup_s_trl, reward_last_ours / reward_last_trl
(mean of the last 5 steps, per seed), overhead_vs_parts (goal <= 1.15; per setting too).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlhf_orch.logging.base import read_metrics  # noqa: E402

SETTINGS: dict[str, dict[str, Any]] = {
    "default": {"overrides": ["algo=grpo"], "steps": 30},
    "generation_heavy": {"overrides": ["algo=grpo", "algo.min_response_len=256", "data.response_max_len=256"], "steps": 8},
}
LAST = 5  # steps averaged for the final reward
TORCH_THREADS_TRL = os.cpu_count() or 1  # one process: TRL's default uses every core
TORCH_THREADS_TRAINER = 1  # rlhf_orch's trainer processes (TrainerSpec.torch_threads)


# --------------------------------------------------------------------------- measuring a command
class ProcessTreeMemory:
    """Peak of the summed RSS of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        import psutil

        self._root, self.peak_bytes, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)
        self._thread.start()

    def _sample(self, every_s: float) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self._root, *self._root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(every_s)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes / 2**30


def measure(cmd: list[str], is_step_line, log: Path) -> dict[str, Any]:
    """Run `cmd`; the time of its first finished step (first stdout line `is_step_line` accepts),
    its step lines, peak memory and wall time. Output is kept in `log`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    memory = ProcessTreeMemory(proc.pid)
    first, steps = None, []
    with open(log, "w") as out:
        for line in proc.stdout:
            out.write(line)
            if is_step_line(line):
                first = first if first is not None else time.perf_counter() - t0
                steps.append(line)
    code = proc.wait()
    peak = memory.stop()
    if code != 0:
        raise SystemExit(f"failed (exit {code}): {' '.join(cmd)}\n  see {log}")
    return {"startup_s": first, "steps": steps, "peak_gb": peak, "wall_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------- the shared inputs
def shared_inputs(overrides: list[str], steps: int, seed: int) -> dict[str, Any]:
    """Our composed config's settings, checkpoint and the prompts our run draws (in order)."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from rlhf_orch.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"seed={seed}"])
    model = instantiate(cfg.model)
    tokenizer = model.tokenizer()
    task = instantiate(cfg.data)
    task.bind(tokenizer)
    a, d = cfg.algo, cfg.data
    prompts = task.sample_prompts(a.rollout_batch_size * steps)
    return {
        "repo": str(REPO),
        "model_path": model.path(),
        "pad_id": tokenizer.pad_token_id,
        "seed": seed,
        "steps": steps,
        "prompts": [{"text": p.text, "label": p.label, "ids": list(p.prompt_ids)} for p in prompts],
        "settings": {
            "rollout_batch_size": a.rollout_batch_size, "samples_per_prompt": a.samples_per_prompt,
            "train_batch_size": a.train_batch_size, "micro_batch_size": a.micro_batch_size, "lr": a.actor_lr,
            "grad_clip": a.grad_clip, "response_max_len": d.response_max_len, "min_response_len": a.min_response_len,
            "temperature": a.temperature, "kl_coef": a.kl_coef, "clip": a.clip_low,
            "max_model_len": d.prompt_max_len + d.response_max_len,
        },
    }


# --------------------------------------------------------------------------- the three runs
def run_ours(setting: dict, steps: int, seed: int, out: Path, skip: int) -> dict[str, Any]:
    run_dir = out / f"ours_{setting['name']}_seed{seed}"
    cmd = [sys.executable, "run.py", *setting["overrides"], f"seed={seed}", f"algo.num_steps={steps}",
           "checkpoint.at_end=false", "checkpoint.export_final=false", "logger.plot_every_n_steps=0",
           f"hydra.run.dir={run_dir}"]
    m = measure(cmd, lambda line: line.startswith("step "), out / f"ours_{setting['name']}_seed{seed}.log")
    rows = read_metrics(run_dir)
    steady = rows[skip:]
    wall = (steady[-1]["time/elapsed"] - rows[skip - 1]["time/elapsed"]) / len(steady) if skip else steady[-1]["time/elapsed"] / len(steady)
    tokens = [r["response/mean_len"] * r["rollout/samples"] for r in steady]
    phases = {k: statistics.median(r.get(f"time/{k}", 0.0) for r in steady)
              for k in ("step", "generate", "hand_over", "experience", "train", "sync")}
    return {
        "startup_s": m["startup_s"], "peak_gb": m["peak_gb"], "wall_per_step_s": wall,
        "gen_tokens_per_s": sum(tokens) / sum(r["time/generate"] for r in steady),
        "trained_tokens_per_s": statistics.mean(tokens) / wall,
        "rewards": [r["reward/mean"] for r in rows], "phases": phases,
        "response_len": statistics.mean(r["response/mean_len"] for r in steady),
    }


def run_trl(spec: dict, setting: dict, seed: int, out: Path, skip: int) -> dict[str, Any]:
    spec = {**spec, "torch_threads": TORCH_THREADS_TRL, "output_dir": str(out / f"trl_{setting['name']}_seed{seed}")}
    spec_path = out / f"trl_{setting['name']}_seed{seed}.json"
    spec_path.write_text(json.dumps(spec))
    m = measure([sys.executable, "scripts/peers/trl_grpo.py", str(spec_path)], lambda line: line.startswith('{"step"'),
                out / f"trl_{setting['name']}_seed{seed}.log")
    rows = [json.loads(line) for line in m["steps"]]
    steady = rows[skip:]
    wall = (steady[-1]["t"] - rows[skip - 1]["t"]) / len(steady) if skip else steady[-1]["t"] / len(steady)
    return {
        "startup_s": m["startup_s"], "peak_gb": m["peak_gb"], "wall_per_step_s": wall,
        "gen_tokens_per_s": sum(r["gen_tokens"] for r in steady) / sum(r["gen_s"] for r in steady),
        "trained_tokens_per_s": statistics.mean(r["trained_tokens"] for r in steady) / wall,
        "rewards": [r["reward"] for r in rows],
        "response_len": statistics.mean(r["response_len"] for r in steady),
    }


def run_parts(spec: dict, setting: dict, out: Path, steps: int, skip: int) -> dict[str, float]:
    spec = {**spec, "steps": steps, "torch_threads": TORCH_THREADS_TRAINER}
    spec_path, sequences = out / f"parts_{setting['name']}.json", out / f"parts_{setting['name']}_sequences.json"
    spec_path.write_text(json.dumps(spec))
    timed = {}
    for part, key in (("generate", "gen_s"), ("train", "train_s")):
        m = measure([sys.executable, "scripts/peers/bare_parts.py", str(spec_path), part, str(sequences)],
                    lambda line: line.startswith("{"), out / f"parts_{setting['name']}_{part}.log")
        timed.update(json.loads(m["steps"][-1]))
    return {"gen_s": statistics.median(timed["gen_s"][skip:]), "train_s": statistics.median(timed["train_s"][skip:]),
            "response_len": timed["response_len"]}


# --------------------------------------------------------------------------- report
def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    colors = {"rlhf_orch": "tab:blue", "trl": "tab:orange"}
    for ax, (name, by_system) in zip(axes[0], results.items()):
        for system, runs in by_system.items():
            for seed, r in runs.items():
                ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], color=colors[system],
                        linestyle="-" if seed == min(runs) else "--", label=f"{system} seed {seed}")
        ax.set_title(f"{name}: GRPO reward per step")
        ax.set_xlabel("step")
        ax.set_ylabel("reward/mean")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: per setting, 30 / 8)")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the per-step figures")
    ap.add_argument("--parts-steps", type=int, default=4, help="steps the bare parts are timed over (the first is warm-up)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_peers" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    args = ap.parse_args()
    if importlib.util.find_spec("trl") is None:
        print("error: TRL is not installed; install the peers extra: pip install -e '.[peers]'", file=sys.stderr)
        raise SystemExit(2)
    import trl

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, dict[int, dict]]] = {}
    parts: dict[str, dict[str, float]] = {}
    for name in args.settings:
        setting = {**SETTINGS[name], "name": name}
        steps = args.steps or setting["steps"]
        results[name] = {"rlhf_orch": {}, "trl": {}}
        specs = {}
        for seed in args.seeds:
            specs[seed] = spec = shared_inputs(setting["overrides"], max(steps, args.parts_steps), seed)
            t = time.perf_counter()
            results[name]["rlhf_orch"][seed] = run_ours(setting, steps, seed, args.out, args.skip)
            print(f"  {name:16s} rlhf_orch seed {seed}: {steps} steps in {time.perf_counter() - t:.0f}s", flush=True)
            t = time.perf_counter()
            results[name]["trl"][seed] = run_trl({**spec, "steps": steps}, setting, seed, args.out, args.skip)
            print(f"  {name:16s} trl       seed {seed}: {steps} steps in {time.perf_counter() - t:.0f}s", flush=True)
        parts[name] = run_parts(specs[args.seeds[0]], setting, args.out, args.parts_steps, 1)

    print(f"\nrlhf_orch vs TRL {trl.__version__} (GRPO, tiny model, digit task; machine: {os.cpu_count()} cores, no GPU)")
    header = f"{'setting':17s}{'system':10s}{'seed':>5s}{'startup s':>10s}{'s/step':>8s}{'gen tok/s':>10s}{'train tok/s':>12s}{'peak GB':>8s}{'resp len':>9s}{'reward last':>12s}"
    print(header)
    print("-" * len(header))
    for name, by_system in results.items():
        for system, runs in by_system.items():
            for seed, r in runs.items():
                print(f"{name:17s}{system:10s}{seed:5d}{r['startup_s']:10.1f}{r['wall_per_step_s']:8.3f}{r['gen_tokens_per_s']:10.0f}"
                      f"{r['trained_tokens_per_s']:12.0f}{r['peak_gb']:8.2f}{r['response_len']:9.1f}{statistics.mean(r['rewards'][-LAST:]):12.3f}")
    print("\nrlhf_orch's step against its parts alone (median seconds; other = step - generate - hand-over - experience - train - sync)")
    print(f"{'setting':17s}{'step':>7s}{'gen':>7s}{'handover':>9s}{'exp':>7s}{'train':>7s}{'sync':>7s}{'other':>7s} | {'bare gen':>9s}{'bare train':>11s}{'overhead':>9s}")
    overhead = {}
    for name in results:
        ours = results[name]["rlhf_orch"][args.seeds[0]]
        ph, p = ours["phases"], parts[name]
        other = ph["step"] - ph["generate"] - ph["hand_over"] - ph["experience"] - ph["train"] - ph["sync"]
        overhead[name] = ours["wall_per_step_s"] / (p["gen_s"] + p["train_s"])
        print(f"{name:17s}{ph['step']:7.3f}{ph['generate']:7.3f}{ph['hand_over']:9.3f}{ph['experience']:7.3f}{ph['train']:7.3f}"
              f"{ph['sync']:7.3f}{other:7.3f} | {p['gen_s']:9.3f}{p['train_s']:11.3f}{overhead[name]:9.2f}")
    plot(results, args.out / "rewards.png")

    def mean_of(name: str, system: str, key: str) -> float:
        return statistics.mean(r[key] for r in results[name][system].values())

    summary: dict[str, Any] = {"trl_version": trl.__version__, "seeds": args.seeds, "out": str(args.out)}
    for name in results:
        summary[f"speedup_vs_trl_{name}"] = round(mean_of(name, "trl", "wall_per_step_s") / mean_of(name, "rlhf_orch", "wall_per_step_s"), 3)
        summary[f"overhead_vs_parts_{name}"] = round(overhead[name], 3)
        summary[f"reward_last_ours_{name}"] = [round(statistics.mean(r["rewards"][-LAST:]), 3) for r in results[name]["rlhf_orch"].values()]
        summary[f"reward_last_trl_{name}"] = [round(statistics.mean(r["rewards"][-LAST:]), 3) for r in results[name]["trl"].values()]
    first = "default" if "default" in results else next(iter(results))
    summary.update({
        "startup_s_ours": round(mean_of(first, "rlhf_orch", "startup_s"), 2),
        "startup_s_trl": round(mean_of(first, "trl", "startup_s"), 2),
        "reward_last_ours": summary[f"reward_last_ours_{first}"],
        "reward_last_trl": summary[f"reward_last_trl_{first}"],
        "overhead_vs_parts": summary[f"overhead_vs_parts_{first}"],
        "goals": {"speedup_vs_trl_default": 1.0, "speedup_vs_trl_generation_heavy": 2.0, "startup_s_ours": 10.0,
                  "overhead_vs_parts": 1.15},
    })
    (args.out / "summary.json").write_text(json.dumps({"summary": summary, "results": results, "parts": parts}, indent=2))
    print(f"\nplot: {args.out / 'rewards.png'}; everything: {args.out / 'summary.json'}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
