"""DeepSpeed trainer workers (Ray actors are thin shells in `workers.py`)."""
