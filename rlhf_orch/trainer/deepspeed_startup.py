"""Start-up costs of DeepSpeed that a trainer process of this project never uses, avoided.

Both are paid per trainer process (policy, critic, reference, reward model), all starting at once on
the run's cores, so each second here is a second of every run's start-up on a small machine.

* The shared-memory all-reduce op: DeepSpeed's CPU backend JIT-compiles it when its comm starts.
  Only DeepSpeed's inference all-reduce (AutoTP) uses it, never training; compiling it cost ~60 s
  of both cores once per virtual environment (and per path of one). DeepSpeed skips an op its
  compatibility table marks off, and that table is one cached dict (`deepspeed.ops`).
* The Muon optimizer: ZeRO's optimizer checks and gradient reduction import
  `deepspeed.runtime.zero.muon` to ask whether the optimizer is a Muon one, and its kernels are
  `torch.compile`d at import, which loads torch's inductor: ~1.5 s of a core in every trainer
  process (measured: `deepspeed.initialize` of the tiny model 1.53 s with it, 0.03 s without).
  Muon is no `trainer.optimizer` option, so the answer is always "no": stand-in modules give it.
"""

from __future__ import annotations

import sys
import types

MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


def skip_shm_comm_op() -> None:
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


class MuonWithAuxAdam:
    """Stands in for DeepSpeed's Muon optimizer class: never instantiated, so no optimizer of a run
    is one (the `isinstance` checks DeepSpeed makes answer False)."""


def muon_update(*args, **kwargs):
    raise RuntimeError("DeepSpeed asked for a Muon update, but Muon is no trainer.optimizer option of this project")


def skip_muon_import() -> None:
    """Install the stand-ins unless DeepSpeed's own Muon modules are already loaded."""
    for name in MUON_MODULES:
        if name in sys.modules:
            return
    for name in MUON_MODULES:
        stub = types.ModuleType(name, "rlhf_orch stand-in: Muon is never used (rlhf_orch/trainer/deepspeed_startup.py)")
        stub.MuonWithAuxAdam = MuonWithAuxAdam
        stub.muon_update = muon_update
        sys.modules[name] = stub
