"""GPU paths of the weight sync (skipped without CUDA; run them on a GPU machine).

They exercise the thin GPU layers over the CPU-tested code: packing/unpacking buckets in CUDA
memory, the CUDA IPC hand-over between two processes on one GPU (what `cuda_ipc` does between a
colocated trainer and engine), and an NCCL bucketed broadcast (needs two GPUs: NCCL refuses two
ranks on one GPU). Results are recorded in docs/benchmarks.md ("Weight sync").
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from rlhf_orch.sync.buckets import (
    TensorMeta,
    bucket_capacity,
    pack_bucket,
    plan_buckets,
    send_buffers,
    unpack_bucket,
)

pytestmark = pytest.mark.gpu


def _params(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (512, 64),
        "model.layers.0.self_attn.q_proj.weight": (64, 64),
        "model.layers.0.self_attn.k_proj.weight": (16, 64),
        "model.layers.0.mlp.gate_proj.weight": (128, 64),
        "model.layers.0.mlp.up_proj.weight": (128, 64),
        "model.layers.0.input_layernorm.weight": (64,),
    }
    return {n: torch.randn(s, generator=g).to(torch.bfloat16).to(device) for n, s in shapes.items()}


def test_pack_unpack_in_cuda_memory():
    params = _params("cuda")
    buckets = plan_buckets([TensorMeta.of(n, t) for n, t in params.items()], 20_000)  # boundaries inside the layer

    class Holder:
        pass

    buffers = send_buffers(Holder(), bucket_capacity(buckets), torch.device("cuda"))
    seen = {}
    for b in buckets:
        view = pack_bucket(b, params, buffers[b.index % 2])
        seen.update((n, t.clone()) for n, t in unpack_bucket(b, view))
    assert all(torch.equal(seen[n], t) for n, t in params.items())


def _engine_side(queue, results):
    # The "engine": map the trainer's buffer through its IPC handle and copy the bucket out. It stays
    # up until told to stop: the CPU tensors it sends travel as file descriptors it must still serve.
    from rlhf_orch.sync.buckets import unpack_bucket

    torch.cuda.set_device(0)
    for _ in range(2):
        bucket, payload = queue.get()
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device="cuda")
        payload.copy_into(buf)
        results.put({n: t.cpu() for n, t in unpack_bucket(bucket, buf)})
    queue.get()  # stop


def test_cuda_ipc_handover_between_two_processes_on_one_gpu():
    from rlhf_orch.sync.cuda_ipc_handles import cuda_ipc_payload

    params = _params("cuda")
    buckets = plan_buckets([TensorMeta.of(n, t) for n, t in params.items()], 40_000)[:2]
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=_engine_side, args=(queue, results), daemon=True)  # a failed test must not wait on it
    engine.start()
    buffers = [torch.empty(bucket_capacity(buckets), dtype=torch.uint8, device="cuda") for _ in range(2)]
    received = {}
    for b in buckets:
        queue.put((b, cuda_ipc_payload(pack_bucket(b, params, buffers[b.index % 2]))))
        received.update(results.get(timeout=120))  # sender keeps its buffer alive until the copy is done
    queue.put(None)
    engine.join(timeout=60)
    assert engine.exitcode == 0
    for b in buckets:
        for name in b.names:
            assert torch.equal(received[name], params[name].cpu())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU")
def test_nccl_broadcast_of_packed_buckets_two_gpus():
    from rlhf_orch.sync.group import free_port_address, release_port

    address = free_port_address(2, "nccl", 60.0)
    release_port(address.host, address.port)  # rank 0's store server runs in a spawned process
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_nccl_rank, args=(address, r, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert results.get(timeout=5) is True


def _nccl_rank(address, rank, results):
    from rlhf_orch.sync.group import BroadcastGroup

    torch.cuda.set_device(rank)
    group = BroadcastGroup(address, rank)
    params = _params(f"cuda:{rank}")
    buckets = plan_buckets([TensorMeta.of(n, t) for n, t in params.items()], 20_000)
    buf = torch.empty(bucket_capacity(buckets), dtype=torch.uint8, device=f"cuda:{rank}")
    ok = True
    for b in buckets:
        view = pack_bucket(b, params, buf) if rank == 0 else buf[: b.nbytes].zero_()
        group.broadcast(view, 0).wait()
        if rank == 1:
            ok &= all(torch.equal(t, params[n]) for n, t in unpack_bucket(b, view))
    if rank == 1:
        results.put(ok)
