"""Run dirs as a run leaves them, for the run page's tests: whole, half-written, empty, a sweep."""

from __future__ import annotations

import json
from pathlib import Path

CONFIG = "experiment_name: page_test\nalgo:\n  name: ppo\n  num_steps: 3\n"


def trajectory_line(step: int, index: int, reward: float, turns: int = 1, source: str = "digits", **extra) -> dict:
    """A dumped sequence in the dump's format: a prompt, then `turns` model turns with a tool
    observation between each two."""
    pieces, mask = ["<bos>", " find", " 3", " ="], [0, 0, 0, 0]
    for t in range(turns):
        if t:
            pieces += [" got", f" {index}", " ="]
            mask += [0, 0, 0]
        pieces += [" call" if t < turns - 1 else f" answer{index}", "<eos>"]
        mask += [1, 1]
    n = len(pieces)
    text = "".join(pieces)
    line = {
        "step": step,
        "index": index,
        "trajectory": index,
        "data_source": source,
        "turns": turns,
        "reward": reward,
        "advantage": reward - 0.5,
        "response_tokens": sum(mask),
        "weight_version": step - 1,
        "truncated": False,
        "interrupted": False,
        "errors": 0,
        "env": None,
        "prompt": "".join(pieces[:4]),
        "response": "".join(pieces[4:]),
        "text": text,
        "tokens": {
            "ids": list(range(n)),
            "text": pieces,
            "loss_mask": mask,
            "advantage": [round(reward - 0.5, 4) if m else 0.0 for m in mask],
            "engine_logprob": [-0.5 if m else 0.0 for m in mask],
            "trainer_logprob": [-0.5001 if m else 0.0 for m in mask],
            "weight_version": [step - 1] * n,
        },
    }
    line.update(extra)
    return line


def write_run(run_dir: Path, steps: int = 3, per_step: int = 4, summary: bool = True, overrides=()) -> Path:
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text(CONFIG)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides) or "[]\n")
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(
                json.dumps(
                    {
                        "step": s,
                        "reward/mean": 0.1 * s,
                        "time/step": 1.0,
                        "time/generate": 0.5,
                        "policy/grad_norm": 1.0 / s,
                        "kl": 0.001 * s,
                    }
                )
                + "\n"
            )
    (run_dir / "rollouts").mkdir(exist_ok=True)
    for s in range(1, steps + 1):
        lines = [
            trajectory_line(
                s,
                i,
                reward=i / max(per_step - 1, 1),
                turns=1 + i % 2,
                source="digits" if i % 2 else "lookup",
                truncated=i == 2,
                errors=int(i == 3),
                env={"tool_errors": 1.0, "turns": 2.0} if i == 3 else None,
            )
            for i in range(per_step)
        ]
        (run_dir / "rollouts" / f"step_{s:06d}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if summary:
        (run_dir / "summary.json").write_text(
            json.dumps(
                {"status": "completed", "steps": steps, "reward_first": 0.1, "reward_last": 0.1 * steps, "wall_s": 9.5}
            )
        )
    return run_dir


def wait_for(predicate, timeout_s: float) -> bool:
    """Whether `predicate()` became true within `timeout_s` (polled)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
