"""`env=single_turn` (the default): a rollout is one prompt and one response, as always."""

from __future__ import annotations

from rlhf_orch.env.base import EnvGroup


class SingleTurn(EnvGroup):
    multi_turn = False
