#!/usr/bin/env bash
# Wheels of what specd needs beyond a CUDA image's own packages (torch, transformers, numpy, pytest...), for a GPU
# host with no network: run here, carry the folder there, and run the kit with WHEELS=<folder>.
#   benchmarks/gpu/wheels.sh [DIR] [PYTHON_VERSION]      (defaults: .whl, 3.12)
# Versions come from constraints.txt, the pins the suite runs on.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${1:-.whl}" py="${2:-3.12}"
names="fastapi starlette pydantic pydantic_core annotated-types typing-inspection uvicorn llguidance openai distro
jiter sniffio annotated-doc opentelemetry-api importlib-metadata"
mkdir -p "$dir"
for name in $names; do
  pin=$(grep -i -E "^${name//[-_]/[-_]}==" constraints.txt || echo "$name")
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --abi "cp${py/./}" --abi abi3 --abi none -d "$dir" "$pin"
done
ls "$dir"
