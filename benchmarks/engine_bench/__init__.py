"""The pieces of benchmarks/bench_engine.py; its docstring says what is measured and how."""

BATCH = 8  # prompts per generate call in the batched rows
VERIFY_SIZES = (2, 3, 5, 9)  # new tokens per sequence in a verify forward (k + 1)
