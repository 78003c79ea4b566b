#!/usr/bin/env bash
# The GPU kit, one command on a GPU host (benchmarks/gpu/kit.py lists its stages); --dry-run checks it on a CPU.
#   benchmarks/gpu/run.sh [--dry-run] [--stages ...] [--out FILE]
# It installs nothing: the host's own torch and transformers run it, and the JSON records their versions.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" benchmarks/gpu/kit.py "$@"
