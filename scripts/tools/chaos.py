"""A run under a seeded schedule of faults ends as the same run undisturbed.

Two runs of the same config in one Ray session: undisturbed, then with faults injected from a
seeded random schedule, at least one of each kind:

  generation  an engine is killed while it generates (a timer fires 0-200 ms into the rollout):
              replaced in its bundle, its prompts made again (fault.max_engine_restarts)
  sync        an engine is killed as the trainers push the step's weights: replaced, the groups
              formed again, the same version pushed (fault.max_engine_restarts)
  evaluation  an engine is killed just before the step's evaluation: every role restarts from the
              last checkpoint (fault.max_trainer_restarts)
  trainer     a policy rank is killed between steps: every role restarts from the last checkpoint
              (fault.max_trainer_restarts)
  update      a policy rank is killed while the trainers update (its train call in flight, the
              critic's too): every role restarts from the last checkpoint, and nothing is
              checkpointed from the half-made update

Each fault fires once (a step re-run after a restart is not hit again). The run must finish every
step, count what happened (`fault/engine_restarts`, `fault/trainer_restarts`), train every sample
of every step exactly once, and log the undisturbed run's metrics for every step (wall-clock
figures and the fault counters aside) -- except under `pipeline=async` with `max_staleness` > 0,
whose sampling depends on timing by design: there the verdict is every step completed with every
sample once and the reward within the seed-to-seed spread: undisturbed runs with seeds 1..K
(`--spread-seeds`, default 3 there) measure how far another seed's run lies from the undisturbed
one (run-mean reward, and the mean per-step distance of the reward curve); the chaos run must lie
no farther than the farthest of them on both.

With `--outside engine:3,trainer:1` the faults come instead from outside the run, at random wall-clock
times (seeded, within 5-80 % of the undisturbed run's training time, counted from the first step), as an operator's `kill` or a
node's OOM killer would: each kills the current attempt's engine or policy rank whatever it is
doing -- generating, training, receiving weights, handing over. `--default-budgets` leaves
fault.max_engine_restarts / max_trainer_restarts at their defaults (3 / 2) instead of one per fault.

    .venv/bin/python scripts/chaos.py                      # 40 steps, seed 0, 6 faults
    .venv/bin/python scripts/chaos.py --steps 20 --faults 4 --seed 3
    .venv/bin/python scripts/chaos.py pipeline=one_step_off   # any overrides, for both runs
    .venv/bin/python scripts/chaos.py pipeline=async pipeline.max_staleness=2 algo.decoupled_is_cap=5
    .venv/bin/python scripts/chaos.py --steps 30 --outside engine:3,trainer:1 --default-budgets \
        pipeline=async pipeline.max_staleness=2 algo.decoupled_is_cap=5

Prints the schedule, what each fault cost, and a JSON line: `passed` (the verdict),
`steps_completed`, `metrics_equal`, `every_sample_once`, `engine_restarts`, `trainer_restarts`,
`steps_rerun`, `wall_s_undisturbed`, `wall_s_chaos`, `reward_within_seed_spread`. Exit 0 only when every fault fired and every step
completed with equal metrics (async: every sample once and the reward within the seed spread).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from rlhf_orch.logging.base import read_metrics

KINDS = ("generation", "sync", "evaluation", "trainer", "update")
# Wall-clock figures differ between any two runs; the fault counters differ by design.
UNCOMPARED = ("time/", "perf/", "share/", "sync/gb_per_s", "transfer/metadata", "fault/")


@dataclass
class Fault:
    step: int  # the step it hits
    kind: str
    target: int  # engine or policy rank
    delay_s: float = 0.0  # generation: into the rollout
    fired_at: float | None = None  # wall clock (perf_counter) when it fired


def schedule(steps: int, faults: int, seed: int, engines: int, policy_ranks: int, eval_every: int) -> list[Fault]:
    """`faults` faults on distinct steps in 2..steps, every kind at least once (evaluation on
    steps with an evaluation)."""
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(max(0, faults - len(KINDS)))]
    rng.shuffle(kinds)
    free = list(range(2, steps + 1))
    evals = [s for s in free if s % eval_every == 0]
    out = []
    for kind in kinds:
        pool = [s for s in (evals if kind == "evaluation" else free) if s in free]
        step = rng.choice(pool)
        free.remove(step)
        target = rng.randrange(policy_ranks if kind in ("trainer", "update") else engines)
        out.append(Fault(step, kind, target, delay_s=rng.uniform(0.0, 0.2) if kind == "generation" else 0.0))
    return sorted(out, key=lambda f: f.step)


class Injector:
    """The run's callback: after step k-1 it arms the faults of step k on that attempt's loop."""

    def __init__(self, faults: list[Fault]):
        self.by_step = {f.step: f for f in faults}

    # Generation faults are armed this many steps early: under pipeline=one_step_off step k's
    # rollout is requested while step k-1 trains, under async (max_staleness <= 2) up to 3 steps ahead.
    GENERATION_LEAD = 4

    def __call__(self, step: int, loop: Any) -> None:
        for ahead in range(1, self.GENERATION_LEAD + 1):
            fault = self.by_step.get(step + ahead)
            if fault is not None and (ahead == 1 or fault.kind == "generation") and fault.fired_at is None:
                armed = vars(loop).setdefault(
                    "_chaos_armed", set()
                )  # on the loop: once per attempt (a restart builds a new one)
                if fault.step not in armed:
                    armed.add(fault.step)
                    self._arm(fault, loop)

    def _arm(self, fault: Fault, loop: Any) -> None:
        import ray

        def fire(actor) -> None:
            if fault.fired_at is None:
                fault.fired_at = time.perf_counter()
                ray.kill(actor)

        if fault.kind == "trainer":
            fire(loop.actors.policy[fault.target])
        elif fault.kind == "update":
            update = loop._update

            def update_with_a_lost_rank(policy_calls, critic_calls):
                if loop.trained == fault.step - 1:  # step k's update: its train calls are in flight
                    fire(loop.actors.policy[fault.target])
                return update(policy_calls, critic_calls)

            loop._update = update_with_a_lost_rank
        elif fault.kind == "generation":
            request = loop.rollout_request

            def rollout_request(s: int):
                if s == fault.step and fault.fired_at is None:
                    threading.Timer(fault.delay_s, fire, args=(loop.actors.engines[fault.target],)).start()
                return request(s)

            loop.rollout_request = rollout_request
        elif fault.kind == "sync":
            sync_engines = loop.sync_engines

            def sync_with_a_lost_engine(timings):
                if loop.trained == fault.step:
                    fire(loop.actors.engines[fault.target])
                    _wait_until_dead(loop.actors.engines[fault.target])
                return sync_engines(timings)

            loop.sync_engines = sync_with_a_lost_engine
        elif fault.kind == "evaluation":
            train_step = loop.step

            def step_then_lose_an_engine(s: int):
                metrics = train_step(s)
                if s == fault.step:  # the evaluation runs next, on the engines
                    fire(loop.actors.engines[fault.target])
                    _wait_until_dead(loop.actors.engines[fault.target])
                return metrics

            loop.step = step_then_lose_an_engine


class OutsideKiller:
    """Kills from outside the run at seeded times: `(seconds after the first step, role, index)`,
    each on the actors of whichever attempt is running then (a callback keeps the latest loop). A
    kill waits for a live target: one whose process an earlier kill took down counts once it was
    replaced (a kill of a dead process would kill nothing)."""

    def __init__(self, kills: list[tuple[float, str, int]]):
        self.kills = sorted(kills)
        self.loop: Any = None
        self.fired: list[tuple[float, str, int]] = []
        self._dead: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0: float | None = None

    def __call__(self, step: int, loop: Any) -> None:
        self.loop = loop
        if self._t0 is None:  # the clock starts with training (start-up is no target)
            self._t0 = time.perf_counter()
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _target(self, role: str, index: int) -> Any:
        actors = self.loop.actors.engines if role == "engine" else self.loop.actors.policy
        actor = actors[index]
        return None if any(actor is dead for dead in self._dead) else actor

    def _run(self) -> None:
        import ray

        for at, role, index in self.kills:
            while not self._stop.wait(0.05):
                if time.perf_counter() - self._t0 >= at and self._target(role, index) is not None:
                    break
            if self._stop.is_set():
                return
            actor = self._target(role, index)
            self._dead.append(actor)
            try:
                ray.kill(actor)
            except Exception:  # an attempt ending just now: the next kill goes on
                pass
            self.fired.append((round(time.perf_counter() - self._t0, 1), role, index))


def outside_schedule(
    spec: str, seed: int, train_s: float, engines: int, policy_ranks: int
) -> list[tuple[float, str, int]]:
    """`engine:3,trainer:1` -> that many kills at seeded times within 5-80 % of `train_s` (the
    undisturbed run's training time, from its first step's end to its last)."""
    rng = random.Random(seed)
    kills = []
    for part in spec.split(","):
        role, count = part.split(":")
        if role not in ("engine", "trainer"):
            raise SystemExit(f"chaos.py: --outside {spec!r}: roles are engine and trainer")
        for _ in range(int(count)):
            kills.append(
                (rng.uniform(0.05, 0.80) * train_s, role, rng.randrange(engines if role == "engine" else policy_ranks))
            )
    return sorted(kills)


def _wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)


def _train(overrides: list[str], run_dir: Path, callbacks=()) -> tuple[list[dict], dict, float]:
    from hydra.utils import instantiate

    from rlhf_orch.app import check
    from rlhf_orch.orchestration.session import run_training
    from tests.conftest import compose_config

    cfg = compose_config([*overrides, "launcher.reuse_session=true"])
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)
    t = time.perf_counter()
    summary = run_training(cfg, typed, plan, launcher, run_dir, callbacks=list(callbacks))
    wall = time.perf_counter() - t
    rows = read_metrics(run_dir)
    return rows, summary, wall


def _steps_rerun(run_dir: Path, faults: list[Fault]) -> int:
    """Steps trained twice, as the run recorded them: each record of metrics.jsonl a restart went
    back past (marked superseded, kept) is a step trained again -- and so is the step of each
    evaluation fault that fired (trained before its evaluation, logged only after it: never logged)."""
    superseded = len(read_metrics(run_dir, include_superseded=True)) - len(read_metrics(run_dir))
    return superseded + sum(f.kind == "evaluation" and f.fired_at is not None for f in faults)


def _dumps_whole(run_dir: Path, steps: int, dumped_per_step: int) -> bool:
    """Each step's rollout dump holds exactly the indices it dumps (the lowest `dumped_per_step`:
    logger.rollouts_per_step, or every sample of the step when that is more), each once."""
    dumps = run_dir / "rollouts"
    for step in range(1, steps + 1):
        path = dumps / f"step_{step:06d}.jsonl"
        if not path.exists():
            return False
        indices = sorted(json.loads(line)["index"] for line in path.read_text().splitlines())
        if indices != list(range(dumped_per_step)):
            return False
    return True


def _curve_gap(rows: list[dict], reference: list[dict]) -> float:
    """Mean over the steps both have of |reward/mean - the reference's|."""
    ref = {r["step"]: r["reward/mean"] for r in reference}
    diffs = [abs(r["reward/mean"] - ref[r["step"]]) for r in rows if r["step"] in ref]
    return sum(diffs) / len(diffs) if diffs else float("inf")


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(UNCOMPARED)} for r in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-every", type=int, default=5, help="checkpoint.every_n_steps (the restarts' loss bound)"
    )
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument(
        "--spread-seeds",
        type=int,
        default=None,
        help="undisturbed runs with seeds 1..K beside the chaos run, the spread its reward must stay in "
        "(default 3 under async with max_staleness > 0, else 0)",
    )
    parser.add_argument(
        "--outside",
        default=None,
        help="kills from outside at random times instead of the step-bound faults, e.g. engine:3,trainer:1",
    )
    parser.add_argument(
        "--default-budgets",
        action="store_true",
        help="keep fault.max_engine_restarts / max_trainer_restarts at their defaults",
    )
    parser.add_argument("overrides", nargs="*", help="more config overrides for both runs, e.g. pipeline=one_step_off")
    args = parser.parse_args()
    if args.spread_seeds is not None and args.spread_seeds < 0:
        parser.error(f"--spread-seeds {args.spread_seeds}: give 0 or more undisturbed seeds")

    from launchers.local import LocalRayLauncher

    engines, policy_ranks = 2, 2
    faults = schedule(args.steps, args.faults, args.seed, engines, policy_ranks, args.eval_every)
    # Budgets for every fault either way: an engine killed "while generating" may die only after
    # its rollout was delivered (while handing it over), which restarts every role instead.
    engine_faults = restart_faults = len(faults)
    budgets = (
        []
        if args.default_budgets
        else [f"fault.max_engine_restarts={engine_faults}", f"fault.max_trainer_restarts={restart_faults}"]
    )
    overrides = [
        "experiment=quick",
        f"algo.num_steps={args.steps}",
        f"placement.engines={engines}",
        f"placement.actor_ranks={policy_ranks}",
        f"checkpoint.every_n_steps={args.checkpoint_every}",
        f"eval.every_n_steps={args.eval_every}",
        "eval.num_prompts=16",
        "checkpoint.export_final=false",
        *budgets,
        *args.overrides,
    ]
    from tests.conftest import compose_config

    composed = compose_config(overrides)
    # Timing-dependent sampling by design (rollouts drawn at once, weights landing between engine
    # steps): judged by completion and the seed-to-seed spread, not step-for-step equality.
    exact = not (composed.pipeline._target_.endswith("AsyncPipeline") and composed.pipeline.max_staleness > 0)
    per_step = composed.algo.rollout_batch_size * composed.algo.samples_per_prompt
    if args.outside:
        faults = []
    else:
        print("schedule (seed %d):" % args.seed)
    for f in faults:
        extra = f" {f.delay_s * 1000:.0f} ms into the rollout" if f.kind == "generation" else ""
        who = f"policy rank {f.target}" if f.kind in ("trainer", "update") else f"engine {f.target}"
        print(f"  step {f.step:>3}  {f.kind:<11} {who}{extra}")
    outside: OutsideKiller | None = None
    with tempfile.TemporaryDirectory() as work, LocalRayLauncher(logical_gpus=8, reuse_session=True).session():
        clean, _, clean_wall = _train(overrides, Path(work) / "undisturbed")
        if args.outside:
            train_s = clean[-1]["time/elapsed"] - clean[0]["time/elapsed"]
            outside = OutsideKiller(outside_schedule(args.outside, args.seed, train_s, engines, policy_ranks))
            print(
                f"kills from outside (seed {args.seed}; seconds after the first step): "
                + ", ".join(f"{who} {i} at {at:.1f}s" for at, who, i in outside.kills)
            )
        try:
            chaos, summary, chaos_wall = _train(
                overrides, Path(work) / "chaos", callbacks=[outside or Injector(faults)]
            )
        finally:
            if outside is not None:
                outside.stop()
        steps_rerun = _steps_rerun(Path(work) / "chaos", faults)
        per_step_samples = composed.algo.rollout_batch_size * composed.algo.samples_per_prompt
        dumps_whole = _dumps_whole(
            Path(work) / "chaos", args.steps, min(per_step_samples, composed.logger.rollouts_per_step)
        )
        spread_seeds = args.spread_seeds if args.spread_seeds is not None else (0 if exact else 3)
        if not exact and spread_seeds < 1:
            sys.exit("chaos.py: under async the verdict needs the seed spread: --spread-seeds >= 1 (default 3)")
        others = [_train([*overrides, f"seed={k}"], Path(work) / f"seed{k}")[0] for k in range(1, spread_seeds + 1)]
    completed = [r["step"] for r in chaos] == list(range(1, args.steps + 1))
    # Every sample of every step once: the loop refuses a delivery with a sample missing or twice,
    # and each step's rollout dump (logger.rollouts, every sequence when rollouts_per_step covers
    # the step) lists each index once, with no step logged twice.
    once = completed and all(r["rollout/samples"] == per_step for r in chaos) and dumps_whole
    equal = completed and _comparable(chaos) == _comparable(clean)
    unequal = [a["step"] for a, b in zip(_comparable(chaos), _comparable(clean)) if a != b]
    runs = [("undisturbed", clean), ("chaos", chaos), *((f"seed{k}", rows) for k, rows in enumerate(others, 1))]
    reward = {name: round(sum(r["reward/mean"] for r in rows) / len(rows), 4) for name, rows in runs}
    # The reward curve's distance from the undisturbed run's: the mean per-step |difference| of
    # reward/mean, for the chaos run and for each other seed's undisturbed run (the spread it must stay in).
    gap = {name: round(_curve_gap(rows, clean), 4) for name, rows in runs[1:]}
    seeds = [name for name, _ in runs[2:]]
    within = (
        {
            "run_mean": abs(reward["chaos"] - reward["undisturbed"])
            <= max(abs(reward[s] - reward["undisturbed"]) for s in seeds),
            "curve": gap["chaos"] <= max(gap[s] for s in seeds),
        }
        if seeds
        else None
    )
    verdict = equal if exact else once and within is not None and all(within.values())
    fired = len(outside.fired) if outside is not None else sum(f.fired_at is not None for f in faults)
    planned = len(outside.kills) if outside is not None else len(faults)
    passed = verdict and fired == planned
    result = {
        "pipeline": composed.pipeline._target_.rsplit(".", 1)[-1],
        "exact_expected": exact,
        "steps": args.steps,
        "faults": {k: sum(f.kind == k for f in faults) for k in KINDS}
        if outside is None
        else {"outside": args.outside},
        "faults_fired": fired,
        "kills_from_outside": outside.fired if outside is not None else None,
        "steps_completed": len(chaos),
        "every_sample_once": once,
        "metrics_equal": equal,
        "steps_unequal": unequal,
        "reward_mean": reward,
        "reward_curve_gap": gap,
        "reward_within_seed_spread": within,
        "passed": passed,
        "engine_restarts": chaos[-1]["fault/engine_restarts"],
        "trainer_restarts": summary["trainer_restarts"],
        "steps_rerun": steps_rerun,
        "wall_s_undisturbed": round(clean_wall, 1),
        "wall_s_chaos": round(chaos_wall, 1),
        "chaos_vs_undisturbed": round(chaos_wall / clean_wall, 2),
    }
    print()
    print(f"{'':<28}{'undisturbed':>12}{'chaos':>10}")
    print(f"{'steps completed':<28}{len(clean):>12}{len(chaos):>10}")
    print(f"{'wall (s)':<28}{clean_wall:>12.1f}{chaos_wall:>10.1f}")
    print(f"{'engine restarts':<28}{0:>12}{result['engine_restarts']:>10}")
    print(f"{'trainer restarts':<28}{0:>12}{result['trainer_restarts']:>10}")
    print(f"{'every sample once':<28}{'':>12}{str(once):>10}")
    print(f"{'metrics equal, every step':<28}{'':>12}{str(equal):>10}")

    def others_note(values):
        return f"   (undisturbed {', '.join(f'{s}: {values[s]:.4f}' for s in seeds)})" if seeds else ""

    print(f"{'reward/mean, run mean':<28}{reward['undisturbed']:>12.4f}{reward['chaos']:>10.4f}" + others_note(reward))
    if seeds:
        print(f"{'reward curve gap (mean |d|)':<28}{'':>12}{gap['chaos']:>10.4f}" + others_note(gap))
        print(f"{'within the seed spread':<28}{'':>12}{str(all(within.values())):>10}")
    print(json.dumps(result))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
