"""The multi-turn driver (every `env` option but `agent`), pure of vLLM: many trajectories through
one engine at once (`runner`), one trajectory's tokens (`trajectory`), environment steps on
threads that can be given up (`abandonable`). The engine side is `rlhf_orch.engines.turns`."""
