# Two commands: `make serve` and `make test`. Both set up .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
# The CPU wheel of torch already on these machines; a GPU host's image brings its own torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test lint bench compare default-pair eval-pair compile-cache constraints clean

# The Dockerfile runs the same two pip install commands (tests/docker checks), without -e and [dev].
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

install: $(VENV)/.installed

serve: install
	$(PY) -m server serve --port $(PORT)

test: install
	$(PY) -m ruff check engine server recipe tests benchmarks
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15

lint: install
	$(PY) -m ruff check engine server recipe tests benchmarks
	$(VENV)/bin/lint-imports

bench: install
	$(PY) benchmarks/bench_engine.py

# specd against transformers serve and generate() on the default pair (~20 min on 2 CPU cores).
compare: install
	$(PY) benchmarks/compare.py

# Retrain the embedded pair from a seed (~80 min target + ~25 min draft on 2 CPU cores), then measure it.
default-pair: install
	$(PY) -m recipe.default_pair

eval-pair: install
	$(PY) -m recipe.evaluate

# The embedded pair's compile cache, shipped beside it so a first start compiles as a warm one (~10 min).
compile-cache: install
	$(PY) -m recipe.compile_cache

# Re-pin every dependency to what the venv holds, except torch and the packages only torch needs: the CUDA
# image keeps its own torch, and that torch's exact pins (sympy, ...) must not meet ours.
constraints: install
	{ echo "# Pins for every dependency of specd and its dev extra (Python 3.11). Regenerate: make constraints"; \
	  $(PY) -m pip freeze --exclude-editable | grep -viE '^(torch|sympy|mpmath|networkx|triton|nvidia-[a-z0-9-]+)[=@ ]'; \
	} > constraints.txt

clean:
	rm -rf $(VENV)
