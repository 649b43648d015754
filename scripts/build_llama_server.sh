#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server` and `llama-perplexity` from the llama.cpp sources vendored in the
# llama-cpp-python sdist, for bench/peers.py and bench/accuracy.py. Everything lives in a cache directory outside the repo; a second run finds the binary and exits.
#
# Usage: scripts/build_llama_server.sh [CACHE_DIR]
#   CACHE_DIR  default $JAXSTATION_PEERS_CACHE or ~/.cache/jaxstation-peers
#   env LLAMA_CPP_PYTHON_VERSION=0.3.x   pin the sdist (default: the newest)
#   env JOBS=N                           parallel build jobs (default: nproc)
# Prints the path of llama-server on its last line. Takes ~15 minutes on 2 cores; needs cmake and a C++ compiler.
# The cmake flags keep the build offline: no web UI download, no OpenSSL, no curl.
set -euo pipefail

CACHE_DIR="${1:-${JAXSTATION_PEERS_CACHE:-$HOME/.cache/jaxstation-peers}}"
PY="${PYTHON:-python3}"
SPEC="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
JOBS="${JOBS:-$(nproc)}"
BIN="$CACHE_DIR/llama-server"

if [[ -x "$BIN" && -x "$CACHE_DIR/llama-perplexity" ]]; then
  echo "llama-server and llama-perplexity already built in $CACHE_DIR" >&2
  echo "$BIN"
  exit 0
fi

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found; install it first" >&2; exit 1; }
done

mkdir -p "$CACHE_DIR/sdist" "$CACHE_DIR/src"
if ! compgen -G "$CACHE_DIR/sdist/llama_cpp_python-*.tar.gz" >/dev/null; then
  echo "downloading the $SPEC sdist into $CACHE_DIR/sdist" >&2
  "$PY" -m pip download --no-deps --no-binary llama-cpp-python -d "$CACHE_DIR/sdist" "$SPEC" >&2
fi
SDIST="$(ls -t "$CACHE_DIR"/sdist/llama_cpp_python-*.tar.gz | head -n1)"
NAME="$(basename "$SDIST" .tar.gz)"
if [[ ! -d "$CACHE_DIR/src/$NAME" ]]; then
  echo "unpacking $SDIST" >&2
  tar -xzf "$SDIST" -C "$CACHE_DIR/src"
fi
LLAMA_SRC="$CACHE_DIR/src/$NAME/vendor/llama.cpp"
[[ -f "$LLAMA_SRC/CMakeLists.txt" ]] || { echo "error: no llama.cpp sources at $LLAMA_SRC" >&2; exit 1; }

BUILD="$CACHE_DIR/build-$NAME"
echo "configuring $LLAMA_SRC -> $BUILD" >&2
cmake -S "$LLAMA_SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF >&2
echo "building llama-server and llama-perplexity with $JOBS jobs" >&2
cmake --build "$BUILD" --config Release --target llama-server llama-perplexity -j "$JOBS" >&2

for tool in llama-server llama-perplexity; do
  [[ -x "$BUILD/bin/$tool" ]] || { echo "error: the build finished but $BUILD/bin/$tool is missing" >&2; exit 1; }
  ln -sf "$BUILD/bin/$tool" "$CACHE_DIR/$tool"
done
echo "built $BIN ($NAME)" >&2
echo "$BIN"
