"""What a checkpoint costs: size on disk, save and restore time, and the Hugging Face export, for the
tiny model and a Qwen2.5-0.5B-shaped model; and what replacing a dead vLLM engine costs a step.

    python scripts/bench/bench_checkpoint.py                 # tiny + 0.5B shape + engine restart
    python scripts/bench/bench_checkpoint.py --models tiny --no-engine-restart

The checkpoint path is the run's own: `PolicyWorker.save_checkpoint` / `load_checkpoint` /
`export_hf` (DeepSpeed ZeRO-2, fp32 AdamW after one optimizer step, so the optimizer state exists),
in this process as a one-rank world. The reference is the time to write the same bytes with one
`torch.save` of the state dict (the limit a checkpoint format can approach on this disk). The engine
restart runs `experiment=quick` with two engines, kills one after step 1 and reports
`time/engine_restart` against an ordinary step. Prints a table and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from rlhf_orch.orchestration.checkpoint import dir_size_bytes
from rlhf_orch.trainer.policy import PolicyWorker
from rlhf_orch.trainer.spec import TrainerSpec
from rlhf_orch.logging.base import read_metrics


def _qwen05b_shaped(root: Path) -> str:
    """A randomly initialised model with Qwen2.5-0.5B's shapes (494M parameters, tied embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = root / "qwen2_5_0_5b_shaped"
    if not (path / "config.json").exists():
        config = Qwen2Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
        Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
        _tokenizer_like_tiny(path)
    return str(path)


def _tokenizer_like_tiny(path: Path) -> None:
    from hydra.utils import instantiate
    from tests.conftest import compose_config

    instantiate(compose_config().model).tokenizer().save_pretrained(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(name: str, model_path: str, work: Path) -> dict:
    spec = TrainerSpec(
        model_path=model_path,
        dtype="float32",
        zero_stage=2,
        micro_batch_size=1,
        train_batch_size=1,
        data_parallel_size=1,
        pad_id=0,
        temperature=1.0,
        lr=1e-5,
        weight_decay=0.0,
        grad_clip=1.0,
        clip_eps=0.2,
        ppo_epochs=1,
        seed=1,
        torch_threads=max(os.cpu_count() or 1, 1),
        optimizer="adamw",
        reference_memory="full",
    )
    worker = PolicyWorker(spec, 0, 1)
    if not torch.distributed.is_initialized():
        worker.init_distributed("127.0.0.1", _free_port())
    params = worker.build()
    ids = torch.randint(0, worker.engine.module.get_input_embeddings().num_embeddings, (1, 16))
    loss = worker.engine(input_ids=ids, labels=ids).loss
    worker.engine.backward(loss)
    worker.engine.step()  # the optimizer state exists from here on

    ck = work / f"{name}_checkpoint"
    t = time.perf_counter()
    worker.save_checkpoint(str(ck))
    save_s = time.perf_counter() - t
    size = dir_size_bytes(ck)
    t = time.perf_counter()
    worker.load_checkpoint(str(ck))
    load_s = time.perf_counter() - t
    hf = work / f"{name}_hf"
    t = time.perf_counter()
    worker.export_hf(str(hf))
    export_s = time.perf_counter() - t
    # The limit: the same state (weights + AdamW moments) in one torch.save.
    state = {"model": worker.engine.module.state_dict(), "optim": worker.engine.optimizer.state_dict()}
    t = time.perf_counter()
    torch.save(state, work / f"{name}_plain.pt")
    plain_s = time.perf_counter() - t
    plain_size = (work / f"{name}_plain.pt").stat().st_size
    del worker, state
    return {
        "model": name,
        "params": params,
        "checkpoint_bytes": size,
        "save_s": save_s,
        "restore_s": load_s,
        "export_hf_s": export_s,
        "export_hf_bytes": dir_size_bytes(hf),
        "plain_torch_save_s": plain_s,
        "plain_torch_save_bytes": plain_size,
        "save_vs_plain": save_s / max(plain_s, 1e-9),
    }


def engine_restart() -> dict:
    from hydra.utils import instantiate

    from rlhf_orch.app import check
    from rlhf_orch.orchestration.session import run_training
    from tests.conftest import compose_config

    import ray

    cfg = compose_config(
        [
            "experiment=quick",
            "algo.num_steps=3",
            "placement.engines=2",
            "transfer=packed",
            "checkpoint.export_final=false",
        ]
    )
    launcher = instantiate(cfg.launcher)
    typed, plan = check(cfg, launcher)

    def kill(step: int, loop) -> None:
        if step == 2:
            ray.kill(loop.actors.engines[0])

    with tempfile.TemporaryDirectory() as d:
        run_training(cfg, typed, plan, launcher, Path(d), callbacks=[kill])
        rows = read_metrics(Path(d))
    ordinary, restarted = rows[1], rows[2]
    return {
        "engine_restart_s": restarted["time/engine_restart"],
        "step_s_with_restart": restarted["time/step"],
        "step_s_ordinary": ordinary["time/step"],
        "restart_vs_step": restarted["time/engine_restart"] / ordinary["time/step"],
        "restarts": restarted["fault/engine_restarts"],
        "samples": restarted["rollout/samples"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,qwen05b", help="comma list of: tiny, qwen05b")
    p.add_argument("--no-engine-restart", action="store_true")
    p.add_argument("--work", default=None, help="scratch dir (default: a temporary dir, removed)")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_ckpt_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        from hydra.utils import instantiate

        from tests.conftest import compose_config

        paths = {"tiny": lambda: instantiate(compose_config().model).path(), "qwen05b": lambda: _qwen05b_shaped(work)}
        rows = [measure(name, paths[name](), work) for name in args.models.split(",")]
        print(
            f"{'model':<9}{'params':>12}{'ckpt MB':>10}{'save s':>9}{'restore s':>11}{'export s':>10}{'plain save s':>14}{'save/plain':>12}"
        )
        for r in rows:
            print(
                f"{r['model']:<9}{r['params']:>12,}{r['checkpoint_bytes'] / 1e6:>10.1f}{r['save_s']:>9.2f}{r['restore_s']:>11.2f}"
                f"{r['export_hf_s']:>10.2f}{r['plain_torch_save_s']:>14.2f}{r['save_vs_plain']:>12.2f}"
            )
        summary = {"checkpoint": rows}
        if not args.no_engine_restart:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            summary["engine_restart"] = er = engine_restart()
            print(
                f"engine restart: {er['engine_restart_s']:.1f}s (an ordinary step {er['step_s_ordinary']:.2f}s; "
                f"the step with the restart {er['step_s_with_restart']:.1f}s; {er['samples']} samples, each once)"
            )
        print(json.dumps(summary))
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
