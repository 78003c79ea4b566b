"""The pieces of benchmarks/compare.py; its docstring says what is compared and how."""
