#!/usr/bin/env bash
# Serving benchmark, speculation on vs off, on the random benchmark pair that bench_engine.py builds:
# one specd server per configuration on 127.0.0.1, the same bench_serving.py client settings.
#   benchmarks/serving_pair.sh [CONCURRENCY...]      (default: 1 4)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8765}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -c "import sys; sys.path[:0] = ['.', 'benchmarks']; from pathlib import Path; \
from engine_bench.pair import build_pair; build_pair(Path('$work'), False, 1, 3.0, 0)"
for method in draft_model none; do
  OMP_NUM_THREADS=1 "$PY" -m server serve --model "$work/target" --draft-model "$work/draft" \
      --speculative-method "$method" --port "$PORT" > "$work/server_$method.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
  for conc in "${@:-1 4}"; do
    for c in $conc; do
      echo "== speculative method $method, concurrency $c"
      "$PY" benchmarks/bench_serving.py --base-url "http://127.0.0.1:$PORT" --num-prompts 24 --max-tokens 128 \
          --temperature 0 --ignore-eos --max-concurrency "$c" --json-out "benchmarks/results/serving_${method}_c$c.json"
    done
  done
  kill -TERM "$pid"; wait "$pid"
done
