#!/usr/bin/env bash
# The GPU kit, one command on a GPU host (benchmarks/gpu/kit.py lists its stages); --dry-run checks it on a CPU.
#   benchmarks/gpu/run.sh [--dry-run] [--stages ...] [--out FILE]
# It installs nothing: the host's own torch and transformers run it, and the JSON records their versions.
# WHEELS=DIR adds specd's other dependencies from wheels, for a host with no network (benchmarks/gpu/wheels.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [ -n "${WHEELS:-}" ]; then  # specd's own dependencies, carried as wheels (benchmarks/gpu/wheels.sh)
  site="$(mktemp -d)"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu/kit.py "$@"
