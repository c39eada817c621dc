#!/usr/bin/env bash
# Install the LiteLLM proxy the gateway tests run, in its own venv (.cache/engines/litellm/), so that its
# pins never touch the main venv's vLLM. Idempotent: a venv whose proxy imported at the pinned version
# (a marker file says so) is kept as it is. Prints the path of the `litellm` binary.
#
# litellm[proxy] 1.110.2 cannot be installed as such from the package index CI uses: it requires a
# `litellm-proxy` distribution the index does not serve, and .post releases of litellm-proxy-extras and
# litellm-enterprise it lacks. The litellm wheel itself carries the proxy (litellm/proxy/, the `litellm`
# entry point), so this installs the wheel, then the proxy extra's other requirements, read from the wheel's
# own metadata, with those two companions at the nearest release the index has (Prisma migrations and
# enterprise hooks: neither is used by a proxy without a database).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=1.110.2
VENV=.cache/engines/litellm
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

ready() {
    [ -x "$VENV/bin/litellm" ] && "$VENV/bin/python" -c "
import sys
from importlib.metadata import version
import litellm.proxy.proxy_server  # noqa: F401
sys.exit(version('litellm') != '$VERSION')" >/dev/null 2>&1
}
# A marker written once the proxy imported: checking it costs nothing (importing the proxy takes ~20 s).
MARK="$VENV/.installed-$VERSION"
if [ -f "$MARK" ] && [ -x "$VENV/bin/litellm" ]; then
    echo "$PWD/$VENV/bin/litellm"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet)
echo "install_litellm: installing litellm==$VERSION and its proxy requirements into $VENV" >&2
"${pip[@]}" "litellm==$VERSION" 2>&1 | grep -v "^WARNING: Location" >&2 || true
mapfile -t reqs < <("$VENV/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement

NEAREST = {"litellm-proxy": None, "litellm-proxy-extras": "==0.4.110", "litellm-enterprise": "==0.1.83"}
for line in requires("litellm") or []:
    r = Requirement(line)
    if r.marker is None or not r.marker.evaluate({"extra": "proxy"}) or r.marker.evaluate({"extra": ""}):
        continue
    spec = NEAREST.get(r.name, str(r.specifier))
    if spec is not None:
        print(f"{r.name}{''.join(f'[{e}]' for e in sorted(r.extras))}{spec}")
PY
)
"${pip[@]}" "${reqs[@]}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
ready || { echo "install_litellm: the litellm proxy does not import in $VENV" >&2; exit 1; }
touch "$MARK"
echo "$PWD/$VENV/bin/litellm"
