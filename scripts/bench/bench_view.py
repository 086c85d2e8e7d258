"""The run page at scale: a 1000-step run with 64 trajectories dumped per step, written and opened
in headless Chromium (the issue's bar: it opens in seconds; the file size stated).

The run dir is synthetic but in the dump's exact format (`logger.rollouts`: ids, token texts, loss
mask, advantage, engine and trainer log-probs, weight version per token), with --prompt-tokens +
--response-tokens per sequence, one in three trajectories multi-turn (an observation between two
model turns), and 60 metric keys a step. Measured: the dump's size on disk, the time to write the
page and its size (and again after one more step: what logger.report and --serve do in a long run),
then in the browser (the same process, one browser): the time until the page
is drawn, until step 500's table is drawn, and until a trajectory opens. Baseline in the same run:
the same page of a 3-step run (what the browser costs for any page). Limit: the big page drawn in
at most --limit-s seconds.

Usage: python scripts/bench/bench_view.py [--steps 1000] [--per-step 64] [--limit-s 10]
       (prints a table and one JSON line; ~3 min on the 2-core CPU machine, ~1 GB of temporary files)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

WORDS = [" the", " value", " of", " record", " is", " 4", " 2", " 7", " =", " call", " got", "\n", " so", " answer"]


def sequence(step: int, index: int, prompt_tokens: int, response_tokens: int, rng: random.Random) -> dict:
    multi = index % 3 == 0
    pieces = ["<|im_start|>", "user", "\n"] + [rng.choice(WORDS) for _ in range(prompt_tokens - 6)]
    pieces += ["<|im_end|>", "\n<|im_start|>assistant\n"]
    mask = [0] * len(pieces)
    obs = ["<|im_end|>", "\n<|im_start|>tool\n", " 4", " 2", "<|im_end|>", "\n<|im_start|>assistant\n"]
    model = response_tokens - (len(obs) if multi else 0)
    first = model // 2 if multi else model
    pieces += [rng.choice(WORDS) for _ in range(first)]
    mask += [1] * first
    if multi:
        pieces += obs + [rng.choice(WORDS) for _ in range(model - first)]
        mask += [0] * len(obs) + [1] * (model - first)
    n = len(pieces)
    reward = rng.random()
    return {
        "step": step, "index": index, "trajectory": index, "data_source": rng.choice(["lookup", "gsm8k"]),
        "turns": 2 if multi else 1, "reward": reward, "advantage": reward - 0.5,
        "response_tokens": sum(mask), "weight_version": step - 1, "truncated": rng.random() < 0.05,
        "interrupted": False, "errors": int(rng.random() < 0.03), "env": None,
        "prompt": "".join(pieces[: prompt_tokens]), "response": "".join(pieces[prompt_tokens:]), "text": "".join(pieces),
        "tokens": {
            "ids": [rng.randrange(49152) for _ in range(n)], "text": pieces, "loss_mask": mask,
            "advantage": [round(reward - 0.5 + rng.gauss(0, 0.1), 4) if m else 0.0 for m in mask],
            "engine_logprob": [round(-rng.random() * 3, 4) if m else 0.0 for m in mask],
            "trainer_logprob": [round(-rng.random() * 3, 4) if m else 0.0 for m in mask],
            "weight_version": [step - 1] * n,
        },
    }  # fmt: skip


def make_run(run_dir: Path, steps: int, per_step: int, prompt_tokens: int, response_tokens: int) -> int:
    rng = random.Random(0)
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("experiment_name: bench_view\n")
    (run_dir / "rollouts").mkdir()
    keys = [f"{topic}/k{j}" for topic in ("reward", "policy", "time", "rollout", "env", "perf") for j in range(10)]
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, **{k: rng.random() for k in keys}}) + "\n")
    size = 0
    for s in range(1, steps + 1):
        path = run_dir / "rollouts" / f"step_{s:06d}.jsonl"
        with open(path, "w") as f:
            for i in range(per_step):
                f.write(json.dumps(sequence(s, i, prompt_tokens, response_tokens, rng), separators=(",", ":")) + "\n")
        size += path.stat().st_size
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": steps}))
    return size


def measure(page_path: Path, browser, open_step: int) -> dict:
    from rlhf_orch.view.headless import file_url

    page = browser.page
    drawn = page.navigate(file_url(page_path))
    t = time.perf_counter()
    page.evaluate(
        f"(async () => {{ const e = document.getElementById('step'); e.value = '{open_step}';"
        " e.dispatchEvent(new Event('change')); })()"
    )
    if not page.wait_for(f"document.getElementById('traj-count').textContent.startsWith('step {open_step}:')", 120):
        raise RuntimeError(f"step {open_step}'s table was not drawn in 120 s")
    step_s = time.perf_counter() - t
    t = time.perf_counter()
    page.evaluate("document.querySelector('#traj-table tr.row').click()")
    if not page.wait_for("document.querySelector('#open-trajectory .tokens')", 120):
        raise RuntimeError("the trajectory did not open in 120 s")
    open_s = time.perf_counter() - t
    return {"drawn_s": drawn, "step_s": step_s, "trajectory_s": open_s, "errors": list(page.errors)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--per-step", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--response-tokens", type=int, default=120)
    parser.add_argument("--limit-s", type=float, default=10.0)
    args = parser.parse_args()

    from rlhf_orch.view.headless import Browser
    from rlhf_orch.view.page import write_report

    tmp = Path(tempfile.mkdtemp(prefix="bench-view-"))
    try:
        small, big = tmp / "small", tmp / "big"
        make_run(small, 3, args.per_step, args.prompt_tokens, args.response_tokens)
        t = time.perf_counter()
        dump_bytes = make_run(big, args.steps, args.per_step, args.prompt_tokens, args.response_tokens)
        made_s = time.perf_counter() - t
        t = time.perf_counter()
        small_page = write_report([small])
        small_write_s = time.perf_counter() - t
        t = time.perf_counter()
        big_page = write_report([big])
        big_write_s = time.perf_counter() - t
        # One more step dumped, the page written again (logger.report / --serve in a long run):
        # only the new step is read and compressed.
        rng = random.Random(1)
        with open(big / "rollouts" / f"step_{args.steps + 1:06d}.jsonl", "w") as f:
            for i in range(args.per_step):
                line = sequence(args.steps + 1, i, args.prompt_tokens, args.response_tokens, rng)
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
        t = time.perf_counter()
        write_report([big])
        rewrite_s = time.perf_counter() - t
        with Browser() as browser:
            baseline = measure(small_page, browser, 2)
            result = measure(big_page, browser, args.steps // 2)
        rows = [
            ("3-step run (baseline)", small_page.stat().st_size, small_write_s, baseline),
            (f"{args.steps}-step run", big_page.stat().st_size, big_write_s, result),
        ]
        print(f"{args.steps} steps x {args.per_step} sequences of {args.prompt_tokens}+{args.response_tokens} tokens;"
              f" dump {dump_bytes / 1e6:.0f} MB on disk (made in {made_s:.0f} s);"
              f" the page written again after one more step: {rewrite_s:.1f} s")  # fmt: skip
        print(f"{'page':<24}{'size MB':>10}{'write s':>10}{'drawn s':>10}{'step s':>9}{'open s':>9}")
        for name, size, write_s, m in rows:
            print(
                f"{name:<24}{size / 1e6:>10.1f}{write_s:>10.1f}{m['drawn_s']:>10.2f}{m['step_s']:>9.2f}{m['trajectory_s']:>9.2f}"
            )
        print(json.dumps({
            "bench": "view", "steps": args.steps, "per_step": args.per_step,
            "tokens_per_sequence": args.prompt_tokens + args.response_tokens,
            "dump_mb": round(dump_bytes / 1e6, 1), "page_mb": round(big_page.stat().st_size / 1e6, 1),
            "write_s": round(big_write_s, 2), "rewrite_s": round(rewrite_s, 2), "drawn_s": round(result["drawn_s"], 2),
            "step_open_s": round(result["step_s"], 3), "trajectory_open_s": round(result["trajectory_s"], 3),
            "baseline_drawn_s": round(baseline["drawn_s"], 2), "limit_drawn_s": args.limit_s,
            "within_limit": result["drawn_s"] <= args.limit_s, "js_errors": result["errors"] + baseline["errors"],
        }))  # fmt: skip
        return 0 if result["drawn_s"] <= args.limit_s and not result["errors"] else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
