"""Step metrics: metrics.jsonl always, plus the configured logger (console, wandb)."""
