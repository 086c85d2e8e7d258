"""What `python run.py` does with the composed config: check, plan, launch, train, report.

Exit codes: 0 done, 2 configuration error (nothing started), 3 runtime failure (any exception once
the run started: an actor died, a sync timed out, a NaN; one line naming the cause and the last
checkpoint, the traceback in <run dir>/error.log), 130 / 143 stopped by SIGINT / SIGTERM (after a
checkpoint; a SIGINT while the inputs are prepared stops before the first step). metrics.jsonl is flushed every step, so a failure loses no finished step.
"""

from __future__ import annotations

import json
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from rlhf_orch.config.schema import RootConfig
from rlhf_orch.config.ranges import added_key_problems
from rlhf_orch.config.problems import Problem
from rlhf_orch.config.validate import ConfigError, Hardware, check_run_dir_writable, range_problems, validate
from rlhf_orch.orchestration.restart_decision import EXIT_RUNTIME
from rlhf_orch.reward.base import RewardError
from rlhf_orch.reward.scoring import build_reward
from rlhf_orch.topology.plan import PlacementError, PlacementPlan

EXIT_CONFIG = 2
# EXIT_RUNTIME (3): a run that gave up after it started -- the restart decision's code
EXIT_SIGNAL_BASE = 128  # stopped by a signal: 130 SIGINT, 143 SIGTERM (after a checkpoint)


def check(cfg: DictConfig, launcher: Any) -> tuple[RootConfig, PlacementPlan]:
    """Typed config + plan, or ConfigError/PlacementError; runs before Ray starts.

    Every key's own range is checked first (`range_problems`, no plan needed); the planner, the
    group constructors and the relations between keys follow, and all problems found are reported
    together (a constructor that refuses a value only counts when the ranges found nothing).
    """
    missing = sorted(OmegaConf.missing_keys(cfg))  # `???` in the schema: the option needs them set
    if missing:
        raise ConfigError([Problem(k, "???", f"required by the option chosen: set {k}=<value>") for k in missing])
    typed: RootConfig = OmegaConf.to_object(cfg)
    problems = added_key_problems(typed) + range_problems(typed)
    try:
        reward = build_reward(cfg.reward)
        if reward.rule is not None:
            reward.rule.fn.check()  # a user's reward file is loaded here: its errors come before Ray
        plan = instantiate(cfg.placement).plan(
            reward_model=reward.has_model, critic=typed.algo.needs_critic, reference=typed.algo.needs_reference_ranks
        )
        hw = Hardware(gpus=launcher.gpus_present(), cuda=launcher.cuda_present())
        if launcher.dry_run:
            # A dry run plans for the target cluster: GPUs missing *here* are reported, not fatal.
            hw = Hardware(gpus=max(hw.gpus, int(plan.total_gpus + 0.999)), cuda=hw.cuda or plan.total_gpus > 0)
        validate(typed, plan, hw)
    except ConfigError as e:
        raise ConfigError(problems + [p for p in e.problems if p not in problems]) from None
    except (PlacementError, RewardError, ValueError, InstantiationException):
        if problems:  # the out-of-range value is the cause; its message names the key
            raise ConfigError(problems) from None
        raise
    if problems:
        raise ConfigError(problems)
    return typed, plan


def memory_verdict(cfg: DictConfig, typed: RootConfig, plan: PlacementPlan, launcher: Any):
    """The run's memory plan (`rlhf_orch.memory`): a GPU layout is planned on GPUs where the roles
    run on real ones (the launcher's answer: a CPU-only driver of a GPU cluster plans GPUs), and in
    a dry run; logical GPUs (launcher.logical_gpus, CPU testing) are host processes."""
    from rlhf_orch.memory.check import check_memory

    on_gpu = plan.total_gpus > 0 and (typed.launcher.dry_run or launcher.cuda_present())
    return check_memory(typed, plan, on_gpu, reward_model=plan.num_ranks("reward") > 0)


def run_dir() -> Path:
    try:
        return Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under @hydra.main (tests calling main() directly)
        return Path("outputs") / time.strftime("%Y-%m-%d_%H-%M-%S")


