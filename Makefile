# README's two commands: `make run` (set up, then train the default experiment) and `make test`.
.PHONY: setup run test test-fast

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/python run.py $(ARGS)

# Two workers: one runs the in-process end-to-end tests in order (xdist_group, tests/conftest.py), the
# other the pure tests, then the tests that start run.py as their own processes (docs/testing.md).
test: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup $(PYTEST_ARGS)

# Pure tests only (no Ray, vLLM or DeepSpeed processes), two workers (107 s -> 81 s, docs/testing.md).
test-fast: setup
	.venv/bin/python -m pytest -q -p no:cacheprovider -m "not integration" -n 2 $(PYTEST_ARGS)
