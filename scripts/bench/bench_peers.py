"""rlhf_orch beside TRL on the same model, task and GRPO settings, and rlhf_orch beside its own parts.

    pip install -e '.[peers]'                                  # TRL (not a runtime dependency)
    .venv/bin/python scripts/bench_peers.py                    # the tiny model: both settings, 2 seeds (~15 min here)
    .venv/bin/python scripts/bench_peers.py --model smollm2_135m   # SmolLM2-135M-Instruct (~75 min here)
    .venv/bin/python scripts/bench_peers.py --settings default --seeds 0 --steps 10
    .venv/bin/python scripts/bench_peers.py --model smollm2_135m --search   # which of our configurations is fastest

Per model, setting, seed and system, the whole command is run as its own process tree and measured
from outside: time from the command to the first finished step (`startup_s`), wall per step after
`--skip` warm-up steps (held-out evaluations left out, on both sides), generation tokens/s, trained
tokens/s (response tokens / wall per step), peak memory of all its processes (the sum of their RSS,
sampled every 0.2 s, and the sum of their PSS, every 2 s: Ray's GCS, raylet and workers included;
`process_memory.py`), the reward of every step and the
held-out score (before training and every few steps: the same prompts, samples per prompt,
temperature and reward on both sides) against steps and against training wall seconds.

  rlhf_orch  `python run.py ...` in two configurations: `best` (the fastest on this machine, found
             with --search: pipeline, trainer threads; `OURS_BEST` in scripts/bench/peers_settings.py) and `identical`
             (pipeline=sync: what the pipeline buys is the difference). Engine, policy and the
             reference inside the policy's process, as Ray actors.
  trl        `scripts/peers/trl_grpo.py`: GRPOTrainer, one process; the settings matched to ours
             are listed in that file, the prompts are the ones our run draws in the same order,
             the reward is our run's reward class. Generation: transformers' generate, or
             `--trl-generation paged` (TRL's use_transformers_paged).
  parts      (tiny model) `scripts/peers/bare_parts.py`: a bare vllm.LLM generating the same
             prompts + a bare PyTorch pass over the generated sequences; overhead_vs_parts = our
             wall per step / (generation + training alone), with our step's phases beside it.

Models and settings: `tiny` (the digit task as `python run.py algo=grpo` runs it) and `smollm2_135m`
(`experiment=smollm2_arith`: reasoning-gym sums, 4 prompts x 8 samples); `default` as configured,
`generation_heavy` with every response 256 tokens (algo.min_response_len=256 on our side,
min_new_tokens on TRL's). Prints tables, writes rewards.png (reward and held-out score per step
and per wall second) and summary.json to --out, and ends with one JSON line:
speedup_vs_trl_<setting> (tiny; goals >= 1.0 default, >= 1.0 generation-heavy) or
speedup_vs_trl_real_<setting> (SmolLM2; goals >= 2.5 default, >= 2.0 generation-heavy), each also
`_identical`, reward_per_wall_s_ours / _trl (held-out score gained per training wall second,
per seed), startup_s_ours (tiny default goal <= 10), peak_gb_ours (summed RSS; tiny default goal
<= 2.5) and peak_pss_gb_ours / _trl (summed PSS: a library or file page shared by several processes
counted once), startup_ratio_vs_trl, peak_gb_ratio_vs_trl and peak_pss_gb_ratio_vs_trl (ours / TRL's,
the first setting's; each setting's with its name appended; SmolLM2 goals <= 1.0, <= 1.5, <= 1.5),
reward_last_ours / _trl, overhead_vs_parts (tiny).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from process_memory import ProcessTreeMemory
from rlhf_orch.logging.base import read_metrics

from peers_settings import HELD_OUT, MODELS, OURS_BEST, SEARCH

LAST = 5  # steps averaged for the final reward
TORCH_THREADS_TRL = os.cpu_count() or 1  # one process: TRL's default uses every core
TORCH_THREADS_TRAINER = 1  # the bare parts' trainer thread (rlhf_orch's default TrainerSpec.torch_threads)


# --------------------------------------------------------------------------- measuring a command
def measure(cmd: list[str], is_step_line, log: Path, keep=lambda line: False) -> dict[str, Any]:
    """Run `cmd`; the time of its first finished step (first stdout line `is_step_line` accepts),
    its step lines (and the lines `keep` accepts, in order), peak memory (summed RSS and summed PSS
    of its process tree, GiB) and wall time. Output is kept in `log`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    memory = ProcessTreeMemory(proc.pid)
    first, steps, kept = None, [], []
    with open(log, "w") as out:
        for line in proc.stdout:
            out.write(line)
            if keep(line):
                kept.append(line)
            if is_step_line(line):
                first = first if first is not None else time.perf_counter() - t0
                steps.append(line)
    code = proc.wait()
    peak = memory.stop()
    if code != 0:
        raise SystemExit(f"failed (exit {code}): {' '.join(cmd)}\n  see {log}")
    return {
        "startup_s": first,
        "steps": steps,
        "kept": kept,
        "peak_gb": peak,
        "peak_pss_gb": memory.peak_pss_gb,
        "memory": memory.report(),
        "wall_s": time.perf_counter() - t0,
    }


