"""LoRA on the policy without Ray or vLLM: the weight views a sync sends, the reference, the export.

`MergedLoraWeights` must be PEFT's own merge (`merge_and_unload`) under the base's names;
`AdapterWeights` must carry PEFT's saved names, which vLLM's LoRA loader parses back to the
base's layers; `frozen_base` must be the base model; the export must load in PEFT and in
transformers as it is. On the tiny model and on SmolLM2's real layout (grouped KV heads, tied
embeddings, 30 layers).
"""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_orch.models.lora import LoraSettings
from rlhf_orch.trainer.lora import (
    AdapterWeights,
    MergedLoraWeights,
    adapted_layers,
    apply_lora,
    export_adapter,
    frozen_base,
)


def _load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _trained(path: str, settings: LoraSettings, seed: int = 0):
    """The policy wrapped with LoRA and its adapters moved away from PEFT's zero B (as training would)."""
    model = apply_lora(_load(path), settings, seed=0)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _gather_all(source) -> dict[str, torch.Tensor]:
    names = [m.name for m in source.metas()]
    with source.gathered(names) as tensors:
        return {n: t.clone() for n, t in tensors.items()}


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_merged_view_is_peft_merge_under_the_base_names(tiny_model_path, targets):
    settings = LoraSettings(rank=8, alpha=16, target_modules=targets)
    model = _trained(tiny_model_path, settings)
    merged = _gather_all(MergedLoraWeights(model, zero_stage=0))
    reference = model.merge_and_unload().state_dict()
    base_names = dict(_load(tiny_model_path).named_parameters())
    assert list(merged) == list(base_names)  # the base checkpoint's names, its order, a tied head once
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6)
    changed = [n for n in merged if not torch.equal(merged[n], base_names[n].data)]
    expected = 2 * (2 if targets != "all-linear" else 7)  # two layers x adapted projections
    assert len(changed) == expected


@pytest.mark.integration  # imports vLLM (~5 s): not in the fast tier
def test_adapter_view_carries_peft_names_that_vllm_parses_to_base_layers(tiny_model_path):
    from vllm.lora.utils import parse_fine_tuned_lora_name

    settings = LoraSettings(rank=8, alpha=16)
    model = _trained(tiny_model_path, settings)
    adapter = AdapterWeights(model, zero_stage=0)
    tensors = _gather_all(adapter)
    base_layers = {n[: -len(".weight")] for n, _ in _load(tiny_model_path).named_parameters()}
    parsed = {parse_fine_tuned_lora_name(name) for name in tensors}
    assert {module for module, _ in parsed} <= base_layers
    assert len(parsed) == len(tensors) == 2 * len(adapted_layers(model))  # one A and one B per layer
    # What PEFT itself saves (its get_peft_model_state_dict) is the same set of names and tensors.
    from peft.utils import get_peft_model_state_dict

    peft_saved = get_peft_model_state_dict(model)
    assert set(peft_saved) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, peft_saved[name])
    # The byte count (start-up line, sync reports) is rank x (in + out) float32 numbers per adapted layer.
    shapes = [tuple(layer.weight.shape) for layer in adapted_layers(model).values()]
    assert sum(m.nbytes for m in adapter.metas()) == sum(8 * (out + inp) for out, inp in shapes) * 4


def test_frozen_base_is_the_base_model(tiny_model_path):
    model = _trained(tiny_model_path, LoraSettings(rank=8, alpha=16))
    base = _load(tiny_model_path)
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with frozen_base(model) as frozen:
            without = frozen(input_ids=ids).logits
        expected = base(input_ids=ids).logits
        again = model(input_ids=ids).logits
    torch.testing.assert_close(without, expected, rtol=0, atol=1e-5)
    assert (adapted - expected).abs().max() > 1e-3  # the adapters do change the model
    torch.testing.assert_close(again, adapted, rtol=0, atol=0)  # and are back after the block


