"""The `transfer` group's declarations: how rollout experience moves from engines to trainer ranks
(`rlhf_orch.transfer.padded`, `.packed`, `.micro_batched`).

Imports nothing heavy (composing a config stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING


@dataclass
class TransferConfig:
    """How rollout experience moves from engines to trainer ranks."""

    _target_: str = MISSING

    def largest_micro_batch(self, micro_batch_size: int, max_seq_len: int) -> tuple[int, bool]:
        """(tokens of the largest micro-batch a trainer rank runs, whether it is a padded rectangle);
        the memory plan sizes activations with it."""
        return micro_batch_size * max_seq_len, True


@dataclass
class PaddedTransferConfig(TransferConfig):
    _target_: str = "rlhf_orch.transfer.padded.PaddedTransfer"


@dataclass
class PackedTransferConfig(TransferConfig):
    _target_: str = "rlhf_orch.transfer.packed.PackedTransfer"
    # Tokens per packed micro-batch; 0 = derive from micro_batch_size * max_len.
    token_budget: int = 0

    def largest_micro_batch(self, micro_batch_size: int, max_seq_len: int) -> tuple[int, bool]:
        # A sequence longer than the budget still travels, alone in its row.
        return max(self.token_budget or micro_batch_size * max_seq_len, max_seq_len), False


@dataclass
class MicroBatchedTransferConfig(TransferConfig):
    _target_: str = "rlhf_orch.transfer.micro_batched.MicroBatchedTransfer"
    # Bound on micro-batches handed over but not yet staged on the trainers.
    max_in_flight: int = 4
