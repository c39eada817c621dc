#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (that target only) for the e2e tests and print the binary's path.
#
# The source is the llama.cpp that the PyPI sdist of llama-cpp-python vendors (a registry route with a
# pinned commit); nothing of the Python package is built. Idempotent: an existing binary built from the
# same sdist with the same flags is reused at once. CI time is what matters, so the build is the server
# target alone, at -O0 (the tests serve a model of a few hundred kB: compile time dominates, not speed),
# generic CPU code, no OpenMP, no curl/OpenSSL, and no web UI (whose assets would be downloaded at build
# time from a moving "latest"). LLAMA_CPP_SDIST=path uses an already downloaded sdist (offline builds).
set -euo pipefail

VERSION=0.3.36
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEST=${CANARYD_LLAMA_DIR:-$ROOT/.cache/engines/llama.cpp}
PY=${PYTHON:-$ROOT/.venv/bin/python}
JOBS=${JOBS:-$(nproc)}
FLAGS=(
  -DCMAKE_BUILD_TYPE=Release "-DCMAKE_C_FLAGS_RELEASE=-O0 -DNDEBUG" "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG"
  -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
)
STAMP="llama-cpp-python==$VERSION ${FLAGS[*]}"
BIN=$DEST/bin/llama-server

# One build at a time, and the e2e tests wait on this lock while a build runs (test.sh starts it in the
# background, so the compile overlaps the rest of the suite).
mkdir -p "$(dirname "$DEST")"
exec 9>"$DEST.lock"
flock 9
if [[ -x $BIN && "$(cat "$DEST/stamp" 2>/dev/null)" == "$STAMP" ]]; then
  echo "$BIN"
  exit 0
fi

mkdir -p "$DEST"
SDIST=${LLAMA_CPP_SDIST:-}
if [[ -z $SDIST ]]; then
  rm -rf "$DEST/sdist"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$DEST/sdist" "llama-cpp-python==$VERSION" >&2
  SDIST=$(ls "$DEST"/sdist/llama_cpp_python-"$VERSION".tar.gz)
fi

# Only the vendored llama.cpp, without its model vocabularies, docs and web UI sources (half the sdist).
rm -rf "$DEST/src" "$DEST/build"
mkdir -p "$DEST/src"
tar -xzf "$SDIST" -C "$DEST/src" --strip-components=3 \
  --exclude='*/vendor/llama.cpp/models' --exclude='*/vendor/llama.cpp/docs' \
  --exclude='*/vendor/llama.cpp/tools/ui/src' --exclude='*/vendor/llama.cpp/tools/ui/static' \
  "llama_cpp_python-$VERSION/vendor/llama.cpp"

# The sdist's git metadata names the vendored commit; without it the server would report "b0-unknown".
COMMIT=$(tar -xzOf "$SDIST" "llama_cpp_python-$VERSION/.git/modules/vendor/llama.cpp/HEAD" | cut -c1-7)
cmake -S "$DEST/src" -B "$DEST/build" "${FLAGS[@]}" "-DLLAMA_BUILD_COMMIT=$COMMIT" >&2
cmake --build "$DEST/build" --target llama-server -j "$JOBS" >&2
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$BIN"
rm -rf "$DEST/src" "$DEST/build" "$DEST/sdist"
echo "$STAMP" >"$DEST/stamp"
echo "$BIN"