def test_only_adapters_train_and_a_fresh_adapter_is_the_base(tiny_model_path):
    model = apply_lora(_load(tiny_model_path), LoraSettings(rank=4, alpha=8, target_modules=["q_proj"]), seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    merged = _gather_all(MergedLoraWeights(model, zero_stage=0))
    for name, p in _load(tiny_model_path).named_parameters():
        assert torch.equal(merged[name], p.data)  # B = 0 at start: the policy is the base


def test_lora_on_an_embedding_is_refused(tiny_model_path):
    with pytest.raises(ValueError, match="non-linear layers"):
        apply_lora(_load(tiny_model_path), LoraSettings(rank=4, target_modules=["embed_tokens", "q_proj"]), seed=0)
    with pytest.raises(ValueError, match="no_such_proj"):  # PEFT names what it did not find
        apply_lora(_load(tiny_model_path), LoraSettings(rank=4, target_modules=["no_such_proj"]), seed=0)


def test_a_head_adapter_on_a_tied_embedding_cannot_be_merged_silently(tiny_model_path):
    """The tiny model ties its head to the embedding: the head's adapter would be left out of the
    merged weights (the config check refuses the target; the view refuses it too)."""
    model = apply_lora(_load(tiny_model_path), LoraSettings(rank=4, target_modules=["lm_head", "q_proj"]), seed=0)
    with pytest.raises(ValueError, match="lm_head"):
        MergedLoraWeights(model, zero_stage=0)


def test_the_merged_view_merges_only_what_is_read(tiny_model_path, monkeypatch):
    """A rank that only takes part in a gather (ZeRO-3: every rank gathers, one writes) merges nothing."""
    import rlhf_orch.trainer.lora as lora

    model = _trained(tiny_model_path, LoraSettings(rank=8, alpha=16))
    view = MergedLoraWeights(model, zero_stage=0)
    merges = []
    monkeypatch.setattr(lora, "merged", lambda layer: merges.append(layer.name) or layer.weight.data)
    names = [m.name for m in view.metas()]
    with view.gathered(names) as tensors:
        assert len(tensors) == len(names) and merges == []
        tensors["model.layers.0.self_attn.q_proj.weight"]
    assert merges == ["model.layers.0.self_attn.q_proj.weight"]


def test_exported_adapter_loads_in_peft_as_the_trained_policy(tiny_model_path, tmp_path):
    from peft import PeftModel

    settings = LoraSettings(rank=8, alpha=16)
    model = _trained(tiny_model_path, settings)
    export_adapter(AdapterWeights(model, 0), model, str(tmp_path / "adapter"), write=True)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert any(m.endswith("q_proj") for m in config["target_modules"])  # "all-linear" as PEFT resolved it
    loaded = PeftModel.from_pretrained(_load(tiny_model_path), str(tmp_path / "adapter"))
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-5)


@pytest.mark.integration  # SmolLM2's 0.5 GB, twice: not in the fast tier
def test_real_layout_smollm2_merged_and_adapter_views(smollm2_path):
    """SmolLM2's layout: grouped KV heads (k/v 192 x 576), tied embeddings, 30 layers."""
    settings = LoraSettings(rank=16, alpha=32)
    model = _trained(smollm2_path, settings)
    layers = adapted_layers(model)
    assert len(layers) == 30 * 7
    k = layers["model.layers.0.self_attn.k_proj.weight"]
    assert tuple(k.lora_a.shape) == (16, 576) and tuple(k.lora_b.shape) == (192, 16)
    merged = MergedLoraWeights(model, 0)
    full_bytes = sum(m.nbytes for m in merged.metas())
    adapter = sum(m.nbytes for m in AdapterWeights(model, 0).metas())
    assert "lm_head.weight" not in {m.name for m in merged.metas()}  # tied: sent once, as the embedding
    assert full_bytes / adapter >= 25  # the goal for rank 16 on all linear layers
    names = ["model.layers.3.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight", "model.norm.weight"]
    with merged.gathered(names) as got:
        got = {n: t.clone() for n, t in got.items()}
    reference = model.merge_and_unload().state_dict()
    for name in names:
        torch.testing.assert_close(got[name], reference[name], rtol=0, atol=1e-6)


def test_the_model_option_builds_the_settings_the_roles_get():
    """`model.lora` as the composed config gives it: the model option holds the settings (None at rank 0)."""
    from hydra.utils import instantiate

    from tests.conftest import compose_config

    assert instantiate(compose_config([]).model).lora is None
    settings = instantiate(
        compose_config(["model.lora.rank=16", "model.lora.target_modules=[q_proj,v_proj]"]).model
    ).lora
    assert settings == LoraSettings(rank=16, alpha=64.0, target_modules=("q_proj", "v_proj"))  # alpha null: 4 x rank
    assert (
        settings.scaling == 4.0
        and settings.engine_max_rank() == 16
        and settings.peft_kwargs()["target_modules"] == ["q_proj", "v_proj"]
    )
    assert LoraSettings(rank=17).engine_max_rank() == 32  # vLLM's kernels come in fixed ranks
    assert LoraSettings(rank=8, target_modules=["lm_head", "q_proj", "embed_tokens"]).refused_targets() == [
        "lm_head",
        "embed_tokens",
    ]


