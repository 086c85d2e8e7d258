"""DeepSpeed start-up work a trainer process never needs is skipped, and training is unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# One rank, ZeRO stage `argv[1]`, AdamW: three optimizer steps of a small linear model; prints
# whether torch.compile's inductor backend was loaded (the Muon import compiles kernels with it;
# torch.optim alone loads parts of torch._inductor, not compile_fx) and the weights.
_TRAIN = """
import json, os, sys, tempfile
import torch, torch.distributed as dist
stub = sys.argv[2] == "stub"
from rlhf_orch.trainer.deepspeed_startup import skip_muon_import, skip_shm_comm_op
from rlhf_orch.trainer.deepspeed_config import deepspeed_config
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
skip_shm_comm_op()
import deepspeed
deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
if stub:
    skip_muon_import()
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95))
config = deepspeed_config(zero_stage=int(sys.argv[1]), micro_batch_size=4, train_batch_size=4, data_parallel_size=1,
                          grad_clip=1.0, dtype="float32")
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
x = torch.randn(4, 8)
for _ in range(3):
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
print(json.dumps({"inductor": "torch._inductor.compile_fx" in sys.modules, "weight": engine.module.weight.detach().flatten().tolist()}), flush=True)
# The result is out: leave without the interpreter's teardown, where gloo's and DeepSpeed's
# threads were once seen aborting the process ("terminate called without an active exception").
dist.destroy_process_group()
os._exit(0)
"""


def _train(zero_stage: int, mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _TRAIN, str(zero_stage), mode], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.parametrize("zero_stage", [pytest.param(1, marks=pytest.mark.extended), 2])
def test_muon_stand_in_skips_inductor_and_trains_the_same(zero_stage):
    stubbed, real = _train(zero_stage, "stub"), _train(zero_stage, "real")
    assert not stubbed["inductor"]  # ~1.5 s of a core saved in every trainer process
    assert real["inductor"]  # DeepSpeed's own path loads it (so the check above can fail)
    assert stubbed["weight"] == real["weight"]
