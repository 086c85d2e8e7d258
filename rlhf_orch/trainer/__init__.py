"""DeepSpeed trainer workers: the Ray actors are thin shells (`worker.py`, the shared base, and one
module per role: `policy.py`, `critic.py`, `reference.py`, `reward_model.py`) over plain parts
(`experience.py`, `policy_update.py`, `accumulation.py`, `frozen_models.py`, `training_engine.py`,
`policy_weights.py`, `checkpointing.py`, `trained_sequences.py`, `probes.py`)."""
