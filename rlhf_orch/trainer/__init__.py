"""DeepSpeed trainer workers (Ray actors are thin shells in `worker.py` and one module per role: `policy.py`, `critic.py`, `reference.py`, `reward_model.py`)."""
