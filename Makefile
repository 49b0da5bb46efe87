# Every target runs the same commands in CI (.ci/run → make test) as on a laptop.
BIN := .venv/bin

.PHONY: setup up test lint fmt bench clean

setup:
	scripts/setup.sh

up: setup
	$(BIN)/laneway up

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

fmt: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: setup
	$(BIN)/python -m bench.overhead

# Only what lives in the repo; ~/.cache (pip, Kafka classpath) and ~/.m2 are kept.
clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache .coverage .coverage.* htmlcov .cache build dist
	find . -path ./.git -prune -o \( -name __pycache__ -o -name "*.egg-info" \) -type d -prune -exec rm -rf {} +
