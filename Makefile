# README's two commands: `make run` (set up, then train the default experiment) and `make test`.
.PHONY: setup run test test-full test-fast test-real

# The test command's prefix. The project's modules are byte-compiled first and the test processes
# may write the bytecode of what they import: on a host that sets PYTHONDONTWRITEBYTECODE=1 (this
# one does) every process -- each Ray actor of ~70 end-to-end runs, each CLI call -- otherwise
# compiles rlhf_orch's ~220 modules again, ~0.7 s a process (docs/measurements/ci_timings.md,
# 2026-12-03 evening). (A module that does not compile is named there and again by the tests.)
PYTEST = .venv/bin/python -m compileall -q -j 0 rlhf_orch; PYTHONDONTWRITEBYTECODE= .venv/bin/python -m pytest -q -p no:cacheprovider

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
	$(PYTEST) -n 2 --dist loadgroup -m "not extended" $(PYTEST_ARGS)

# Every test: CI's tier and the extended one (the fault matrix, every oracle case, a lost node, ...).
# Run it before a change to faults, resume, pipelines, sync or the trainer lands (40-50 min on
# 2026-11-26's host; slower hosts take longer).
test-full: setup
	$(PYTEST) -n 2 --dist loadgroup $(PYTEST_ARGS)

# Pure tests only (no Ray, vLLM or DeepSpeed processes), two workers (5 min 03 s, 1369 tests, on 2026-12-03; 6 min 56 s on 2026-12-02's slower afternoon host).
test-fast: setup
	$(PYTEST) -m "not integration" -n 2 $(PYTEST_ARGS)

# The real chat model's tier alone (SmolLM2-135M-Instruct end to end, docs/real_model.md; in the
# full tier, not CI's): ~3 min.
test-real: setup
	$(PYTEST) -m real_model $(PYTEST_ARGS)
