"""The driver side of a run: start the role actors a plan asks for, then run PPO steps."""
