"""Environments: what a rollout is (single turn, multi-turn with tools)."""
