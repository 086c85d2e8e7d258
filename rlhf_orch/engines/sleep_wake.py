"""An engine's vLLM sleep between a rollout and the next weight sync (colocated GPUs), and waking up.

`engine.sleep_level` (the spec's, resolved at start): 0 never sleeps; at level 1 the weights go to
CPU memory and come back on waking; at level 2 they are dropped, and only a weight sync that loads
every weight brings them back -- sampling or scoring before that is refused. Every method runs on
the thread that owns vLLM (`SharedEngineSteps.run`).
"""

from __future__ import annotations

from typing import Any


class SleepWake:
    def __init__(self, llm: Any, level: int, index: int):
        self.llm = llm
        self.level = level
        self.index = index  # the engine's, for the refusal's message
        self.asleep = False
        self.weights_dropped = False  # slept at level 2; a finished weight update loads them again

    def sleep(self) -> None:
        """Release the engine's GPU memory (vLLM's levels; 0 = never)."""
        if self.level > 0 and not self.asleep:
            self.llm.sleep(level=self.level)
            self.asleep = True
            self.weights_dropped = self.weights_dropped or self.level == 2

    def awake(self) -> None:
        """Before any use of the GPU: wake a sleeping engine (KV cache reallocated; at level 1 the
        weights come back from CPU memory, at level 2 they are gone until a sync loads them)."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def weights_present(self) -> None:
        """Before sampling or scoring with the weights: refuse weights level 2 dropped."""
        self.awake()
        if self.weights_dropped:
            raise RuntimeError(
                f"engine {self.index} dropped its weights (engine.sleep_level=2) and no weight sync has loaded them "
                "since: the driver must sync before it generates"
            )

    def weights_loaded(self, loaded: bool) -> None:
        """A weight update finished: every sync sends every weight (`loaded`: it loaded them too)."""
        self.weights_dropped = self.weights_dropped and not loaded
