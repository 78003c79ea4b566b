# Two commands: `make serve` and `make test`. Both set up .venv from nothing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
# The CPU wheel of torch already on these machines; a GPU host's image brings its own torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install serve test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

serve: install
	$(PY) -m server serve --port $(PORT)

test: install
	$(PY) -m ruff check engine server tests benchmarks
	$(PY) -m pytest -q

lint: install
	$(PY) -m ruff check engine server tests benchmarks

bench: install
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV)
