#!/usr/bin/env bash
# Build llama.cpp's C++ `llama-server`, `llama-perplexity` and `llama-quantize` from the llama.cpp sources vendored in
# the llama-cpp-python sdist, for bench/peers.py, bench/accuracy.py and bench/shapes.py. Everything lives in a cache
# directory outside the repo; a second run finds the binaries and exits.
#
# The build names its instruction sets rather than asking for -march=native: the x86 extensions this CPU lists
# (AVX2, FMA, F16C, AVX-512 F/BW/DQ/VL, VNNI, BF16, VBMI, AVX-VNNI) on, AMX off. A native build turns AMX on where
# the CPU lists it, and dies with SIGILL at start on a VM that lists AMX without granting it; the flags used are
# written to build-flags.txt beside the binaries, which bench.peers records.
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
TOOLS=(llama-server llama-perplexity llama-quantize)

if [[ -x "$BIN" && -x "$CACHE_DIR/llama-perplexity" && -x "$CACHE_DIR/llama-quantize" ]]; then
  echo "${TOOLS[*]} already built in $CACHE_DIR" >&2
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

# GGML option -> the /proc/cpuinfo flag that turns it on
ISA=(GGML_AVX:avx GGML_AVX2:avx2 GGML_FMA:fma GGML_F16C:f16c GGML_BMI2:bmi2 GGML_AVX_VNNI:avx_vnni
     GGML_AVX512:avx512f GGML_AVX512_VBMI:avx512vbmi GGML_AVX512_VNNI:avx512_vnni GGML_AVX512_BF16:avx512_bf16)
CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
ISA_ARGS=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
for pair in "${ISA[@]}"; do
  if [[ "$CPU_FLAGS" == *" ${pair#*:} "* ]]; then ISA_ARGS+=("-D${pair%%:*}=ON"); else ISA_ARGS+=("-D${pair%%:*}=OFF"); fi
done

BUILD="$CACHE_DIR/build-$NAME"
echo "configuring $LLAMA_SRC -> $BUILD: ${ISA_ARGS[*]}" >&2
cmake -S "$LLAMA_SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF "${ISA_ARGS[@]}" >&2
echo "building ${TOOLS[*]} with $JOBS jobs" >&2
cmake --build "$BUILD" --config Release --target "${TOOLS[@]}" -j "$JOBS" >&2
echo "$NAME ${ISA_ARGS[*]}" > "$CACHE_DIR/build-flags.txt"

for tool in "${TOOLS[@]}"; do
  [[ -x "$BUILD/bin/$tool" ]] || { echo "error: the build finished but $BUILD/bin/$tool is missing" >&2; exit 1; }
  ln -sf "$BUILD/bin/$tool" "$CACHE_DIR/$tool"
done
echo "built $BIN ($NAME)" >&2
echo "$BIN"