def _runtime_failure(out: Path, cause: BaseException, message: str, write_summary: bool = False) -> int:
    """Exit 3: the traceback into <run dir>/error.log, one line on the console; `write_summary`:
    summary.json too (a failure before the session could write it)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "error.log").write_text("".join(traceback.format_exception(cause)))
        if write_summary:
            from rlhf_orch.orchestration.run_record import run_summary

            outcome = {"status": "failed", "error": " ".join(message.split())}
            (out / "summary.json").write_text(json.dumps(run_summary(out, [], 0.0, outcome, None), indent=2))
    except OSError:
        pass  # the one line below still says what happened
    print(f"error: {' '.join(message.split()) or type(cause).__name__}", file=sys.stderr)  # one line
    return EXIT_RUNTIME


def plan_line(typed: RootConfig, plan: PlacementPlan) -> str:
    """The resolved plan in one line: the options chosen, the processes and GPUs, the schedule."""
    try:
        choices = dict(HydraConfig.get().runtime.choices)
    except ValueError:  # not under @hydra.main
        choices = {}
    teacher = ["teacher"] if typed.teacher is not None else []
    groups = ["algo", "placement", "pipeline", "transfer", "sync", "model", *teacher, "data", "reward"]
    if getattr(typed.env, "max_turns", None) is not None:  # multi-turn rollouts: say which environment
        groups.append("env")
    picked = " ".join(f"{g}={choices[g]}" for g in groups if choices.get(g))
    # what the reference ranks hold (the KL reference, the teacher) and where
    held = "+".join(typed.algo.frozen_models)
    where = ", in actor" if plan.reference_in_actor else ""
    hosted = {"reference": f"({held}{where})"} if held != "ref" or where else {}
    ranks = " ".join(f"{role}={plan.num_ranks(role)}{hosted.get(role, '')}" for role in plan.roles)
    a = typed.algo
    return (
        f"plan: {picked} | {ranks} engine_tp={plan.engine_tp} GPUs={plan.total_gpus} | "
        f"{a.num_steps} steps x {a.rollout_batch_size} prompts x {a.samples_per_prompt} samples"
    )


def main(cfg: DictConfig) -> tuple[int, dict[str, Any] | None]:
    """(exit code, the run's summary: what summary.json holds; None when no training ran).

    Under Hydra, everything printed on the console also goes to <run dir>/run.log."""
    try:
        out = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under @hydra.main (tests calling main() directly)
        return _main(cfg)
    from rlhf_orch.logging.runlog import RUN_LOG, tee_console

    with tee_console(out / RUN_LOG):
        return _main(cfg)


def _main(cfg: DictConfig) -> tuple[int, dict[str, Any] | None]:
    try:
        launcher = instantiate(cfg.launcher)
        typed, plan = check(cfg, launcher)
    except (ConfigError, PlacementError, RewardError, ValueError) as e:
        # ValueError: a group option's constructor refused a value (it names the key).
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG, None
    except InstantiationException as e:
        # A group option's constructor refused a value: its own message names the key.
        cause = e.__cause__ or e
        print(f"error: {cause}", file=sys.stderr)
        return EXIT_CONFIG, None
    except ConnectionError as e:
        # launcher=cluster asks the cluster how many GPUs it has before anything starts.
        print(f"error: cannot reach the Ray cluster at launcher.address={cfg.launcher.address!r}: {e}", file=sys.stderr)
        return EXIT_CONFIG, None

    memory = memory_verdict(cfg, typed, plan, launcher)
    if typed.launcher.dry_run:
        print(plan.describe())
        if typed.sync.needs_colocated_engines:
            from rlhf_orch.topology.plan import describe_feeds, ipc_feeds

            print()
            print(describe_feeds(ipc_feeds(plan)))
        present = launcher.gpus_present()
        if plan.total_gpus > present:
            print(f"note: this machine offers {present} GPUs; the plan needs {plan.total_gpus:g} (dry run only)")
        print()
        print(memory.table())
        if not memory.fits:
            print(memory.refusal())
            if typed.launcher.memory_check == "refuse":
                print(
                    "error: the memory plan does not fit (launcher.memory_check=warn runs it anyway)", file=sys.stderr
                )
                return EXIT_CONFIG, None
        return 0, None
    if not memory.fits:
        if typed.launcher.memory_check == "refuse":
            print(memory.table(), file=sys.stderr)
            print(memory.refusal(), file=sys.stderr)
            print(
                "error: the memory plan does not fit; nothing was started (launcher.memory_check=warn runs it anyway)",
                file=sys.stderr,
            )
            return EXIT_CONFIG, None
        print(
            f"warning: the memory plan does not fit (launcher.memory_check=warn): {memory.summary_line()}",
            file=sys.stderr,
        )

    # A checkpoint named by a hub id must be here; asked before the heavy imports below (~4 s).
    from rlhf_orch.models.hub import ModelSourceError, check_model_source

    try:
        check_model_source(typed.model)
    except ModelSourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG, None

    out = run_dir()
    try:
        check_run_dir_writable(out)  # permissions, a read-only or full disk: refused before Ray starts
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG, None
    print(plan_line(typed, plan), flush=True)
    print(memory.summary_line(), flush=True)
    # Ray comes up (~4 s, mostly waiting on its own processes) while this process imports torch
    # and transformers and prepares the inputs (launchers/base.py); an input error shuts it down.
    launcher.connect_early(out, typed.logger.verbose)
    try:
        return _train(cfg, typed, plan, launcher, out)
    finally:
        launcher.close_early()


def _stopped_during_start_up() -> tuple[int, None]:
    """A SIGINT before the run's own handler is installed arrives as KeyboardInterrupt: exit 130."""
    print("error: SIGINT received during start-up: stopped before the first step", file=sys.stderr)
    return EXIT_SIGNAL_BASE + signal.SIGINT, None


def _train(
    cfg: DictConfig, typed: RootConfig, plan: PlacementPlan, launcher: Any, out: Path
) -> tuple[int, dict[str, Any] | None]:
    # heavy imports only when training
    try:
        from rlhf_orch.checkpoint_dirs import ResumeError
        from rlhf_orch.orchestration.inputs import InputError
        from rlhf_orch.orchestration.session import RunFailed, run_training
        from rlhf_orch.orchestration.signals import SignalAbort
    except KeyboardInterrupt:
        return _stopped_during_start_up()

    try:
        summary = run_training(cfg, typed, plan, launcher, out)
    except (InputError, ResumeError) as e:  # the inputs or the checkpoint cannot be used: before any actor started
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG, None
    except RunFailed as e:
        # One line here; the whole traceback (the actor's included) is kept in the run dir.
        return _runtime_failure(out, e.__cause__ or e, str(e)), None
    except SignalAbort as e:
        print(f"error: {e}; the step in progress was abandoned (summary.json says so)", file=sys.stderr)
        return EXIT_SIGNAL_BASE + e.signum, None
    except KeyboardInterrupt:  # before the run's own handler is installed (while the inputs are prepared)
        return _stopped_during_start_up()
    except Exception as e:  # any other failure of a run is a runtime failure too (exit 3)
        return _runtime_failure(out, e, f"{type(e).__name__}: {e}", write_summary=True), None
    print(json.dumps(summary))
    if summary.get("status") == "interrupted":
        return EXIT_SIGNAL_BASE + int(signal.Signals[summary["signal"]]), summary
    return 0, summary
