# README's two commands: `make run` (set up, then train the default experiment) and `make test`.
.PHONY: setup run test test-full test-fast test-real

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/python run.py $(ARGS)

# Two workers sharing the tests by load (three measured no faster on 2 cores and slower by luck of
# placement: docs/measurements/ci_timings.md, 2026-12-02); the in-process end-to-end tests of one module stay on one
# worker, so its Ray session and actors are built once (an xdist group per module, tests/conftest.py).
# CI's tier: everything but the tests marked `extended` (left out for time; docs/testing.md lists
# each with what this tier still runs of the same capability, and what only the full tier checks).
test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup -m "not extended" $(PYTEST_ARGS)

# Every test: CI's tier and the extended one (the fault matrix, every oracle case, a lost node, ...).
# Run it before a change to faults, resume, pipelines, sync or the trainer lands (40-50 min on
# 2026-11-26's host; slower hosts take longer).
test-full: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup $(PYTEST_ARGS)

# Pure tests only (no Ray, vLLM or DeepSpeed processes), two workers (5 min 03 s, 1369 tests, on 2026-12-03; 6 min 56 s on 2026-12-02's slower afternoon host).
test-fast: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider -m "not integration" -n 2 $(PYTEST_ARGS)

# The real chat model's tier alone (SmolLM2-135M-Instruct end to end, docs/real_model.md; in the
# full tier, not CI's): ~3 min.
test-real: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider -m real_model $(PYTEST_ARGS)