# --------------------------------------------------------------------------- the shared inputs
def shared_inputs(overrides: list[str], steps: int, seed: int) -> dict[str, Any]:
    """Our composed config's settings, checkpoint, reward, the prompts our run draws (in order) and
    the held-out prompts its evaluation scores."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from rlhf_orch.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"seed={seed}"])
    model = instantiate(cfg.model)
    tokenizer = model.tokenizer()
    task = instantiate(cfg.data)
    task.bind(tokenizer)
    a, d, e = cfg.algo, cfg.data, cfg.eval
    prompts = task.sample_prompts(a.rollout_batch_size * steps)
    held_out = task.eval_prompts(e.num_prompts)
    reward = OmegaConf.to_container(cfg.reward, resolve=True)
    target = reward.pop("_target_")
    for key in ("timeout_s", "pool_size"):  # how our rule runs, not its arguments
        reward.pop(key, None)
    return {
        "repo": str(REPO),
        "model_path": model.path(),
        "pad_id": tokenizer.pad_token_id,
        "seed": seed,
        "steps": steps,
        "prompts": [{"text": p.text, "label": p.label, "ids": list(p.prompt_ids)} for p in prompts],
        "reward": {"target": target, "kwargs": reward},
        "eval": {
            "prompts": [{"text": p.text, "label": p.label, "ids": list(p.prompt_ids)} for p in held_out],
            "samples_per_prompt": e.samples_per_prompt,
            "temperature": e.temperature,
            "before_train": e.before_train,
            "every": e.every_n_steps,
        },
        "settings": {
            "rollout_batch_size": a.rollout_batch_size,
            "samples_per_prompt": a.samples_per_prompt,
            "train_batch_size": a.train_batch_size,
            "micro_batch_size": a.micro_batch_size,
            "lr": a.actor_lr,
            "grad_clip": a.grad_clip,
            "response_max_len": d.response_max_len,
            "min_response_len": a.min_response_len,
            "temperature": a.temperature,
            "kl_coef": a.kl_coef,
            "clip": a.clip_low,
            "max_model_len": d.prompt_max_len + d.response_max_len,
        },
    }


# --------------------------------------------------------------------------- the runs
def _wall_per_step(walls: list[float], skip: int) -> float:
    """Mean training wall per step after `skip` warm-up steps (`walls`: cumulative, per step)."""
    if skip and len(walls) > skip:
        return (walls[-1] - walls[skip - 1]) / (len(walls) - skip)
    return walls[-1] / len(walls)


def run_ours(name: str, overrides: list[str], steps: int, seed: int, out: Path, skip: int) -> dict[str, Any]:
    run_dir = out / f"{name}_seed{seed}"
    cmd = [
        sys.executable,
        "run.py",
        *overrides,
        f"seed={seed}",
        f"algo.num_steps={steps}",
        "checkpoint.at_end=false",
        "checkpoint.export_final=false",
        "logger.plot_every_n_steps=0",
        f"hydra.run.dir={run_dir}",
    ]
    # (a training step's console line; "step    0/N" is the evaluation before training)
    m = measure(
        cmd,
        lambda line: line.startswith("step ") and not line.split()[1].startswith("0/"),
        out / f"{name}_seed{seed}.log",
    )
    rows = read_metrics(run_dir)
    train = [r for r in rows if r.get("step", 0) >= 1]
    startup_in_run = train[0]["time/startup"]
    # Training wall at the end of each step: the run's clock from its start, less the start-up and
    # every held-out evaluation so far (time/elapsed is taken after a step's evaluation).
    eval_so_far, walls, evals = 0.0, [], []
    for r in rows:
        eval_so_far += r.get("time/eval", 0.0)
        wall = r["time/elapsed"] - startup_in_run - eval_so_far if r.get("step", 0) >= 1 else 0.0
        if r.get("step", 0) >= 1:
            walls.append(wall)
        score = next((v for k, v in r.items() if k.startswith("eval/") and "/mean@" in k), None)
        if score is not None:
            evals.append({"step": r.get("step", 0), "wall_s": wall, "score": score})
    steady = train[skip:]
    tokens = [r["response/mean_len"] * r["rollout/samples"] for r in steady]
    wall = _wall_per_step(walls, skip)
    phases = {
        k: statistics.median(r.get(f"time/{k}", 0.0) for r in steady)
        for k in ("step", "generate", "hand_over", "experience", "train", "sync")
    }
    before = rows[0].get("time/eval", 0.0) if rows[0].get("step", 0) == 0 else 0.0
    return {  # start-up: command to first step, less the evaluation before training (both sides)
        "overrides": overrides,
        "startup_s": m["startup_s"] - before,
        "peak_gb": m["peak_gb"],
        "peak_pss_gb": m["peak_pss_gb"],
        "memory": m["memory"],
        "wall_per_step_s": wall,
        "gen_tokens_per_s": sum(tokens) / sum(r["time/generate"] for r in steady),
        "trained_tokens_per_s": statistics.mean(tokens) / wall,
        "rewards": [r["reward/mean"] for r in train],
        "walls": walls,
        "evals": evals,
        "phases": phases,
        "response_len": statistics.mean(r["response/mean_len"] for r in steady),
    }


def run_trl(spec: dict, name: str, seed: int, out: Path, skip: int, generation: str) -> dict[str, Any]:
    spec = {
        **spec,
        "torch_threads": TORCH_THREADS_TRL,
        "generation": generation,
        "output_dir": str(out / f"{name}_seed{seed}"),
    }
    spec_path = out / f"{name}_seed{seed}.json"
    spec_path.write_text(json.dumps(spec))
    m = measure(
        [sys.executable, "scripts/peers/trl_grpo.py", str(spec_path)],
        lambda line: line.startswith('{"step"'),
        out / f"{name}_seed{seed}.log",
        keep=lambda line: line.startswith('{"'),
    )
    lines = [json.loads(line) for line in m["kept"]]
    begin = next(line["train_begin"] for line in lines if "train_begin" in line)
    # Training wall at each step: from train_begin (after the evaluation before training), less the
    # evaluations since; an evaluation's wall is its step's.
    evals_since, walls, evals, rows = 0.0, [], [], []
    for line in lines:
        if "eval_step" in line:
            evals_since += line["eval_s"] if line["eval_step"] else 0.0
            evals.append(
                {"step": line["eval_step"], "wall_s": walls[-1] if line["eval_step"] else 0.0, "score": line["score"]}
            )
        elif "step" in line:
            rows.append(line)
            walls.append(line["t"] - begin - evals_since)
    before = next((line["eval_s"] for line in lines if line.get("eval_step") == 0), 0.0)
    steady = rows[skip:]
    wall = _wall_per_step(walls, skip)
    return {
        "generation": generation,
        "startup_s": m["startup_s"] - before,
        "peak_gb": m["peak_gb"],
        "peak_pss_gb": m["peak_pss_gb"],
        "memory": m["memory"],
        "wall_per_step_s": wall,
        "gen_tokens_per_s": sum(r["gen_tokens"] for r in steady) / sum(r["gen_s"] for r in steady),
        "trained_tokens_per_s": statistics.mean(r["trained_tokens"] for r in steady) / wall,
        "rewards": [r["reward"] for r in rows],
        "walls": walls,
        "evals": evals,
        "response_len": statistics.mean(r["response_len"] for r in steady),
    }


def run_parts(spec: dict, name: str, out: Path, steps: int, skip: int) -> dict[str, float]:
    spec = {**spec, "steps": steps, "torch_threads": TORCH_THREADS_TRAINER}
    spec_path, sequences = out / f"parts_{name}.json", out / f"parts_{name}_sequences.json"
    spec_path.write_text(json.dumps(spec))
    timed = {}
    for part, key in (("generate", "gen_s"), ("train", "train_s")):
        m = measure(
            [sys.executable, "scripts/peers/bare_parts.py", str(spec_path), part, str(sequences)],
            lambda line: line.startswith("{"),
            out / f"parts_{name}_{part}.log",
        )
        timed.update(json.loads(m["steps"][-1]))
    return {
        "gen_s": statistics.median(timed["gen_s"][skip:]),
        "train_s": statistics.median(timed["train_s"][skip:]),
        "response_len": timed["response_len"],
    }


# --------------------------------------------------------------------------- report
COLORS = {"ours_best": "tab:blue", "ours_identical": "tab:green", "trl": "tab:orange"}


def plot(results: dict, path: Path, label: str) -> None:
    """Per setting: the reward per step, the held-out score per step and per training wall second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 3, figsize=(17, 4 * len(results)), squeeze=False)
    for row, (name, by_system) in zip(axes, results.items()):
        for system, runs in by_system.items():
            for seed, r in runs.items():
                style = {
                    "color": COLORS[system],
                    "linestyle": "-" if seed == min(runs) else "--",
                    "label": f"{system} seed {seed}",
                }
                row[0].plot(range(1, len(r["rewards"]) + 1), r["rewards"], **style)
                if r["evals"]:
                    row[1].plot([e["step"] for e in r["evals"]], [e["score"] for e in r["evals"]], marker="o", **style)
                    row[2].plot(
                        [e["wall_s"] for e in r["evals"]], [e["score"] for e in r["evals"]], marker="o", **style
                    )
        for ax, (title, xlabel, ylabel) in zip(
            row,
            (
                ("training reward per step", "step", "reward/mean"),
                ("held-out score per step", "step", "held-out mean@k"),
                ("held-out score per training wall second", "training wall s (no evaluation)", "held-out mean@k"),
            ),
        ):
            ax.set_title(f"{name}: {title}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=8)
    fig.suptitle(f"rlhf_orch vs TRL, GRPO, {label}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def gain_per_wall_s(r: dict) -> float | None:
    """Held-out score gained from before training to the last evaluation, per training wall second."""
    evals = r["evals"]
    if len(evals) < 2 or evals[-1]["wall_s"] <= 0:
        return None
    return (evals[-1]["score"] - evals[0]["score"]) / evals[-1]["wall_s"]


def _keep(out: Path, name: str, result: dict) -> None:
    """Each run's figures as soon as it ends (a benchmark cut short keeps what it measured)."""
    (out / f"{name}.result.json").write_text(json.dumps(result, indent=1))


def search(args, model: dict, out: Path) -> None:
    """Each SEARCH configuration for --search-steps steps, one seed: wall per step after one warm-up."""
    print(
        f"searching our configurations ({args.search_steps} steps each, seed {args.seeds[0]}; per-step wall after 1 warm-up step)"
    )
    rows = []
    for name in args.settings:
        setting = model["settings"][name]
        for index, (label, extra) in enumerate(SEARCH.items()):
            if args.search_configs and label not in args.search_configs:
                continue
            overrides = [
                *model["base"],
                *setting["overrides"],
                *extra,
                "eval.before_train=false",
                "eval.every_n_steps=0",
            ]
            tag = f"search_{name}_{index}_{label.split(',')[0].split(' ')[0]}_{extra[1].split('=')[1]}t"
            try:
                r = run_ours(tag, overrides, args.search_steps, args.seeds[0], out, 1)
            except SystemExit as e:
                print(f"  {name:17s} {label:40s} failed: {str(e).splitlines()[0]}")
                continue
            rows.append(
                {
                    "setting": name,
                    "config": label,
                    "overrides": extra,
                    "wall_per_step_s": r["wall_per_step_s"],
                    "phases": r["phases"],
                    "peak_gb": r["peak_gb"],
                    "peak_pss_gb": r["peak_pss_gb"],
                    "memory": r["memory"],  # per process kind at the peaks
                }
            )
            print(
                f"  {name:17s} {label:40s} {r['wall_per_step_s']:8.2f} s/step  (gen {r['phases']['generate']:.2f}, "
                f"train {r['phases']['train']:.2f}; peak {r['peak_gb']:.2f} GB RSS, {r['peak_pss_gb']:.2f} GB PSS)",
                flush=True,
            )
    (out / "search.json").write_text(json.dumps(rows, indent=2))
    print(json.dumps({"search": {f"{r['setting']}: {r['config']}": round(r["wall_per_step_s"], 3) for r in rows}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=list(MODELS))
    ap.add_argument(
        "--settings", nargs="+", default=["default", "generation_heavy"], choices=["default", "generation_heavy"]
    )
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: per model and setting)")
    ap.add_argument(
        "--skip",
        type=int,
        default=None,
        help="warm-up steps left out of the per-step figures (default 2 tiny, 1 SmolLM2)",
    )
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["best", "identical"],
        choices=["best", "identical"],
        help="our configurations: best (OURS_BEST) and identical (pipeline=sync); run once when they are the same",
    )
    ap.add_argument("--trl-generation", default="generate", choices=["generate", "paged"])
    ap.add_argument(
        "--parts-steps",
        type=int,
        default=4,
        help="steps the bare parts are timed over (tiny model; the first is warm-up)",
    )
    ap.add_argument("--search", action="store_true", help="time our SEARCH configurations instead of the comparison")
    ap.add_argument("--search-steps", type=int, default=3)
    ap.add_argument("--search-configs", nargs="+", default=None, help="which SEARCH entries (default: all)")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_peers" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    args = ap.parse_args()
    model = MODELS[args.model]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.search:
        search(args, model, args.out)
        return
    if importlib.util.find_spec("trl") is None:
        print("error: TRL is not installed; install the peers extra: pip install -e '.[peers]'", file=sys.stderr)
        raise SystemExit(2)
    import trl

    skip = args.skip if args.skip is not None else (2 if args.model == "tiny" else 1)
    too_short = [name for name in args.settings if (args.steps or model["settings"][name]["steps"]) <= skip]
    if too_short:
        print(f"error: --steps must be more than the {skip} warm-up steps left out (--skip)", file=sys.stderr)
        raise SystemExit(2)
    results: dict[str, dict[str, dict[int, dict]]] = {}
    parts: dict[str, dict[str, float]] = {}
    for name in args.settings:
        setting = model["settings"][name]
        steps = args.steps or setting["steps"]
        every = setting["eval_every"] if steps % setting["eval_every"] == 0 else steps  # the last step is evaluated
        configured = [
            *model["base"],
            *setting["overrides"],
            *HELD_OUT,
            *setting["eval"],
            f"eval.every_n_steps={every}",
        ]
        variants = {"ours_identical": [*configured, "pipeline=sync"]} if "identical" in args.variants else {}
        best = [*configured, *OURS_BEST[args.model][name]]
        if "best" in args.variants and best != variants.get("ours_identical"):
            variants = {"ours_best": best, **variants}
        results[name] = {v: {} for v in variants} | {"trl": {}}
        for seed in args.seeds:
            spec = shared_inputs(configured, max(steps, args.parts_steps), seed)
            for variant, overrides in variants.items():
                t = time.perf_counter()
                results[name][variant][seed] = run_ours(f"{variant}_{name}", overrides, steps, seed, args.out, skip)
                _keep(args.out, f"{variant}_{name}_seed{seed}", results[name][variant][seed])
                print(
                    f"  {name:17s} {variant:15s} seed {seed}: {steps} steps in {time.perf_counter() - t:.0f}s",
                    flush=True,
                )
            t = time.perf_counter()
            results[name]["trl"][seed] = run_trl(
                {**spec, "steps": steps}, f"trl_{name}", seed, args.out, skip, args.trl_generation
            )
            _keep(args.out, f"trl_{name}_seed{seed}", results[name]["trl"][seed])
            print(f"  {name:17s} {'trl':15s} seed {seed}: {steps} steps in {time.perf_counter() - t:.0f}s", flush=True)
            if args.model == "tiny" and seed == args.seeds[0]:
                parts[name] = run_parts(spec, name, args.out, args.parts_steps, 1)

    print(f"\nrlhf_orch vs TRL {trl.__version__} (GRPO, {model['label']}; machine: {os.cpu_count()} cores, no GPU)")
    header = (
        f"{'setting':17s}{'system':15s}{'seed':>5s}{'startup s':>10s}{'s/step':>8s}{'gen tok/s':>10s}{'train tok/s':>12s}"
        f"{'peak GB':>8s}{'PSS GB':>8s}{'resp len':>9s}{'reward last':>12s}{'held-out':>18s}{'gain/wall s':>12s}"
    )
    print(header)
    print("-" * len(header))
    for name, by_system in results.items():
        for system, runs in by_system.items():
            for seed, r in runs.items():
                held = f"{r['evals'][0]['score']:.3f} -> {r['evals'][-1]['score']:.3f}" if r["evals"] else "-"
                gain = gain_per_wall_s(r)
                print(
                    f"{name:17s}{system:15s}{seed:5d}{r['startup_s']:10.1f}{r['wall_per_step_s']:8.3f}{r['gen_tokens_per_s']:10.0f}"
                    f"{r['trained_tokens_per_s']:12.0f}{r['peak_gb']:8.2f}{r['peak_pss_gb']:8.2f}{r['response_len']:9.1f}{statistics.mean(r['rewards'][-LAST:]):12.3f}"
                    f"{held:>18s}{(f'{gain:.2e}' if gain is not None else '-'):>12s}"
                )
    print("\nour step's phases (median seconds; other = step - generate - hand-over - experience - train - sync)")
    print(
        f"{'setting':17s}{'system':15s}{'step':>7s}{'gen':>7s}{'handover':>9s}{'exp':>7s}{'train':>7s}{'sync':>7s}{'other':>7s}"
    )
    for name, by_system in results.items():
        for system, runs in by_system.items():
            if system == "trl":
                continue
            ph = runs[args.seeds[0]]["phases"]
            other = ph["step"] - ph["generate"] - ph["hand_over"] - ph["experience"] - ph["train"] - ph["sync"]
            # Under one_step_off / async the next rollout generates while this step trains: no remainder to show.
            # (medians of the parts need not add up exactly: a small negative remainder reads 0)
            other_text = f"{max(other, 0.0):7.3f}" if other > -0.05 * ph["step"] else f"{'overlap':>8s}"
            print(
                f"{name:17s}{system:15s}{ph['step']:7.3f}{ph['generate']:7.3f}{ph['hand_over']:9.3f}{ph['experience']:7.3f}"
                f"{ph['train']:7.3f}{ph['sync']:7.3f}{other_text}"
            )
    overhead = {}
    if parts:
        print(
            "\nrlhf_orch (identical: pipeline=sync) against its parts alone (median s; bare vLLM with our block size 32)"
        )
        for name in parts:
            if "ours_identical" not in results[name]:
                continue
            ours, p = results[name]["ours_identical"][args.seeds[0]], parts[name]
            overhead[name] = ours["wall_per_step_s"] / (p["gen_s"] + p["train_s"])
            print(
                f"{name:17s} step {ours['wall_per_step_s']:.3f} | bare gen {p['gen_s']:.3f} bare train {p['train_s']:.3f} | overhead {overhead[name]:.2f}"
            )
    plot(results, args.out / "rewards.png", model["label"])

    def mean_of(name: str, system: str, key: str) -> float:
        return statistics.mean(r[key] for r in results[name][system].values())

    ours = {name: "ours_best" if "ours_best" in results[name] else "ours_identical" for name in results}
    key = model["key"]
    summary: dict[str, Any] = {
        "model": args.model,
        "trl_version": trl.__version__,
        "trl_generation": args.trl_generation,
        "seeds": args.seeds,
        "out": str(args.out),
    }
    for name in results:
        trl_wall = mean_of(name, "trl", "wall_per_step_s")
        summary[f"speedup_vs_trl_{key}{name}"] = round(trl_wall / mean_of(name, ours[name], "wall_per_step_s"), 3)
        if "ours_identical" in results[name]:
            summary[f"speedup_vs_trl_{key}{name}_identical"] = round(
                trl_wall / mean_of(name, "ours_identical", "wall_per_step_s"), 3
            )
        summary[f"ours_config_{name}"] = OURS_BEST[args.model][name] if ours[name] == "ours_best" else ["pipeline=sync"]
        for system, tag in ((ours[name], "ours"), ("trl", "trl")):
            runs = results[name][system].values()
            summary[f"reward_last_{tag}_{name}"] = [round(statistics.mean(r["rewards"][-LAST:]), 3) for r in runs]
            gains = [gain_per_wall_s(r) for r in runs]
            summary[f"reward_per_wall_s_{tag}_{name}"] = [round(g, 6) if g is not None else None for g in gains]
            summary[f"held_out_{tag}_{name}"] = [
                [round(r["evals"][0]["score"], 3), round(r["evals"][-1]["score"], 3)] if r["evals"] else None
                for r in runs
            ]
        if name in overhead:
            summary[f"overhead_vs_parts_{name}"] = round(overhead[name], 3)
    first = "default" if "default" in results else next(iter(results))
    summary.update(
        {
            "startup_s_ours": round(mean_of(first, ours[first], "startup_s"), 2),
            "startup_s_trl": round(mean_of(first, "trl", "startup_s"), 2),
            "peak_gb_ours": round(mean_of(first, ours[first], "peak_gb"), 2),
            "peak_gb_trl": round(mean_of(first, "trl", "peak_gb"), 2),
            "peak_pss_gb_ours": round(mean_of(first, ours[first], "peak_pss_gb"), 2),
            "peak_pss_gb_trl": round(mean_of(first, "trl", "peak_pss_gb"), 2),
            "reward_last_ours": summary[f"reward_last_ours_{first}"],
            "reward_last_trl": summary[f"reward_last_trl_{first}"],
            "reward_per_wall_s_ours": summary[f"reward_per_wall_s_ours_{first}"],
            "reward_per_wall_s_trl": summary[f"reward_per_wall_s_trl_{first}"],
        }
    )
    # Start-up and memory against TRL's, the same measure on both sides, per setting (the first's unsuffixed).
    for name in results:
        for measure in ("startup_s", "peak_gb", "peak_pss_gb"):
            theirs = mean_of(name, "trl", measure)  # (0 where PSS could not be read: no ratio, no crash)
            ratio = round(mean_of(name, ours[name], measure) / theirs, 3) if theirs > 0 else None
            summary[f"{measure.removesuffix('_s')}_ratio_vs_trl_{name}"] = ratio
            if name == first:
                summary[f"{measure.removesuffix('_s')}_ratio_vs_trl"] = ratio
    if first in overhead:
        summary["overhead_vs_parts"] = overhead[first]
    same_as_trl = {"startup_ratio_vs_trl": 1.0, "peak_gb_ratio_vs_trl": 1.5, "peak_pss_gb_ratio_vs_trl": 1.5}
    summary["goals"] = (
        {"speedup_vs_trl_real_default": 2.5, "speedup_vs_trl_real_generation_heavy": 2.0, **same_as_trl}
        if key
        else {
            "speedup_vs_trl_default": 1.0,
            "speedup_vs_trl_generation_heavy": 1.0,
            "startup_s_ours": 10.0,
            "peak_gb_ours": 2.5,
            "overhead_vs_parts": 1.15,
        }
    )
    (args.out / "summary.json").write_text(
        json.dumps({"summary": summary, "results": results, "parts": parts}, indent=2)
    )
    print(f"\nplot: {args.out / 'rewards.png'}; everything: {args.out / 'summary.json'}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
