"""Bucket planning and (un)packing: pure, no Ray."""

import pytest
import torch

from rlhf_orch.sync.buckets import (
    TensorMeta,
    balanced_owners,
    bucket_capacity,
    buffer_release_points,
    layer_key,
    pack_bucket,
    plan_buckets,
    send_buffers,
    unpack_bucket,
)


def _params():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 32, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g).to(torch.bfloat16),
        "model.layers.1.mlp.gate_proj.weight": torch.randn(64, 32, generator=g),
        "model.layers.1.mlp.up_proj.weight": torch.randn(64, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
    }


def test_every_tensor_once_in_order_and_within_budget():
    params = _params()
    metas = [TensorMeta.of(n, t) for n, t in params.items()]
    buckets = plan_buckets(metas, 9000)
    names = [n for b in buckets for n in b.names]
    assert names == list(params)  # order kept, nothing lost or duplicated
    for b in buckets:
        assert b.nbytes <= 9000 or len(b.slots) == 1  # only a single oversized tensor may exceed
        for s in b.slots:
            assert s.offset % 64 == 0


def test_oversized_tensor_gets_its_own_bucket():
    metas = [
        TensorMeta("a", "float32", (10,)),
        TensorMeta("big", "float32", (1000,)),
        TensorMeta("c", "float32", (10,)),
    ]
    buckets = plan_buckets(metas, 1024)
    assert [b.names for b in buckets] == [["a"], ["big"], ["c"]]
    assert bucket_capacity(buckets) == 4000


def test_bucket_boundary_inside_a_layer_round_trips():
    params = _params()
    metas = [TensorMeta.of(n, t) for n, t in params.items()]
    # 5000 bytes: q_proj (4096 B) and k_proj land in different buckets -> boundary inside layer 0.
    buckets = plan_buckets(metas, 5000)
    owner = {n: b.index for b in buckets for n in b.names}
    assert owner["model.layers.0.self_attn.q_proj.weight"] != owner["model.layers.0.self_attn.k_proj.weight"]
    buf = torch.empty(bucket_capacity(buckets), dtype=torch.uint8)
    seen = {}
    for b in buckets:
        view = pack_bucket(b, params, buf)
        received = view.clone()  # what the wire delivers
        for name, t in unpack_bucket(b, received):
            seen[name] = t.clone()
    assert seen.keys() == params.keys()
    for name, t in params.items():
        assert seen[name].dtype == t.dtype
        assert torch.equal(seen[name], t)


def test_release_points_hold_layers_and_non_layer_tensors():
    params = _params()
    metas = [TensorMeta.of(n, t) for n, t in params.items()]
    buckets = plan_buckets(metas, 5000)
    points = buffer_release_points(buckets)
    names = [n for b in buckets for n in b.names]
    for b, point in zip(buckets, points):
        for n in b.names:
            key = layer_key(n)
            if key is None:
                assert point == len(names)  # embeddings / final norm: held to the end
            else:
                last = max(i for i, m in enumerate(names) if layer_key(m) == key)
                assert point >= last


def test_layer_key():
    assert layer_key("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_key("lm_head.weight") is None


def test_bad_bucket_size():
    with pytest.raises(ValueError, match="sync.bucket_mb"):
        plan_buckets([TensorMeta("a", "float32", (1,))], 0)


def test_balanced_owners_interleave_and_balance_bytes():
    metas = [TensorMeta(f"t{i}", "float32", (256,)) for i in range(12)]
    buckets = plan_buckets(metas, 1024)  # one tensor per bucket, equal sizes
    owners = balanced_owners(buckets, 3)
    assert owners[:6] == [0, 1, 2, 0, 1, 2]  # consecutive buckets go to different senders
    load = [sum(b.nbytes for b, o in zip(buckets, owners) if o == s) for s in range(3)]
    assert max(load) == min(load)


def test_balanced_owners_with_one_oversized_bucket():
    metas = [TensorMeta("embed", "float32", (4096,))] + [TensorMeta(f"t{i}", "float32", (256,)) for i in range(8)]
    buckets = plan_buckets(metas, 1024)
    owners = balanced_owners(buckets, 2)
    # The 16 KB embedding bucket fills sender 0; the small ones then go to sender 1 first.
    assert owners[0] == 0 and owners[1:5] == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        balanced_owners(buckets, 0)


def test_send_buffers_live_for_one_update_in_host_memory_and_persist_and_grow_on_a_device():
    import weakref

    class Holder:
        pass

    holder = Holder()
    first = send_buffers(holder, 100, torch.device("cpu"))
    assert len(first) == 2 and all(b.numel() >= 100 for b in first)
    gone = [weakref.ref(b) for b in first]
    del first  # the update is over: nothing else keeps them
    assert all(ref() is None for ref in gone) and not vars(holder)
    # Off the host (a GPU; the meta device here) they are the same buffers again, grown when needed.
    device = torch.device("meta")
    kept = send_buffers(holder, 100, device)
    assert send_buffers(holder, 80, device)[0] is kept[0]
    bigger = send_buffers(holder, 1000, device)
    assert bigger[0].numel() >= 1000 and send_buffers(holder, 10, device)[0] is bigger[0]


def test_a_host_buffer_of_huge_page_size_is_aligned_to_huge_pages():
    from rlhf_orch.sync.buckets import byte_buffer

    big = byte_buffer(3 * 2**21 + 5, torch.device("cpu"))
    assert big.numel() == 3 * 2**21 + 5 and big.dtype == torch.uint8 and big.data_ptr() % 2**21 == 0
    big.fill_(7)  # (every byte of it is the buffer's own)
    assert byte_buffer(100, torch.device("cpu")).numel() == 100


def test_receive_pool_releases_buffers_only_after_their_layers():
    from rlhf_orch.sync.receive import ReceiveBufferPool

    params = _params()
    metas = [TensorMeta.of(n, t) for n, t in params.items()]
    buckets = plan_buckets(metas, 5000)
    pool = ReceiveBufferPool(bucket_capacity(buckets), torch.device("cpu"))
    packed = []
    for b in buckets:
        buf = pool.acquire()[: b.nbytes]
        pack_bucket(b, params, buf)
        packed.append((b, buf))
    streamed = dict((n, t.clone()) for n, t in pool.stream(iter(packed), buffer_release_points(buckets)))
    assert all(torch.equal(streamed[n], t) for n, t in params.items())
    pool.release_all()  # embeddings' buffers are held to the end, then all come back
    assert len(pool._free) == pool.allocated == len(buckets)
