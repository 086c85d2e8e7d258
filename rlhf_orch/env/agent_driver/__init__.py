"""The `env=agent` driver, pure of vLLM: the agents' processes (`runner`, `host`), their calls'
HTTP endpoint (`chat_server`) and wire format (`chat_api`), and each trajectory's token record
(`record`). The engine side that drives vLLM for them is `rlhf_orch.engines.agent_rollout`."""
