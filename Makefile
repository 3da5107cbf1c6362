VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast bench lint

$(VENV)/.installed: pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[lightning,transformers,test]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m elastic_batches demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not distributed and not slow"

bench: $(VENV)/.installed
	$(PY) -m elastic_batches bench

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check elastic_batches tests benchmarks examples
	$(VENV)/bin/ruff format --check elastic_batches tests benchmarks examples
	$(VENV)/bin/mypy elastic_batches
