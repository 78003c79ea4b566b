#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) from the llama-cpp-python sdist, which vendors llama.cpp.
#
#   benchmarks/llamacpp/build.sh                     # sdist from PyPI into the cache, build there
#   LLAMACPP_SRC=/path/to/llama_cpp_python-0.3.36 benchmarks/llamacpp/build.sh
#
# LLAMACPP_SRC    the unpacked sdist, or llama.cpp itself (default: the source the build directory was
#                 configured from, else the sdist downloaded and unpacked into the cache)
# LLAMACPP_BUILD  the build directory (default: ~/.cache/specd/llama.cpp); the binary is bin/llama-server
# JOBS            parallel compile jobs (default: 2)
# Needs cmake and a C++ compiler (Debian: apt-get install cmake g++). Safe to re-run: it only rebuilds
# what changed. benchmarks/compare.py finds the binary at the same default place (or $LLAMA_SERVER).
set -euo pipefail

VERSION="${LLAMACPP_VERSION:-0.3.36}"
CACHE="${SPECD_CACHE:-$HOME/.cache/specd}"
BUILD="${LLAMACPP_BUILD:-$CACHE/llama.cpp}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-$(dirname "$0")/../../.venv/bin/python}"
[ -x "$PY" ] || PY=python3

# A build directory stays with the source it was configured from (cmake refuses another).
if [ -z "${LLAMACPP_SRC:-}" ] && [ -f "$BUILD/CMakeCache.txt" ]; then
    LLAMACPP_SRC="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")"
    [ -d "$LLAMACPP_SRC" ] || LLAMACPP_SRC=""
fi
if [ -z "${LLAMACPP_SRC:-}" ]; then
    LLAMACPP_SRC="$CACHE/llama_cpp_python-$VERSION"
    if [ ! -d "$LLAMACPP_SRC" ]; then
        mkdir -p "$CACHE"
        sdist="$CACHE/llama_cpp_python-$VERSION.tar.gz"
        if [ ! -f "$sdist" ]; then
            echo "== downloading the llama-cpp-python $VERSION sdist"
            "$PY" -m pip download --no-deps --no-binary :all: -d "$CACHE" "llama-cpp-python==$VERSION"
        fi
        echo "== unpacking $sdist"
        tar -xzf "$sdist" -C "$CACHE"
    fi
fi
SRC="$LLAMACPP_SRC"
[ -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ] && SRC="$SRC/vendor/llama.cpp"
[ -f "$SRC/tools/server/CMakeLists.txt" ] || { echo "no llama.cpp source at $SRC" >&2; exit 1; }

# LLAMA_CURL is deprecated in this llama.cpp (downloads go through cpp-httplib); OpenSSL is turned off
# instead, and the prebuilt web UI too: it would be fetched from the Hub at build time.
echo "== configuring $SRC -> $BUILD"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF

echo "== building llama-server with $JOBS jobs (10-20 min on 2 cores the first time)"
cmake --build "$BUILD" --config Release --target llama-server -j "$JOBS"

echo "== built $BUILD/bin/llama-server"
"$BUILD/bin/llama-server" --version 2>&1 | tail -n 2
