"""Deterministic epoch-based sampling of dataset indices.

Epoch ``e`` visits every index once, in the order ``numpy.random.default_rng([seed, e]).permutation(n)``
(the identity when ``shuffle=False``). The only state is how many indices were handed out so far, so
a checkpoint stores one integer and a restored sampler continues exactly where it stopped.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class EpochSampler:
    """Hands out dataset indices epoch after epoch, with no repeats inside an epoch."""

    def __init__(self, num_items: int, seed: int, shuffle: bool = True):
        if isinstance(num_items, bool) or not isinstance(num_items, (int, np.integer)) or num_items < 1:
            raise ValueError(f"EpochSampler needs num_items >= 1, got {num_items!r}")
        self.num_items = int(num_items)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._consumed = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    # ------------------------------------------------------------------ order
    def permutation(self, epoch: int) -> np.ndarray:
        """The index order of `epoch` (cached for the current epoch)."""
        if epoch != self._perm_epoch or self._perm is None:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
            else:
                self._perm = np.arange(self.num_items)
            self._perm_epoch = epoch
        return self._perm

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from."""
        return self._consumed // self.num_items

    @property
    def consumed(self) -> int:
        return self._consumed

    def take(self, n: int) -> list[int]:
        """The next `n` indices, crossing epoch boundaries as needed (n may exceed num_items)."""
        if n < 0:
            raise ValueError(f"take(n) needs n >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            epoch, offset = divmod(self._consumed, self.num_items)
            count = min(n - len(out), self.num_items - offset)
            out.extend(int(i) for i in self.permutation(epoch)[offset : offset + count])
            self._consumed += count
        return out

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self._consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        consumed = state.get("consumed") if isinstance(state, dict) else None
        if isinstance(consumed, bool) or not isinstance(consumed, (int, np.integer)) or consumed < 0:
            raise ValueError(f"EpochSampler state needs a non-negative int 'consumed', got {state!r}")
        self._consumed = int(consumed)
