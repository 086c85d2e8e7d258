"""The memory plan: what every role process needs, per device, before anything starts (docs/memory.md)."""
