"""What a trainer rank counts as done (rlhf_orch/trainer/progress.py): micro-batches, each decoder
layer's forward and backward, collectives entered and left. Pure, on a small Llama built here."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_orch.liveness import WorkCount
from rlhf_orch.trainer.progress import count_layers, counted_modules, counting_saved_tensors, decoder_layers

LAYERS = 3


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def test_each_decoder_layer_and_its_parts_count_their_forward_and_backward_and_the_model_is_left_as_it_was():
    model, plain = _model(), _model()
    progress = WorkCount()
    assert len(decoder_layers(model)) == LAYERS
    hooked = counted_modules(model)
    assert len(hooked) == LAYERS * 5  # the layer, its attention, its MLP and its two norms
    count_layers(model, progress)
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)
    assert progress.count == 2 * len(hooked)  # each forward starts and ends; no backward to count
    loss = model(ids).logits.sum()
    assert progress.count == 4 * len(hooked)
    loss.backward()
    # one long micro-batch moves the count in its backward too: the gradients of each part's output
    # and input (where a part's input is the one before's output, both hooks fire)
    assert progress.count == 6 * len(hooked)
    plain(ids).logits.sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


def test_a_loop_counts_each_micro_batch_done_and_a_collective_its_entry_and_exit():
    progress = WorkCount()
    seen = []
    for mb in progress.each(["a", "b", "c"]):
        seen.append((mb, progress.count))
    assert seen == [("a", 0), ("b", 1), ("c", 2)] and progress.count == 3
    with progress.collective():
        assert progress.count == 4
    assert progress.count == 5
    with pytest.raises(RuntimeError), progress.collective():
        raise RuntimeError("the peer is gone")
    assert progress.count == 7


def test_a_model_that_names_no_repeated_block_is_counted_by_its_micro_batches_only():
    assert decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))) == []


def test_every_tensor_saved_for_the_backward_counts_as_it_is_saved_and_used_and_the_gradients_stay():
    model, plain = _model(), _model()
    progress = WorkCount()
    ids = torch.tensor([[1, 5, 7, 9, 2]])
    with counting_saved_tensors(progress):
        loss = model(ids).logits.sum()
    saved = progress.count
    assert saved > 10 * LAYERS  # many per layer: its attention's and MLP's operations
    loss.backward()
    assert progress.count == 2 * saved  # each used once by the backward
    plain(ids).logits.sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