@pytest.mark.integration  # imports vLLM
def test_the_cpu_lora_ops_compute_what_vllm_s_compute_without_the_per_token_copy(monkeypatch):
    """`cpu_lora_ops` against vLLM's own torch ops: one adapter for every token (the fast path: no
    call of vLLM's op), and tokens naming two adapters (vLLM's path)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    from rlhf_orch.engines import cpu_lora_ops

    names = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
    for module in (lora_ops, punica_cpu):  # vLLM's ops back after the test
        for n in names:
            monkeypatch.setattr(module, n, getattr(module, n))
    vllm_ops = {n: getattr(lora_ops, n) for n in names}
    calls: list[str] = []
    for n in names:  # count the fallbacks to vLLM's op
        monkeypatch.setattr(lora_ops, n, lambda *a, _n=n, **k: calls.append(_n) or vllm_ops[_n](*a, **k))
    assert cpu_lora_ops.install()
    patched = {n: getattr(lora_ops, n) for n in names}
    assert all(getattr(punica_cpu, n) is patched[n] for n in names)  # the CPU wrapper calls them by name
    cpu_lora_ops.install()  # idempotent: wraps the op it wrapped before, not the wrapper
    assert all(getattr(lora_ops, n).__wrapped_vllm_op__ is patched[n].__wrapped_vllm_op__ for n in names)
    original = vllm_ops
    gen = torch.Generator().manual_seed(0)
    tokens, rank, d_in, d_out = 300, 16, 64, 96
    x = torch.randn(tokens, d_in, generator=gen)
    a, b = torch.randn(2, 1, rank, d_in, generator=gen), torch.randn(2, 1, d_out, rank, generator=gen)
    for indices in (
        torch.zeros(tokens, dtype=torch.long),
        torch.ones(tokens, dtype=torch.long),
        torch.randint(0, 2, (tokens,), generator=gen),
    ):
        out = {}
        for label, ops in (("vllm", original), ("ours", patched)):
            shrunk = torch.zeros(tokens, rank)
            ops["bgmv_shrink"](x, a, shrunk, indices, 0.5)
            expanded = torch.ones(tokens, d_out)
            ops["bgmv_expand"](shrunk, b, expanded, indices, True)
            sliced = torch.ones(tokens, d_out + 10)
            ops["bgmv_expand_slice"](shrunk, b, sliced, indices, 5, d_out, True)
            out[label] = (shrunk, expanded, sliced)
        for ours, theirs in zip(out["ours"], out["vllm"]):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
        shared = bool((indices == indices[0]).all())
        assert calls == ([] if shared else list(names)), (shared, calls)  # the fast path where it applies
        calls.clear()


def test_an_adapter_update_must_cover_every_layer_the_engine_adapts():
    """What the engine's LoRA manager wraps (vLLM fuses q/k/v into qkv_proj, gate/up into gate_up_proj)
    against the layers an update carries: a layer the engine adapts but the update lacks would serve
    the base for it; a fused layer needs only its parts the engine targets."""
    from rlhf_orch.engines.adapter_serving import layer_coverage

    packed = {
        f"model.layers.{i}.self_attn.qkv_proj": [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"]
        for i in range(2)
    }
    wrapped = [*packed, "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    every = [part for parts in packed.values() for part in parts] + [
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
    ]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert layer_coverage(wrapped, packed, targets, every) == ([], [])
    missing, unknown = layer_coverage(wrapped, packed, targets, [n for n in every if ".layers.1." not in n])
    assert (
        missing
        == [
            "model.layers.1.self_attn.k_proj",
            "model.layers.1.self_attn.o_proj",
            "model.layers.1.self_attn.q_proj",
            "model.layers.1.self_attn.v_proj",
        ]
        and unknown == []
    )
    # [q_proj, v_proj]: the engine wraps qkv_proj, but k_proj is no target: the update needs no k_proj
    qv = [n for n in every if n.endswith(("q_proj", "v_proj"))]
    assert layer_coverage(list(packed), packed, ["q_proj", "v_proj"], qv) == ([], [])
    assert layer_coverage(list(packed), packed, ["q_proj", "v_proj"], [*qv, "model.layers.2.mlp.up_proj"]) == (
        [],
        ["model.layers.2.mlp.up_proj"],
    )
